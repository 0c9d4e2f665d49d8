"""Running a stage's processes on a Ray cluster, as one Ray Train gang (`launch.engine: ray`).

    caller (the flow's task)           Ray driver (this module, a child process)        N ranks (Ray Train workers)
    run(call) -- follow(command) --->  main(spec): ray.init, room check, Inbox actor,   _rank(config): start_rank,
    events.jsonl / result.pkl   <----  TorchTrainer.fit; the Inbox's events as lines    the stage, rank 0's events and
                                       of events.jsonl, rank 0's result as result.pkl   result sent to the Inbox actor

Why a `TorchTrainer` gang and not actors in a placement group: Ray Train already does what a gang
needs (a placement group of N bundles, `PACK` or `SPREAD`; the torch process group set up on
every rank before the stage runs; a failed gang torn down and started again up to
`FailureConfig.max_failures` times; every rank's exception gathered by rank). Our own actors
would rewrite each of those.

Why a driver process of its own: `ray.init` binds a process to one cluster for its life, can
abort the process on an unreachable address, and a killed driver takes the gang with it (Ray
ends the actors a dead driver owned). So the caller follows it exactly as it follows
`accelerate launch` (`stages.launch.job.follow`), and stopping the caller stops the gang.

What rank 0 tells the caller travels through Ray, not a disk: every `Reporting` call and its
result (or the `StageUserError` it raised) go to a small actor (`Inbox`, no CPU of its own,
placed on the driver's node), which the driver drains. The ranks' own work folders (the stage's
checkpoint, PPO's resume state) are the stage's `output_dir`: on one machine that is this
machine's disk; across machines it must be storage every node mounts (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import rlhf.numerics as numerics
from rlhf.sections.base import state_dir
from stages.common.reporting import Reporting
from stages.launch.job import (
    ERROR,
    EVENTS,
    RESULT,
    LaunchError,
    StageCall,
    accelerate_environment,
    cpu_environment,
    event_writer,
    follow,
    log_tail,
    run_rank,
    start_rank,
    write_result,
    write_spec,
)

LAUNCH, FAILURE = "launch.json", "failure.txt"
"""In the spec folder: where each rank ran (`launch_record`), and why the gang failed."""
TAG_NODES = "rlhf.launch.nodes"
CONNECT_TIMEOUT = 10.0
"""Seconds the driver waits for the cluster's head to answer before the stage fails, naming the address."""
ROOM_TIMEOUT = 60.0
"""Seconds the driver waits for the cluster to hold the gang (its placement group) before failing."""

# --- the caller's side ------------------------------------------------------------------------


def run(call: StageCall, reporting: Reporting):
    """`call` on `call.section.launch.num_processes` ranks of the Ray cluster at `launch.ray_address`;
    rank 0's result, its tags naming every rank's node."""
    spec = write_spec(call)
    for stale in (LAUNCH, FAILURE):
        (spec / stale).unlink(missing_ok=True)
    command = [sys.executable, "-m", "stages.launch.ray_gang", str(spec)]
    returncode = follow(command, spec, reporting, dict(os.environ, PYTHONUNBUFFERED="1"))
    if returncode != 0 or not (spec / RESULT).exists():
        failure = spec / FAILURE
        why = failure.read_text() if failure.exists() else f"the Ray driver exited with code {returncode}"
        raise LaunchError(f"the {call.section.launch.num_processes}-process Ray gang failed: {why}; its log is "
                          f"{spec / 'launch.log'}; last lines:\n{log_tail(spec)}")
    result = pickle.loads((spec / RESULT).read_bytes())
    record = json.loads((spec / LAUNCH).read_text())
    return _with_launch(result, record)


def _with_launch(result, record: dict):
    """The result with its launch in its tags (`rlhf.launch.engine`, `rlhf.launch.nodes`) and metrics
    (`time/launch_seconds`: from the driver's start to rank 0's)."""
    import dataclasses

    if not dataclasses.is_dataclass(result) or not hasattr(result, "tags"):
        return result
    nodes = json.dumps(record["ranks"], separators=(",", ":"))
    return dataclasses.replace(result, tags={**result.tags, "rlhf.launch.engine": "ray", TAG_NODES: nodes},
                               metrics={**result.metrics, "time/launch_seconds": record["seconds_to_rank0"]})


