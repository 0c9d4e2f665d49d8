"""Against a peer on the tool world: our GRPO in episodes and TRL 1.12's GRPOTrainer with tools, from the
same SFT checkpoint, on the same prompts, tool, reward functions and work per iteration, judged by one
evaluation.

    python -m bench.tools_trl --reference .bench-venv/bin/python      (or: make bench-tools-trl)

1. The tool world and its SFT checkpoint as `bench/tools.py` builds them (`configs/tools.yaml`, kept in --state).
2. For every seed, ours runs the config's GRPO in episodes (`ppo.environment`: the built-in tool-calling loop),
   evaluated every `--eval-every` iterations in the run; TRL runs the same work in its own environment
   (bench/trl_tools.py: `environment_factory` with the same tool, the same two reward functions on the final
   answer), its policy copied at the same iterations and judged after training.
3. One judge for both: `stages.rl.evaluation.evaluate` in episodes on the held-out prompts against the SFT
   policy's episodes (common random numbers), then the hidden gold function on the final answers (`judged`).
4. Time to quality: the target is TRL's mean final gold win rate over the seeds; a run reaches it at its first
   evaluation at or above it. The clock is training only: ours sums `time/iteration`, TRL's counts each optimizer
   step from the end of the one before; neither counts loading, copying or evaluation.

Where TRL cannot say what our config says, the nearest setting (`DIFFERENCES`). Writes
`bench/results/tools-trl-<date>.json` and prints a table. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.quality import Judge
from bench.tools import judged, upstream

REPO = Path(__file__).resolve().parent.parent

DIFFERENCES = [
    "KL to the SFT policy: ours is a per-token penalty in the reward (k1, kl.init_coef 0.2, adapted towards "
    "kl.target); TRL's GRPO has it as a loss term (k3) with a fixed beta, set here to our initial 0.2.",
    "Turn length: ours caps each turn at sampling.response_length (32) and the episode at environment.episode_tokens "
    "(80); TRL caps only the whole completion, tool answers included (max_completion_length 80).",
    "A cut-off answer: ours scores it ppo.missing_eos_score; TRL scores it as written (mask_truncated_completions "
    "off, its default).",
    "Reward scale: ours refits a gain and bias on the first rollouts; TRL sums the two functions as they return. "
    "Group advantages divide by the group's std in both, so only the KL's weight against the reward differs.",
]
"""What differs between the two runs, because TRL cannot say what our config says."""


OWNER = {"ours": "ours'", "trl": "TRL's"}


def run_ours(ppo_cfg, sft: Path, frames: dict, out: Path) -> dict:
    """Our GRPO in episodes, its evaluation tables every `evaluation.every` iterations and its clock."""
    from stages.common.reporting import Reporting
    from stages.ppo import PPOInputs, train_ppo

    shutil.rmtree(out, ignore_errors=True)
    tables = {}
    reporting = Reporting(evaluation=lambda table, i: tables.update({i: table}))
    result = train_ppo(ppo_cfg, PPOInputs(sft_location=str(sft), reward_location=None, prompts=frames["prompts"],
                                          eval_prompts=frames["prompts_eval"]), out, reporting)
    clock = dict(zip([row["iteration"] for row in result.history],
                     np.cumsum([row["time/iteration"] for row in result.history]).tolist(), strict=True))
    tables[len(result.history)] = result.evaluation
    return {"tables": tables, "clock": clock, "tool_call_rate": result.metrics.get("eval/tool_call_rate")}


def run_trl(reference: str, ppo_cfg, sft: Path, prompts_file: Path, threads: int, out: Path) -> dict:
    """TRL's run of the same work: its policy copied every `evaluation.every` iterations, and its clock."""
    settings = {"episodes": ppo_cfg.rollout_batch_size, "group": ppo_cfg.samples_per_prompt,
                "iterations": ppo_cfg.num_iterations, "ppo_epochs": ppo_cfg.num_ppo_epochs,
                "minibatches": ppo_cfg.num_minibatches, "learning_rate": ppo_cfg.learning_rate,
                "clip_range": ppo_cfg.clip_low, "beta": ppo_cfg.kl.init_coef,
                "temperature": ppo_cfg.sampling.temperature, "episode_tokens": ppo_cfg.environment.episode_tokens,
                "max_turns": ppo_cfg.environment.max_turns, "seed": ppo_cfg.seed, "threads": threads,
                "snapshot_every": ppo_cfg.evaluation.every}
    shutil.rmtree(out, ignore_errors=True)
    command = [reference, str(REPO / "bench" / "trl_tools.py"), "--policy", str(sft), "--prompts", str(prompts_file),
               "--out", str(out), "--settings", json.dumps(settings)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"TRL run failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT="))[len("RESULT="):])
    return {"clock": {int(i): seconds for i, seconds in result["clock"].items()},
            "folders": {i: out / f"iteration-{i}" for i in range(ppo_cfg.evaluation.every, ppo_cfg.num_iterations,
                                                                  ppo_cfg.evaluation.every)}
            | {ppo_cfg.num_iterations: out}}


