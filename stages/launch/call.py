"""Where a stage's processes run, behind one interface: `call_stage(train, cfg, inputs, ...)`.

One process: the stage function in the caller's own process. Several: a launcher starts them and
hands back what rank 0 returned, forwarding its reports while the job runs. Today that launcher is
one machine's (`stages.launch.local`: `accelerate launch`); another engine (Ray) goes beside it in
this folder and is chosen here, by the stage's `launch` settings. The caller gets the same result
object whichever runs it, with the stage's measured peak memory in its metrics."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from stages.common.reporting import Reporting
from stages.launch import local
from stages.launch.job import Stage, StageCall
from stages.memory.measured import measured_peak, with_figures


def call_stage(train: Stage, section, inputs, output_dir: Path, reporting: Reporting, *, deterministic: bool,
               num_threads: int | None):
    """`train(section, inputs, output_dir, reporting)` on `section.launch.num_processes` processes;
    its result. A `StageUserError` raised on rank 0 is raised here as it was."""
    if section.launch.num_processes == 1:
        with measured_peak() as peak:
            result = train(section, inputs, output_dir, reporting)
        return with_figures(result, peak)
    threads = max(1, (num_threads or os.cpu_count() or 1) // section.launch.num_processes)
    call = StageCall(train, section, inputs, output_dir, deterministic, threads, attempt=uuid.uuid4().hex)
    return local.run(call, reporting)