# --- the driver ---------------------------------------------------------------------------------


def main(spec: Path) -> int:
    started = time.time()
    call: StageCall = pickle.loads((spec / "call.pkl").read_bytes())
    launch = call.section.launch
    try:
        _connect(launch.ray_address)  # the first import of Ray in this process
        per_rank = _rank_resources(call.num_threads)
        _check_room(launch.num_processes, per_rank, launch.ray_placement)
    except LaunchError as e:
        (spec / FAILURE).write_text(str(e))
        return 1
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    gpus = "GPU" in per_rank

    inbox = ray.remote(Inbox).options(num_cpus=0, scheduling_strategy=_on_this_node()).remote()
    trainer = TorchTrainer(
        _rank, train_loop_config={"call": (spec / "call.pkl").read_bytes(), "inbox": inbox},
        torch_config=TorchConfig(backend="nccl" if gpus else "gloo", timeout_s=launch.timeout_seconds),
        scaling_config=ScalingConfig(num_workers=launch.num_processes, use_gpu=gpus, resources_per_worker=per_rank,
                                     placement_strategy=launch.ray_placement),
        run_config=RunConfig(name=f"{call.output_dir.name}-{call.attempt}",
                             storage_path=str(Path(launch.ray_storage_path or call.output_dir / "ray").resolve()),
                             failure_config=FailureConfig(max_failures=launch.max_failures,
                                                          controller_failure_limit=0),
                             worker_runtime_env={"env_vars": _rank_environment(gpus) | accelerate_environment(launch)}))
    events = event_writer(spec / EVENTS)
    with ThreadPoolExecutor(1) as pool:
        fit = pool.submit(trainer.fit)
        while True:
            finished = fit.done()
            for kind, arguments in ray.get(inbox.drain.remote(), timeout=launch.timeout_seconds):
                getattr(events, kind)(*arguments)
            if finished:
                break
            time.sleep(0.5)
    outcome = ray.get(inbox.outcome.remote(), timeout=launch.timeout_seconds)
    (spec / LAUNCH).write_text(json.dumps(launch_record(outcome["joined"], started)))
    if outcome["error"] is not None:  # a StageUserError on rank 0: the caller raises it as it was
        (spec / ERROR).write_bytes(outcome["error"])
        return 1
    try:
        fit.result()
    except Exception as e:  # ray.train.TrainingFailedError and what it wraps
        lost = lost_nodes(outcome["joined"], launch.num_processes, per_rank, launch.ray_placement)
        (spec / FAILURE).write_text(lost + describe_failure(e, outcome["joined"]))
        return 1
    write_result(pickle.loads(outcome["result"]), spec)
    return 0


def _resolve(address: str) -> str:
    """The head's `host:port` for `address` (`auto`: `RAY_ADDRESS`, else the cluster `make ray-up` or
    `ray start` recorded on this machine). For a cluster `make ray-up` started, its token too, in
    this process's environment, unless the user set Ray's auth settings themselves."""
    local = _local_cluster()
    target = address
    if address == "auto":
        target = os.environ.get("RAY_ADDRESS") or (local[0] if local else None)
        if target is None:
            raise LaunchError("launch.ray_address is auto, and no Ray cluster runs on this machine (none started "
                              "with `ray start` or `make ray-up`, no RAY_ADDRESS): start one, or set "
                              "launch.ray_address")
    if local and local[1] is not None and target == local[0] and "RAY_AUTH_MODE" not in os.environ:
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(local[1]))
    return target


def _connect(address: str) -> None:
    """`ray.init` on the cluster at `address` (`_resolve`), after making sure its head answers within
    `CONNECT_TIMEOUT` (Ray's own client retries for a minute, then may abort the process)."""
    target = _resolve(address)  # before Ray is imported: it reads its auth settings then
    import ray

    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except (OSError, ValueError) as e:
        raise LaunchError(f"no Ray cluster answers at {target} (launch.ray_address {address!r}) within "
                          f"{CONNECT_TIMEOUT:.0f} s: {e}") from None
    try:
        _check_token(target)  # at once: `ray.init` retries an unauthenticated driver for a minute
        ray.init(address=target, logging_level="WARNING", log_to_driver=True)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:  # a token, a port not the GCS's, ...
        raise LaunchError(f"could not join the Ray cluster at {target} (launch.ray_address {address!r}): "
                          f"{str(e).strip()[-1500:]}") from None


