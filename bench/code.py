"""Code-world benchmark: does GRPO with the sandbox as its reward learn to write the function asked for?

    python -m bench.code                          (seeds 0-2; make bench-code)
    python -m bench.code --seeds 0 --iterations 10

On the code world (`configs/code.yaml`, `demo.task: code`), SFT is trained once on demonstrations that
are right about half the time. Then, for every training seed, GRPO from that checkpoint with the
config's one reward: the response and its record's `tests` run in the sandbox
(`stages.sandbox.code:tests_pass`), 1 where they pass. Each final policy is judged on the held-out
prompts by the hidden gold function (`gold_code_score`: the answer read, checked on inputs the tests do
not show) against the SFT policy's answers (the run's own evaluation baseline): gold reward, gold win
rate with its standard error, the share of final answers that pass their tests, KL to SFT per
sequence and training seconds (the sum of `time/iteration`). Writes `bench/results/code-<date>.json`
and prints a table. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

from bench.tools import REPO, _spread, run, upstream


def judged(table, metrics: dict) -> dict:
    """The final policy's held-out answers against SFT's, by the gold function, and how many pass their
    tests (the run's own evaluation scored both with the reward: `eval/reward/tests`, `..._sft`)."""
    from rlhf.demo.world import judge_evaluation

    figures = {key.removeprefix("eval/"): value for key, value in judge_evaluation(table).items()}
    return figures | {"policy_tests_pass": metrics["eval/reward/tests"],
                      "sft_tests_pass": metrics["eval/reward/tests_sft"], "kl": float(table["kl"].mean())}


def main(argv: list[str] | None = None) -> int:
    from rlhf.config import load_config, with_overrides

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/code.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=None, help="ppo.num_iterations (default: the config's)")
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench-code")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    started = time.time()
    sft, frames = upstream(cfg, args.state)
    rows = []
    for seed in args.seeds:
        changes = {"seed": seed, "evaluation": {"every": None}}
        if args.iterations:
            changes["num_iterations"] = args.iterations
        result = run(with_overrides(cfg.ppo, changes), sft, frames, args.state / f"grpo-{seed}")
        rows.append({"seed": seed, **judged(result["table"], result["metrics"]),
                     "train_seconds": result["train_seconds"], "final_rollout": result["final_rollout"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "final_rollout"}), flush=True)
    summary = "\n".join([
        "| gold win rate vs SFT | gold reward (SFT's) | tests pass: SFT -> after | KL | train s |",
        "|---|---|---|---|---|",
        f"| {_spread(rows, 'gold_win_rate')} | {_spread(rows, 'gold_reward', 2)} "
        f"({sum(r['gold_reward_sft'] for r in rows) / len(rows):.2f}) | "
        f"{_spread(rows, 'sft_tests_pass', 2)} -> {_spread(rows, 'policy_tests_pass', 2)} | "
        f"{_spread(rows, 'kl', 1)} | {_spread(rows, 'train_seconds', 0)} |"])
    print(summary)
    out = args.out or REPO / "bench" / "results" / f"code-{datetime.date.today()}.json"
    out.write_text(json.dumps({"config": args.config, "seeds": args.seeds, "iterations": args.iterations,
                               "machine": platform.processor() or platform.machine(),
                               "seconds": time.time() - started, "runs": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
