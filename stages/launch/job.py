"""What a launch runs and how its caller follows it, whichever engine starts the processes.

A launch runs one stage function call (`StageCall`), the same on every process. The caller pickles
it into a spec folder (the stage's own work folder: nothing but the launchers write or read it),
starts one command (`accelerate launch ...` for `stages.launch.local`, a Ray driver for
`stages.launch.ray_gang`) and follows it with `follow`: what rank 0 reports (metrics, sample
tables, warnings) arrives as lines of `events.jsonl` and is handed to the caller's `Reporting`
while the job runs; rank 0's result comes back pickled in `result.pkl`, a `StageUserError` it
raised in `error.pkl`. The caller gets the same result object whichever engine ran it.

Each rank's side is `start_rank` (determinism, the process group, sharded loading) and `run_rank`
(the stage, its measured peak memory, its result or error written back).

A job dies with its caller. The command `follow` starts gets SIGKILL when the caller's process dies
(Linux's `PR_SET_PDEATHSIG`, `die_with_parent`), and so does each local rank when the launcher above
it dies; Ray ends a driver's workers when the driver goes. Each local rank holds a shared lock on the
spec folder for its lifetime (`hold_work_folder`), and a new launch into the same folder waits until
no rank of an earlier attempt holds it (`write_spec`), so two attempts never write one folder's
checkpoints at once."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pickle
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd

from stages.common.errors import StageUserError
from stages.common.processes import die_with_parent
from stages.common.reporting import Reporting
from stages.memory.measured import measured_peak, with_figures
from stages.runtime.lora import keep_initial_adapters
from stages.runtime.models import set_determinism

Stage = Callable[[Any, Any, Path, Reporting], Any]
"""A stage function: `train(cfg, inputs, output_dir, reporting)`, returning its result on rank 0."""


class LaunchError(RuntimeError):
    """The multi-process job failed; the message holds the tail of its log."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCall:
    """One stage function call, as every process of a launch makes it."""

    train: Stage
    section: Any
    """The stage's config section."""
    inputs: Any
    """The stage's typed inputs (`SFTInputs`, ...)."""
    output_dir: Path
    deterministic: bool
    num_threads: int
    """This process's share of the CPU threads the pipeline may use."""
    attempt: str
    """This launch's own id, which each rank writes into its done marker: a marker that a process of an
    earlier attempt in the same folder left never counts."""


# --- the caller's side ------------------------------------------------------------------------

RESULT, ERROR, EVENTS, LOG = "result.pkl", "error.pkl", "events.jsonl", "launch.log"


RANKS_LOCK = "ranks.lock"
"""In the spec folder: the file each local rank holds a shared lock on while it lives."""
EARLIER_RANKS_WAIT_S = 60.0
"""How long a launch waits for an earlier attempt's ranks in its folder to end (killed with their parent,
they end within a second)."""
_held_locks: list[int] = []
"""Descriptors of the locks this process holds until it ends."""


