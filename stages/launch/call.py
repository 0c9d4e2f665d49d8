"""Where a stage's processes run, behind one interface: `call_stage(train, cfg, inputs, ...)`.

The stage's `launch` settings choose the engine:
- one local process: the stage function in the caller's own process;
- `engine: local`, more processes: `stages.launch.local`, this machine's `accelerate launch`;
- `engine: ray`: `stages.launch.ray_gang`, one Ray Train gang on a Ray cluster.
A launcher starts the processes and hands back what rank 0 returned, forwarding its reports
while the job runs (`stages.launch.job`). The caller gets the same result object whichever runs
it, with the stage's measured peak memory in its metrics; a stage run in the caller's process leaves
none of its models behind. A new engine goes beside these two, in
this folder, and is chosen here."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import rlhf.numerics as numerics
from stages.common.reporting import Reporting
from stages.launch.job import Stage, StageCall
from stages.memory.measured import measured_peak, release_unreachable, with_figures


@dataclass(frozen=True)
class Determinism:
    """How a stage's processes compute: the conditions under which the same config, seed and data repeat."""

    deterministic: bool = True
    """Deterministic torch kernels."""
    num_threads: int | None = None
    """CPU threads for torch, shared by a launch's processes (None: the machine's cores)."""


def call_stage(train: Stage, section, inputs, output_dir: Path, reporting: Reporting, determinism: Determinism):
    """`train(section, inputs, output_dir, reporting)` on `section.launch.num_processes` processes;
    its result. Launched processes compute as `determinism` says (one in this process, as this process
    was set up). A `StageUserError` raised on rank 0 is raised here as it was."""
    launch = section.launch
    if slow := _slow_numerics(section):
        reporting.warning(slow)
    if launch.in_process:
        release_unreachable()  # what an earlier stage in this process left is neither counted nor in the way
        try:
            with measured_peak() as peak:
                result = train(section, inputs, output_dir, reporting)
        finally:
            release_unreachable()  # nor is this stage's, for whatever runs next
        return with_figures(result, peak)
    threads = max(1, (determinism.num_threads or os.cpu_count() or 1) // launch.num_processes)
    call = StageCall(train=train, section=section, inputs=inputs, output_dir=output_dir,
                     deterministic=determinism.deterministic, num_threads=threads, attempt=uuid.uuid4().hex)
    if launch.engine == "ray":
        from stages.launch import ray_gang

        return ray_gang.run(call, reporting)
    from stages.launch import local

    return local.run(call, reporting)


def _slow_numerics(section) -> str | None:
    """A warning where the stage trains in bf16 on a CPU under portable numerics: without AVX-512's
    bf16 instructions and AMX, torch's bf16 matrix products take a slow path (10x the iteration of
    `make bench`'s work, measured: docs/reproducibility.md)."""
    import torch

    if getattr(section, "precision", None) != "bf16-mixed" or torch.cuda.is_available() or not numerics.pins():
        return None
    return (f"precision bf16-mixed on the CPU under {numerics.VARIABLE}=portable: bf16 runs on AVX2 there, about "
            f"10x slower than {numerics.VARIABLE}=native or fp32 (docs/reproducibility.md, 'CPU numerics')")
