"""Shared fixtures: a tiny demo world built once per test session. The session fails when it leaves anything
new in the working tree (`pytest_sessionfinish`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# hypothesis keeps its examples and constants in ./.hypothesis by default: the suite leaves no file in the tree.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "rlhf-tests-hypothesis"))
# vLLM's CPU build compiles the served model with inductor at every server start (18 s of a 44-s start
# here: its compile cache is keyed by the model's path, and each served folder is new). Its own CPU CI's
# switch traces the model with dynamo and runs it without inductor. The tests check what is sampled.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# Two workers share two cores, and every stage process, server and worker under them runs torch's OpenMP
# threads: spinning while they wait, each steals the core the other's threads need. One test measured
# alone 51 s; two copies at once 89 s each by default and 42.5 s each with passive waits (docs/testing.md).
# Set before torch loads here, and inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rlhf.config import load_config
from rlhf.demo.world import build_world  # noqa: E402


def _starts_python(args) -> bool:
    program = Path(str(args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]))
    return program.name.startswith("python") or program.parent == Path(sys.executable).parent


SLOWEST_FIRST = ("test_vllm.py", "test_faults.py", "test_e2e.py", "test_ray.py", "test_flow.py", "test_sharding.py",
                 "test_reliability.py", "test_distributed.py")
"""The files that take longest (measured on 2 vCPUs, docs/testing.md), longest first. `make test` hands whole
files to its two workers in collection order, so these go first and the short files fill in behind them."""


def pytest_collection_modifyitems(items):
    slow = {name: rank for rank, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: slow.get(item.path.name, len(slow)))  # stable: the rest keep their order


REPO = Path(__file__).resolve().parent.parent
CACHES = {"__pycache__", ".pytest_cache"}
"""Python's and pytest's own caches: any import or run writes them, and git ignores them."""
ON_PURPOSE = {"RLHF_GOLDEN": ("refresh", "tests/golden/"), "RLHF_LOAD_TEST": ("1", "bench/results/")}
"""What a session writes into the tree on purpose, by the variable that asks for it: `make golden` this CPU
vendor's golden record, `make load-test` its figures."""
TREE_BEFORE = pytest.StashKey[set[str]]()
NEW_IN_TREE = pytest.StashKey[list[str]]()


def _tree_status() -> set[str] | None:
    """The working tree's `git status --porcelain`, one line per changed, untracked or ignored file (ignored too:
    `mlruns/` is ignored so that it is never committed, and a test that writes there must still be caught),
    less the caches and the virtual environments (Prefect's server unpacks its UI into its own package on a
    first start); None outside a git checkout."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if status.returncode != 0:
        return None
    return {line for line in status.stdout.splitlines()
            if not CACHES & set(Path(line[3:]).parts) and not (REPO / Path(line[3:]).parts[0] / "pyvenv.cfg").exists()}


def pytest_sessionstart(session):
    """The working tree as the session found it: what was already there (a virtual environment's link, a
    file being edited) is never the session's doing. Under pytest-xdist the controller alone looks."""
    if not hasattr(session.config, "workerinput") and (status := _tree_status()) is not None:
        session.config.stash[TREE_BEFORE] = status


def pytest_sessionfinish(session, exitstatus):
    """Fails the session when it left anything new in the working tree (every worker has ended by now):
    what a test or a run writes belongs in its temporary folder, never in the checkout."""
    before = session.config.stash.get(TREE_BEFORE, None)
    after = _tree_status() if before is not None else None
    asked = tuple(folder for name, (value, folder) in ON_PURPOSE.items() if os.environ.get(name) == value)
    if after is not None and (new := sorted(line for line in after - before if not line[3:].startswith(asked))):
        session.config.stash[NEW_IN_TREE] = new
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    new = config.stash.get(NEW_IN_TREE, None)
    if new:
        terminalreporter.section("the tests left files in the working tree", sep="=", red=True)
        terminalreporter.line(f"{len(new)} path(s) new to `git status --porcelain --ignored` since the session "
                              "started; write them under the test's tmp_path instead:")
        for line in new[:30]:
            terminalreporter.line(f"  {line}")
        if len(new) > 30:
            terminalreporter.line(f"  ... and {len(new) - 30} more")


@pytest.fixture(autouse=True)
def _marked_multiprocess_if_it_starts_processes(request, monkeypatch):
    """Fails a test that starts a Python process (a stage's ranks, a server, a pipeline in a child
    process) without the `multiprocess` marker, so `make test-fast` (`-m "not multiprocess"`) is
    what it says. Processes a module or session fixture starts are its tests' to declare."""
    started = []
    original = subprocess.Popen.__init__

    def recording(self, args, *rest, **options):
        if _starts_python(args):
            started.append(args)
        original(self, args, *rest, **options)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording)
    yield
    if started and request.node.get_closest_marker("multiprocess") is None:
        pytest.fail(f"started {len(started)} Python process(es) without the `multiprocess` marker: {started[0]}")


@pytest.fixture(scope="session")
def tiny_config():
    return load_config("configs/tiny.yaml")


@pytest.fixture(scope="session")
def world(tmp_path_factory, tiny_config) -> Path:
    return build_world(tmp_path_factory.mktemp("worlds"), tiny_config.demo)


@pytest.fixture(scope="session")
def tokenizer(world):
    from stages.runtime.models import load_tokenizer

    return load_tokenizer(str(world / "model"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, world, tiny_config, tokenizer):
    """Tiny SFT and reward checkpoints, trained once per session, for the PPO tests."""
    from tests.helpers import train_upstream, world_frames

    frames = world_frames(world, tokenizer)
    sft, reward = train_upstream(tiny_config, world, frames, tmp_path_factory.mktemp("trained"))
    return {"sft": sft, "reward": reward, "prompts": frames["prompts"], "eval_prompts": frames["prompts_eval"]}


@pytest.fixture(scope="session")
def tools_trained(tmp_path_factory):
    """The tiny tool world (`demo.task: tools`) and an SFT checkpoint trained on its transcripts, for
    the multi-turn tests: (config, trained)."""
    from tests.helpers import tools_upstream

    return tools_upstream(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A two-node Ray cluster on this machine (`scripts/ray_cluster.sh`: two raylets of one CPU each) on
    a free port, its address; its token in this process's environment (the Ray drivers the tests
    start inherit it) while the module's tests run; stopped after them."""
    from rlhf.sections.base import REPO_ROOT
    from tests.helpers import RayCluster, free_port

    home = tmp_path_factory.mktemp("ray-home")
    env = dict(os.environ, RLHF_HOME=str(home), RLHF_RAY_PORT=str(free_port()))
    script = [str(REPO_ROOT / "scripts" / "ray_cluster.sh")]
    try:
        up = subprocess.run([*script, "up"], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_AUTH_MODE", "token")
            patch.setenv("RAY_AUTH_TOKEN_PATH", str(home / "ray" / "auth_token"))
            yield RayCluster(f"127.0.0.1:{env['RLHF_RAY_PORT']}", env)
    finally:
        subprocess.run([*script, "down"], env=env, capture_output=True, text=True, timeout=120)
