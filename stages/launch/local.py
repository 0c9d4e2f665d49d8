"""Running a stage on several processes of one machine (or hand-launched machines) with
`accelerate launch` (torch.distributed): the launcher `stages.launch.call.call_stage` uses.

`run(call, reporting)` pickles the call (the function, by reference, with
its config and typed inputs) into a spec folder, starts

    accelerate launch --num_processes N [--config_file F | --multi_gpu] -m stages.launch.local SPEC

and forwards what rank 0 reports (metrics, sample tables, warnings) to the caller's own
`Reporting` while the job runs. Rank 0 pickles the stage's result back; the caller gets the same
result object either way. Every rank runs the same stage function: the TRL trainers and our
PPO loop split the work by `PartialState().process_index`, and only rank 0 returns a result.
The spec folder is the stage's own work folder: nothing but this module writes or reads it.

How a rank ends. Once its work is over (rank 0: and its result written) each rank records it
(`done_marker`) and leaves with the others (`leave_job`): it waits for them, tears the process group
down, runs the `atexit` handlers and ends with `os._exit`, skipping the interpreter's finalization.
The group's own object is held until then, so its destructor never runs in the process: dropped
by the last object that held it (a DDP reducer freed after `destroy_process_group`), gloo's
destructor joins its worker threads with the GIL held while one of them waits for the GIL to
free a finished barrier's state, a deadlock (seen in about 1 of 30 runs of a two-process test,
traced with gdb; torch issue 56297 describes the class of bug). That finalization is where a
finished job used to die: gloo's worker threads keep the last reference to a completed
collective's tensors a moment after the caller's `wait()` returns, and dropping it takes the
GIL to free the tensors' Python objects; once finalization has begun, taking the GIL ends the
thread with `pthread_exit`, whose forced unwind through gloo's `noexcept` run loop calls
`std::terminate` ("terminate called without an active exception", SIGABRT), and the launcher then
stopped the other ranks. (`destroy_process_group` does not end those threads while FSDP2's and
the trainers' objects still hold the group.) A crash after every rank recorded "done" cannot
have touched the result: the caller takes it with a warning and the log. A crash before is the
job's failure, reported with the ranks that had not finished.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pandas as pd

from rlhf.config_common import accelerate_config_path
from stages.common.errors import StageUserError
from stages.common.reporting import Reporting
from stages.launch.job import LaunchError, StageCall
from stages.memory.measured import measured_peak, with_figures
from stages.runtime.lora import keep_initial_adapters
from stages.runtime.models import set_determinism

# --- the caller's side ------------------------------------------------------------------------


def run(call: StageCall, reporting: Reporting):
    """`call` on `call.section.launch.num_processes` processes of this machine; rank 0's result."""
    spec = _write_spec(call)
    _launch(spec, call, reporting)
    return pickle.loads((spec / "result.pkl").read_bytes())


