"""Agents at scale: when episodes take their turns, on a tool world whose tool is as slow as an API.

    python -m bench.agents                                  (seeds 0-2, rounds and continuous)
    python -m bench.agents --seeds 0 --iterations 5 --settings rounds continuous

On the latency world (`configs/tools-latency.yaml`: the demo's tool world, its tool answering after a
seeded 0.1-2 s, `environment.concurrent_episodes: 16`), SFT is trained once (bench.tools' upstream),
then for every seed one GRPO run per setting from that checkpoint, with the same prompts, reward and
work per iteration:

- `rounds`: every episode's next turn sampled together, then every tool answers (`schedule: rounds`);
- `continuous`: each episode's next turn as soon as its tool answered (`schedule: continuous`).

Per run: seconds per iteration (mean `time/iteration`), the share of the trainer's time it sat waiting
on tools (`time/episode_wait` over `time/iteration`), the gold win rate against the SFT policy's
answers (the `rounds` run's SFT answers for every setting of a seed, common random numbers), the
tool-call rate after training, and the staleness (0 here: both settings are synchronous). Writes
`bench/results/agents-<date>.json` and prints a table. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import numpy as np

from bench.tools import _spread, judged, run, upstream

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"rounds": {"environment": {"schedule": "rounds"}},
            "continuous": {"environment": {"schedule": "continuous"}}}
"""Each setting's changes to the config's ppo section."""


def main(argv: list[str] | None = None) -> int:
    from rlhf.config import load_config, with_overrides

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tools-latency.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=20, help="ppo.num_iterations")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench-agents")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    started = time.time()
    sft, frames = upstream(cfg, args.state)
    rows = []
    for seed in args.seeds:
        base = {"seed": seed, "num_iterations": args.iterations, "evaluation": {"every": None}}
        results = {setting: run(with_overrides(cfg.ppo, base | SETTINGS[setting]), sft, frames,
                                args.state / f"{seed}-{setting}") for setting in args.settings}
        sft_answers = list(results[args.settings[0]]["table"]["sft_response"])
        for setting, result in results.items():
            history = result["history"]
            seconds = np.array([row["time/iteration"] for row in history])
            waited = np.array([row.get("time/episode_wait", 0.0) for row in history])
            rows.append({"seed": seed, "setting": setting, **judged(result["table"], sft_answers),
                         "seconds_per_iteration": float(seconds.mean()),
                         "trainer_wait_share": float(waited.sum() / seconds.sum()),
                         "tool_call_rate": result["metrics"].get("eval/tool_call_rate"),
                         "staleness": float(np.mean([row.get("rollout/staleness", 0.0) for row in history]))})
            print(json.dumps(rows[-1]), flush=True)
    summary = summarise(rows)
    print(summary)
    out = args.out or REPO / "bench" / "results" / f"agents-{datetime.date.today()}.json"
    out.write_text(json.dumps({"config": args.config, "seeds": args.seeds, "iterations": args.iterations,
                               "settings": args.settings, "machine": platform.processor() or platform.machine(),
                               "seconds": time.time() - started, "runs": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


def summarise(rows: list[dict]) -> str:
    """Mean [min, max] over seeds per setting, and each setting's speed-up over `rounds` seed by seed."""
    lines = ["| setting | s / iteration | speed-up over rounds | trainer waiting | gold win rate vs SFT | "
             "tool-call rate | staleness |", "|---|---|---|---|---|---|---|"]
    rounds = {r["seed"]: r["seconds_per_iteration"] for r in rows if r["setting"] == "rounds"}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == setting]
        speedups = [rounds[r["seed"]] / r["seconds_per_iteration"] for r in mine if r["seed"] in rounds]
        speedup = f"{np.mean(speedups):.2f} [{min(speedups):.2f}, {max(speedups):.2f}]" if speedups else "-"
        lines.append(f"| {setting} | {_spread(mine, 'seconds_per_iteration', 2)} | {speedup} | "
                     f"{_spread(mine, 'trainer_wait_share', 2)} | {_spread(mine, 'gold_win_rate')} | "
                     f"{_spread(mine, 'tool_call_rate', 2)} | {_spread(mine, 'staleness', 1)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
