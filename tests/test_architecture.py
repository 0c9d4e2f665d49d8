"""The layering docs/architecture.md describes, checked on the source: what each folder may import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("schemas", "rlhf", "stages", "flows", "bench", "tests")

ALLOWED = {
    # module or folder: the project modules (prefixes) it may import
    "schemas": ("schemas",),
    "rlhf/config.py": ("rlhf.demo_locations",),
    "rlhf/demo_locations.py": (),
    "rlhf/evaluation.py": (),
    "rlhf/plots.py": (),
    "rlhf/demo_world.py": ("rlhf.demo_locations", "rlhf.evaluation"),
    "rlhf/tracking.py": ("rlhf.config",),
    "rlhf/stack.py": ("rlhf.config",),
    "stages": ("stages", "schemas", "rlhf.config", "rlhf.evaluation"),
    "stages/engines/sampler.py": ("stages.runtime.holding", "stages.runtime.models", "stages.rl.ppo_math"),  # every stage samples through it
}
NEVER_IN_STAGES = ("mlflow", "prefect")


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def rule_for(path: Path) -> tuple[str, ...] | None:
    relative = path.relative_to(REPO).as_posix()
    return ALLOWED.get(relative, ALLOWED.get(relative.split("/")[0]))


@pytest.mark.parametrize("path", sorted(p for folder in ("schemas", "rlhf", "stages") for p in (REPO / folder).glob("*.py")),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_each_layer_imports_only_what_it_may(path):
    allowed = rule_for(path)
    if allowed is None:  # the top layer (flows/cli.py) may import anything, like flows/
        return
    ours = {m for m in imports_of(path) if m.split(".")[0] in OURS}
    refused = sorted(m for m in ours if not any(m == a or m.startswith(a + ".") for a in allowed))
    assert not refused, f"{path.relative_to(REPO)} imports {refused}; docs/architecture.md says it may import only {allowed}"
    if path.parent.name == "stages":
        outside = sorted(m for m in imports_of(path) if m.split(".")[0] in NEVER_IN_STAGES)
        assert not outside, f"{path.relative_to(REPO)} imports {outside}: stages never talk to MLflow or Prefect"


@pytest.mark.multiprocess
def test_the_config_does_not_load_the_demo_worlds_gold_function():
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", "import sys, rlhf.config, stages.ppo; "
                             "print('rlhf.demo_world' in sys.modules)"], capture_output=True, text=True, cwd=REPO,
                            check=True).stdout.strip()
    assert loaded == "False"


SHARED_TEST_MODULES = ("tests.helpers", "tests.model_families", "tests.stand_in_stages", "tests.stack")
"""What test files may import of each other: the shared modules, never another test file or conftest."""


@pytest.mark.parametrize("path", sorted((REPO / "tests").glob("*.py")) + sorted((REPO / "bench").glob("*.py")),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_test_files_share_helpers_only_through_the_shared_modules(path):
    borrowed = {m for m in imports_of(path) if m.startswith("tests.") and m not in SHARED_TEST_MODULES}
    assert not borrowed, f"{path.relative_to(REPO)} imports {borrowed}: move what it borrows into tests/helpers.py"


MAX_LINES, MAX_PARAMETERS = 80, 7


def _is_flow(node: ast.FunctionDef) -> bool:
    """A Prefect flow's parameters are its run form, one section each: they are the user's, not a design choice."""
    return any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "flow" for d in node.decorator_list)


@pytest.mark.parametrize("path", sorted(p for folder in ("stages", "flows") for p in (REPO / folder).glob("*.py")),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_function_is_over_80_lines_or_7_parameters(path):
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_flow(node):
            arguments = node.args
            names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
            count = len([n for n in names if n not in ("self", "cls")]) + bool(arguments.vararg) + bool(arguments.kwarg)
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES or count > MAX_PARAMETERS:
                found.append(f"{node.name} ({lines} lines, {count} parameters)")
    assert not found, f"{path.relative_to(REPO)}: {found}: split it, or bundle what travels together"


def test_the_pipeline_module_stays_small():
    lines = len((REPO / "flows" / "pipeline.py").read_text().splitlines())
    assert lines < 450, f"flows/pipeline.py has {lines} lines: what is not the flow's wiring belongs in another module"

