"""How a stage reports while it runs: one type for every stage, in one process or several.

The flow hands a stage a `Reporting` whose callbacks log to MLflow; on several processes
`stages.launch.local` gives rank 0 one that writes events to a file and replays them into the
caller's. A stage calls the ones it has something for; each does nothing unless set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pandas as pd

MEASURED = ("time/", "memory/")
"""Prefixes of the figures that measure the machine a stage ran on (wall-clock times, memory),
not the stage's result: two identical runs agree on every other figure."""


@contextmanager
def timed(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Adds the block's wall-clock seconds to `timings[phase]` (a stage logs them as `time/<phase>`)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


def _ignore(*_) -> None:
    return None


@dataclass(kw_only=True, frozen=True)
class Reporting:
    metrics: Callable[[dict[str, float], int], None] = _ignore
    """(figures, step): training and evaluation figures, named as MLflow shows them (`train/loss`)."""
    samples: Callable[[pd.DataFrame, int], None] = _ignore
    """(table, step): a few prompts and responses to read."""
    warning: Callable[[str], None] = _ignore
    """A message for the user about the run's health."""
    rollouts: Callable[[pd.DataFrame, int], None] = _ignore
    """(table, iteration), PPO only: every iteration's episodes (this process's share): prompt messages,
    response, normalised score, KL per sequence; for a caller that judges them with what the stage
    must not see (the demo world's gold function)."""
    evaluation: Callable[[pd.DataFrame, int], None] = _ignore
    """(table, iteration), PPO only: an evaluation before the last iteration (the final one is the stage's
    result): prompt messages, the policy's and the SFT baseline's responses, for the same kind of caller."""
    progress: Callable[[int, int], None] = _ignore
    """(done, total): optimizer steps or iterations done of the stage's total, after each one."""
    params: Callable[[dict], None] = _ignore
    """Settings the stage chose as it started (the `auto` micro-batch sizes), named as the run's params."""
