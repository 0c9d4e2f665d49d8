"""What a stage run logs to MLflow, kept on local disk first, then sent in order by a background thread.
A tracking server that stops answering for a while then does not stop a healthy stage.

- Every metric batch, parameter batch, table and tag goes into `<folder>/<run id>.jsonl`, flushed to
  disk, before `log` returns.
- A sender thread writes the entries to the server in that order, with their original steps and
  timestamps, and records in `<run id>.sent` how many it has written.
- While the server does not answer, the stage trains on and the journal grows. When the server answers
  again, the backlog is sent and the gap is recorded on the run (tag `rlhf.tracking_gaps`). The stage
  hears of it too (`new_gaps`).
- Past `outage_limit_s`, the next `log` raises `TrackingError`, naming the server and how long it has
  been gone.
- A refusal by a server that answers (a name it will not store) is raised at the next `log`, as before.
- A journal that a failed attempt left unsent is sent by the next attempt, to its own run
  (`send_leftovers`).
- A journal mends itself when opened (`mend`): a torn last line (a kill or a full disk mid-write) is
  cut off, and a line that is not JSON is set aside in `<run id>.rejected` with a warning. A write that
  fails (the disk full) is cut back before the error is raised, so the journal never holds half a line.
- Delivery is at least once (a kill between a send and its count resends the entry), so every entry is
  safe to send twice: metrics, parameters and tags overwrite themselves, and a table entry knows how
  many rows its artifact held before it (`offset`) and is skipped when the artifact already holds its rows.

Why not MLflow's asynchronous logging (`synchronous=False`): it queues in the process's memory, so what
it holds dies with the process, and a batch that fails after the client's HTTP retries is not tried again.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

from rlhf import tracking

TAG_GAPS = "rlhf.tracking_gaps"
"""On a stage run: the times its tracking server did not answer while it ran, and for how long."""
POLL_S = (0.5, 1.0, 2.0, 5.0)
"""Seconds between health checks while the server does not answer (the last one repeated)."""
SLOW_S = 10.0
"""A send that took longer than this was waiting out the server (the client retries on its own): a gap."""
REJECTED = {"kind": "rejected"}
"""What `mend` leaves in place of a line that is not JSON (the line itself goes to `<run id>.rejected`),
so that the count of sent entries still points at the same lines."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gap:
    """A time the tracking server did not answer."""

    started: float
    """Unix time of the first failed send."""
    seconds: float

    def describe(self) -> str:
        return f"{self.seconds:.0f} s from {time.strftime('%H:%M:%S', time.gmtime(self.started))} UTC"


