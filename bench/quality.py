"""Learning-quality benchmark: the KL - gold-reward frontier of our PPO against TRL 1.12's
PPOTrainer on the demo world, from identical checkpoints, prompts and work per iteration.

    python -m bench.quality --reference .bench-venv/bin/python      (or: make bench-quality)

1. SFT and reward checkpoints are trained once with the demo config's sections (kept in --state).
2. For every fixed KL coefficient beta and training seed, each implementation runs the demo
   config's PPO work (episodes, response length, epochs, minibatches, learning rate, temperature)
   from those checkpoints and saves its final policy. Ours runs as configured (`target_kl` off,
   so beta stays fixed); TRL runs in its own environment (bench/trl_quality.py).
3. One evaluation judges every final policy: `stages.ppo.evaluate` against the SFT reference on
   the held-out prompts, its SFT baseline sampled with common random numbers (the same responses
   for every run), then the demo world's gold function: gold reward, gold win rate against SFT
   with its standard error over prompts, and KL to SFT per sequence.

It prints the table, writes `bench/results/quality-<date>.json` and a PNG of the frontier beside
it. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
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
    "Critic: ours as configured (`critic`, `normalize_critic` columns: by default the reward model with the refitted "
    "gain and bias applied to its head); TRL's value model is the same gain-scaled reward model, without a bias.",
    "Optimiser: ours clips the gradient norm at 1.0 and uses AdamW eps 1e-5 (ppo.max_grad_norm; CleanRL's and "
    "OpenAI's PPO eps); TRL's PPOTrainer does not clip and uses eps 1e-8. Both decay the learning rate linearly "
    "to 0, ours per optimiser step, TRL per iteration.",
    "Sampling noise: each implementation draws its own samples from its own seed; the evaluation shares them.",
]


def train_upstream(cfg, world: Path, state: Path) -> tuple[Path, Path]:
    """SFT and reward checkpoints from the config's sections, trained once and kept."""
    from schemas.validate import LengthBudget, load_validated
    from stages.models import load_tokenizer
    from stages.reward import RewardInputs, train_reward
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
    train_reward(cfg.reward, RewardInputs(str(sft.checkpoint), str(sft.checkpoint),
                                          data(cfg.reward, "preferences", "preference"),
                                          data(cfg.reward, "preferences_eval", "preference"),
                                          data(cfg.reward, "prompts_eval", "prompt")), state / "reward")
    return sft_folder, reward_folder


def scaled_reward_model(reward_folder: Path, state: Path) -> Path:
    """The reward model with its score head multiplied by the stored normalisation gain, for TRL."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from stages.reward import NORMALIZATION_KEY

    folder = state / "reward-scaled"
    if not (folder / "config.json").exists():
        model = AutoModelForSequenceClassification.from_pretrained(reward_folder, num_labels=1)
        model.score.weight.data *= getattr(model.config, NORMALIZATION_KEY)["gain"]
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(reward_folder).save_pretrained(folder)
    return folder


def judge(policy_folder: Path, sft_folder: Path, reward_folder: Path, eval_prompts, ppo_cfg) -> dict[str, float]:
    """The one evaluation every final policy gets (common random numbers for the SFT baseline)."""
    import torch
    from safetensors.torch import load_file

    from rlhf.demo_world import gold_comparison, last_user_turns
    from stages.ppo import HeldOut, evaluate, load_models

    models = load_models(ppo_cfg, str(sft_folder), str(reward_folder))
    held_out = HeldOut.sample(models, eval_prompts, ppo_cfg, torch.device("cpu"))
    weights = load_file(str(policy_folder / "model.safetensors"))
    missing, unexpected = models.policy.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # only a tied head may be absent from the file
        raise ValueError(f"{policy_folder} does not fit the SFT model: missing {missing}, unexpected {unexpected}")
    metrics, table = evaluate(models, held_out, ppo_cfg)
    return metrics | gold_comparison(last_user_turns(table["prompt_messages"]), list(table["policy_response"]),
                                     list(table["sft_response"]))


def run_ours(ppo_cfg, sft_folder: Path, reward_folder: Path, prompts, eval_prompts, out: Path) -> tuple[Path, dict]:
    """Our PPO as configured; besides its policy, the shape of its run: response lengths, and the
    proxy score, gold reward and KL of every iteration's rollouts (the over-optimisation curve)."""
    from rlhf.demo_world import mean_gold_reward
    from stages.ppo import PPOInputs, train_ppo
    from stages.reporting import Reporting

    shutil.rmtree(out, ignore_errors=True)  # a finished run's state there would be resumed, whatever its config
    gold = {}
    reporting = Reporting(rollouts=lambda table, i: gold.update({i: mean_gold_reward(list(table["prompt_messages"]),
                                                                                list(table["response"]))}))
    result = train_ppo(ppo_cfg, PPOInputs(str(sft_folder), str(reward_folder), prompts, eval_prompts.head(4)), out,
                       reporting)
    lengths = [row["rollout/response_length"] for row in result.history]
    worst_drop = max((a - b) / a for a, b in zip(lengths, lengths[1:]))
    curve = [{"iteration": row["iteration"], "kl": row["rollout/kl"], "proxy": row["rollout/score"],
              "gold": gold[row["iteration"]]} for row in result.history]
    return result.checkpoint, {"first_length": lengths[0], "min_length": min(lengths), "worst_length_drop": worst_drop,
                               "curve": curve}


