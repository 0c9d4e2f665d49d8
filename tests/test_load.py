"""A team's stack on PostgreSQL (`RLHF_DB=postgresql make up`): it starts, stops and keeps its runs, and
under load (`make load-test`: 16 `rlhf/full` runs submitted at once) every run completes on its own
lineage with no HTTP 5xx, while a probe times both servers' answers."""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tests.stack import (
    REPO,
    commands_holding,
    credentials,
    deployment_run,
    logs_holding,
    mlflow_client,
    running_stack,
    submit_and_wait,
)

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]

POSTGRES = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
needs_postgres = pytest.mark.skipif(not POSTGRES, reason="PostgreSQL is not installed (Debian: apt-get install "
                                                          "postgresql)")
LOAD_RUNS = int(os.environ.get("RLHF_LOAD_RUNS", 16))
LOAD_WORKER_LIMIT = os.environ.get("RLHF_WORKER_LIMIT", "8")
"""Flow runs the worker runs at once under load (the stack's default is 4); the rest wait their turn."""
SERVER_ERROR = re.compile(r'" 5\d\d |retryable status code 5\d\d|HTTP 5\d\d|status_code=5\d\d')
"""A 5xx answer, as MLflow's access log, Prefect's client retries and the worker's log write it."""


@contextmanager
def _postgres_stack(tmp_path: Path, **settings: str) -> Iterator[dict[str, str]]:
    """The stack on PostgreSQL in `tmp_path`; the cluster in a folder the postgres user can reach (a
    pytest folder is private to its user), removed after."""
    from tests.helpers import free_port

    data = Path(tempfile.mkdtemp(prefix="rlhf-pg-"))
    try:
        with running_stack(tmp_path / "stack", RLHF_DB="postgresql", RLHF_PG_PORT=str(free_port()),
                           RLHF_PG_DATA=str(data), **settings) as env:
            yield env
    finally:
        shutil.rmtree(data, ignore_errors=True)


def _psql(env: dict[str, str], database: str, query: str, password: str | None = None) -> str:
    """`query`'s answer, as the stack's database user with its password (from the connection URL)."""
    binary = POSTGRES[-1].parent / "psql"
    if password is None:
        password = env["PREFECT_API_DATABASE_CONNECTION_URL"].split("://rlhf:", 1)[1].split("@", 1)[0]
    return subprocess.run([str(binary), "-h", "127.0.0.1", "-p", env["RLHF_PG_PORT"], "-U", "rlhf", "-d", database,
                           "-tAc", query], capture_output=True, text=True, check=True,
                          env=os.environ | {"PGPASSWORD": password}).stdout.strip()


@needs_postgres
def test_the_stack_on_postgresql_keeps_both_servers_runs_in_its_databases(tmp_path):
    with _postgres_stack(tmp_path) as env:
        assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://rlhf:")
        with pytest.raises(subprocess.CalledProcessError) as refused:  # scram-sha-256: no password, no entry
            _psql(env, "postgres", "SELECT 1", password="")
        assert "password authentication failed" in refused.value.stderr or "no password" in refused.value.stderr
        done = deployment_run(env, "rlhf/sft", config_file="configs/tiny.yaml", overrides={"experiment": "team"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # the database's password reaches the servers in their environment: in no command line on the machine
        # (`mlflow server --backend-store-uri postgresql+psycopg://rlhf:<password>@...` had it), nor in a log
        secrets = credentials(env)
        held, logged = commands_holding(secrets), logs_holding(env, secrets)  # names, so a failure shows no secret
        assert not held and not logged
        client = mlflow_client(env)
        (run,) = client.search_runs([client.get_experiment_by_name("team").experiment_id],
                                    filter_string="tags.`rlhf.stage` = 'sft'")
        assert run.info.status == "FINISHED"
        # the runs are PostgreSQL's rows, not a SQLite file's
        assert _psql(env, "mlflow", f"SELECT status FROM runs WHERE run_uuid = '{run.info.run_id}'") == "FINISHED"
        assert int(_psql(env, "prefect", "SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'")) >= 1
        assert not (Path(env["RLHF_HOME"]) / "mlflow.db").exists()
        assert not (Path(env["RLHF_HOME"]) / "prefect" / "prefect.db").exists()
        listening = _psql(env, "postgres", "SHOW listen_addresses")
        assert listening == "127.0.0.1"
        refused = subprocess.run([str(REPO / "scripts" / "stack.sh"), "env"], env=env | {"RLHF_DB": "sqlite"},
                                 capture_output=True, text=True)
        assert refused.returncode != 0 and "keeps its runs on postgresql" in refused.stderr
        postgres = int((Path(env["RLHF_HOME"]) / "pids" / "postgres").read_text())
    # `down` stopped PostgreSQL too: its process is gone and nothing answers on its port
    assert not psutil.pid_exists(postgres) or psutil.Process(postgres).status() == psutil.STATUS_ZOMBIE
    ready = POSTGRES[-1].parent / "pg_isready"
    assert subprocess.run([str(ready), "-q", "-h", "127.0.0.1", "-p", env["RLHF_PG_PORT"]]).returncode != 0


class Probe(threading.Thread):
    """Times one read of each server every second while the load runs: Prefect's flow-run filter and
    MLflow's run search, the calls the UI and the flows make most."""

    def __init__(self, env: dict[str, str]):
        super().__init__(daemon=True)
        self.env, self.stopped = env, threading.Event()
        self.seconds: dict[str, list[float]] = {"prefect": [], "mlflow": []}
        self.errors: list[str] = []

    def _time(self, name: str, url: str, body: dict) -> None:
        user = (self.env["PREFECT_API_AUTH_STRING"] if name == "prefect"
                else f"admin:{self.env['MLFLOW_TRACKING_PASSWORD']}")
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": "Basic " + base64.b64encode(user.encode()).decode()})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                answer.read()
            self.seconds[name].append(time.perf_counter() - started)
        except urllib.error.HTTPError as e:
            self.errors.append(f"{name}: HTTP {e.code}")
        except OSError as e:
            self.errors.append(f"{name}: {e}")

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            self._time("prefect", self.env["PREFECT_API_URL"] + "/flow_runs/filter", {"limit": 20})
            self._time("mlflow", self.env["MLFLOW_TRACKING_URI"] + "/api/2.0/mlflow/runs/search",
                       {"experiment_ids": ["0"], "max_results": 20})

    def figures(self) -> dict:
        def percentiles(values: list[float]) -> dict:
            ordered = sorted(values) or [float("nan")]
            pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)  # noqa: E731
            return {"requests": len(values), "p50_ms": pick(0.5), "p95_ms": pick(0.95), "max_ms": pick(1.0)}

        return {name: percentiles(values) for name, values in self.seconds.items()}


def _lineages(env: dict[str, str], experiment: str) -> list[dict]:
    """Each pipeline run of `experiment`: its stage runs and the upstream run ids each names."""
    client = mlflow_client(env)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("rlhf.stages")]
    found = []
    for parent in parents:
        children = {r.data.tags["rlhf.stage"]: r for r in runs
                    if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id and r.data.tags.get("rlhf.stage")}
        found.append({"parent": parent.info.run_id, "status": parent.info.status,
                      "stages": {stage: {"run_id": r.info.run_id, "status": r.info.status,
                                         "upstream": {k.removeprefix("rlhf.upstream."): v
                                                      for k, v in r.data.tags.items()
                                                      if k.startswith("rlhf.upstream.")}}
                                 for stage, r in children.items()},
                      "reused": {k: v for k, v in parent.data.tags.items() if k.startswith("rlhf.reused.")}})
    return found


