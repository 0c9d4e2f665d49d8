"""How torch's CPU kernels compute, chosen before torch loads: `portable` or `native` numerics.

torch, MKL and oneDNN pick their CPU kernels from the widest vector instructions the CPU has
(AVX2, AVX-512, AMX), and each sums in its own order, so the same run gives other low bits on
another CPU. `portable` (the default) pins all three to AVX2 in every process of a run, so its
figures and checkpoints are bit-identical on every x86-64 machine of one CPU vendor that has AVX2
(measured: docs/reproducibility.md). `native` lets them use everything the CPU has: faster where
AVX-512 or AMX pays (bf16 on the CPU), with figures that hold on that CPU type only. GPUs compute as
they do either way.

The setting is the environment variable `RLHF_NUMERICS`, not a config field: it must be in place
before torch loads, and the flow's own process has loaded it by the time it reads a config. Importing
`rlhf`, `stages` or `flows` applies it (`apply`), and every process a stage starts inherits it:
`accelerate launch`'s ranks, the vLLM server, and Ray's ranks (`environment`, passed on by the gang).
The cache key and the stage runs' tags name it (`in_use`, through `rlhf.stack`).

This module imports nothing of ours and nothing heavy: it runs before everything.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from functools import lru_cache
from pathlib import Path

VARIABLE = "RLHF_NUMERICS"
"""The environment variable that says which numerics a run computes with."""
MODES = ("portable", "native")
DEFAULT = "portable"
PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""`portable`'s pins, on any vendor: torch's own kernels (ATen), MKL's and oneDNN's, at AVX2 at most."""
INTEL_PINS = {"MKL_CBWR": "AVX2"}
"""On Intel CPUs also MKL's reproducibility mode for AVX2: fixed cache sizes and reductions, so MKL
gives the same bits on every Intel CPU with AVX2. MKL takes it from Intel CPUs only; elsewhere it
would switch to another code path, so it is not set there."""
PORTABLE_CAPABILITY = "AVX2"
"""What torch reports (`torch.backends.cpu.get_cpu_capability()`) when its kernels are pinned."""


class NumericsError(RuntimeError):
    """The numerics asked for cannot hold in this process."""


def mode() -> str:
    """`RLHF_NUMERICS`, checked (unset: `portable`)."""
    value = os.environ.get(VARIABLE, DEFAULT).strip().lower() or DEFAULT
    if value not in MODES:
        raise NumericsError(f"{VARIABLE}={os.environ[VARIABLE]!r} is not one of {', '.join(MODES)}")
    return value


@lru_cache(maxsize=1)
def cpu() -> tuple[str, frozenset[str]]:
    """This CPU's vendor (`GenuineIntel`, `AuthenticAMD`, or the architecture off x86-64) and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, flags=re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, flags=re.M)
    return (vendor.group(1) if vendor else platform.machine(),
            frozenset(flags.group(1).split()) if flags else frozenset())


def portable_here() -> bool:
    """Whether this machine can compute with portable numerics: x86-64 with AVX2."""
    return platform.machine() in ("x86_64", "AMD64") and "avx2" in cpu()[1]


def pins(wanted: str | None = None) -> dict[str, str]:
    """The variables `wanted` (default: `mode()`) sets on this machine: none for `native` or where
    the CPU has no AVX2 (another architecture computes as it does)."""
    if (wanted or mode()) == "native" or not portable_here():
        return {}
    return PINS | (INTEL_PINS if cpu()[0] == "GenuineIntel" else {})


def environment() -> dict[str, str]:
    """What a process started on another machine needs to compute with this run's numerics: the
    setting and its vendor-independent pins (the Intel-only one is added there, by `apply`)."""
    return {VARIABLE: mode()} | (PINS if mode() == "portable" else {})


def apply() -> None:
    """Put this run's numerics into the environment: this process's, if torch is not loaded yet,
    and every process it starts. Idempotent; `in_use` says whether it took in this process."""
    os.environ[VARIABLE] = mode()
    os.environ.update(pins())


def in_use() -> str:
    """The numerics this process computes with, as the cache key and tags name them: the setting and
    the instructions torch's kernels dispatch to (`portable · AVX2`, `native · AVX512`). Raises where
    `portable` was asked for but torch loaded before it was applied (it then dispatches wider)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if mode() == "portable" and portable_here() and capability != PORTABLE_CAPABILITY:
        raise NumericsError(
            f"{VARIABLE}=portable, but torch in this process ({sys.argv[0] or 'python'}) already computes with "
            f"{capability}: it was imported before the numerics were applied. Import rlhf, stages or flows "
            f"before torch, or set {' '.join(f'{k}={v}' for k, v in pins().items())} before starting it "
            f"(or {VARIABLE}=native)")
    return f"{mode()} · {capability}"
