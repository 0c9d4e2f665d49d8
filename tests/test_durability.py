"""Nothing is lost or half-written at a SIGKILL or a full disk: PPO's full-state checkpoint killed at
every step of its swap, and the MLflow journal torn, corrupted, replayed and written to a disk that fills.
(The TRL stages' resume past a torn trainer checkpoint: `tests.helpers.resumes_past_torn_saves`.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from rlhf import tracking
from stages.rl.ppo_state import complete_state, write_atomically
from tests.helpers import ppo_inputs

ONE_PROCESS = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
"""What `write_atomically` needs of an Accelerator, for one process."""


def _write_version(version: int, tick=lambda: None):
    """A full-state checkpoint's writer: three files, each written in two halves, `loop.json` last."""
    def write(staging: Path) -> None:
        for name in ("policy.safetensors", "optimizer.pt", "loop.json"):
            data = json.dumps({"iteration": version, "file": name}).encode() * 64
            with open(staging / name, "wb") as file:
                file.write(data[:len(data) // 2])
                file.flush()
                tick()
                file.write(data[len(data) // 2:])
            tick()
    return write


def _version(folder: Path) -> int:
    """The one version every file of a checkpoint holds (a torn or mixed checkpoint fails here)."""
    versions = set()
    for name in ("policy.safetensors", "optimizer.pt", "loop.json"):
        data = (folder / name).read_bytes()
        chunk = json.dumps({"iteration": json.loads(data[:data.index(b"}") + 1])["iteration"], "file": name})
        assert data == chunk.encode() * 64, f"{folder / name} is torn"
        versions.add(json.loads(chunk)["iteration"])
    (version,) = versions
    return version


def _killed_at(folder: Path, point: int) -> bool:
    """Save version 2 over `folder` in a forked child that SIGKILLs itself at its `point`-th file-system
    step (a rename, an fsync, a removal, a half file written); whether the kill came before the save ended."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's code
        steps = [0]

        def tick():
            steps[0] += 1
            if steps[0] == point:
                os.kill(os.getpid(), signal.SIGKILL)

        def counted(function):
            def step(*args, **kwargs):
                tick()
                return function(*args, **kwargs)
            return step

        os.rename, os.fsync, shutil.rmtree = counted(os.rename), counted(os.fsync), counted(shutil.rmtree)
        try:
            write_atomically(folder, _write_version(2, tick), ONE_PROCESS)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    return os.WIFSIGNALED(status)


def test_a_ppo_checkpoint_killed_at_any_step_of_its_save_leaves_a_whole_one(tmp_path):
    """At every kill point the newest complete checkpoint is the old one or the new one, each whole, and
    the next save leaves exactly one checkpoint behind. (The real stage resuming from the aside copy to
    the uninterrupted run's weights: `test_ppo.py`'s killed run, `mid_swap`.)"""
    folder, outcomes = tmp_path / "state", []
    point = 0
    while True:
        point += 1
        shutil.rmtree(tmp_path, ignore_errors=True)
        write_atomically(folder, _write_version(1), ONE_PROCESS)
        if not _killed_at(folder, point):
            break
        found, _ = complete_state(folder)
        assert found is not None, f"no complete checkpoint after a kill at step {point}: {os.listdir(tmp_path)}"
        outcomes.append(_version(found))
        write_atomically(folder, _write_version(3), ONE_PROCESS)  # the resumed run's next save
        assert _version(folder) == 3 and sorted(os.listdir(tmp_path)) == ["state"], os.listdir(tmp_path)
    assert _version(folder) == 2 and sorted(os.listdir(tmp_path)) == ["state"]
    assert len(outcomes) >= 10 and set(outcomes) == {1, 2}, outcomes  # killed before and after the swap


@pytest.fixture(scope="module")
def tracking_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("journal")
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    yield root
    if previous is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous
    mlflow.set_tracking_uri(None)


def _new_run() -> str:
    return MlflowClient().create_run(tracking.ensure_experiment("journal")).info.run_id


def _table(run_id: str, artifact_file: str) -> list:
    return json.loads(Path(MlflowClient().download_artifacts(run_id, artifact_file)).read_text())["data"]


def test_a_torn_or_corrupt_journal_mends_itself_on_open(tracking_store, tmp_path, caplog):
    from flows.records.journal import RunJournal, send_leftovers

    run_id, folder = _new_run(), tmp_path / "journal"
    folder.mkdir()
    lines = [json.dumps({"kind": "metrics", "step": s, "timestamp": 1000 + s, "metrics": {"loss": 1.0 / s}})
             for s in (1, 2, 3)]
    # line 2 corrupted on disk, and a last line cut short by a kill mid-write
    (folder / f"{run_id}.jsonl").write_text(lines[0] + "\n" + "{\"kind\": \"met\x00\n" + lines[2] + "\n"
                                            + lines[1][:20])
    with caplog.at_level(logging.WARNING, logger="flows.records.journal"):
        journal = RunJournal(run_id, folder, outage_limit_s=600)
        journal.log({"loss": 0.25}, 4)
        journal.close()
    assert "cut a torn last line of 20 bytes" in caplog.text and "line 2 is not JSON" in caplog.text
    assert (folder / f"{run_id}.rejected").read_text() == "{\"kind\": \"met\x00\n"  # set aside, not lost
    steps = sorted(m.step for m in MlflowClient().get_metric_history(run_id, "loss"))
    assert steps == [1, 3, 4]
    assert all(json.loads(line) for line in (folder / f"{run_id}.jsonl").read_text().splitlines())
    # a leftover journal torn the same way is mended by the next attempt's sender too
    leftover = _new_run()
    (folder / f"{leftover}.jsonl").write_text(lines[0] + "\n" + lines[1][:7])
    assert send_leftovers(folder) == [leftover]
    assert [m.step for m in MlflowClient().get_metric_history(leftover, "loss")] == [1]


def test_a_replayed_journal_adds_no_table_rows_or_metric_points(tracking_store, tmp_path):
    """Delivery is at least once: a kill between a send and its count sends the entry again."""
    from flows.records.journal import RunJournal, send_leftovers

    run_id, folder = _new_run(), tmp_path / "journal"
    journal = RunJournal(run_id, folder, outage_limit_s=600)
    journal.log({"loss": 0.5}, 1)
    journal.table(pd.DataFrame({"user": ["a", "b"], "response": ["x", "y"]}), "evaluation.json")
    journal.table(pd.DataFrame({"user": ["c"], "response": ["z"]}), "evaluation.json")  # appended to the same table
    journal.table(pd.DataFrame({"user": ["d"], "response": ["w"]}), "samples/iteration_00001.json")
    journal.close()
    expected = [["a", "x"], ["b", "y"], ["c", "z"]]
    assert _table(run_id, "evaluation.json") == expected
    for sent in (0, 2, 3):  # the count lost at several points: everything after it is sent again
        (folder / f"{run_id}.sent").write_text(str(sent))
        send_leftovers(folder)
        assert _table(run_id, "evaluation.json") == expected
        assert _table(run_id, "samples/iteration_00001.json") == [["d", "w"]]
        assert len(MlflowClient().get_metric_history(run_id, "loss")) == 1
    # A kill between `log_table`'s upload and its tag: the table is there, MLflow's tag does not list it.
    MlflowClient().set_tag(run_id, "mlflow.loggedArtifacts", "[]")
    (folder / f"{run_id}.sent").write_text("1")
    send_leftovers(folder)
    assert _table(run_id, "evaluation.json") == expected
    logged = json.loads(MlflowClient().get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "evaluation.json", "type": "table"} in logged  # put back, as `log_table` leaves it
    reopened = RunJournal(run_id, folder, outage_limit_s=600)  # a reopened journal continues the table
    reopened.table(pd.DataFrame({"user": ["e"], "response": ["v"]}), "evaluation.json")
    reopened.close()
    assert _table(run_id, "evaluation.json") == expected + [["e", "v"]]


FILLING = """
import json, os, resource, signal, sys
from pathlib import Path
from flows.records.journal import RunJournal, mend
limit = int(sys.argv[2])
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
journal = RunJournal("run", Path(sys.argv[1]), outage_limit_s=600)
written, error = 0, None
for step in range(100000):
    try:
        journal.log({"loss": 1.0 / (step + 1), "padding": 0.123456789}, step)
        written += 1
    except OSError as e:
        error = str(e)
        break
print(json.dumps({"written": written, "error": error, "mended": mend(journal.path)}))
sys.stdout.flush()
os._exit(0)
"""


def _fill(folder: Path, limit: int) -> dict:
    """Log to a journal in `folder` until the disk (or the file size `limit`) is full, in a child process
    whose tracking server never answers (the journal only grows)."""
    env = os.environ | {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", FILLING, str(folder), str(limit)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_whole(path: Path, filled: dict) -> None:
    lines = path.read_text().splitlines(keepends=True)
    assert all(line.endswith("\n") and json.loads(line)["kind"] == "metrics" for line in lines)
    assert len(lines) == filled["written"] == filled["mended"] > 0  # every logged entry, no half line
    assert "could not be written" in filled["error"] and "it holds every entry before this one" in filled["error"]


@pytest.mark.multiprocess
def test_a_journal_on_a_disk_that_fills_keeps_every_whole_entry(tmp_path):
    filled = _fill(tmp_path / "journal", 64 * 1024)  # the file-size limit: a write cut short, as on a full disk
    _assert_whole(tmp_path / "journal" / "run.jsonl", filled)


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_journal_on_a_small_tmpfs_that_fills_keeps_every_whole_entry(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        filled = _fill(disk / "journal", 0)
        assert "No space left on device" in filled["error"]
        _assert_whole(disk / "journal" / "run.jsonl", filled)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


PARENT = """
import pickle, sys
from stages.common.reporting import Reporting
from stages.launch.call import Determinism, call_stage
from stages.ppo import train_ppo
cfg, inputs = pickle.loads(open(sys.argv[1], "rb").read())
call_stage(train_ppo, cfg, inputs, __import__("pathlib").Path(sys.argv[2]), Reporting(), Determinism(num_threads=2))
"""


def _job_processes(folder: Path) -> list:
    """Live processes of a local launch into `folder`: its launcher (`accelerate launch`) and its ranks."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "stages.launch.local" in cmdline and str(folder / "launch") in cmdline:
            found.append(process)
    return found


@pytest.mark.multiprocess
def test_ranks_die_with_a_launcher_killed_while_they_import(tmp_path):
    """The launcher SIGKILLed while its two ranks still import (torch, the stage: seconds): both end at
    once, for each sets its death signal in its first lines, before those imports. (Set after them, a
    rank lived on with no parent until it reached its work.)"""
    import time

    import psutil

    from rlhf.sections.base import LaunchConfig
    from stages.launch.local import launch_command

    spec = tmp_path / "launch"
    spec.mkdir()
    launcher = subprocess.Popen(launch_command(spec, LaunchConfig(num_processes=2)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while len(ranks := [p for p in _job_processes(tmp_path) if p.pid != launcher.pid]) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, "the launcher started no two ranks"
        time.sleep(0.01)
    time.sleep(0.2)  # past a rank's first lines (~50 ms of interpreter and `stages`), inside its imports
    launcher.kill()
    launcher.wait()

    def alive() -> list[int]:  # a zombie has ended: its new parent reaps it when it will
        return [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    gone_by = time.monotonic() + 0.5
    while alive() and time.monotonic() < gone_by:
        time.sleep(0.02)
    assert not alive()


@pytest.mark.multiprocess
def test_ranks_die_with_a_sigkilled_caller_and_the_rerun_resumes_to_the_uninterrupted_weights(tiny_config, trained,
                                                                                              tmp_path):
    """The flow's process SIGKILLed (the OOM killer's way) mid-PPO on two processes: its ranks end within
    10 s instead of training on, and the rerun in the same folder resumes to the uninterrupted weights."""
    import pickle
    import time

    from rlhf.config import with_overrides
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import train_ppo
    from stages.runtime.models import folder_digest

    cfg = with_overrides(tiny_config.ppo, {"launch": {"num_processes": 2}, "num_iterations": 12,
                                           "checkpoint_every": 2, "evaluation.every": None})
    inputs = ppo_inputs(trained)
    whole = call_stage(train_ppo, cfg, inputs, tmp_path / "whole", Reporting(), Determinism(num_threads=2))

    (tmp_path / "call.pkl").write_bytes(pickle.dumps((cfg, inputs)))
    killed = tmp_path / "killed"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "call.pkl"), str(killed)],
                              cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (killed / "state" / "loop.json").exists():
        assert parent.poll() is None and time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.1)
    assert len(_job_processes(killed)) == 3  # the launcher and two ranks
    parent.send_signal(signal.SIGKILL)  # the caller alone: its ranks are in sessions of their own
    parent.wait()
    gone_by = time.monotonic() + 10
    while _job_processes(killed) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not _job_processes(killed), "the launcher or its ranks outlived their caller"
    assert not (killed / "launch" / "result.pkl").exists()  # killed mid-run, not after it
    resumed = call_stage(train_ppo, cfg, inputs, killed, Reporting(), Determinism(num_threads=2))
    assert folder_digest(resumed.checkpoint) == folder_digest(whole.checkpoint)