@needs_postgres
@pytest.mark.skipif(os.environ.get("RLHF_LOAD_TEST") != "1",
                    reason="the load test takes ~7 min on 2 cores: `make load-test` runs it (RLHF_LOAD_TEST=1)")
def test_many_full_runs_at_once_on_postgresql_all_complete_on_their_own_lineage(tmp_path):
    requests = [("rlhf/full", {"config_file": "configs/tiny.yaml",
                               "overrides": {"experiment": "load", "sft.seed": i, "reward.seed": i, "ppo.seed": i}})
                for i in range(LOAD_RUNS)]
    with _postgres_stack(tmp_path, RLHF_WORKER_LIMIT=LOAD_WORKER_LIMIT) as env:
        probe = Probe(env)
        probe.start()
        started = time.monotonic()
        states = submit_and_wait(env, requests, timeout=3600)
        seconds = time.monotonic() - started
        probe.stopped.set()
        probe.join()
        lineages = _lineages(env, "load")
        logs = {name: (Path(env["RLHF_HOME"]) / "logs" / f"{name}.log").read_text(errors="replace")
                for name in ("prefect", "mlflow", "worker")}
    server_errors = [f"{name}: {line.strip()[:200]}" for name, text in logs.items() for line in text.splitlines()
                     if SERVER_ERROR.search(line)]
    figures = {"date": datetime.date.today().isoformat(), "database": "postgresql", "runs": LOAD_RUNS,
               "worker_limit": int(LOAD_WORKER_LIMIT), "cpus": os.cpu_count(),
               "seconds": round(seconds, 1), "runs_per_hour": round(LOAD_RUNS / seconds * 3600, 1),
               "latency": probe.figures(), "probe_errors": probe.errors[:20], "server_errors": server_errors[:20],
               "states": sorted({state for state, _, _ in states})}
    out = Path(os.environ.get("RLHF_LOAD_RESULTS", REPO / "bench" / "results"))
    (out / f"load-postgresql-{figures['date']}.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))

    assert [state for state, _, _ in states] == ["COMPLETED"] * LOAD_RUNS, states
    assert not server_errors and not probe.errors, (server_errors + probe.errors)[:20]
    assert len(lineages) == LOAD_RUNS and all(line["status"] == "FINISHED" for line in lineages)
    for line in lineages:  # each run trained its own stages (their seeds differ) and names only them upstream
        stages = line["stages"]
        assert set(stages) == {"sft", "reward", "ppo"} and not line["reused"], line
        assert all(stage["status"] == "FINISHED" for stage in stages.values()), line
        assert stages["reward"]["upstream"]["sft"] == stages["sft"]["run_id"], line
        assert stages["ppo"]["upstream"] == {"sft": stages["sft"]["run_id"], "reward": stages["reward"]["run_id"]}, line
    assert len({line["stages"]["ppo"]["run_id"] for line in lineages}) == LOAD_RUNS