def _write_spec(call: StageCall) -> Path:
    spec = call.output_dir / "launch"
    spec.mkdir(parents=True, exist_ok=True)
    for stale in ("events.jsonl", "result.pkl", "error.pkl", *(p.name for p in spec.glob("rank-*.done"))):
        (spec / stale).unlink(missing_ok=True)
    (spec / "call.pkl").write_bytes(pickle.dumps(call))
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(spec: Path, launch) -> list[str]:
    """`accelerate launch` for the stage: the given accelerate config, or DDP on this machine's
    GPUs (gloo on CPU). On one machine a free port each time, so two pipelines can launch side by side."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(launch.num_processes)]
    if launch.engine().get("num_machines", 1) == 1:  # several machines must agree on the port in their config
        command += ["--main_process_port", str(_free_port())]
    if launch.accelerate_config:
        command += ["--config_file", str(accelerate_config_path(launch.accelerate_config))]
    else:
        command += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return command + ["-m", "stages.launch.local", str(spec)]


def _launch(spec: Path, call: StageCall, reporting: Reporting) -> None:
    import torch

    launch = call.section.launch
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # torch.distributed over gloo between CPU processes
        # glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which
        # tensors of a few MiB come from the heap and stay resident once freed. A sharded model on the
        # CPU churns exactly such tensors (each layer gathered, used, freed): at 400M over two
        # processes, a process's peak RSS fell from 5.1 to 3.8 GiB with the threshold fixed at 1 MiB
        # (one process's peak did not move), for ~8% more time (three small sharded runs: 39.8 s
        # against 36.9). On GPUs the tensors live in torch's own allocator, so it is left alone
        # there. A value the user set is kept.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 20))
    log = spec / "launch.log"
    events = spec / "events.jsonl"
    with log.open("w") as out:
        process = subprocess.Popen(launch_command(spec, launch), stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=Path(__file__).resolve().parents[2], start_new_session=True)
        read = 0
        try:
            while True:
                finished = process.poll() is not None
                read = _forward_events(events, read, reporting)
                if finished:
                    break
                time.sleep(0.5)
        except BaseException:
            _stop(process)  # the caller stops (or its reporting failed): so do the processes
            raise
    error = spec / "error.pkl"
    if error.exists():
        raise pickle.loads(error.read_bytes())
    if process.returncode == 0 and (spec / "result.pkl").exists():
        return
    lines = log.read_text(errors="replace").splitlines()
    tail = "\n".join(lines[-30:])
    unfinished = [rank for rank in range(launch.num_processes) if not _recorded_done(spec, rank, call.attempt)]
    if (spec / "result.pkl").exists() and not unfinished:
        reporting.warning(f"the {launch.num_processes}-process job finished its work (every rank recorded it done "
                          f"after rank 0 wrote the result), then exited with code {process.returncode} in teardown"
                          f"{_failed_ranks(lines)}; the result stands. Its log is {log}; last lines:\n{tail}")
        return
    raise LaunchError(f"the {launch.num_processes}-process job (accelerate launch) exited with code "
                      f"{process.returncode}{_failed_ranks(lines)}; ranks that had not recorded their work done: "
                      f"{', '.join(map(str, unfinished)) or 'none'}; its log is {log}; last lines:\n{tail}")


def _stop(process: subprocess.Popen) -> None:
    """Kill the launcher and every process under it: torch's launcher starts each rank in a session
    of its own, out of reach of the launcher's process group."""
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


def _recorded_done(spec: Path, rank: int, attempt: str) -> bool:
    marker = done_marker(spec, rank)
    return marker.exists() and marker.read_text().split()[:1] == [attempt]


def _failed_ranks(lines: list[str]) -> str:
    """Each failed process's exception, as torch.distributed prefixes its traceback lines ("[rank1]: RuntimeError: ..."),
    or the signal that killed it, from the launcher's report ("rank : 1 (local_rank: 1)" ... "Signal 6 (SIGABRT)
    received by PID ..."), which otherwise leaves the cause out."""
    raised, rank = {}, None
    for line in lines:
        if found := re.match(r"\[rank(\d+)\]: ((?:\w+\.)*\w*(?:Error|Exception|Exit|Interrupt)\b.*)", line):
            raised[int(found[1])] = found[2]  # the last one: with chained exceptions, the one the process died of
        elif found := re.match(r"\s*rank\s*: (\d+) \(local_rank", line):
            rank = int(found[1])
        elif rank is not None and (found := re.search(r"(Signal \d+ \(\w+\)) received by PID", line)):
            raised.setdefault(rank, f"killed by {found[1]}")
    return "".join(f"; rank {rank}: {message}" for rank, message in sorted(raised.items()))


TABLE = "__table__"
"""In the event file, the key of a table argument's records (no metric is named so)."""


def _forward_events(events: Path, read: int, reporting: Reporting) -> int:
    """Hand complete new lines of rank 0's event file to the caller's callbacks; returns the new offset."""
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


# --- each process's side ----------------------------------------------------------------------


