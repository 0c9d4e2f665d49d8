"""Compiled passes: `torch.compile` (inductor) of the models' forwards for PPO's passes over prompt
+ response; AOTAutograd compiles each graph's backward with it. Fusing the elementwise work and
cutting dispatch is what removes per-operation overhead, which bounds small models' passes
(docs/performance.md).

Shapes. On a CPU the graphs take symbolic lengths and rows (`dynamic=True`): one graph per model
and gradient mode serves every micro-batch, with no padding added (measured here: 1.17x eager on
the bench model at widths 41-64, one 21 s compile). Where the device wants static shapes (a GPU,
whose CUDA graphs and tuned kernels are per shape), a compiled pass rounds its widths and rows up to
a few sizes (`bucketed`: four per octave, at most a quarter more), so recompiles stay bounded.
Either way the graphs compiled and the seconds spent compiling are counted per iteration
(`perf/recompiles`, `time/compile`). The sampler's decode steps enter through a function of their
own (`ENTRIES`; `stages.engines.sampler.DecodeSteps` holds their static KV cache).

`probe_compile` is `ppo.compile: auto`'s decision at load: compile only where a measured pass says
the run's steps repay the compile, and the compiled pass matches the eager one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhf.sections.base import state_dir

BUCKETS_PER_OCTAVE = 4
"""Sizes a compiled pass's dimensions are rounded to per power of two: padding of at most 25% (12%
on average), and at most four graphs per octave of length."""

RECOMPILE_LIMIT = 64
"""Graphs dynamo may compile per function before it falls back to eager: bucketed widths, rows and
kept logits of the policy, the reference and the critic, each with and without gradients."""


def bucketed(n: int) -> int:
    """`n` rounded up to a multiple of a quarter of its power of two: 1-8 exact, then 10, 12, 14,
    16, 20, ..., 32, 40, 48, 56, 64, 80, ... """
    step = max(1, (1 << (max(n, 1).bit_length() - 1)) // BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


def _pass(model: torch.nn.Module, **inputs):
    return model(**inputs)


def _decode_step(model: torch.nn.Module, **inputs):
    return model(**inputs)


ENTRIES = {"pass": _pass, "decode": _decode_step}
"""Where compiled calls enter, one function each: dynamo keeps its graphs per code object and checks
their guards in turn on every call, so the decode loop's graph does not sit behind the passes'. On
the bench model, within a compiled PPO run, one rollout's decode took 0.123-0.136 s through a
shared entry against 0.120-0.129 s eager, and 0.090-0.108 s through its own against 0.114-0.156."""


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (forward graphs; each carries its backward)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_seconds() -> float:
    """Seconds this process has spent compiling: dynamo's forward compiles (tracing, AOTAutograd,
    inductor) and the backward graphs compiled at their first backward. torch's own record
    (`torch._dynamo.utils.compilation_time_metrics`, pinned torch)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", []))
                 + sum(compilation_time_metrics.get("backward._backward_impl", [])))


@dataclass(kw_only=True)
class Compiler:
    """The compiled forwards of a run's models, one per model, and what compiling them cost."""

    enabled: bool = False
    """Off: every pass runs the model as it is, at its own shapes (bit-identical to no compiler)."""
    static_shapes: bool = False
    """Graphs per bucketed shape (`bucketed`), not one with symbolic lengths and rows."""
    cuda_graphs: bool = False
    """The decode step's graph replayed as a CUDA graph (`mode="reduce-overhead"`): one launch a step
    instead of every layer's kernels from Python. Needs static shapes and a CUDA device."""
    reason: str = ""
    """Why it is on or off (`auto`'s probe figures): the run's `rlhf.compile` tag."""
    _compiled: dict[int, Callable] = field(default_factory=dict)
    _graphs: int = 0
    _seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.enabled:
            self._graphs, self._seconds = _compiled_graphs(), _compile_seconds()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def __call__(self, model: torch.nn.Module, purpose: str = "pass") -> Callable:
        """What a pass (`pass`) or a decode step (`decode`) calls: `model` compiled, or `model` itself when off."""
        if not self.enabled:
            return model
        if purpose not in self._compiled:
            private_kernel_cache()
            graphs = self.cuda_graphs and purpose == "decode"
            self._compiled[purpose] = torch.compile(ENTRIES[purpose], dynamic=not self.static_shapes,
                                                    mode="reduce-overhead" if graphs else None)
        return functools.partial(self._compiled[purpose], model)

    def bucket(self, n: int) -> int:
        """A dimension as a compiled pass takes it: `bucketed` with static shapes, else as it is."""
        return bucketed(n) if self.enabled and self.static_shapes else n

    def figures(self) -> dict[str, float]:
        """`perf/recompiles` (graphs compiled) and `time/compile` (seconds) since the last call; empty when off."""
        if not self.enabled:
            return {}
        graphs, seconds = _compiled_graphs(), _compile_seconds()
        figures = {"perf/recompiles": float(graphs - self._graphs), "time/compile": seconds - self._seconds}
        self._graphs, self._seconds = graphs, seconds
        return figures


