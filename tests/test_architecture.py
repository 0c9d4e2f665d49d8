"""The layering docs/architecture.md describes, checked on the source: what each folder may import,
no import circles, and no file or folder grown past what a reader takes in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("schemas", "rlhf", "stages", "servers", "flows", "bench", "tests")
LAYERED = ("schemas", "rlhf", "stages", "servers", "flows")
"""The product's folders: every module in them is in the import graph the tests below check."""

CONFIG = ("rlhf.config", "rlhf.sections", "schemas")
"""What every layer of `stages/` may import: the config, and the data contracts (which import neither)."""
LAYERS = {
    # folder or module: the project modules (prefixes) it may import. Each row imports only rows above it
    # (and its own folder), so no import runs back up. docs/architecture.md shows this table.
    "schemas": ("schemas",),
    "rlhf/numerics.py": (),
    "rlhf/demo/locations.py": (),
    "rlhf/evaluation.py": (),
    "rlhf/plots.py": (),
    "rlhf/demo/rewards.py": (),
    "rlhf/demo/tools.py": (),
    "rlhf/demo/code.py": (),  # the code world's records and gold (rlhf/demo/world.py builds it)
    "rlhf/demo/latency.py": ("rlhf.demo.tools",),  # the tool with an API's latency (configs/tools-latency.yaml)
    "rlhf/sections/base.py": ("rlhf.demo.locations",),
    "rlhf/sections/reward_terms.py": ("rlhf.sections.base",),
    "rlhf/sections/environment.py": ("rlhf.sections.base",),
    "rlhf/sections/ppo.py": ("rlhf.sections.base", "rlhf.sections.reward_terms", "rlhf.sections.environment"),
    "rlhf/config.py": ("rlhf.sections.base", "rlhf.sections.ppo", "rlhf.demo.locations"),
    "rlhf/config_guide.py": ("rlhf.config",),
    "rlhf/demo/world.py": ("rlhf.demo.locations", "rlhf.demo.tools", "rlhf.demo.code", "rlhf.evaluation"),
    "rlhf/stack.py": ("rlhf.sections.base", "rlhf.numerics"),
    "rlhf/tracking.py": CONFIG,
    "stages/common": ("stages.common",) + CONFIG,
    "stages/math": ("stages.common",),
    "stages/sandbox": ("stages.sandbox",),  # untrusted code's confinement: the standard library, landlock, pyseccomp
    "stages/runtime": ("stages.common", "stages.runtime") + CONFIG,
    "stages/memory": ("stages.common", "stages.runtime", "stages.memory") + CONFIG,
    "stages/launch": ("stages.common", "stages.runtime", "stages.memory", "stages.launch", "rlhf.numerics") + CONFIG,
    "stages/engines": ("stages.common", "stages.runtime", "stages.engines") + CONFIG,
    "stages/rewards": ("stages.common", "stages.runtime", "stages.memory", "stages.rewards") + CONFIG,
    "stages/envs": ("stages.common", "stages.runtime", "stages.engines", "stages.envs") + CONFIG,
    "stages/envs/remote": ("stages.common", "stages.envs") + CONFIG,  # environments reached over the network
    "stages/rl": ("stages.common", "stages.math", "stages.runtime", "stages.memory", "stages.engines", "stages.envs",
                  "stages.rewards", "stages.rl", "rlhf.evaluation") + CONFIG,
    "stages": ("stages", "rlhf.evaluation") + CONFIG,  # the stage entry points, stages/*.py
    "servers": ("servers", "stages") + CONFIG,  # processes of their own, reached over HTTP: never `flows`
    # What the flow writes down and reads back (the journal, lineage and cache keys, what is logged): below the
    # flow's wiring, so the bookkeeping never reaches up into the flow, its tasks or the `rlhf` command.
    "flows/records": ("flows.records", "rlhf", "schemas", "stages"),
    "flows": None,  # the top: the flow, its tasks and the `rlhf` command may import anything
}
NEVER_IN_STAGES = ("mlflow", "prefect")
MAX_FILE_LINES, MAX_FOLDER_LINES = 600, 2500


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (`from a.b import c` as `a.b`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def rule_for(path: Path) -> tuple[str, ...] | None:
    """The most specific row of LAYERS for `path`: its module, else its folder, else its top folder."""
    relative = path.relative_to(REPO).as_posix()
    if path.name == "__init__.py":  # a package marker: imports nothing but the numerics, applied first
        return ("rlhf", "rlhf.numerics")
    for key in (relative, relative.rsplit("/", 1)[0], relative.split("/")[0]):
        if key in LAYERS:
            return LAYERS[key]
    raise AssertionError(f"{relative} has no row in LAYERS: say where it sits (and in docs/architecture.md)")


def product_modules() -> list[Path]:
    return sorted(p for folder in LAYERED for p in (REPO / folder).rglob("*.py"))


def module_name(path: Path) -> str:
    return path.relative_to(REPO).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_each_layer_imports_only_what_it_may(path):
    allowed = rule_for(path)
    if allowed is None:
        return
    ours = {m for m in imports_of(path) if m.split(".")[0] in OURS}
    refused = sorted(m for m in ours if not any(m == a or m.startswith(a + ".") for a in allowed))
    assert not refused, (f"{path.relative_to(REPO)} imports {refused}; docs/architecture.md says it may import only "
                         f"{allowed}")
    if path.relative_to(REPO).parts[0] in ("stages", "servers"):
        outside = sorted(m for m in imports_of(path) if m.split(".")[0] in NEVER_IN_STAGES)
        assert not outside, (f"{path.relative_to(REPO)} imports {outside}: stages and servers never talk to MLflow "
                             "or Prefect")


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the product modules it imports (`from stages.launch import local` counts as `stages.launch.local`)."""
    modules = {module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                             for a in node.names)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_circles():
    # Function-level and TYPE_CHECKING imports count: a circle hidden in a function is still one.
    found = circles(import_graph(product_modules()))
    assert not found, f"import circles: {found}; move what both sides need below them"


def test_circle_finding_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_file_is_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.relative_to(REPO)} has {lines} lines: split it by what it holds"


@pytest.mark.parametrize("folder", sorted({p.parent for p in product_modules()}),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_folder_is_over_2500_lines(folder):
    lines = sum(len(p.read_text().splitlines()) for p in folder.glob("*.py"))
    assert lines <= MAX_FOLDER_LINES, (f"{folder.relative_to(REPO)}/ has {lines} lines in its modules: "
                                       "split it by concern")


@pytest.mark.multiprocess
def test_the_config_does_not_load_the_demo_worlds_gold_function():
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", "import sys, rlhf.config, stages.ppo; "
                             "print('rlhf.demo.world' in sys.modules)"], capture_output=True, text=True, cwd=REPO,
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


@pytest.mark.parametrize("path", sorted(p for folder in ("stages", "servers", "flows")
                                        for p in (REPO / folder).rglob("*.py")),
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



MAX_POSITIONAL_FIELDS = 4


def _dataclass_decorator(node: ast.ClassDef) -> ast.expr | None:
    for decorator in node.decorator_list:
        if "dataclass" in ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator):
            return decorator
    return None


@pytest.mark.parametrize("path", sorted(p for folder in ("stages", "servers") for p in (REPO / folder).rglob("*.py")),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_dataclasses_of_more_than_four_fields_are_built_by_keyword(path):
    """A positional call of a dataclass with many fields hides which value is which (and breaks
    silently when a field is added in the middle): such dataclasses are `kw_only`, so Python refuses
    the positional call."""
    for node in ast.walk(ast.parse(path.read_text())):
        decorator = isinstance(node, ast.ClassDef) and _dataclass_decorator(node)
        if not decorator:
            continue
        fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)]
        keyword_only = isinstance(decorator, ast.Call) and any(
            k.arg == "kw_only" and getattr(k.value, "value", False) for k in decorator.keywords)
        assert len(fields) <= MAX_POSITIONAL_FIELDS or keyword_only, (
            f"{path.relative_to(REPO)}:{node.lineno} {node.name} has {len(fields)} fields: declare it "
            "@dataclass(kw_only=True) and build it by keyword")


READING_PATH = ("stages/ppo.py", "stages/rl/rollout.py", "stages/rl/scoring.py", "stages/rl/advantages.py",
                "stages/rl/update.py")
"""One PPO iteration, read in this order: the loop, where its episodes come from (sampled, passed), what
scores them, the advantages, the update. docs/architecture.md names them in the same order."""
NAMED_HELPERS = ("stages.rl.batch", "stages.rl.teacher", "stages.rl.ppo_models", "stages.rl.ppo_report",
                 "stages.rl.evaluation", "stages.rl.ppo_state", "stages.rl.old_logprobs")
"""What the five files call into of the RL stage besides each other, each named by docs/architecture.md
(the batch types, the teacher, the models and critics, the figures, the evaluations, the checkpoints,
where the old log-probs come from)."""


def test_one_iteration_reads_in_the_five_files_docs_architecture_names():
    doc = (REPO / "docs" / "architecture.md").read_text()
    path_section = doc.split("## Read this first", 1)[1].split("\n## ", 1)[0]
    named = [line.split("`")[1] for line in path_section.splitlines() if line[:3] in {f"{i}. " for i in range(1, 10)}]
    assert named == list(READING_PATH), f"docs/architecture.md's reading path names {named}, not {READING_PATH}"
    path_modules = {module_name(REPO / p) for p in READING_PATH}
    for path in READING_PATH:
        assert (REPO / path).exists(), f"{path} is on the reading path but does not exist"
        of_the_rl_stage = {m for m in imports_of(REPO / path) if m.startswith("stages.rl")}
        unnamed = sorted(of_the_rl_stage - path_modules - set(NAMED_HELPERS))
        assert not unnamed, (f"{path} calls into {unnamed} of the RL stage: put it on the reading path, or name it "
                             "as a helper (NAMED_HELPERS and docs/architecture.md)")
    for helper in NAMED_HELPERS:
        assert (REPO / (helper.replace(".", "/") + ".py")).exists(), helper
        assert f"`{helper.replace('.', '/')}.py`" in path_section, f"docs/architecture.md does not name {helper}"
    rl_modules = {module_name(p) for p in (REPO / "stages" / "rl").glob("*.py") if p.name != "__init__.py"}
    assert rl_modules <= path_modules | set(NAMED_HELPERS), (
        f"stages/rl holds {sorted(rl_modules - path_modules - set(NAMED_HELPERS))}, on no reading path")
