"""Running a stage on several processes of one machine (or hand-launched machines) with
`accelerate launch` (torch.distributed): the launcher `stages.launch.call.call_stage` uses.

`run(call, reporting)` pickles the call (the function, by reference, with
its config and typed inputs) into a spec folder and follows (`stages.launch.job.follow`)

    accelerate launch --num_processes N [--config_file F | --multi_gpu] -m stages.launch.local SPEC

Every rank runs the same stage function: the TRL trainers and our PPO loop split the work by
`PartialState().process_index`, and only rank 0 returns a result.

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

from stages.common.processes import die_with_parent  # standard library only: first, so a rank's next line runs early

if __name__ == "__main__":  # a rank: the death signal before the imports below (torch, pandas: seconds), in which
    die_with_parent()  # a launcher killed would leave this rank alive, its parent gone (issue 91)

import atexit
import os
import pickle
import re
import socket
import sys
import time
from pathlib import Path

from rlhf.sections.base import accelerate_config_path
from stages.common.reporting import Reporting
from stages.launch.job import (
    ERROR,
    EVENTS,
    RESULT,
    LaunchError,
    StageCall,
    cpu_environment,
    event_writer,
    follow,
    hold_work_folder,
    log_tail,
    run_rank,
    start_rank,
    write_result,
    write_spec,
)

# --- the caller's side ------------------------------------------------------------------------


def run(call: StageCall, reporting: Reporting):
    """`call` on `call.section.launch.num_processes` processes of this machine; rank 0's result."""
    import torch

    spec = write_spec(call)
    launch = call.section.launch
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    returncode = follow(launch_command(spec, launch), spec, reporting,
                        env if torch.cuda.is_available() else cpu_environment(env))
    if returncode != 0 or not (spec / RESULT).exists():
        _outcome_of_failure(spec, call, returncode, reporting)
    return pickle.loads((spec / RESULT).read_bytes())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(spec: Path, launch) -> list[str]:
    """`accelerate launch` for the stage: the given accelerate config, or DDP on this machine's
    GPUs (gloo on CPU). On one machine a free port each time, so two pipelines can launch side by side."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(launch.num_processes)]
    if launch.accelerate_settings().get("num_machines", 1) == 1:  # several machines must agree on the port
        command += ["--main_process_port", str(_free_port())]
    if launch.accelerate_config:
        command += ["--config_file", str(accelerate_config_path(launch.accelerate_config))]
    else:
        command += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return command + ["-m", "stages.launch.local", str(spec)]


def _outcome_of_failure(spec: Path, call: StageCall, returncode: int, reporting: Reporting) -> None:
    """A job that exited non-zero (or wrote no result): taken with a warning if every rank had
    recorded its work done after rank 0 wrote the result (it died in teardown), else a `LaunchError`
    naming the ranks that had not finished and what each died of."""
    launch = call.section.launch
    lines = (spec / "launch.log").read_text(errors="replace").splitlines()
    tail = log_tail(spec)
    unfinished = [rank for rank in range(launch.num_processes) if not _recorded_done(spec, rank, call.attempt)]
    if (spec / RESULT).exists() and not unfinished:
        reporting.warning(f"the {launch.num_processes}-process job finished its work (every rank recorded it done "
                          f"after rank 0 wrote the result), then exited with code {returncode} in teardown"
                          f"{_failed_ranks(lines)}; the result stands. Its log is {spec / 'launch.log'}; "
                          f"last lines:\n{tail}")
        return
    raise LaunchError(f"the {launch.num_processes}-process job (accelerate launch) exited with code "
                      f"{returncode}{_failed_ranks(lines)}; ranks that had not recorded their work done: "
                      f"{', '.join(map(str, unfinished)) or 'none'}; its log is {spec / 'launch.log'}; "
                      f"last lines:\n{tail}")


def _recorded_done(spec: Path, rank: int, attempt: str) -> bool:
    marker = done_marker(spec, rank)
    return marker.exists() and marker.read_text().split()[:1] == [attempt]


def _failed_ranks(lines: list[str]) -> str:
    """Each failed process's exception, as torch.distributed prefixes its traceback lines
    ("[rank1]: RuntimeError: ..."), or the signal that killed it, from the launcher's report
    ("rank : 1 (local_rank: 1)" ... "Signal 6 (SIGABRT) received by PID ..."), which otherwise leaves
    the cause out."""
    raised, rank = {}, None
    for line in lines:
        if found := re.match(r"\[rank(\d+)\]: ((?:\w+\.)*\w*(?:Error|Exception|Exit|Interrupt)\b.*)", line):
            raised[int(found[1])] = found[2]  # the last one: with chained exceptions, the one the process died of
        elif found := re.match(r"\s*rank\s*: (\d+) \(local_rank", line):
            rank = int(found[1])
        elif rank is not None and (found := re.search(r"(Signal \d+ \(\w+\)) received by PID", line)):
            raised.setdefault(rank, f"killed by {found[1]}")
    return "".join(f"; rank {rank}: {message}" for rank, message in sorted(raised.items()))


# --- each process's side ----------------------------------------------------------------------


def done_marker(spec: Path, rank: int) -> Path:
    """The file rank `rank` writes once its work is over (rank 0: once its result is written)."""
    return spec / f"rank-{rank}.done"


def main(spec: Path) -> None:
    """A rank's work (its death signal set first, at the top of this module: this rank dies with the
    launcher above it, which dies with the caller)."""
    hold_work_folder(spec)
    call: StageCall = pickle.loads((spec / "call.pkl").read_bytes())
    state = start_rank(call)
    reporting = event_writer(spec / EVENTS) if state.is_main_process else Reporting()
    result = run_rank(call, state, reporting, lambda e: (spec / ERROR).write_bytes(pickle.dumps(e)))
    if state.is_main_process:
        write_result(result, spec)
    done_marker(spec, state.process_index).write_text(f"{call.attempt} {os.getpid()} {time.time()}\n")
    # The ranks leave together, once rank 0 has saved and written its result (the others wait up to
    # `launch.timeout_seconds`): a rank that ended first would have the launcher stop the others mid-save.
    leave_job(state)


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