def done_marker(spec: Path, rank: int) -> Path:
    """The file rank `rank` writes once its work is over (rank 0: once its result is written)."""
    return spec / f"rank-{rank}.done"


def _write_result(result, spec: Path) -> None:
    staging = spec / "result.pkl.tmp"
    staging.write_bytes(pickle.dumps(result))
    staging.rename(spec / "result.pkl")


def _event_writer(events: Path) -> Reporting:
    """Rank 0's `Reporting`: every call becomes a line of the event file (tables as their records)."""
    def writer(kind: str):
        def write(*arguments) -> None:
            encoded = [{TABLE: a.to_dict("records")} if isinstance(a, pd.DataFrame) else a for a in arguments]
            with events.open("a") as f:
                f.write(json.dumps({"kind": kind, "arguments": encoded}) + "\n")
        return write

    return Reporting(**{field.name: writer(field.name) for field in dataclasses.fields(Reporting)})


def main(spec: Path) -> None:
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    call: StageCall = pickle.loads((spec / "call.pkl").read_bytes())
    set_determinism(call.deterministic, call.num_threads)
    # First to set up the process group, so the trainers and our PPO loop find it as is (the
    # trainers' own `ddp_timeout` then goes unused): PartialState reads the CPU switch only from its argument.
    state = PartialState(cpu=os.environ.get("ACCELERATE_USE_CPU") == "true",
                         timeout=timedelta(seconds=call.section.launch.timeout_seconds))
    if call.section.launch.sharded:
        # Sharded loading, whatever the accelerate config says: every process builds each model on the meta
        # device, the first reads the checkpoint a tensor at a time and sends every process its shards
        # (`stages.runtime.models.load_pretrained`, `stages.runtime.holding.receive_from_rank0`); LoRA adapters as peft drew them.
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
        keep_initial_adapters()
    if call.section.launch.sharded and state.distributed_type == DistributedType.MULTI_CPU:
        # accelerate takes its FSDP branch only for accelerator devices and would run DDP on CPU
        # without a word; FSDP2 itself runs on CPU over gloo, so let the trainers' accelerator shard.
        state.distributed_type = DistributedType.MULTI_GPU
    reporting = _event_writer(spec / "events.jsonl") if state.is_main_process else Reporting()
    try:
        with measured_peak() as peak:
            result = call.train(call.section, call.inputs, call.output_dir, reporting)
        result = with_figures(result, highest_peak(peak))
    except StageUserError as e:
        if state.is_main_process:
            (spec / "error.pkl").write_bytes(pickle.dumps(e))
        raise
    if state.is_main_process:
        _write_result(result, spec)
    done_marker(spec, state.process_index).write_text(f"{call.attempt} {os.getpid()} {time.time()}\n")
    # The ranks leave together, once rank 0 has saved and written its result (the others wait up to
    # `launch.timeout_seconds`): a rank that ended first would have the launcher stop the others mid-save.
    leave_job(state)


def highest_peak(figures: dict[str, float]) -> dict[str, float]:
    """The memory figures of the process whose resident memory peaked highest (collective)."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    if dist.get_rank() == 0:  # each process's, in the job's log
        print("memory by rank: " + json.dumps(every), flush=True)
    return max(every, key=lambda f: f.get("memory/peak_rss_gib", 0.0))


_held_groups: list = []
"""Process groups `leave_job` keeps from their destructors until the process ends."""


def leave_job(state) -> None:
    """Wait for every rank, tear the process group down and `leave()`, holding the group's object
    to the end so that no object freed after the teardown runs its destructor (module docstring)."""
    import torch.distributed as dist

    _held_groups.append(dist.group.WORLD)
    state.wait_for_everyone()
    state.destroy_process_group()
    leave()


def leave() -> None:
    """End this process as a normal exit would, less the interpreter's finalization (see the module's
    docstring): `atexit` handlers run, output is flushed, and no thread of a library is left to take
    the GIL from a finalizing interpreter."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