class RunJournal:
    """One MLflow run's logging, journaled on disk and sent from a background thread (module docstring)."""

    def __init__(self, run_id: str, folder: Path, outage_limit_s: float):
        self.run_id, self.outage_limit_s = run_id, outage_limit_s
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self._sent_path = folder / f"{run_id}.jsonl", folder / f"{run_id}.sent"
        self._files = folder / "files"
        self._lock, self._wake = threading.Lock(), threading.Event()
        self._written = mend(self.path)
        self._table_rows = _table_rows(self.path)
        self._refusal: Exception | None = None
        self._down_since: float | None = None
        self._attempt_started: float | None = None
        self.gaps: list[Gap] = []
        self._reported = 0
        self._closing = self._halted = False
        self._sender = threading.Thread(target=self._send_loop, name="mlflow-journal", daemon=True)
        self._sender.start()

    # --- what the stage logs -------------------------------------------------------------------------

    def log(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)  # taken now: the curve keeps the caller's order and times
        self._append({"kind": "metrics", "step": step, "timestamp": timestamp,
                      "metrics": {key: float(value) for key, value in metrics.items()}})

    def params(self, values: dict[str, str]) -> None:
        self._append({"kind": "params", "params": dict(values)})

    def table(self, frame: pd.DataFrame, artifact_file: str) -> None:
        """`mlflow.log_table`, journaled: the table is written beside the journal first."""
        self._files.mkdir(exist_ok=True)
        local = self._files / f"{self.run_id}-{self._written:06d}.json"
        frame.to_json(local, orient="split", index=False)
        offset = self._table_rows.get(artifact_file, 0)
        self._append({"kind": "table", "file": str(local), "artifact_file": artifact_file,
                      "offset": offset, "rows": len(frame)})
        self._table_rows[artifact_file] = offset + len(frame)

    def _append(self, entry: dict) -> None:
        self.raise_problems()
        self._write(entry)

    def _write(self, entry: dict) -> None:
        line = (json.dumps(entry) + "\n").encode()
        with self._lock:
            journal = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            end = os.lseek(journal, 0, os.SEEK_END)
            try:
                while line:  # unbuffered: a write cut short is seen here, not at a later flush
                    line = line[os.write(journal, line):]
                os.fsync(journal)
            except OSError as error:  # the disk full: no half line stays behind for the next write
                os.ftruncate(journal, end)
                raise OSError(error.errno, f"the run's journal {self.path} could not be written ({error.strerror}); "
                                           "it holds every entry before this one") from error
            finally:
                os.close(journal)
            self._written += 1
        self._wake.set()

    def raise_problems(self) -> None:
        """Raise a refusal by the server, or an outage past the limit."""
        if self._refusal is not None:
            raise self._refusal
        since = self._down_since or self._attempt_started
        if since is not None and (gone := time.time() - since) > self.outage_limit_s:
            raise tracking.ServerGone(
                f"the MLflow tracking server {mlflow.get_tracking_uri()} has not answered for {gone:.0f} s, "
                f"past the limit of {self.outage_limit_s:.0f} s (outage_limit_s); what the stage logged is kept in "
                f"{self.path} and sent when the server answers, and a retry resumes from the stage's checkpoint")

    def new_gaps(self) -> list[Gap]:
        """Gaps that ended since the last call, for the stage's own report (its log and progress)."""
        gaps, self._reported = self.gaps[self._reported:], len(self.gaps)
        return gaps

    # --- the end of the run ------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until everything logged so far is on the server, through an outage up to the limit;
        raise what `raise_problems` raises."""
        while self._sent() < self._written:
            self.raise_problems()
            time.sleep(0.05)
        self.raise_problems()

    def close(self) -> None:
        """`flush`, then stop the sender."""
        self.flush()
        self._stop()

    def close_after_failure(self) -> None:
        """The stage failed: send what the server takes within a few seconds; the rest stays in the
        journal for the next attempt."""
        deadline = time.monotonic() + 10
        while self._sent() < self._written and self._refusal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._halted = True  # not one entry more: the next attempt sends the rest (`send_leftovers`)
        self._stop()

    def _stop(self) -> None:
        self._closing = True
        self._wake.set()
        self._sender.join(timeout=5)

    # --- the sender ------------------------------------------------------------------------------------

    def _sent(self) -> int:
        try:
            return int(self._sent_path.read_text())
        except (OSError, ValueError):
            return 0

    def _send_loop(self) -> None:
        try:
            self._send_all()
        except Exception as error:  # noqa: BLE001 - whatever stops the sender reaches the stage at its next log
            self._refusal = error

    def _send_all(self) -> None:
        client, done, position = MlflowClient(), self._sent(), 0
        if done:  # a journal this attempt reopened: skip what was sent, once
            with open(self.path) as journal:
                for _ in range(done):
                    journal.readline()
                position = journal.tell()
        while self._refusal is None:
            if done >= self._written:
                if self._closing:
                    return
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._lock, open(self.path) as journal:  # the lock: only whole lines are there to read
                journal.seek(position)
                lines = journal.readlines()
                position = journal.tell()
            for line in lines:
                if self._halted or not self._send(client, json.loads(line)):
                    return
                done += 1
                _write_atomically(self._sent_path, str(done))

    def _send(self, client: MlflowClient, entry: dict) -> bool:
        """Send one entry, waiting out the server's absence; False once the sender must stop (a refusal,
        or closing while the server is gone). A send that fails, or that the client's own retries
        stretch past `SLOW_S`, counts as a gap from its start."""
        polls, refused = 0, 0
        while True:
            self._attempt_started = started = time.time()
            try:
                send_entry(client, self.run_id, entry)
                break
            except Exception as error:  # noqa: BLE001 - sorted below: the server gone, or a refusal
                if tracking.server_answers(timeout=2.0):
                    refused += 1
                    if refused >= 2:  # twice, to a server that answers: it will not store this
                        self._refusal, self._attempt_started = error, None
                        return False
                    continue
            finally:
                self._attempt_started = None
            self._down_since = self._down_since or started
            while not tracking.server_answers(timeout=2.0):
                if self._closing:
                    return False
                time.sleep(POLL_S[min(polls, len(POLL_S) - 1)])
                polls += 1
        if self._down_since is None and time.time() - started > SLOW_S:
            self._down_since = started
        if self._down_since is not None:
            self.gaps.append(Gap(self._down_since, time.time() - self._down_since))
            self._down_since = None
            self._write({"kind": "tag", "key": TAG_GAPS, "value": "; ".join(gap.describe() for gap in self.gaps)})
        return True


def send_entry(client: MlflowClient, run_id: str, entry: dict) -> None:
    """One journal entry to the run on the server."""
    if entry["kind"] == "metrics":
        client.log_batch(run_id, metrics=[Metric(key, value, entry["timestamp"], entry["step"])
                                          for key, value in entry["metrics"].items()])
    elif entry["kind"] == "params":
        client.log_batch(run_id, params=[Param(key, value) for key, value in entry["params"].items()])
    elif entry["kind"] == "table" and not _table_sent(client, run_id, entry):
        table = pd.read_json(entry["file"], orient="split", dtype=False, convert_dates=False)  # as it was logged
        client.log_table(run_id, table, entry["artifact_file"])
    elif entry["kind"] == "tag":
        client.log_batch(run_id, tags=[RunTag(entry["key"], entry["value"])])


def send_leftovers(folder: Path) -> list[str]:
    """Send what earlier attempts journaled in `folder` and did not send, each to its own run; the run ids
    it sent to. Raises what the client raises (the flow checked that the server answers)."""
    client, sent_to = MlflowClient(), []
    for path in sorted(folder.glob("*.jsonl")):
        sent_path = path.with_suffix(".sent")
        done = int(sent_path.read_text()) if sent_path.exists() else 0
        mend(path)
        entries = path.read_text().splitlines()[done:]
        for line in entries:
            send_entry(client, path.stem, json.loads(line))
            done += 1
            _write_atomically(sent_path, str(done))
        if entries:
            sent_to.append(path.stem)
    return sent_to


def _table_sent(client: MlflowClient, run_id: str, entry: dict) -> bool:
    """Whether the run's table artifact already holds this entry's rows (a resend after a kill between the
    send and its count). Entries journaled before `offset` existed are always sent."""
    if "offset" not in entry:
        return False
    folder = os.path.dirname(entry["artifact_file"]) or None
    held = 0
    if entry["artifact_file"] in [listed.path for listed in client.list_artifacts(run_id, folder)]:
        held = _stored_rows(client, run_id, entry["artifact_file"])
    if held == entry["offset"]:
        return False
    if held >= entry["offset"] + entry["rows"]:
        _mark_table(client, run_id, entry["artifact_file"])
        return True
    raise ValueError(f"the table {entry['artifact_file']} of run {run_id} holds {held} rows; the journal expected "
                     f"{entry['offset']} before this entry's {entry['rows']}")


def _stored_rows(client: MlflowClient, run_id: str, artifact_file: str) -> int:
    """Rows of a run's table artifact, read from the file itself: `MlflowClient.load_table` finds tables
    by the run's `mlflow.loggedArtifacts` tag, which `log_table` sets after the upload, so a kill between
    the two leaves a table it cannot see (seen in `make test`'s SIGKILL test)."""
    with tempfile.TemporaryDirectory() as scratch:
        stored = client.download_artifacts(run_id, artifact_file, scratch)
        return len(pd.read_json(stored, orient="split", dtype=False, convert_dates=False))


def _mark_table(client: MlflowClient, run_id: str, artifact_file: str) -> None:
    """The run's `mlflow.loggedArtifacts` tag lists this table, as `log_table` leaves it (the UI's
    evaluation view reads it): a kill after the upload may have left it out."""
    logged = json.loads(client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    if {"path": artifact_file, "type": "table"} not in logged:
        client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*logged, {"path": artifact_file, "type": "table"}]))


