"""Stage functions that stand in for real ones in the launch tests: importable by the launched
processes (they run from the repository root), as `call_stage` needs."""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import PartialState


@dataclass(frozen=True)
class Pause:
    seconds: float


def pause_on_the_main_process(cfg, inputs: Pause, output_dir: Path, reporting) -> dict | None:
    """A stage whose main process evaluates and saves for `inputs.seconds` after training, alone."""
    if not PartialState().is_main_process:
        atexit.register(lambda: (output_dir / "rank-1-left").write_text(repr(time.time())))
        return None
    time.sleep(inputs.seconds)
    return {"paused": inputs.seconds}