def _check_token(target: str) -> None:
    """Ask the head's GCS for the cluster's id with this process's auth settings: a cluster that requires a
    token this driver lacks (or holds wrong) refuses in milliseconds, with Ray's reason (`AuthenticationError`;
    a port that is not the GCS's: `RpcError`).
    Ray Client addresses (`ray://`) authenticate their own way and are left to `ray.init`."""
    if target.startswith("ray://"):
        return
    from ray._raylet import GcsClient

    GcsClient(address=target)


def _local_cluster() -> tuple[str, Path | None] | None:
    """The head of the cluster `make ray-up` started (scripts/ray_cluster.sh records its address and
    token in `$RLHF_HOME/ray`), else the one a plain `ray start` recorded (no token of ours), or None."""
    ours = state_dir() / "ray"
    for recorded, token in ((ours / "address", ours / "auth_token"), (Path("/tmp/ray/ray_current_cluster"), None)):
        if recorded.is_file() and (address := recorded.read_text().strip()):
            return address, token if token is not None and token.is_file() else None
    return None


def _rank_environment(gpus: bool) -> dict[str, str]:
    """What the ranks get from the caller: the repository on the import path (the stage functions
    live in it), the run's CPU numerics (set before the worker loads torch), and on a CPU cluster
    gloo's switch and glibc's malloc settings."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])), "PYTHONUNBUFFERED": "1"}
    env |= numerics.environment()
    return env if gpus else cpu_environment(env)


def _rank_resources(num_threads: int) -> dict[str, float]:
    """What each rank reserves: its CPU threads, and a GPU where the cluster has GPUs."""
    import ray

    return {"CPU": num_threads, **({"GPU": 1} if ray.cluster_resources().get("GPU", 0) >= 1 else {})}


def _check_room(ranks: int, per_rank: dict[str, float], placement: str) -> None:
    """Fail now, naming what is missing, when the cluster cannot hold the gang: Ray Train would
    otherwise retry its start for ever."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    missing = {k: v * ranks for k, v in per_rank.items() if total.get(k, 0) < v * ranks}
    if missing:
        have = ", ".join(f"{total.get(k, 0):g} {k}" for k in per_rank)
        raise LaunchError(f"the Ray cluster has {have} in all; the gang needs {ranks} processes x "
                          f"{per_rank} = {', '.join(f'{v:g} {k}' for k, v in missing.items())}")
    trial = placement_group([dict(per_rank) for _ in range(ranks)], strategy=placement)
    try:
        if not trial.wait(timeout_seconds=ROOM_TIMEOUT):
            raise LaunchError(f"the Ray cluster could not place {ranks} processes of {per_rank} ({placement}) within "
                              f"{ROOM_TIMEOUT:.0f} s: no node has that much free (another job may hold it)")
    finally:
        remove_placement_group(trial)


def _on_this_node():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def launch_record(joined: list[dict], started: float) -> dict:
    """Where the last start of each rank ran (`ranks`: rank, Ray node id, IP, pid), how many starts
    there were, and the seconds from the driver's start to rank 0's first."""
    last = {j["rank"]: j for j in joined}
    first_rank0 = min((j["time"] for j in joined if j["rank"] == 0), default=started)
    return {"engine": "ray", "starts": sum(j["rank"] == 0 for j in joined),
            "ranks": [{k: last[r][k] for k in ("rank", "node", "ip", "pid")} for r in sorted(last)],
            "seconds_to_rank0": round(first_rank0 - started, 3)}


RESTART_TIMEOUT_S = float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", 60.0))
"""How long a restarting gang waits for the cluster to hold it again: Ray Train's worker-group start
timeout (`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`, 60 s by default); a lost node must be back within it."""