# --- ppo.compile: auto ---------------------------------------------------------------------------------------

LARGEST_SAVING = 0.3
"""The largest share of a pass's time compiling has saved on a CPU here (0.19-0.30 of a forward and
backward of small Llamas, docs/performance.md): `auto` compiles nothing where even this saving over
the whole run stays under a compile's cost, and so spends no probe compile on it."""

LEAST_COMPILE_S = 10.0
"""The shortest first compile of a forward and backward seen here (a two-layer Llama of hidden 64 on
the 2-core CPU; 22 s at hidden 128 and 4 layers): what `auto` takes a compile to cost at least."""

EXPECTED_GRAPHS = 4
"""Compiles a run pays per probe-sized compile, as `auto` counts the cost: the policy's and the
critic's passes, with and without gradients (with static shapes, the buckets multiply it)."""


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One pass, timed eager and compiled, as `auto` decides."""

    eager_s: float
    compiled_s: float | None = None
    compile_s: float | None = None
    gap: float | None = None
    """Largest |compiled - eager| of the pass's outputs, relative to their largest magnitude."""


def private_kernel_cache() -> None:
    """Compiled kernels read and written under `RLHF_HOME/inductor` (0700), not inductor's default
    `/tmp/torchinductor_<user>`, which any local user could create first and fill with kernels this
    process would load; a `TORCHINDUCTOR_CACHE_DIR` set by the user is kept."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    folder = state_dir() / "inductor"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def probe_compile(run_pass: Callable[[Callable], torch.Tensor], model: torch.nn.Module, passes_in_run: int,
                  least_compile_s: float, tolerance: float, static_shapes: bool) -> tuple[bool, str]:
    """Whether compiling `model` pays over a run of `passes_in_run` passes like `run_pass(callable)`
    (a forward and backward returning the outputs), and why. Eager timing first: where even
    `LARGEST_SAVING` of the run's passes is under `least_compile_s`, no probe compile is spent.
    Otherwise the pass compiled: its outputs must match eager's to `tolerance` (relative), and the
    measured saving over the run must repay the measured compile, `EXPECTED_GRAPHS` times over."""
    eager_s = _best_time(lambda: run_pass(model))
    ceiling = LARGEST_SAVING * eager_s * passes_in_run
    if ceiling < least_compile_s:
        return False, (f"off (auto: eager pass {eager_s * 1e3:.1f} ms x {passes_in_run} passes; compiling could "
                       f"save at most {ceiling:.1f} s, a compile takes {least_compile_s:.0f} s or more)")
    private_kernel_cache()
    compiled = torch.compile(model, dynamic=not static_shapes)
    started = time.perf_counter()
    outputs = run_pass(compiled)
    compile_s = time.perf_counter() - started
    compiled_s = _best_time(lambda: run_pass(compiled))
    expected = run_pass(model)
    gap = float((outputs - expected).abs().max() / expected.abs().max().clamp(min=1e-6))
    saved = (eager_s - compiled_s) * passes_in_run
    figures = (f"eager pass {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms, compile {compile_s:.0f} s, "
               f"{passes_in_run} passes, outputs within {gap:.1g}")
    if gap > tolerance:
        return False, f"off (auto: the compiled pass differs from eager by {gap:.2g}, over {tolerance:g}; {figures})"
    if saved < EXPECTED_GRAPHS * compile_s:
        return False, (f"off (auto: saves {saved:.0f} s, under {EXPECTED_GRAPHS} compiles of {compile_s:.0f} s; "
                       f"{figures})")
    return True, f"on (auto: saves {saved:.0f} s over the run; {figures})"


def _best_time(work: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls, after one untimed."""
    work()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best
