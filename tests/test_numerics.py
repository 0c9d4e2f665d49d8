"""Portable CPU numerics (rlhf/numerics.py): what the setting pins, on which CPUs, in which processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf import numerics

REPO = Path(__file__).resolve().parent.parent


def _cpu(monkeypatch, vendor: str, flags: set[str], machine: str = "x86_64") -> None:
    monkeypatch.setattr(numerics, "cpu", lambda: (vendor, frozenset(flags)))
    monkeypatch.setattr(numerics.platform, "machine", lambda: machine)


def test_portable_pins_torch_mkl_and_onednn_to_avx2_and_mkls_reproducible_branch_on_intel_only(monkeypatch):
    _cpu(monkeypatch, "GenuineIntel", {"avx2", "avx512f", "amx_tile"})
    assert numerics.pins("portable") == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                         "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}
    _cpu(monkeypatch, "AuthenticAMD", {"avx2", "avx512f"})
    assert numerics.pins("portable") == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                         "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert numerics.pins("native") == {}


def test_portable_pins_nothing_where_the_cpu_has_no_avx2(monkeypatch):
    _cpu(monkeypatch, "GenuineIntel", {"sse4_2", "avx"})
    assert numerics.pins("portable") == {} and not numerics.portable_here()
    _cpu(monkeypatch, "aarch64", {"asimd"}, machine="aarch64")
    assert numerics.pins("portable") == {} and not numerics.portable_here()


def test_a_setting_that_is_not_a_mode_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("RLHF_NUMERICS", "fast")
    with pytest.raises(numerics.NumericsError, match="RLHF_NUMERICS='fast' is not one of portable, native"):
        numerics.mode()
    monkeypatch.delenv("RLHF_NUMERICS")
    assert numerics.mode() == "portable"  # the default


def test_ray_ranks_get_the_setting_and_its_vendor_independent_pins(monkeypatch):
    from stages.launch.ray_gang import _rank_environment

    monkeypatch.setenv("RLHF_NUMERICS", "portable")
    env = _rank_environment(gpus=False)
    assert env["RLHF_NUMERICS"] == "portable" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert "MKL_CBWR" not in env  # Intel-only: the rank's own machine adds it when it imports rlhf
    monkeypatch.setenv("RLHF_NUMERICS", "native")
    assert numerics.environment() == {"RLHF_NUMERICS": "native"}


def test_a_bf16_stage_on_the_cpu_under_portable_numerics_is_warned_of_its_slow_path(monkeypatch):
    from types import SimpleNamespace

    from stages.launch.call import _slow_numerics

    _cpu(monkeypatch, "GenuineIntel", {"avx2", "avx512f", "amx_tile"})
    monkeypatch.setenv("RLHF_NUMERICS", "portable")
    assert "about 10x slower than RLHF_NUMERICS=native" in _slow_numerics(SimpleNamespace(precision="bf16-mixed"))
    assert _slow_numerics(SimpleNamespace(precision="fp32")) is None
    monkeypatch.setenv("RLHF_NUMERICS", "native")
    assert _slow_numerics(SimpleNamespace(precision="bf16-mixed")) is None


PROBE = """
import subprocess, sys
{first}
from rlhf import numerics
print("parent", numerics.in_use())
child = "import torch; print('child', torch.backends.cpu.get_cpu_capability())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
"""


def _probe(first: str, setting: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "RLHF_NUMERICS": setting}
    return subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.skipif(not numerics.portable_here(), reason="portable numerics need x86-64 with AVX2")
def test_importing_rlhf_pins_this_process_and_the_processes_it_starts():
    done = _probe("", "portable")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["parent portable · AVX2", "child AVX2"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not numerics.portable_here(), reason="portable numerics need x86-64 with AVX2")
def test_torch_loaded_before_the_setting_is_refused_when_a_run_reads_its_numerics():
    if "avx512f" not in numerics.cpu()[1]:
        pytest.skip("this CPU's widest kernels are AVX2 already: torch loaded first computes as pinned")
    done = _probe("import torch; torch.ones(2).sum()", "portable")
    assert done.returncode != 0
    assert "RLHF_NUMERICS=portable, but torch in this process" in done.stderr
    assert "it was imported before the numerics were applied" in done.stderr
