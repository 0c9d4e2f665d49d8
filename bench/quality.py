"""Learning-quality benchmark: what our PPO learns, and how fast, against TRL 1.12's PPOTrainer on
the demo world, from identical checkpoints, prompts and work per iteration.

    python -m bench.quality --reference .bench-venv/bin/python      (or: make bench-quality)

1. SFT and reward checkpoints are trained once with the demo config's sections (kept in --state).
2. For every fixed KL coefficient beta and training seed, TRL runs the demo config's PPO work
   (episodes, response length, epochs, minibatches, learning rate, temperature) from those
   checkpoints in its own environment (bench/trl_quality.py), and each of our candidate
   configurations (`CANDIDATES`: the default, and cheaper or faster ones) runs it with the
   candidate's settings on top (`kl.target` off, so beta stays fixed).
3. Every run is judged every `--eval-every` iterations and at the end by one evaluation:
   `stages.rl.evaluation.evaluate` against the SFT reference on the held-out prompts, its SFT baseline sampled
   with common random numbers (the same responses for every run and every point), then the demo
   world's gold function: gold reward, gold win rate against SFT, KL to SFT per sequence. Ours
   evaluates in the run (`ppo.evaluation.every`, training's random stream untouched); TRL's policy is
   copied at those iterations and judged after training. The clock is training only: ours sums
   `time/iteration` (rollout, scoring, update), TRL's counts each step from the end of the previous
   one, the copy excluded; neither counts loading or evaluation.
4. Time to quality: the target at each beta is TRL's mean final gold reward over the seeds; a run
   reaches it at the first evaluation whose gold reward is at or above it with KL at most 110% of
   TRL's mean final KL. Per candidate: training seconds and iterations to target per seed, the
   ratio to TRL's mean training time to its own final iteration, and seconds per iteration.

It prints the tables, writes `bench/results/quality-<date>.json` after every run (`--resume`
continues an interrupted one), a PNG of gold reward against training time per beta, and the
frontier and over-optimisation PNGs of the default. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

DIFFERENCES = [
    "Reward scale: ours refits the reward normalisation (gain and bias) on its first rollouts, so scores start at "
    "mean 0, std 1; TRL scores with the reward model's head multiplied by the reward stage's normalisation gain "
    "(its Llama score head has no bias, so no shift: about mean -0.27, std 0.96 at the start).",
    "A response without EOS: ours scores it -3 (ppo.missing_eos_score replaces the score); TRL subtracts "
    "missing_eos_penalty=3 from the reward model's score.",
    "Critic: ours as configured (`critic.kind`, `critic.normalize` columns: by default the reward model with the "
    "refitted gain and bias applied to its head); TRL's value model is the same gain-scaled reward model, without a "
    "bias.",
    "Optimiser: ours clips the gradient norm at 1.0 and uses AdamW eps 1e-5 (ppo.max_grad_norm; CleanRL's and "
    "OpenAI's PPO eps); TRL's PPOTrainer does not clip and uses eps 1e-8. Both decay the learning rate linearly "
    "to 0, ours per optimiser step, TRL per iteration.",
    "Sampling noise: each implementation draws its own samples from its own seed; the evaluation shares them.",
]


def train_upstream(cfg, world: Path, state: Path) -> tuple[Path, Path]:
    """SFT and reward checkpoints from the config's sections, trained once and kept."""
    from schemas.validate import LengthBudget, load_validated
    from stages.reward import RewardInputs, train_reward
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    sft_folder, reward_folder = state / "sft" / "checkpoint", state / "reward" / "checkpoint"
    if (reward_folder / "config.json").exists():
        return sft_folder, reward_folder
    tokenizer = load_tokenizer(str(world / "model"))

    def data(section, name, kind):
        budget = LengthBudget(section.max_prompt_length, section.max_length)
        return load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer, budget=budget).frame

    sft = train_sft(cfg.sft, SFTInputs(str(world / "model"), data(cfg.sft, "sft", "sft"),
                                       data(cfg.sft, "sft_eval", "sft")), state / "sft")
    reward = train_reward(cfg.reward, RewardInputs(model_location=str(sft.checkpoint),
                                                   policy_location=str(sft.checkpoint),
                                                   train=data(cfg.reward, "preferences", "preference"),
                                                   evaluation=data(cfg.reward, "preferences_eval", "preference"),
                                                   normalization_prompts=data(cfg.reward, "prompts_eval", "prompt")),
                          state / "reward")
    (state / UPSTREAM_METRICS).write_text(json.dumps({"sft": sft.metrics, "reward": reward.metrics}, indent=1))
    return sft_folder, reward_folder


