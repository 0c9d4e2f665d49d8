"""What a stage measured: the peak memory of the block that ran it (`measured_peak`), added to
its result's metrics (`with_figures`) beside what the plan predicted."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from stages.memory.shapes import GIB

# --- what a stage measured ----------------------------------------------------------------------------------


def _peak_rss() -> float | None:
    """This process's peak resident memory in bytes since the last reset (Linux's VmHWM)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_unreachable() -> None:
    """Frees what earlier work left unreachable but not yet collected. A finished stage's models and
    optimizer sit in reference cycles (modules, hooks, the trainer) that only Python's cyclic collector
    frees, and it runs when it will: until then a GPU keeps their memory allocated under the next stage
    run in the same process (measured on an H100: 1.4-5.4 GiB of an earlier stage's models under PPO)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def measured_peak() -> Iterator[dict[str, float]]:
    """The block's peak memory, set in the yielded dict when it ends: `memory/peak_rss_gib`, this
    process's resident memory (its high-water mark reset at the start through /proc/self/clear_refs,
    where Linux allows it; `memory/start_rss_gib` what it was then: libraries and the process's own),
    and on a GPU `memory/peak_allocated_gib`, torch's peak allocated bytes."""
    import torch

    figures: dict[str, float] = {}
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pass
    if (start := _peak_rss()) is not None:
        figures["memory/start_rss_gib"] = start / GIB
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        yield figures
    finally:
        if (rss := _peak_rss()) is not None:
            figures["memory/peak_rss_gib"] = rss / GIB
        if torch.cuda.is_available():
            figures["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB


def with_figures(result, figures: dict[str, float]):
    """A stage's result (a `*Result` dataclass with `metrics`) with `figures` added to its metrics;
    anything else (None on the other processes) is returned as it is."""
    if not isinstance(getattr(result, "metrics", None), dict):
        return result
    return replace(result, metrics=result.metrics | figures)
