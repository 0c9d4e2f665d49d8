"""The real local stack for end-to-end tests: servers on free ports in a temporary state folder.

`running_stack` starts a Prefect server, an MLflow server, a process worker and the deployments
exactly as `make up` does, and stops exactly what it started. The helpers submit deployment runs
through Prefect's API and read their final states.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parent.parent
STACK = REPO / "scripts" / "stack.sh"


@contextmanager
def running_stack(home: Path, **settings: str) -> Iterator[dict[str, str]]:
    """The stack's environment (what `scripts/stack.sh env` exports, plus `settings`) while it runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(RLHF_HOME=str(home), RLHF_PREFECT_PORT=str(free_port()), RLHF_MLFLOW_PORT=str(free_port()),
               RLHF_POOL=f"rlhf-test-{os.getpid()}-{home.name}", RLHF_PYTHON=sys.executable, **settings)
    exported = subprocess.run([str(STACK), "env"], env=env, capture_output=True, text=True, check=True).stdout
    for line in exported.splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value.strip('"').replace("$PATH", env.get("PATH", ""))
    try:
        start(env)
        yield env
    finally:
        subprocess.run([str(STACK), "down"], env=env, capture_output=True, text=True, timeout=120)
        pids = home / "pids"
        assert not list(pids.iterdir()) if pids.exists() else True


def start(env: dict[str, str]) -> None:
    """`stack.sh up`: starts whatever of the stack is not running."""
    up = subprocess.run([str(STACK), "up"], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr


def credentials(env: dict[str, str]) -> dict[str, str]:
    """Each secret the stack generated, by name (`$RLHF_HOME/credentials`, `NAME="value"` lines): of
    PREFECT_AUTH's `user:password`, the password."""
    lines = (Path(env["RLHF_HOME"]) / "credentials").read_text().splitlines()
    return {name: value.strip('"').rpartition(":")[2] for name, value in (line.split("=", 1) for line in lines)}


def commands_holding(secrets: dict[str, str]) -> list[str]:
    """`pid (program): NAME` for each process on this machine whose command line holds one of `secrets`:
    /proc/<pid>/cmdline is readable by every local user. The secret itself is never named."""
    held = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended while the scan ran
            continue
        held += [f"{cmdline.parent.name} ({Path(args[0]).name}): {name}"
                 for name, secret in secrets.items() if any(secret in arg for arg in args)]
    return held


def logs_holding(env: dict[str, str], secrets: dict[str, str]) -> list[str]:
    """`log: NAME` for each of the stack's logs ($RLHF_HOME/logs) that holds one of `secrets`."""
    return [f"{log.name}: {name}" for log in sorted((Path(env["RLHF_HOME"]) / "logs").iterdir())
            for name, secret in secrets.items() if secret in log.read_text(errors="replace")]


def kill_service(env: dict[str, str], name: str) -> None:
    """SIGKILL one service of the stack (mlflow, prefect or worker) and its children, as a crash would."""
    pid_file = Path(env["RLHF_HOME"]) / "pids" / name
    pid = int(pid_file.read_text())
    os.killpg(pid, signal.SIGKILL)
    pid_file.unlink()
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"{name} (pid {pid}) survived SIGKILL"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie awaiting its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def deployment_run(env: dict[str, str], deployment: str, **params) -> subprocess.CompletedProcess:
    """`prefect deployment run NAME --param ... --watch`, as a user types it."""
    args = [sys.executable, "-m", "prefect", "deployment", "run", deployment, "--watch"]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


_SUBMIT_AND_WAIT = """
import asyncio, json, sys
from prefect import get_client
from prefect.deployments import run_deployment

async def main(requests):
    runs = [await run_deployment(name, parameters=params, timeout=0) for name, params in requests]
    async with get_client() as client:
        while True:
            try:
                states = [(await client.read_flow_run(run.id)).state for run in runs]
            except Exception:  # the Prefect server away (a fault test): ask again
                await asyncio.sleep(1)
                continue
            if all(state.is_final() for state in states):
                break
            await asyncio.sleep(1)
    print("STATES=" + json.dumps([[state.type.value, state.message or "", str(run.id)]
                                  for state, run in zip(states, runs)]))

asyncio.run(main(json.loads(sys.argv[1])))
"""


def submit(env: dict[str, str], requests: list[tuple[str, dict]]) -> subprocess.Popen:
    """Submit deployment runs all at once, from a process that waits for them; see `final_states`."""
    return subprocess.Popen([sys.executable, "-c", _SUBMIT_AND_WAIT, json.dumps(requests)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_states(submitted: subprocess.Popen, timeout: int = 900) -> list[tuple[str, str, str]]:
    """(final state type, state message, flow run id) of each submitted run, in order."""
    out, err = submitted.communicate(timeout=timeout)
    assert submitted.returncode == 0, out[-3000:] + err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("STATES="))
    return [tuple(state) for state in json.loads(line.removeprefix("STATES="))]


def submit_and_wait(env: dict[str, str], requests: list[tuple[str, dict]],
                    timeout: int = 900) -> list[tuple[str, str, str]]:
    return final_states(submit(env, requests), timeout)


def mlflow_client(env: dict[str, str]):
    """A client of the stack's MLflow server, in this process: its URI and credentials (basic auth) set."""
    import mlflow
    from mlflow.tracking import MlflowClient

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        os.environ[key] = env[key]
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    return MlflowClient(env["MLFLOW_TRACKING_URI"])


_LOGS = """
import json, sys
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
messages = []
with get_client(sync_client=True) as client:
    while page := client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[sys.argv[1]])), limit=200,
                                   offset=len(messages)):
        messages += [log.message for log in page]
print("LOGS=" + json.dumps(messages))
"""


def flow_run_logs(env: dict[str, str], flow_run_id: str) -> list[str]:
    """The log messages of a flow run and its tasks, as the Prefect UI shows them."""
    out = subprocess.run([sys.executable, "-c", _LOGS, flow_run_id], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    line = next(line for line in out.stdout.splitlines() if line.startswith("LOGS="))
    return json.loads(line.removeprefix("LOGS="))