UPSTREAM_METRICS = "upstream-metrics.json"
"""The SFT and reward stages' final figures, beside their checkpoints in a benchmark's state."""


def scaled_reward_model(reward_folder: Path, state: Path) -> Path:
    """The reward model with its score head multiplied by the stored normalisation gain, for TRL."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from stages.rewards.scoring import NORMALIZATION_KEY

    folder = state / "reward-scaled"
    if not (folder / "config.json").exists():
        model = AutoModelForSequenceClassification.from_pretrained(reward_folder, num_labels=1)
        model.score.weight.data *= getattr(model.config, NORMALIZATION_KEY)["gain"]
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(reward_folder).save_pretrained(folder)
    return folder


class Judge:
    """The one evaluation TRL's policies get, ours's in the run: `stages.rl.evaluation.evaluate` against the SFT
    responses to the held-out prompts (common random numbers), sampled once here: one turn each, or the
    config's episodes where it names an environment (bench/tools_trl.py). `reward_folder` None: no reward model."""

    def __init__(self, sft_folder: Path, reward_folder: Path | None, eval_prompts, ppo_cfg):

        from stages.envs.loop import episode_source
        from stages.memory.phases import Counts
        from stages.memory.plan import with_micro_batches
        from stages.rl.evaluation import HeldOut
        from stages.rl.ppo_models import load_models

        reward = reward_folder and str(reward_folder)
        # The sampling sizes left `auto` resolved as the stage resolves them (the config's own are not sizes yet).
        ppo_cfg = with_micro_batches("ppo", ppo_cfg, Counts(ppo_eval_prompts=len(eval_prompts)), str(sft_folder),
                                     reward)
        self.cfg = ppo_cfg
        self.models = load_models(ppo_cfg, str(sft_folder), reward)
        source = episode_source(ppo_cfg.environment, self.models.tokenizer, str(sft_folder), self.models.stop_ids,
                                ppo_cfg.sampling.response_length)
        self.held_out = HeldOut.sample(self.models, eval_prompts, ppo_cfg.evaluation, ppo_cfg.sampling, source,
                                       tuple(ppo_cfg.reward.columns))

    def __call__(self, policy_folder: Path):
        """The evaluation table of the policy saved in `policy_folder`."""
        from safetensors.torch import load_file

        from stages.rl.evaluation import evaluate
        from stages.rl.rollout import policy_sampler

        weights = load_file(str(policy_folder / "model.safetensors"))
        missing, unexpected = self.models.policy.load_state_dict({k: v.float() for k, v in weights.items()},
                                                                 strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # only a tied head may be absent from the file
            raise ValueError(f"{policy_folder} does not fit the SFT model: missing {missing}, unexpected {unexpected}")
        return evaluate(self.models, policy_sampler(self.models), self.held_out, self.cfg.evaluation,
                        self.cfg.sampling)[1]


CANDIDATES: dict[str, dict] = {
    "default": {},
    # The demo's PPO settings before this benchmark chose lr 1e-3 with clip 0.1 (the rows named "default" in
    # bench/results/quality-2026-11-23.json are these).
    "learning rate 3e-4, clip 0.2": {"learning_rate": 3.0e-4, "clip_range": 0.2},
    # One model trained, not two; three iterations that train only the value head first (no collapse,
    # docs/performance.md).
    "shared critic, 3 warm-up iterations": {"critic.kind": "shared", "critic.freeze_policy_iterations": 3},
    # The critic as LoRA adapters and a value head on the reward model the scorer holds.
    "reward-lora critic": {"critic.kind": "reward-lora"},
    # No critic: the other responses to the same prompt are the baseline (same 64 responses per iteration).
    "rloo, 2 per prompt": {"advantage_estimator": "rloo", "samples_per_prompt": 2},
    "rloo, 4 per prompt": {"advantage_estimator": "rloo", "samples_per_prompt": 4},
    "reinforce++-baseline, 4 per prompt": {"advantage_estimator": "reinforce++-baseline", "samples_per_prompt": 4},
    # Less update work per iteration.
    "2 ppo epochs": {"num_ppo_epochs": 2},
    "2 minibatches": {"num_minibatches": 2},
    # Bigger steps, each held closer to the sampling policy (demo: 3e-4, clip 0.2).
    "learning rate 6e-4, clip 0.1": {"learning_rate": 6.0e-4, "clip_range": 0.1},
    # Half the optimizer steps (or passes), each twice as large: the same distance per iteration for less work?
    "2 minibatches, learning rate 6e-4": {"num_minibatches": 2, "learning_rate": 6.0e-4},
    # The passes without padding where it saves a tenth of them, micro-batches by tokens (docs/performance.md).
    "padding-free": {"padding_free": "auto", "micro_batch_tokens": "auto"},
    # bf16 autocast on a CPU with bf16 units (float32 master weights), with padding-free passes.
    "padding-free, bf16": {"padding_free": "auto", "micro_batch_tokens": "auto", "precision": "bf16-mixed"},
    # Compiled passes and decode loop (torch.compile): the compile counted in the time.
    "compiled": {"compile": True},
    "padding-free, compiled": {"padding_free": "auto", "micro_batch_tokens": "auto", "compile": True},
    "2 ppo epochs, learning rate 6e-4": {"num_ppo_epochs": 2, "learning_rate": 6.0e-4},
    # The two that helped, together; and a larger step still.
    "learning rate 6e-4, clip 0.1, 2 minibatches": {"learning_rate": 6.0e-4, "clip_range": 0.1, "num_minibatches": 2},
    "learning rate 1e-3, clip 0.1": {"learning_rate": 1.0e-3, "clip_range": 0.1},
    "learning rate 1e-3, clip 0.1, 2 minibatches": {"learning_rate": 1.0e-3, "clip_range": 0.1, "num_minibatches": 2},
}
"""Our configurations in the race to TRL's quality: `ppo` settings on top of the config's section."""


TRL = "trl 1.12"
"""The reference's name among the candidates in the results."""


def final_figures(table) -> dict[str, float]:
    """What an evaluation table (policy and SFT responses to the held-out prompts) says under the gold function."""
    from rlhf.demo.world import judge_evaluation

    gold = judge_evaluation(table)
    return {"kl": float(table["kl"].mean()), **{key.removeprefix("eval/"): value for key, value in gold.items()}}


def gold_point(table, iteration: int, seconds: float) -> dict:
    """One point of a run's curve: the evaluation after `iteration`, `seconds` of training in."""
    figures = final_figures(table)
    return {"iteration": iteration, "seconds": seconds, "kl": figures["kl"], "gold_reward": figures["gold_reward"],
            "gold_win_rate": figures["gold_win_rate"]}


def run_ours(ppo_cfg, sft_folder: Path, reward_folder: Path | None, prompts, eval_prompts, out: Path,
             teacher: Path | None = None) -> tuple[Path, dict]:
    """Our PPO as configured (`reward_folder` None: no reward model; `teacher`: a distillation teacher's
    folder), evaluated every `ppo_cfg.evaluation.every` iterations; besides its policy, the shape of its
    run: the curve of those evaluations against training time, response lengths, and the proxy score,
    gold reward and KL of every iteration's rollouts (the over-optimisation curve)."""
    from rlhf.demo.world import mean_gold_reward
    from stages.common.reporting import Reporting
    from stages.ppo import PPOInputs, train_ppo

    shutil.rmtree(out, ignore_errors=True)  # a finished run's state there would be resumed, whatever its config
    gold, evaluations = {}, {}
    reporting = Reporting(rollouts=lambda table, i: gold.update({i: mean_gold_reward(list(table["prompt_messages"]),
                                                                                list(table["response"]))}),
                          evaluation=lambda table, i: evaluations.update({i: table}))
    inputs = PPOInputs(sft_location=str(sft_folder), reward_location=reward_folder and str(reward_folder),
                       prompts=prompts, eval_prompts=eval_prompts, teacher_location=teacher and str(teacher))
    result = train_ppo(ppo_cfg, inputs, out, reporting)
    clock = dict(zip([row["iteration"] for row in result.history],
                     np.cumsum([row["time/iteration"] for row in result.history]).tolist(), strict=True))
    evaluations[len(result.history)] = result.evaluation
    lengths = [row["rollout/response_length"] for row in result.history]
    worst_drop = max((a - b) / a for a, b in itertools.pairwise(lengths))
    rollouts = [{"iteration": row["iteration"], "kl": row["rollout/kl"], "proxy": row["rollout/score"],
                 "gold": gold[row["iteration"]]} for row in result.history]
    return result.checkpoint, {"first_length": lengths[0], "min_length": min(lengths), "worst_length_drop": worst_drop,
                               "curve": rollouts, "train_seconds": clock[len(result.history)],
                               "final_table": result.evaluation,
                               "evaluations": [gold_point(table, i, clock[i])
                                               for i, table in sorted(evaluations.items())]}


def run_trl(reference: str, sft_folder: Path, reward_folder: Path, prompts_file: Path, ppo_cfg, beta: float, seed: int,
            threads: int, out: Path) -> tuple[Path, dict[int, float]]:
    """TRL's run; its final policy in `out`, a copy every `ppo_cfg.evaluation.every` iterations in `out/iteration-<i>`,
    and its training clock (seconds after each iteration)."""
    settings = {"episodes": ppo_cfg.rollout_batch_size, "iterations": ppo_cfg.num_iterations,
                "response_length": ppo_cfg.sampling.response_length, "ppo_epochs": ppo_cfg.num_ppo_epochs,
                "minibatches": ppo_cfg.num_minibatches, "learning_rate": ppo_cfg.learning_rate,
                "temperature": ppo_cfg.sampling.temperature, "kl_coef": beta, "seed": seed, "threads": threads,
                "vf_coef": ppo_cfg.critic.vf_coef, "cliprange": ppo_cfg.clip_low,
                "cliprange_value": ppo_cfg.critic.clip_range_value, "gamma": ppo_cfg.gamma, "lam": ppo_cfg.critic.lam,
                "missing_eos_penalty": -(ppo_cfg.missing_eos_score or 0.0), "snapshot_every": ppo_cfg.evaluation.every}
    shutil.rmtree(out, ignore_errors=True)
    command = [reference, str(REPO / "bench" / "trl_quality.py"), "--policy", str(sft_folder), "--reward",
               str(reward_folder), "--prompts", str(prompts_file), "--out", str(out),
               "--settings", json.dumps(settings)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"TRL run failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT="))[len("RESULT="):])
    return out, {int(i): seconds for i, seconds in result["clock"].items()}