def run_trl(reference: str, sft_folder: Path, reward_folder: Path, prompts_file: Path, ppo_cfg, beta: float, seed: int,
            threads: int, out: Path) -> Path:
    settings = {"episodes": ppo_cfg.rollout_batch_size, "iterations": ppo_cfg.num_iterations,
                "response_length": ppo_cfg.response_length, "ppo_epochs": ppo_cfg.num_ppo_epochs,
                "minibatches": ppo_cfg.num_minibatches, "learning_rate": ppo_cfg.learning_rate,
                "temperature": ppo_cfg.temperature, "kl_coef": beta, "seed": seed, "threads": threads,
                "vf_coef": ppo_cfg.vf_coef, "cliprange": ppo_cfg.clip_range, "cliprange_value": ppo_cfg.clip_range_value,
                "gamma": ppo_cfg.gamma, "lam": ppo_cfg.lam, "missing_eos_penalty": -(ppo_cfg.missing_eos_score or 0.0)}
    command = [reference, str(REPO / "bench" / "trl_quality.py"), "--policy", str(sft_folder), "--reward",
               str(reward_folder), "--prompts", str(prompts_file), "--out", str(out), "--settings", json.dumps(settings)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"TRL run failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return out


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
    """The per-seed table, then each beta's comparison at matched KL: TRL's mean point against ours
    at the same beta when the mean KLs are within 10%, else against our frontier (our per-beta
    means joined in KL order) read at TRL's KL."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--reference", default=str(REPO / ".bench-venv" / "bin" / "python"),
                        help="python of the environment with TRL 1.12.0; 'none' runs ours only")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.02, 0.05, 0.2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (YAML value)")
    parser.add_argument("--state", default=str(REPO / ".rlhf" / "bench-quality"))
    parser.add_argument("--results", default=str(REPO / "bench" / "results"))
    parser.add_argument("--report", metavar="JSON", help="print the tables of an earlier run's results and redraw "
                        "its PNGs beside it, without training")
    parser.add_argument("--name", default=f"quality-{datetime.date.today().isoformat()}",
                        help="file name (no suffix) of the results JSON and PNGs")
    args = parser.parse_args(argv)
    if args.report:
        stem = Path(args.report).with_suffix("")
        rows = json.loads(Path(args.report).read_text())["rows"]
        print(report(rows) + "\n\nDifferences between the two setups that remain:\n"
              + "\n".join(f"- {d}" for d in DIFFERENCES))
        frontier_png(rows, stem.with_suffix(".png"))
        overoptimization_png(rows, stem.with_name(f"{stem.name}-overoptimization.png"))
        return 0
    import yaml

    from rlhf.config import load_config
    from rlhf.demo_world import build_world
    from schemas.validate import LengthBudget, load_validated
    from stages.models import load_tokenizer, set_determinism

    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    cfg = load_config(args.config, overrides)
    threads = cfg.num_threads or 2
    set_determinism(cfg.deterministic, threads)
    state = Path(args.state)
    world = build_world(state / "worlds", cfg.demo)
    started = time.perf_counter()
    sft_folder, reward_folder = train_upstream(cfg, world, state)
    tokenizer = load_tokenizer(str(sft_folder))
    budget = LengthBudget(cfg.ppo.max_prompt_length, cfg.ppo.max_prompt_length + cfg.ppo.response_length)
    prompts = load_validated(str(world / "prompts.jsonl"), "prompt", tokenizer=tokenizer, budget=budget).frame
    eval_prompts = load_validated(str(world / "prompts_eval.jsonl"), "prompt", tokenizer=tokenizer, budget=budget).frame
    prompts_file = state / "prompts.jsonl"
    prompts.to_json(prompts_file, orient="records", lines=True)
    print(f"quality benchmark: {args.config}; upstream ready after {time.perf_counter() - started:.0f} s; "
          f"{cfg.ppo.num_iterations} iterations x {cfg.ppo.rollout_batch_size} episodes x {cfg.ppo.response_length} "
          f"tokens; critic {cfg.ppo.critic}; betas {args.betas}; seeds {args.seeds}", flush=True)

    rows = []
    for beta in args.betas:
        for seed in args.seeds:
            ppo_cfg = cfg.ppo.model_copy(update={"init_kl_coef": beta, "target_kl": None, "seed": seed,
                                                 "checkpoint_every": 10_000, "sample_every": 10_000})
            runs = {}
            clock = time.perf_counter()
            folder, shape = run_ours(ppo_cfg, sft_folder, reward_folder, prompts, eval_prompts,
                                     state / f"ours-b{beta}-s{seed}")
            runs["ours"] = (folder, shape, time.perf_counter() - clock)
            if args.reference != "none":
                clock = time.perf_counter()
                folder = run_trl(args.reference, sft_folder, scaled_reward_model(reward_folder, state), prompts_file,
                                 ppo_cfg, beta, seed, threads, state / f"trl-b{beta}-s{seed}")
                runs["trl"] = (folder, {}, time.perf_counter() - clock)
            for implementation, (folder, shape, seconds) in runs.items():
                figures = judge(folder, sft_folder, reward_folder, eval_prompts, ppo_cfg)
                row = {"implementation": implementation, "beta": beta, "seed": seed, "critic": cfg.ppo.critic,
                       "normalize_critic": cfg.ppo.normalize_critic,
                       "kl": figures["eval/kl"], "gold_reward": figures["eval/gold_reward"],
                       "gold_reward_sft": figures["eval/gold_reward_sft"], "gold_win_rate": figures["eval/gold_win_rate"],
                       "gold_win_rate_se": figures["eval/gold_win_rate_se"], "win_rate_rm": figures["eval/win_rate_rm"],
                       "response_length": figures["eval/response_length"], "train_seconds": seconds, **shape}
                rows.append(row)
                print(f"  {implementation:>4} beta {beta:<5} seed {seed}: KL {row['kl']:6.2f}  gold {row['gold_reward']:5.2f} "
                      f"(SFT {row['gold_reward_sft']:.2f})  gold win {row['gold_win_rate']:.3f} ± {row['gold_win_rate_se']:.3f}  "
                      f"length {row['response_length']:.1f}  {seconds:.0f} s", flush=True)

    print(report(rows))
    print("\nDifferences between the two setups that remain:\n" + "\n".join(f"- {d}" for d in DIFFERENCES))
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = results / args.name
    stem.with_suffix(".json").write_text(json.dumps({"config": args.config, "overrides": overrides, "rows": rows,
                                                      "differences": DIFFERENCES,
                                                      "seconds": time.perf_counter() - started}, indent=1))
    frontier_png(rows, stem.with_suffix(".png"))
    overoptimization_png(rows, stem.with_name(f"{stem.name}-overoptimization.png"))
    print(f"\nwrote {stem.with_suffix('.json')}, {stem.with_suffix('.png')} (frontier) and "
          f"{stem.name}-overoptimization.png in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
