"""The sandbox's cost: a confined run (`stages.sandbox.code.run_python`) against a bare `subprocess.run` of the
same code in the same interpreter, both to their end, `--runs` times each, interleaved.

    python -m bench.sandbox            (or: make bench-sandbox; about a minute)

The overhead is what confinement adds: the confining child's start (an interpreter with `landlock` and
`pyseccomp` loaded), its steps (namespace, rlimits, user, Landlock, seccomp), the working directory and
the group kill. Prints median and 90th percentile of each and of the difference, and writes
`bench/results/sandbox-<date>.json`. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = {"print": "print(1)", "asserts": "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n"}


def main(argv: list[str] | None = None) -> int:
    from stages.sandbox.code import run_python

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    first = run_python("print(1)")
    python = first.python
    rows = {}
    for name, code in PROGRAMS.items():
        bare, confined = [], []
        for _ in range(args.runs):
            started = time.perf_counter()
            subprocess.run([python, "-I", "-c", code], capture_output=True, check=True)
            bare.append(time.perf_counter() - started)
            started = time.perf_counter()
            result = run_python(code)
            confined.append(time.perf_counter() - started)
            assert result.ok, result.text()
        bare_ms, confined_ms = np.array(bare) * 1000, np.array(confined) * 1000
        rows[name] = {"bare_ms": _quantiles(bare_ms), "sandbox_ms": _quantiles(confined_ms),
                      "overhead_ms": _quantiles(confined_ms - bare_ms)}
        print(f"{name}: bare {rows[name]['bare_ms']}, sandbox {rows[name]['sandbox_ms']}, "
              f"overhead {rows[name]['overhead_ms']} (ms: median, p90)")
    out = args.out or REPO / "bench" / "results" / f"sandbox-{datetime.date.today()}.json"
    out.write_text(json.dumps({"runs": args.runs, "python": python, "applied": first.applied,
                               "missing": first.missing, "machine": platform.processor() or platform.machine(),
                               "results": rows}, indent=2))
    print(f"applied: {', '.join(first.applied)}; missing: {first.missing or 'none'}\nwrote {out}")
    return 0


def _quantiles(values: np.ndarray) -> dict[str, float]:
    return {"median": round(float(np.median(values)), 1), "p90": round(float(np.percentile(values, 90)), 1)}


if __name__ == "__main__":
    raise SystemExit(main())