def lost_nodes(joined: list[dict], ranks: int, per_rank: dict[str, float], placement: str) -> str:
    """Where the gang failed because nodes that held its ranks left the cluster: which nodes, what the
    gang needs and what the live nodes hold ('' when every node that held a rank is alive)."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    alive_ids = {n["NodeID"] for n in alive}
    gone: dict[str, tuple[str, list[int]]] = {}
    for j in joined:
        if j["node"] not in alive_ids:
            gone.setdefault(j["node"], (j["ip"], []))[1].append(j["rank"])
    if not gone:
        return ""
    held = {k: sum(n["Resources"].get(k, 0) for n in alive) for k in per_rank}
    nodes = "; ".join(f"node {node[:12]} ({ip}), which held rank {', '.join(map(str, sorted(set(held_ranks))))}"
                      for node, (ip, held_ranks) in gone.items())
    return (f"{nodes}, left the Ray cluster and was not back within {RESTART_TIMEOUT_S:.0f} s "
            f"(RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S); the gang needs {ranks} processes x {per_rank} ({placement}), "
            f"and the live nodes hold {', '.join(f'{v:g} {k}' for k, v in held.items())}. ")


def describe_failure(error: BaseException, joined: list[dict]) -> str:
    """What ended the gang, rank by rank, with the node and process each rank last ran as."""
    failures = getattr(error, "worker_failures", None) or {}
    last = {j["rank"]: j for j in joined}
    if not failures:
        return f"{type(error).__name__}: {str(error)[:2000]}"

    def where(rank: int) -> str:
        j = last.get(rank)
        return f"rank {rank}" + (f" (node {j['node'][:12]}, {j['ip']}, pid {j['pid']})" if j else "")

    def last_line(e: BaseException) -> str:
        return str(e).strip().splitlines()[-1][:500] if str(e).strip() else ""

    return "; ".join(f"{where(rank)}: {type(e).__name__}: {last_line(e)}" for rank, e in sorted(failures.items()))


# --- the Inbox: what the ranks tell the driver --------------------------------------------------


class Inbox:
    """Rank 0's reports, result and error, and where every rank started (each start of a rank): a
    Ray actor on the driver's node (`ray.remote(Inbox)`), the ranks' one channel to the driver."""

    def __init__(self):
        self.events: list = []
        self.joined: list[dict] = []
        self.result: bytes | None = None
        self.error: bytes | None = None

    def join(self, record: dict) -> None:
        self.joined.append(record)

    def event(self, kind: str, arguments: list) -> None:
        self.events.append((kind, arguments))

    def drain(self) -> list:
        events, self.events = self.events, []
        return events

    def deliver(self, result: bytes) -> None:
        self.result = result

    def fail(self, error: bytes) -> None:
        self.error = error

    def outcome(self) -> dict:
        return {"joined": self.joined, "result": self.result, "error": self.error}


def _inbox_reporting(inbox) -> Reporting:
    """Rank 0's `Reporting`: every call sent to the inbox, in order (one caller's calls to an actor run in order)."""
    import dataclasses

    def sender(kind: str):
        return lambda *arguments: inbox.event.remote(kind, list(arguments))

    return Reporting(**{field.name: sender(field.name) for field in dataclasses.fields(Reporting)})


# --- each rank ----------------------------------------------------------------------------------


def _rank(config: dict) -> None:
    """One rank of the gang, in a Ray Train worker: the process group is Ray Train's."""
    import ray
    import ray.train

    call: StageCall = pickle.loads(config["call"])
    inbox = config["inbox"]
    rank = ray.train.get_context().get_world_rank()
    ray.get(inbox.join.remote({"rank": rank, "node": ray.get_runtime_context().get_node_id(),
                               "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "time": time.time()}))
    state = start_rank(call)
    reporting = _inbox_reporting(inbox) if state.is_main_process else Reporting()
    result = run_rank(call, state, reporting, lambda e: ray.get(inbox.fail.remote(pickle.dumps(e))))
    if state.is_main_process:
        ray.get(inbox.deliver.remote(pickle.dumps(result)))
    state.wait_for_everyone()  # rank 0 has delivered: Ray Train ends the ranks and their process group


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
