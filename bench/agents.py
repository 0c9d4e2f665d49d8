"""Agents at scale: when episodes take their turns, on a tool world whose tool is as slow as an API.

    python -m bench.agents                                  (seeds 0-2, every setting)
    python -m bench.agents --seeds 0 --iterations 5 --settings hf-rounds vllm-ahead-1

On the latency world (`configs/tools-latency.yaml`: the demo's tool world with 2 heads of 32, its
tool answering after a seeded 0.1-2 s, `environment.concurrent_episodes: 16`), SFT is trained once
(bench.tools' upstream), then for every seed one GRPO run per setting from that checkpoint, with the
same prompts, reward and work per iteration:

- `hf-rounds`, `vllm-rounds`: every episode's next turn sampled together, then every tool answers
  (`schedule: rounds`), on transformers' loop or the vLLM server: the synchronous baseline;
- `hf-continuous`, `vllm-continuous`: each episode's next turn as soon as its tool answered;
- `vllm-ahead-1`, `vllm-ahead-2`: continuous, and sampled ahead (`rollout.max_staleness` 1, 2);
- `vllm-partial`: continuous, ahead by 1, episodes continued across a sync (`rollout.partial`).

Per run: seconds per iteration (mean `time/iteration`), the share of the trainer's time it sat waiting
for episodes (`time/episode_wait`, `time/rollout_wait` and `time/sampling_wait` over
`time/iteration`), the gold win rate against the SFT policy's answers (the first setting's SFT
answers for every setting of a seed, common random numbers), the tool-call rate after training, the
mean and largest staleness, the share of episodes whose turns span versions and the share of tokens
the correction masked. Writes `bench/results/agents-<date>.json` and prints a table. A benchmark, not
a test: nothing here asserts.
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
VLLM = {"rollout_engine": "vllm"}
SETTINGS = {"hf-rounds": {"environment": {"schedule": "rounds"}},
            "hf-continuous": {"environment": {"schedule": "continuous"}},
            "vllm-rounds": VLLM | {"environment": {"schedule": "rounds"}},
            "vllm-continuous": VLLM | {"environment": {"schedule": "continuous"}},
            "vllm-ahead-1": VLLM | {"environment": {"schedule": "continuous"}, "rollout": {"max_staleness": 1}},
            "vllm-ahead-2": VLLM | {"environment": {"schedule": "continuous"}, "rollout": {"max_staleness": 2}},
            "vllm-partial": VLLM | {"environment": {"schedule": "continuous"},
                                    "rollout": {"max_staleness": 1, "partial": True}}}
"""Each setting's changes to the config's ppo section."""
WAITS = ("time/episode_wait", "time/rollout_wait", "time/sampling_wait")
"""What the trainer's thread spends waiting for episodes: on tools and turns, for a rollout sampled
ahead, for the rollouts in flight before a sync."""


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
            waited = np.array([sum(row.get(name, 0.0) for name in WAITS) for row in history])
            rows.append({"seed": seed, "setting": setting, **judged(result["table"], sft_answers),
                         "seconds_per_iteration": float(seconds.mean()),
                         "trainer_wait_share": float(waited.sum() / seconds.sum()),
                         "tool_call_rate": result["metrics"].get("eval/tool_call_rate"),
                         "staleness": float(np.mean([row.get("rollout/staleness_mean", 0.0) for row in history])),
                         "staleness_max": float(max(row.get("rollout/staleness", 0.0) for row in history)),
                         "mixed_version_share": float(np.mean([row.get("rollout/mixed_version_share", 0.0)
                                                               for row in history])),
                         "masked_share": float(np.mean([row.get("rollout/engine_masked_share", 0.0)
                                                        for row in history]))})
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
    """Mean [min, max] over seeds per setting, and each setting's speed-up over `hf-rounds` seed by seed."""
    lines = ["| setting | s / iteration | speed-up over hf-rounds | trainer waiting | gold win rate vs SFT | "
             "tool-call rate | staleness (mean; max) | mixed versions | masked |",
             "|---|---|---|---|---|---|---|---|---|"]
    rounds = {r["seed"]: r["seconds_per_iteration"] for r in rows if r["setting"] == "hf-rounds"}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == setting]
        speedups = [rounds[r["seed"]] / r["seconds_per_iteration"] for r in mine if r["seed"] in rounds]
        speedup = f"{np.mean(speedups):.2f} [{min(speedups):.2f}, {max(speedups):.2f}]" if speedups else "-"
        lines.append(f"| {setting} | {_spread(mine, 'seconds_per_iteration', 2)} | {speedup} | "
                     f"{_spread(mine, 'trainer_wait_share', 2)} | {_spread(mine, 'gold_win_rate')} | "
                     f"{_spread(mine, 'tool_call_rate', 2)} | {_spread(mine, 'staleness', 2)}; "
                     f"{max(r['staleness_max'] for r in mine):.0f} | {_spread(mine, 'mixed_version_share', 2)} | "
                     f"{_spread(mine, 'masked_share', 3)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