def hold_work_folder(spec: Path) -> None:
    """Hold a shared lock on `spec` until this process ends (`write_spec` waits for it to be let go)."""
    descriptor = os.open(spec / RANKS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    _held_locks.append(descriptor)


def wait_for_earlier_ranks(spec: Path, timeout_s: float = EARLIER_RANKS_WAIT_S) -> None:
    """Return once no rank of an earlier attempt holds `spec` (`hold_work_folder`); `LaunchError` naming the
    folder when one still does after `timeout_s`."""
    descriptor = os.open(spec / RANKS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LaunchError(f"processes of an earlier attempt still run in {spec.parent} after "
                                      f"{timeout_s:g} s (they hold {spec / RANKS_LOCK}); stop them and retry") from None
                time.sleep(0.2)
    finally:
        os.close(descriptor)  # the exclusive lock goes with it: this launch's ranks take theirs


def write_spec(call: StageCall) -> Path:
    """The spec folder of `call`, once no rank of an earlier attempt is alive in it, cleared of that
    launch's files, holding the pickled call."""
    spec = call.output_dir / "launch"
    spec.mkdir(parents=True, exist_ok=True)
    wait_for_earlier_ranks(spec)
    for stale in (EVENTS, RESULT, ERROR, *(p.name for p in spec.glob("rank-*.done"))):
        (spec / stale).unlink(missing_ok=True)
    (spec / "call.pkl").write_bytes(pickle.dumps(call))
    return spec


def follow(command: list[str], spec: Path, reporting: Reporting, env: dict[str, str]) -> int:
    """Run `command` (its output into the spec's `launch.log`), forwarding rank 0's events to
    `reporting` until it ends; its exit code. A `StageUserError` rank 0 raised is raised here. If
    the caller stops (or its reporting fails), every process the command started is stopped."""
    with (spec / LOG).open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,  # noqa: PLW1509
                                   cwd=Path(__file__).resolve().parents[2], start_new_session=True,
                                   preexec_fn=die_with_parent)
        read = 0
        try:
            while True:
                finished = process.poll() is not None
                read = _forward_events(spec / EVENTS, read, reporting)
                if finished:
                    break
                time.sleep(0.5)
        except BaseException:
            stop(process)
            raise
    if (spec / ERROR).exists():
        raise pickle.loads((spec / ERROR).read_bytes())
    return process.returncode


def log_tail(spec: Path, lines: int = 30) -> str:
    """The last lines of the launch's log."""
    return "\n".join((spec / LOG).read_text(errors="replace").splitlines()[-lines:])


def stop(process: subprocess.Popen) -> None:
    """Kill the command and every process under it: torch's launcher starts each rank in a session
    of its own, out of reach of the command's process group."""
    import psutil

    try:
        processes = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        processes = []
    for child in processes:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.kill()
    process.wait()


TABLE = "__table__"
"""In the event file, the key of a table argument's records (no metric is named so)."""


def _forward_events(events: Path, read: int, reporting: Reporting) -> int:
    """Hand complete new lines of the event file to the caller's callbacks; returns the new offset."""
    if not events.exists():
        return read
    with events.open() as f:
        f.seek(read)
        chunk = f.read()
    complete = chunk[:chunk.rfind("\n") + 1]
    for line in complete.splitlines():
        event = json.loads(line)
        arguments = [pd.DataFrame(a[TABLE]) if isinstance(a, dict) and TABLE in a else a for a in event["arguments"]]
        getattr(reporting, event["kind"])(*arguments)
    return read + len(complete)


def event_writer(events: Path) -> Reporting:
    """A `Reporting` whose every call becomes a line of the event file (tables as their records)."""
    def writer(kind: str):
        def write(*arguments) -> None:
            encoded = [{TABLE: a.to_dict("records")} if isinstance(a, pd.DataFrame) else a for a in arguments]
            with events.open("a") as f:
                f.write(json.dumps({"kind": kind, "arguments": encoded}) + "\n")
        return write

    return Reporting(**{field.name: writer(field.name) for field in dataclasses.fields(Reporting)})


def write_result(result, spec: Path) -> None:
    """Rank 0's result into the spec folder, whole or not at all."""
    staging = spec / f"{RESULT}.tmp"
    staging.write_bytes(pickle.dumps(result))
    staging.rename(spec / RESULT)


# --- each process's side ----------------------------------------------------------------------


def start_rank(call: StageCall):
    """This process's `PartialState`, set up before the stage runs, so the trainers and our PPO
    loop find it as is: the process group (the launcher's environment, or one Ray Train set up),
    determinism and thread count, and the sharded-loading switches."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    set_determinism(call.deterministic, call.num_threads)
    # PartialState reads the CPU switch only from its argument; the trainers' own `ddp_timeout` goes unused.
    state = PartialState(cpu=os.environ.get("ACCELERATE_USE_CPU") == "true",
                         timeout=timedelta(seconds=call.section.launch.timeout_seconds))
    if call.section.launch.sharded:
        # Sharded loading, whatever the accelerate config says: every process builds each model on the meta
        # device, the first reads the checkpoint a tensor at a time and sends every process its shards
        # (`stages.runtime.models.load_pretrained`, `stages.runtime.holding.receive_from_rank0`); LoRA
        # adapters as peft drew them.
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
        keep_initial_adapters()
    if call.section.launch.sharded and state.distributed_type == DistributedType.MULTI_CPU:
        # accelerate takes its FSDP branch only for accelerator devices and would run DDP on CPU
        # without a word; FSDP2 itself runs on CPU over gloo, so let the trainers' accelerator shard.
        state.distributed_type = DistributedType.MULTI_GPU
    return state


def run_rank(call: StageCall, state, reporting: Reporting, user_error: Callable[[StageUserError], None]):
    """The stage on this rank, with the memory figures of the rank that peaked highest; rank 0's
    result (None on the others). A `StageUserError` goes to `user_error` on rank 0, then is raised."""
    try:
        with measured_peak() as peak:
            result = call.train(call.section, call.inputs, call.output_dir, reporting)
        return with_figures(result, highest_peak(peak))
    except StageUserError as e:
        if state.is_main_process:
            user_error(e)
        raise


def highest_peak(figures: dict[str, float]) -> dict[str, float]:
    """The memory figures of the process whose resident memory peaked highest (collective)."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    if dist.get_rank() == 0:  # each process's, in the job's log
        print("memory by rank: " + json.dumps(every), flush=True)
    return max(every, key=lambda f: f.get("memory/peak_rss_gib", 0.0))


def accelerate_environment(launch) -> dict[str, str]:
    """What `accelerate launch --config_file` sets for its ranks from `launch.accelerate_config`
    (FSDP2's switches, mixed precision, dynamo), for ranks another launcher starts (a Ray gang),
    so the trainers' `Accelerator` builds what it builds under `accelerate launch`. {} without a
    config file: DDP, as `accelerate launch --multi_gpu` gives. # launch: LaunchConfig"""
    if launch.accelerate_config is None:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from rlhf.sections.base import accelerate_config_path

    args = launch_command_parser().parse_args(["--config_file", str(accelerate_config_path(launch.accelerate_config)),
                                               "--num_processes", str(launch.num_processes), "stage"])
    args, _, _ = _validate_launch_command(args)  # the config file's settings into the arguments, as the command does
    return {key: value for key, value in prepare_multi_gpu_env(args).items()
            if key.startswith(("ACCELERATE_", "FSDP_")) and key != "ACCELERATE_USE_CPU"}  # the device is the node's


def cpu_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` for a CPU job's ranks: torch.distributed over gloo, and glibc's malloc kept from
    hoarding freed tensors (a value the user set is kept).

    glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which
    tensors of a few MiB come from the heap and stay resident once freed. A sharded model on the
    CPU churns exactly such tensors (each layer gathered, used, freed): at 400M over two
    processes, a process's peak RSS fell from 5.1 to 3.8 GiB with the threshold fixed at 1 MiB
    (one process's peak did not move), for ~8% more time (three small sharded runs: 39.8 s
    against 36.9). On GPUs the tensors live in torch's own allocator, so it is left alone there."""
    env = dict(env, ACCELERATE_USE_CPU="true")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 20))
    return env