def _table_rows(path: Path) -> dict[str, int]:
    """Rows journaled so far per table artifact (a reopened journal continues its tables' offsets)."""
    rows: dict[str, int] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        entry = json.loads(line)
        if entry["kind"] == "table":
            table = entry["artifact_file"]
            rows[table] = entry.get("offset", rows.get(table, 0)) + entry.get("rows", 0)
    return rows


def mend(path: Path) -> int:
    """Make the journal at `path` whole: cut a torn last line (no newline: its write was cut short), and
    set aside each line that is not JSON in `<run id>.rejected`, leaving `REJECTED` in its place so the
    sent count still points at the same lines; warn of each. The number of entries it holds."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        logger.warning("journal %s: cut a torn last line of %d bytes (its write was cut short)", path,
                       len(data) - len(whole))
        with open(path, "r+b") as journal:
            journal.truncate(len(whole))
            os.fsync(journal.fileno())
    lines, bad = whole.decode("utf-8", errors="replace").splitlines(), []
    for number, line in enumerate(lines):
        try:
            json.loads(line)
        except ValueError:
            bad.append(line)
            lines[number] = json.dumps(REJECTED)
            logger.warning("journal %s: line %d is not JSON; set aside in %s", path, number + 1,
                           path.with_suffix(".rejected"))
    if bad:
        with open(path.with_suffix(".rejected"), "a") as rejected:
            rejected.write("".join(line + "\n" for line in bad))
        _write_atomically(path, "".join(line + "\n" for line in lines))
    return len(lines)


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)
