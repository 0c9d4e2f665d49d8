"""The documentation's links: README.md is the front page, docs/*.md the pages behind it.

The docs are plain Markdown that GitHub (or any editor) renders, with no site generator: no MkDocs, no build
step, nothing to install or keep running. What a site generator would check at build time is checked here
instead, on the files, without starting a process:

- every relative link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`) and every image
  (`![alt](ui/page.png)`) points to a file that exists;
- every `#anchor` is a heading of the page it points into, by GitHub's slug rules (lowercase; punctuation
  other than hyphens and spaces dropped; spaces to hyphens; a repeated heading gets `-1`, `-2`, ...);
- every page under docs/ can be reached from README.md by following links;
- README.md stays a front page: at most 220 lines.

Links to web addresses (http, https, mailto) and to the local UIs are not followed. Code blocks and inline
code are skipped, so a link-shaped string in an example is not a link.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 220

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.DOTALL)  # within a paragraph
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
EXTERNAL = ("http://", "https://", "mailto:")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, without punctuation, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(path: Path) -> list[tuple[str, Path, str]]:
    """(the link as written, the file it points to, the anchor or '') for each relative link of a page."""
    found = []
    for target in LINK.findall(prose(path.read_text())):
        if target.startswith(EXTERNAL) or "127.0.0.1" in target or "localhost" in target:
            continue
        file, _, anchor = target.partition("#")
        found.append((target, (path.parent / file).resolve() if file else path, anchor))
    return found


def test_anchors_follow_githubs_slugs():
    assert slug("Choosing a method") == "choosing-a-method"
    assert slug("`make bench`: our PPO against TRL 1.12's PPOTrainer") == (
        "make-bench-our-ppo-against-trl-112s-ppotrainer")
    assert slug("Measured on a lent H200 (2026-11-26, `python -m bench.gpu`)") == (
        "measured-on-a-lent-h200-2026-11-26-python--m-benchgpu")
    assert slug("Sampling while training: `ppo.rollout.max_staleness`") == (
        "sampling-while-training-pporolloutmax_staleness")


def test_the_link_reader_skips_code_and_web_addresses(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [a](a.md#x) and ![b](ui/b.png), [c](https://example.com), <http://127.0.0.1:5000>,\n"
                    "`[d](d.md)` and [the\nUI](http://127.0.0.1:4200).\n\n```bash\necho [e](e.md)\n```\n")
    assert [(written, anchor) for written, _, anchor in links(page)] == [("a.md#x", "x"), ("ui/b.png", "")]
    page.write_text("# Title\n\n## Again\n\n## Again\n\n```python\n# not a heading\n```\n")
    assert anchors(page) == {"title", "again", "again-1"}


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for written, target, anchor in links(page):
        if not target.exists():
            broken.append(f"{written}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{written}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n  " + "\n  ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {README.resolve()}, [README.resolve()]
    while todo:
        for _, target, _ in links(todo.pop()):
            if target.suffix == ".md" and target.exists() and target not in reached:
                reached.add(target)
                todo.append(target)
    unreachable = [str(p.relative_to(ROOT)) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in reached]
    assert not unreachable, f"no chain of links from README.md reaches {unreachable}: list them under its Documentation"


def test_the_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into "
                                       "a page under docs/ and link it from README's Documentation list")
