"""Whole-pipeline guarantees, each on real processes: a run killed with SIGKILL mid-PPO and resumed is the
uninterrupted run again, stage for stage (its SFT and reward stages, trained before the kill in a process
of their own, identical reruns of the first run's), and the smoke pipeline is its golden record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.common.reporting import MEASURED

pytestmark = pytest.mark.multiprocess  # every test runs the pipeline in child processes

REPO = Path(__file__).resolve().parent.parent
RUN = """
import json, os, sys
from flows.pipeline import rlhf
from tests.helpers import park_after_first_checkpoint

if os.environ.get("HOLD_MARKER"):
    park_after_first_checkpoint(os.environ["HOLD_MARKER"])

state = rlhf(config_file="configs/smoke.yaml", overrides=json.loads(sys.argv[1]), return_state=True)
assert state.is_completed(), state.message
print("RECORDS=" + json.dumps([r.model_dump() for r in state.result()]))
"""


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_"))}
    # Each run starts Prefect's temporary server on a fresh database; migrating it took longer than
    # Prefect's 20 s default on a loaded 2-core CI machine, so allow the same 120 s as the harness.
    env.update(RLHF_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home}/mlflow.db",
               PREFECT_HOME=str(home / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    return env


def _start(home: Path, overrides: dict, hold_marker: Path | None = None) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    env = _env(home) | ({"HOLD_MARKER": str(hold_marker)} if hold_marker else {})
    return subprocess.Popen([sys.executable, "-c", RUN, json.dumps(overrides)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _results(metrics: dict) -> dict:
    """The metrics a rerun must reproduce: all but what the machine measured (timings, memory)."""
    return {k: v for k, v in metrics.items() if not k.startswith(MEASURED)}


def _records(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out[-4000:]
    line = next(line for line in out.splitlines() if line.startswith("RECORDS="))
    return {r["stage"]: r for r in json.loads(line.removeprefix("RECORDS="))}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    return _records(_start(tmp_path_factory.mktemp("repro-a"), {}))


def test_ppo_killed_with_sigkill_resumes_and_ends_as_an_uninterrupted_run(first_run, tmp_path):
    home, marker = tmp_path / "killed", tmp_path / "in-iteration-3"
    process = _start(home, {}, hold_marker=marker)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert process.poll() is None, "the run ended before PPO reached its third iteration"
        assert time.monotonic() < deadline, "PPO did not reach its third iteration within 300 s"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    state_files = list((home / "work").glob("ppo-*/state/loop.json"))
    assert len(state_files) == 1
    assert json.loads(state_files[0].read_text())["iteration"] == 2  # smoke.yaml: checkpoint_every 2

    resumed = _records(_start(home, {}))
    for stage in ("sft", "reward"):  # finished before the kill, in a process of their own: the first run's
        assert resumed[stage]["reused"], stage
        assert resumed[stage]["checkpoint_digest"] == first_run[stage]["checkpoint_digest"], stage
        assert resumed[stage]["data_digest"] == first_run[stage]["data_digest"], stage
        expected = _results(first_run[stage]["metrics"])
        assert {k: resumed[stage]["metrics"].get(k) for k in expected} == expected, stage
    assert not resumed["ppo"]["reused"]
    assert _results(resumed["ppo"]["metrics"]) == _results(first_run["ppo"]["metrics"])
    assert resumed["ppo"]["checkpoint_digest"] == first_run["ppo"]["checkpoint_digest"]
    assert not list((home / "work").glob("ppo-*/state"))  # the work folder goes once the stage succeeded


GOLDEN = REPO / "tests" / "golden"
REFRESH = "make golden"
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def _golden_record() -> Path:
    """This CPU vendor's record: MKL takes its own code path on each vendor, so portable numerics give
    one set of bits per vendor (docs/reproducibility.md)."""
    from rlhf import numerics

    vendor = numerics.cpu()[0]
    return GOLDEN / f"smoke-{VENDORS.get(vendor, vendor)}.json"


def _golden(records: dict) -> dict:
    """What the smoke pipeline produced, and what it computed with: the golden record's shape."""
    from rlhf import stack

    here = stack.current()
    return {"made_by": f"`{REFRESH}` (tests/test_reliability.py); docs/reproducibility.md",
            "machine": here.machine, "numerics": here.numerics, "stack": here.key(), "lock": here.lock_digest,
            "stages": {stage: {"checkpoint_digest": r["checkpoint_digest"], "data_digest": r["data_digest"],
                               "metrics": _results(r["metrics"])} for stage, r in sorted(records.items())}}


