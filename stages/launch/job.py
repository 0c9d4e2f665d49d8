"""What a launch runs: one stage function call (`StageCall`), the same on every process, and the
error a failed multi-process job raises. Launchers (`stages.launch.local`, one machine) take a
`StageCall`; `stages.launch.call.call_stage` is the one interface stages are called through."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.common.reporting import Reporting

Stage = Callable[[Any, Any, Path, Reporting], Any]
"""A stage function: `train(cfg, inputs, output_dir, reporting)`, returning its result on rank 0."""


class LaunchError(RuntimeError):
    """The multi-process job failed; the message holds the tail of its log."""


@dataclasses.dataclass(frozen=True)
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