def frontier_png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.4))
    markers = {0.02: "o", 0.05: "s", 0.2: "^"}
    for implementation, color in (("ours", "tab:blue"), ("trl", "tab:orange")):
        for row in (r for r in rows if r["implementation"] == implementation):
            axis.scatter(row["kl"], row["gold_reward"], color=color, marker=markers.get(row["beta"], "x"), alpha=0.8)
        axis.scatter([], [], color=color, label=implementation)
    for beta, marker in markers.items():
        axis.scatter([], [], color="gray", marker=marker, label=f"beta {beta}")
    axis.set_xlabel("KL(policy || SFT) per sequence, held-out prompts")
    axis.set_ylabel("gold reward, held-out prompts")
    axis.set_title("Demo world: gold reward against KL, a point per seed", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def overoptimization_png(rows: list[dict], path: Path, window: int = 5) -> None:
    """Our runs' rollouts over training, a line per beta (mean over seeds per iteration, then a
    running mean): proxy score and gold reward against KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlhf.plots import running_mean

    figure, (proxy_axis, gold_axis) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for beta in sorted({r["beta"] for r in rows if "curve" in r}):
        curves = [r["curve"] for r in rows if r["beta"] == beta and "curve" in r]
        mean = {key: [sum(c[i][key] for c in curves) / len(curves) for i in range(len(curves[0]))]
                for key in ("kl", "proxy", "gold")}
        kl = running_mean(mean["kl"], window)
        proxy_axis.plot(kl, running_mean(mean["proxy"], window), label=f"beta {beta}")
        gold_axis.plot(kl, running_mean(mean["gold"], window), label=f"beta {beta}")
    for axis, label in ((proxy_axis, "proxy: reward-model score (normalised)"), (gold_axis, "gold reward")):
        axis.set_xlabel("KL(policy || SFT) per sequence, rollouts")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"Demo world, our PPO: rollouts over training (mean over seeds, running mean of {window} "
                    "iterations)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(rows: list[dict]) -> str:
    """The default's per-seed table, then each beta's comparison at matched KL: TRL's mean point
    against ours at the same beta when the mean KLs are within 10%, else against our frontier (our
    per-beta means joined in KL order) read at TRL's KL."""
    rows = [r for r in rows if r["candidate"] in ("default", TRL)]
    betas = sorted({r["beta"] for r in rows})
    means = {}
    lines = ["| implementation | beta | final KL (per seed) | gold reward (per seed) | mean KL | mean gold | "
             "gold win rate (per seed) | min response length |", "|---|---|---|---|---|---|---|---|"]
    for beta in betas:
        for implementation in ("ours", "trl"):
            group = [r for r in rows if r["implementation"] == implementation and r["beta"] == beta]
            if not group:
                continue
            kls, golds = [r["kl"] for r in group], [r["gold_reward"] for r in group]
            means[implementation, beta] = (sum(kls) / len(kls), sum(golds) / len(golds))
            shortest = min((r["min_length"] for r in group if "min_length" in r), default=float("nan"))
            wins = " / ".join(f"{r['gold_win_rate']:.3f}" for r in group)
            lines.append(f"| {implementation} | {beta} | {' / '.join(f'{k:.2f}' for k in kls)} | "
                         f"{' / '.join(f'{g:.2f}' for g in golds)} | {means[implementation, beta][0]:.2f} | "
                         f"{means[implementation, beta][1]:.2f} | "
                         f"{wins} | {shortest:.1f} |")
    frontier = sorted(point for (implementation, _), point in means.items() if implementation == "ours")
    lines += ["", "| beta | TRL mean KL, gold | ours same beta: KL (ratio), gold | ours at TRL's KL | ours >= TRL |",
              "|---|---|---|---|---|"]
    for beta in betas:
        if ("trl", beta) not in means or ("ours", beta) not in means:
            continue
        (trl_kl, trl_gold), (our_kl, our_gold) = means["trl", beta], means["ours", beta]
        if abs(our_kl / trl_kl - 1) <= 0.1:
            ours_there, how = our_gold, "same beta, KL within 10%"
        elif frontier[0][0] <= trl_kl <= frontier[-1][0]:
            ours_there = float(np.interp(trl_kl, [k for k, _ in frontier], [g for _, g in frontier]))
            how = "our frontier, interpolated"
        else:
            ours_there, how = float("nan"), "outside our frontier"
        lines.append(f"| {beta} | {trl_kl:.2f}, {trl_gold:.2f} | {our_kl:.2f} ({our_kl / trl_kl:.2f}), {our_gold:.2f} "
                     f"| {ours_there:.2f} ({how}) | {'yes' if ours_there >= trl_gold else 'no'} |")
    return "\n".join(lines)


KL_SLACK = 1.1
"""A run reaches the target only with KL at most this multiple of TRL's mean final KL."""


def targets(rows: list[dict]) -> dict[float, dict[str, float]]:
    """Per beta, from TRL's runs: the gold reward to reach (its mean final), the KL cap, and its mean
    training time to its own final iteration."""
    out = {}
    for beta in sorted({r["beta"] for r in rows if r["candidate"] == TRL}):
        group = [r for r in rows if r["candidate"] == TRL and r["beta"] == beta]
        out[beta] = {"gold": float(np.mean([r["gold_reward"] for r in group])),
                     "kl_cap": KL_SLACK * abs(float(np.mean([r["kl"] for r in group]))),
                     "seconds": float(np.mean([r["train_seconds"] for r in group])), "seeds": len(group)}
    return out


def reached(run: dict, target: dict[str, float]) -> dict | None:
    """The first evaluation of `run` at or above the target gold reward within the KL cap, if any."""
    return next((point for point in run["evaluations"]
                 if point["gold_reward"] >= target["gold"] and point["kl"] <= target["kl_cap"]), None)


def collapsed(run: dict) -> bool:
    """The run ends below the SFT policy's gold reward, or its rollouts' mean response length fell by
    more than 40% within one iteration (ppo.warn_length_collapse's default)."""
    return run["gold_reward"] < run["gold_reward_sft"] or run.get("worst_length_drop", 0.0) > 0.4


def time_to_quality(rows: list[dict]) -> tuple[str, list[dict]]:
    """Per candidate and beta: training time and iterations to TRL's quality on each seed, the worst
    seed's ratio to TRL's mean training time, work per iteration; the summary rows behind the table."""
    goals, summary = targets(rows), []
    lines = ["| candidate | beta | target gold (KL cap) | time to target per seed, s (iteration) | "
             "worst seed / TRL's time | s per iteration | final gold, KL (mean) | collapsed |",
             "|---|---|---|---|---|---|---|---|"]
    for beta, goal in goals.items():
        for candidate in [TRL, *CANDIDATES]:
            group = sorted((r for r in rows if r["candidate"] == candidate and r["beta"] == beta),
                           key=lambda r: r["seed"])
            if not group:
                continue
            hits = [reached(r, goal) for r in group]
            ratios = [hit["seconds"] / goal["seconds"] if hit else float("inf") for hit in hits]
            per_iteration = float(np.mean([r["train_seconds"] / r["evaluations"][-1]["iteration"] for r in group]))
            row = {"candidate": candidate, "beta": beta, "seeds": [r["seed"] for r in group],
                   "seconds_to_target": [hit["seconds"] if hit else None for hit in hits],
                   "iterations_to_target": [hit["iteration"] if hit else None for hit in hits],
                   "worst_ratio": max(ratios), "seconds_per_iteration": per_iteration,
                   "final_gold": float(np.mean([r["gold_reward"] for r in group])),
                   "final_kl": float(np.mean([r["kl"] for r in group])),
                   "collapsed": sum(collapsed(r) for r in group)}
            summary.append(row)
            times = " / ".join(f"{hit['seconds']:.1f} ({hit['iteration']})" if hit else "never" for hit in hits)
            lines.append(f"| {candidate} | {beta} | {goal['gold']:.2f} ({goal['kl_cap']:.2f}) | {times} | "
                         f"{row['worst_ratio']:.2f} | {per_iteration:.2f} | {row['final_gold']:.2f}, "
                         f"{row['final_kl']:.2f} | {row['collapsed']} of {len(group)} |")
    return "\n".join(lines), summary


def time_png(rows: list[dict], path: Path) -> None:
    """Gold reward against training time, a panel per beta: each configuration's mean over seeds at
    each evaluation, TRL's beside them, the target and a third of TRL's time marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    goals = targets(rows)
    betas = sorted({r["beta"] for r in rows})
    figure, axes = plt.subplots(1, len(betas), figsize=(6.4 * len(betas), 4.6), squeeze=False)
    colors = plt.cm.tab20.colors  # one per candidate: the default cycle's ten repeat
    for axis, beta in zip(axes[0], betas, strict=True):
        for index, candidate in enumerate([TRL, *CANDIDATES]):
            group = [r for r in rows if r["candidate"] == candidate and r["beta"] == beta]
            if not group:
                continue
            points = min(len(r["evaluations"]) for r in group)
            seconds = [np.mean([r["evaluations"][i]["seconds"] for r in group]) for i in range(points)]
            gold = [np.mean([r["evaluations"][i]["gold_reward"] for r in group]) for i in range(points)]
            style = ({"color": "black", "linewidth": 2.5} if candidate == TRL
                     else {"color": colors[index % len(colors)], "linewidth": 1.2, "alpha": 0.9})
            axis.plot(seconds, gold, marker=".", label=candidate, **style)
        if beta in goals:
            axis.axhline(goals[beta]["gold"], color="gray", linestyle="--", linewidth=1)
            axis.axvline(goals[beta]["seconds"] / 3, color="gray", linestyle=":", linewidth=1)
        axis.set_title(f"beta {beta}: dashed, TRL's mean final gold; dotted, a third of TRL's time", fontsize=9)
        axis.set_xlabel("training time, s (evaluations excluded)")
        axis.set_ylabel("gold reward, held-out prompts (mean over seeds)")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_results(path: Path, config: str, overrides: dict, rows: list[dict], seconds: float) -> None:
    """The results so far, replaced whole (a run that stops keeps every finished row)."""
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"config": config, "overrides": overrides, "rows": rows,
                                     "differences": DIFFERENCES, "seconds": seconds}, indent=1))
    temporary.replace(path)


def print_and_draw(rows: list[dict], stem: Path) -> dict:
    table, summary = time_to_quality(rows)
    print(report(rows) + "\n\nTime to TRL's quality (training time only):\n" + table
          + "\n\nDifferences between the two setups that remain:\n" + "\n".join(f"- {d}" for d in DIFFERENCES))
    default = [r for r in rows if r["candidate"] in ("default", TRL)]
    frontier_png(default, stem.with_suffix(".png"))
    overoptimization_png(default, stem.with_name(f"{stem.name}-overoptimization.png"))
    time_png(rows, stem.with_name(f"{stem.name}-time.png"))
    return {"targets": targets(rows), "time_to_quality": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--reference", default=str(REPO / ".bench-venv" / "bin" / "python"),
                        help="python of the environment with TRL 1.12.0; 'none' runs ours only")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--eval-every", type=int, default=5, help="iterations between evaluations of every run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (YAML value)")
    parser.add_argument("--state", default=str(REPO / ".rlhf" / "bench-quality"))
    parser.add_argument("--results", default=str(REPO / "bench" / "results"))
    parser.add_argument("--report", metavar="JSON", help="print the tables of an earlier run's results and redraw "
                        "its PNGs beside it, without training")
    parser.add_argument("--name", default=f"quality-{datetime.date.today().isoformat()}",
                        help="file name (no suffix) of the results JSON and PNGs")
    parser.add_argument("--resume", action="store_true", help="keep the finished runs in the results JSON of this "
                        "name and run only the others")
    args = parser.parse_args(argv)
    if args.report:
        print_and_draw(json.loads(Path(args.report).read_text())["rows"], Path(args.report).with_suffix(""))
        return 0
    import yaml

    from rlhf.config import load_config
    from rlhf.demo.world import build_world
    from schemas.validate import LengthBudget, load_validated
    from stages.runtime.models import load_tokenizer, set_determinism

    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    cfg = load_config(args.config, overrides)
    threads = cfg.num_threads or 2
    set_determinism(cfg.deterministic, threads)
    state, results = Path(args.state), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = results / args.name
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"] if args.resume else []
    finished = {(r["candidate"], r["beta"], r["seed"]) for r in rows}
    world = build_world(state / "worlds", cfg.demo)
    started = time.perf_counter()
    sft_folder, reward_folder = train_upstream(cfg, world, state)
    tokenizer = load_tokenizer(str(sft_folder))
    budget = LengthBudget(cfg.ppo.max_prompt_length, cfg.ppo.max_prompt_length + cfg.ppo.sampling.response_length)
    prompts = load_validated(str(world / "prompts.jsonl"), "prompt", tokenizer=tokenizer, budget=budget).frame
    eval_prompts = load_validated(str(world / "prompts_eval.jsonl"), "prompt", tokenizer=tokenizer, budget=budget).frame
    prompts_file = state / "prompts.jsonl"
    prompts.to_json(prompts_file, orient="records", lines=True)
    print(f"quality benchmark: {args.config}; upstream ready after {time.perf_counter() - started:.0f} s; "
          f"{cfg.ppo.num_iterations} iterations x {cfg.ppo.rollout_batch_size} episodes x "
          f"{cfg.ppo.sampling.response_length} "
          f"tokens; evaluated every {args.eval_every}; betas {args.betas}; seeds {args.seeds}", flush=True)

    def fixed(settings: dict, beta: float, seed: int):
        """The PPO section a run trains with: the candidate's settings, beta fixed, evaluated every `eval_every`."""
        run = {"kl.init_coef": beta, "kl.target": None, "seed": seed, "checkpoint_every": 10_000,
               "evaluation.every": args.eval_every}
        return load_config(args.config, overrides | {f"ppo.{k}": v for k, v in (settings | run).items()}).ppo

    judge = None
    runs = [(TRL, beta, seed) for beta in args.betas for seed in args.seeds if args.reference != "none"]
    runs += [(candidate, beta, seed) for candidate in args.candidates for beta in args.betas for seed in args.seeds]
    for candidate, beta, seed in runs:
        if (candidate, beta, seed) in finished:
            continue
        ppo_cfg = fixed({} if candidate == TRL else CANDIDATES[candidate], beta, seed)
        clock = time.perf_counter()
        if candidate == TRL:
            judge = judge or Judge(sft_folder, reward_folder, eval_prompts, ppo_cfg)
            out, trained = run_trl(args.reference, sft_folder, scaled_reward_model(reward_folder, state), prompts_file,
                                   ppo_cfg, beta, seed, threads, state / f"trl-b{beta}-s{seed}")
            folders = {i: out / f"iteration-{i}" for i in trained
                       if i % ppo_cfg.evaluation.every == 0 and i < ppo_cfg.num_iterations}
            folders[ppo_cfg.num_iterations] = out
            tables = {i: judge(folder) for i, folder in sorted(folders.items())}
            shape = {"train_seconds": trained[ppo_cfg.num_iterations],
                     "evaluations": [gold_point(table, i, trained[i]) for i, table in tables.items()]}
            final = tables[ppo_cfg.num_iterations]
        else:
            out = state / f"ours-{candidate.replace(' ', '-').replace(',', '')}-b{beta}-s{seed}"
            _, shape = run_ours(ppo_cfg, sft_folder, reward_folder, prompts, eval_prompts, out)
            final = shape.pop("final_table")
        seconds = time.perf_counter() - clock
        figures = final_figures(final)
        row = {"implementation": "trl" if candidate == TRL else "ours", "candidate": candidate,
               "settings": {} if candidate == TRL else CANDIDATES[candidate], "beta": beta, "seed": seed,
               **figures, "wall_seconds": seconds, **shape}
        rows.append(row)
        write_results(stem.with_suffix(".json"), args.config, overrides, rows, time.perf_counter() - started)
        print(f"  {candidate:>36} beta {beta:<5} seed {seed}: KL {row['kl']:6.2f}  gold {row['gold_reward']:5.2f} "
              f"(SFT {row['gold_reward_sft']:.2f})  gold win {row['gold_win_rate']:.3f} ± {row['gold_win_rate_se']:.3f}"
              f"  training {row['train_seconds']:.1f} s ({seconds:.0f} s in all)", flush=True)

    summary = print_and_draw(rows, stem)
    write_results(stem.with_suffix(".json"), args.config, overrides, rows, time.perf_counter() - started)
    stem.with_name(f"{stem.name}-time-to-quality.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {stem.with_suffix('.json')}, its -time-to-quality.json summary, and PNGs: "
          f"{stem.name}.png (frontier), "
          f"{stem.name}-overoptimization.png, {stem.name}-time.png, in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