def prompts_jsonl(frame, path: Path) -> Path:
    """The training prompts as TRL's dataset reads them: each prompt's messages and its `liked` column."""
    path.write_text("".join(json.dumps({"messages": json.loads(m), "liked": liked}) + "\n"
                            for m, liked in zip(frame["prompt_messages"], frame["liked"], strict=True)))
    return path


def curve(tables: dict, clock: dict, sft_answers: list[str]) -> list[dict]:
    """Each evaluation's gold figures, with the iteration and the training seconds to it."""
    return [{"iteration": i, "seconds": clock[i], **judged(table, sft_answers),
             "tool_call_rate": float((np.array(table["policy_tool_calls"]) > 0).mean())}
            for i, table in sorted(tables.items())]


def time_to(points: list[dict], target: float) -> dict | None:
    """The first evaluation at or above `target` gold win rate."""
    return next(({"iteration": p["iteration"], "seconds": p["seconds"]} for p in points
                 if p["gold_win_rate"] >= target), None)


def report(rows: list[dict]) -> str:
    """Final figures (mean [min, max] over seeds), and the training time to each side's mean final gold win rate
    (the first evaluation at or above it; `-`: not reached in the run), per side and seed."""
    sides = [side for side in ("ours", "trl") if any(r["side"] == side for r in rows)]
    targets = {side: float(np.mean([r["curve"][-1]["gold_win_rate"] for r in rows if r["side"] == side]))
               for side in sides}
    lines = ["| side | gold win rate vs SFT (final) | gold reward | tool-call rate | KL | train s | s/it | "
             + " | ".join(f"s to {OWNER[side]} final {value:.3f}, per seed" for side, value in targets.items()) + " |",
             "|---" * (7 + len(targets)) + "|"]
    for side in sides:
        mine = [r for r in rows if r["side"] == side]
        finals = [r["curve"][-1] for r in mine]
        reached = [", ".join("-" if hit is None else f"{hit['seconds']:.0f} (it {hit['iteration']})"
                             for hit in (time_to(r["curve"], target) for r in mine)) for target in targets.values()]
        lines.append(
            f"| {side} | {_spread(finals, 'gold_win_rate')} | {_spread(finals, 'gold_reward', 2)} | "
            f"{_spread(finals, 'tool_call_rate', 2)} | {_spread(finals, 'kl', 1)} | {_spread(finals, 'seconds', 0)} | "
            f"{np.mean([p['seconds'] / p['iteration'] for p in finals]):.2f} | " + " | ".join(reached) + " |")
    return "\n".join(lines)


def _spread(rows: list[dict], key: str, digits: int = 3) -> str:
    values = np.array([r[key] for r in rows], dtype=float)
    return f"{values.mean():.{digits}f} [{values.min():.{digits}f}, {values.max():.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    import torch

    from rlhf.config import load_config, with_overrides
    from rlhf.sections.ppo import GROUP_SIZE

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", default=str(REPO / ".bench-venv" / "bin" / "python"),
                        help="the Python of the TRL environment (make bench-env)")
    parser.add_argument("--config", default="configs/tools.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=None, help="ppo.num_iterations (default: the config's)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench-tools")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None, help="a results file: print (and rewrite) its summary")
    args = parser.parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())
        results["summary"] = report(results["runs"])
        args.report.write_text(json.dumps(results, indent=2))
        print(results["summary"])
        return 0

    started = time.time()
    cfg = load_config(args.config)
    sft, frames = upstream(cfg, args.state)
    prompts_file = prompts_jsonl(frames["prompts"], args.state / "trl-prompts.jsonl")
    base = with_overrides(cfg.ppo, {"advantage_estimator": "grpo", "samples_per_prompt": GROUP_SIZE,
                                    "evaluation": {"every": args.eval_every}}
                          | ({"num_iterations": args.iterations} if args.iterations else {}))
    judge = Judge(sft, None, frames["prompts_eval"], base)
    sft_answers = judge.held_out.sft_texts
    rows = []
    for seed in args.seeds:
        ppo_cfg = with_overrides(base, {"seed": seed})
        for side in args.sides:
            if side == "ours":
                run = run_ours(ppo_cfg, sft, frames, args.state / f"ours-{seed}")
                points = curve(run["tables"], run["clock"], sft_answers)
            else:
                run = run_trl(args.reference, ppo_cfg, sft, prompts_file, torch.get_num_threads(),
                              args.state / f"trl-{seed}")
                points = curve({i: judge(folder) for i, folder in run["folders"].items()}, run["clock"], sft_answers)
            rows.append({"seed": seed, "side": side, "curve": points})
            print(json.dumps({"seed": seed, "side": side, **points[-1]}), flush=True)
    summary = report(rows)
    print(summary)
    out = args.out or REPO / "bench" / "results" / f"tools-trl-{datetime.date.today()}.json"
    out.write_text(json.dumps({"config": args.config, "seeds": args.seeds, "iterations": base.num_iterations,
                               "eval_every": args.eval_every, "differences": DIFFERENCES,
                               "machine": platform.processor() or platform.machine(),
                               "seconds": time.time() - started, "runs": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