def _refresh(record: Path, now: dict) -> None:
    """`make golden`: this vendor's record written anew. Where its figures moved, every other vendor's
    record is marked as waiting for a refresh on a machine of that vendor (its test skips, saying so,
    until then): the change that moved these moves those. A refresh of a record that was waiting
    is that catch-up, and marks nothing. Says which records wait."""
    old = json.loads(record.read_text()) if record.exists() else None
    moved = ["no record before"] if old is None else _figure_differences(old, now)
    if old is not None and old.get("waiting_for_refresh"):
        moved = []
    record.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    print(f"wrote {record.name}: commit it with the change that moved the figures")
    for other in sorted(GOLDEN.glob("smoke-*.json")):
        if other == record:
            continue
        golden = json.loads(other.read_text())
        if moved and not golden.get("waiting_for_refresh"):
            golden["waiting_for_refresh"] = (f"the figures moved on {record.stem.removeprefix('smoke-')} "
                                             f"({len(moved)} differences, first: {moved[0]})")
            other.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        if golden.get("waiting_for_refresh"):
            print(f"{other.name} waits for `{REFRESH}` on a machine of its vendor: "
                  f"{golden['waiting_for_refresh']}")


def _figure_differences(golden: dict, now: dict) -> list[str]:
    found = []
    for stage in sorted(set(golden["stages"]) | set(now["stages"])):
        old, new = golden["stages"].get(stage, {}), now["stages"].get(stage, {})
        for digest in ("checkpoint_digest", "data_digest"):
            if old.get(digest) != new.get(digest):
                found.append(f"{stage} {digest}: {old.get(digest)} -> {new.get(digest)}")
        for name in sorted(set(old.get("metrics", {})) | set(new.get("metrics", {}))):
            before, after = old.get("metrics", {}).get(name), new.get("metrics", {}).get(name)
            if before != after:
                found.append(f"{stage} {name}: {before!r} -> {after!r}")
    return found


def test_the_smoke_pipeline_matches_its_golden_record(first_run):
    from rlhf import numerics, stack

    if not numerics.portable_here():
        pytest.skip(f"the golden records hold portable numerics, which need x86-64 with AVX2; this machine is "
                    f"{stack.current().machine!r}")
    if numerics.mode() != "portable":
        pytest.skip(f"{numerics.VARIABLE}={numerics.mode()}: the golden records hold portable numerics")
    now, record = _golden(first_run), _golden_record()
    if os.environ.get("RLHF_GOLDEN") == "refresh":  # `make golden`: a deliberate new record
        _refresh(record, now)
        return
    if not record.exists():
        pytest.skip(f"no golden record for this CPU vendor ({numerics.cpu()[0]}) yet: `{REFRESH}` here makes "
                    f"{record.relative_to(REPO)}")
    golden = json.loads(record.read_text())
    if golden.get("waiting_for_refresh"):
        pytest.skip(f"{record.relative_to(REPO)} is waiting for a refresh on a machine of its vendor: "
                    f"{golden['waiting_for_refresh']}; `{REFRESH}` there writes it")
    differences = _figure_differences(golden, now)
    moved = stack.changes(golden["stack"], now["stack"])
    assert not differences, (
        f"the smoke pipeline's figures differ from {record.relative_to(REPO)} ({len(differences)} differences):\n  "
        + "\n  ".join(differences[:40])
        + (f"\nthe stack moved since the record: {'; '.join(moved)}" if moved else
           "\nthe stack is the record's: a change of code or config moved them")
        + f"\nif the change is meant to move them, refresh the record deliberately with `{REFRESH}` and commit it")


def test_a_refresh_that_moves_the_figures_leaves_the_other_vendors_record_waiting(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.modules[__name__], "GOLDEN", tmp_path)
    before = {"stages": {"ppo": {"checkpoint_digest": "a", "data_digest": "d", "metrics": {"train/kl": 1.0}}}}
    after = {"stages": {"ppo": {"checkpoint_digest": "b", "data_digest": "d", "metrics": {"train/kl": 2.0}}}}
    amd, intel = tmp_path / "smoke-amd.json", tmp_path / "smoke-intel.json"
    for record in (amd, intel):
        record.write_text(json.dumps(before))
    _refresh(amd, after)  # the change moved the figures here: the Intel record waits
    waiting = json.loads(intel.read_text())["waiting_for_refresh"]
    assert waiting.startswith("the figures moved on amd (2 differences, first: ppo checkpoint_digest: a -> b)")
    assert "smoke-intel.json waits for `make golden`" in capsys.readouterr().out
    _refresh(intel, after)  # the catch-up on an Intel machine: its mark goes, and the AMD record is not marked
    assert "waiting_for_refresh" not in json.loads(intel.read_text())
    assert "waiting_for_refresh" not in json.loads(amd.read_text())
    _refresh(amd, after)  # nothing moved: nothing waits
    assert "waiting_for_refresh" not in json.loads(intel.read_text())
