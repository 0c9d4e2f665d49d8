"""Which commits, and which packages, changed `make bench`'s speed: ours only, alternating variants.

    python -m bench.regression --variant nov21 70ca464 --variant head HEAD --rounds 3
    python -m bench.regression --variant head-shared HEAD 'ppo.critic={kind: shared}' \\
        --variant head-tf523 HEAD --stack head-tf523=/tmp/stack/tf523

A variant is a label, a git revision and config overrides. Each revision is checked out into a
worktree of its own under `--worktrees` (this checkout is never touched, so it can be edited while
this runs), and its own `bench.ppo` runs there, ours only, one round of `--warmup` + `--iterations`
iterations, in a fresh process on this checkout's environment. `--stack LABEL=DIR` puts DIR first on
that variant's `PYTHONPATH`: other versions of the packages (for example `pip install --no-deps
--target DIR transformers==5.23.0`) on the same code. The variants take turns for `--rounds`
rounds, so a slow spell of a shared machine falls on all of them; the figure is the median of the
rounds' medians. Writes every round to `--out`. A benchmark: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.ppo import cpu_model

REPO = Path(__file__).resolve().parent.parent
OURS = re.compile(r"ours: (?P<seconds>[\d.]+) s/iteration.*split: (?P<split>.*)$")
PHASE = re.compile(r"([a-z_/]+) ([\d.]+) s")


@dataclass
class Variant:
    """One thing measured: code at `revision`, with `overrides`, on this environment plus `stack`."""

    label: str
    revision: str
    commit: str
    overrides: list[str]
    stack: str | None = None
    rounds: list[dict] = field(default_factory=list)


def worktree(revision: str, root: Path) -> tuple[str, Path]:
    """The commit of `revision`, checked out (once) into `root/<commit>`, with this checkout's venvs linked."""
    commit = subprocess.run(["git", "rev-parse", "--short=12", revision], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    path = root / commit
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), commit], cwd=REPO, check=True,
                       capture_output=True)
    for venv in (".venv", ".bench-venv"):
        if not (path / venv).exists() and (REPO / venv).exists():
            (path / venv).symlink_to(REPO / venv)
    return commit, path


def measure(variant: Variant, path: Path, warmup: int, iterations: int) -> dict:
    """One round of `variant`: its own bench.ppo, ours only, parsed from the line it prints."""
    environment = dict(os.environ)
    if variant.stack:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [variant.stack, environment.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "bench.ppo", "--reference", "none", "--rounds", "1", "--warmup", str(warmup),
               "--iterations", str(iterations), *(f"--set={item}" for item in variant.overrides)]
    done = subprocess.run(command, cwd=path, env=environment, capture_output=True, text=True)
    lines = [OURS.search(line) for line in done.stdout.splitlines()]
    found = next((match for match in lines if match), None)
    if done.returncode != 0 or found is None:
        sys.exit(f"{variant.label} ({variant.commit}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {"seconds": float(found["seconds"]), **{k: float(v) for k, v in PHASE.findall(found["split"])}}


def summary(variant: Variant) -> dict:
    seconds = [round_["seconds"] for round_ in variant.rounds]
    phases = {key for round_ in variant.rounds for key in round_} - {"seconds"}
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
            "phases": {key: statistics.median(r[key] for r in variant.rounds if key in r) for key in sorted(phases)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", nargs="+", action="append", required=True, metavar="LABEL REV [KEY=VALUE]",
                        help="a label, a git revision and config overrides; repeatable")
    parser.add_argument("--stack", action="append", default=[], metavar="LABEL=DIR",
                        help="put DIR first on the PYTHONPATH of the variant LABEL")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--worktrees", default="/tmp/rlhf-bisect", help="where the revisions are checked out")
    parser.add_argument("--out", help="results JSON (default bench/results/bisect-<date>.json)")
    parser.add_argument("--note", default="", help="what this run compares, kept in the results")
    args = parser.parse_args(argv)

    stacks = dict(item.split("=", 1) for item in args.stack)
    root = Path(args.worktrees)
    root.mkdir(parents=True, exist_ok=True)
    variants, paths = [], {}
    for label, revision, *overrides in args.variant:
        commit, path = worktree(revision, root)
        variants.append(Variant(label, revision, commit, overrides, stacks.get(label)))
        paths[label] = path
    for number in range(1, args.rounds + 1):
        for variant in variants:
            variant.rounds.append(measure(variant, paths[variant.label], args.warmup, args.iterations))
            print(f"round {number}: {variant.label:>16} {variant.rounds[-1]['seconds']:.3f} s/iteration "
                  f"{variant.rounds[-1]}", flush=True)

    print(f"\n{'variant':>16} {'commit':>12} {'s/iteration':>12} {'(min-max)':>14}  phases (median s)")
    results = []
    for variant in variants:
        figures = summary(variant)
        results.append(asdict(variant) | {"summary": figures})
        phases = ", ".join(f"{k} {v:.3f}" for k, v in figures["phases"].items())
        print(f"{variant.label:>16} {variant.commit:>12} {figures['median']:>12.3f} "
              f"{figures['min']:>6.3f}-{figures['max']:<6.3f}  {phases}")
    out = Path(args.out or REPO / "bench" / "results" / f"bisect-{datetime.date.today()}.json")
    out.write_text(json.dumps({"date": str(datetime.date.today()), "machine": platform.machine(),
                               "processor": cpu_model(), "cores": os.cpu_count(), "note": args.note,
                               "rounds": args.rounds, "warmup": args.warmup, "iterations": args.iterations,
                               "variants": results}, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
