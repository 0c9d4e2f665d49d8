"""Method comparison: the RL stage's advantage estimators, and DPO, on the demo world, from the
same SFT (and reward) checkpoints, prompts and response budget.

    python -m bench.methods                 (or: make bench-methods)
    python -m bench.methods --methods "ppo (gae)" "ppo (gae), reward-lora critic" --seeds 0 1 2 --tag critics
    python -m bench.methods --methods "ppo (gae)" --freeze embed norm --trace --seeds 0 1 2   (a diagnosis)

`--trace` keeps each iteration's figures and the policy's weight change by part (embeddings,
attention, MLP, norms, output head); `--freeze` trains the policy with some of its parameters held
(full fine-tuning without the embeddings and norms reproduced the LoRA policy's failure:
docs/performance.md, "2026-11-25: why a LoRA policy learned little").

1. SFT and reward checkpoints are trained once with the demo config's sections (`bench.quality`).
2. Each method runs the demo config's PPO section with its own settings (`METHODS`: the estimator,
   responses per prompt), in a process of its own, so its wall time and peak memory are its own.
   Every RL method samples the same number of responses per iteration (`rollout_batch_size`) for
   the same number of iterations. DPO runs the config's `dpo` section on the preference pairs
   (no reward model, no sampling while training); its wall time includes its evaluation.
   `--seeds` runs each method once per training seed (`ppo.seed`, `dpo.seed`).
3. Each final policy is judged as the flow judges it: the stage's own evaluation against the SFT
   baseline responses on the held-out prompts (common random numbers), then the demo world's gold
   function: gold win rate against SFT with its standard error, and KL to SFT per sequence.
4. Memory: the process's peak RSS, and for the RL methods the bytes of the tensors the run holds
   after its first optimizer step, counted from the tensors as `bench.scale` counts them (every
   model's parameters once, the trained ones' gradients, AdamW's state).

It prints a Markdown table and writes `bench/results/methods-<date>[-<tag>].json`. A benchmark,
not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GRPO = {"advantage_estimator": "grpo", "samples_per_prompt": 4, "kl.init_coef": 0.2}
RULE_ALONE = {**GRPO, "reward": {"terms": [{"name": "on_subject", "function": "rlhf.demo.rewards:names_the_subject"}]}}
SERVED = "http://served.reward.model/score"
"""A remote term's URL that `run_one` replaces with `rlhf serve-reward`'s, serving the bench's own reward checkpoint."""

METHODS: dict[str, dict] = {
    "ppo (gae)": {"advantage_estimator": "gae"},
    # GRPO's beta weighs a k3 loss term averaged over tokens, not a penalty summed into each return:
    # the same KL takes a larger beta (demo sweep, KL to SFT: 0.05 -> 25.4, 0.1 -> 17.2, 0.2 -> 4.75, 0.3 -> 1.85).
    "grpo": GRPO,
    # The same reward checkpoint served over HTTP (`rlhf serve-reward`) as a remote `score` term: no reward model in
    # the trainer's process (issue 65: the same gold win rate as "grpo", within the evaluation's noise).
    "grpo, served reward model": {**GRPO, "reward": {"terms": [{"name": "served", "remote": {"url": SERVED}}]}},
    "rloo": {"advantage_estimator": "rloo", "samples_per_prompt": 4},
    "reinforce++": {"advantage_estimator": "reinforce++"},
    "reinforce++-baseline": {"advantage_estimator": "reinforce++-baseline", "samples_per_prompt": 4},
    "dpo": {},
    # The critic as LoRA adapters and a value head on the reward model the scorer holds (one copy of it, not two).
    "ppo (gae), reward-lora critic": {"advantage_estimator": "gae", "critic.kind": "reward-lora"},
    # LoRA on the policy (the defaults: rank 8 on every linear layer and the output head): its own weights are the
    # reference.
    "ppo (gae), lora policy": {"advantage_estimator": "gae", "lora": {}},
    "ppo (gae), lora policy r1": {"advantage_estimator": "gae", "lora": {"r": 1}},
    "ppo (gae), lora policy without head adapters": {"advantage_estimator": "gae", "lora": {"output_layer": False}},
    "ppo (gae), lora policy, reward-lora critic": {"advantage_estimator": "gae", "lora": {},
                                                   "critic.kind": "reward-lora"},
    # The reward model plus a rule written from the prompts alone (rlhf.demo.rewards): -1 for not naming the asked
    # subject.
    "ppo (gae), reward model + on-subject rule": {"advantage_estimator": "gae", "reward": {"terms": [
        {"name": "reward_model"}, {"name": "on_subject", "function": "rlhf.demo.rewards:names_the_subject",
                                   "weight": 0.5}]}},
    # No reward model: the same rule alone, the score a GRPO group compares (`stages: [sft, ppo]`).
    "grpo, on-subject rule alone": RULE_ALONE,
    # The policy-loss options (docs/methods.md): each on GRPO beside the plain row.
    "grpo, clip-higher": {**GRPO, "clip_range": [0.1, 0.14]},  # 1.4x the demo's clip 0.1 below, as DAPO's 0.28 to 0.2
    "grpo, seq-mean-token-mean": {**GRPO, "loss_aggregation": "seq-mean-token-mean"},
    "grpo, dr. grpo": {**GRPO, "loss_aggregation": "seq-mean-token-sum-norm", "group_normalization": "mean"},
    "grpo, batch-normalized (no group std)": {**GRPO, "group_normalization": "batch"},
    "grpo, gspo": {**GRPO, "ratio_level": "sequence", "loss_aggregation": "seq-mean-token-mean",
                   "clip_range": [3e-4, 4e-4]},  # GSPO's paper's sequence-level clip
    "grpo, truncated masked": {**GRPO, "mask_truncated_responses": True},
    # Dynamic sampling matters where groups tie: the on-subject rule alone scores 1, 0 or -1.
    "grpo, on-subject rule alone, dynamic sampling": {**RULE_ALONE, "dynamic_sampling": {"max_rounds": 4}},
    "grpo, on-subject rule alone, dapo": {**RULE_ALONE, "clip_range": [0.1, 0.14],
                                          "dynamic_sampling": {"max_rounds": 4}, "mask_truncated_responses": True,
                                          "reward": {**RULE_ALONE["reward"], "overlong": {"buffer": 6}}},
}
"""Each method's settings on top of its config section (`ppo`; `dpo` for DPO)."""


TRACED = ("rollout/kl", "rollout/score", "train/grad_norm", "train/clip_fraction", "train/approx_kl",
          "train/ratio_max", "train/entropy", "train/kl_coef")
"""The per-iteration figures `--trace` keeps (besides the policy's weight change)."""


def _part(name: str) -> str:
    """The part of a decoder a weight belongs to, for the weight change by part."""
    for part, keys in (("embeddings", ("embed",)), ("output head", ("lm_head",)), ("norms", ("norm",)),
                       ("attention", ("q_proj", "k_proj", "v_proj", "o_proj", "attn")),
                       ("mlp", ("gate_proj", "up_proj", "down_proj", "mlp"))):
        if any(key in name for key in keys):
            return part
    return "other"


def policy_change(policy, initial: dict) -> dict[str, float]:
    """‖W - W_sft‖_F of the policy's weights summed in quadrature by part, and relative to ‖W_sft‖:
    for a LoRA policy the merged adapters' delta (scale * B @ A), else the trained weights' change."""
    import torch
    from peft.tuners.lora import LoraLayer

    squares: dict[str, float] = {}
    with torch.no_grad():
        adapted = {name: module for name, module in policy.named_modules() if isinstance(module, LoraLayer)}
        if adapted:
            deltas = {name: module.get_delta_weight(module.active_adapters[0]) for name, module in adapted.items()}
        else:
            deltas = {name: p.detach().float() - initial[name] for name, p in policy.named_parameters()}
        for name, delta in deltas.items():
            squares[_part(name)] = squares.get(_part(name), 0.0) + delta.float().pow(2).sum().item()
        base = sum(w.pow(2).sum().item() for w in initial.values())
    change = {f"delta_norm/{part}": value ** 0.5 for part, value in squares.items()}
    return change | {"delta_norm/relative": (sum(squares.values()) / base) ** 0.5}


def run_one(config: str, method: str, settings: dict, state: Path, overrides: dict | None = None,
            trace: bool = False, freeze: tuple[str, ...] = ()) -> dict:
    """One method's PPO run (`settings`: `ppo` fields; `overrides`: dotted keys of the whole config)
    and its judgement, in this process: the row of the table. `trace`: the row also holds each
    iteration's `TRACED` figures and the policy's weight change (`policy_change`). `freeze`: the
    policy's parameters whose names hold one of these stay as they are (a diagnosis, not a setting)."""
    import torch

    import stages.ppo
    from bench.quality import UPSTREAM_METRICS, train_upstream
    from bench.scale import held_bytes
    from rlhf.config import load_config, with_overrides
    from rlhf.demo.world import build_world, judge_evaluation
    from schemas.validate import LengthBudget, load_validated
    from stages.common.reporting import Reporting
    from stages.dpo import DPOInputs, train_dpo
    from stages.ppo import PPOInputs, train_ppo
    from stages.runtime.models import load_tokenizer, set_determinism

    section = "dpo" if method == "dpo" else "ppo"
    cfg = load_config(config, (overrides or {}) | {f"{section}.{key}": value for key, value in settings.items()})
    set_determinism(cfg.deterministic, cfg.num_threads or 2)
    world = build_world(state / "worlds", cfg.demo)
    sft_folder, reward_folder = train_upstream(cfg, world, state)
    if served := [t for t in cfg.ppo.reward.remotes if t.remote.url == SERVED]:
        url = served_reward(reward_folder)
        cfg = with_overrides(cfg, {"ppo.reward.terms": [t.model_dump() | ({"remote": t.remote.model_dump() | {
            "url": url}} if t in served else {}) for t in cfg.ppo.reward.terms]})
    tokenizer = load_tokenizer(str(sft_folder))
    budget = LengthBudget(cfg.ppo.max_prompt_length, cfg.ppo.max_prompt_length + cfg.ppo.sampling.response_length)
    prompts, eval_prompts = (load_validated(str(world / f"{name}.jsonl"), "prompt", tokenizer=tokenizer,
                                            budget=budget).frame for name in ("prompts", "prompts_eval"))
    out = state / method.replace(" ", "-").replace("(", "").replace(")", "").replace(",", "")
    shutil.rmtree(out, ignore_errors=True)  # a finished run's state there would be resumed, whatever its settings
    held, real_update = {}, stages.ppo.ppo_update
    initial, changes, iterations = {}, [], {}

    def ppo_update(trainer, *args, **kwargs):
        if trace and not initial:
            initial.update({name: p.detach().float().clone() for name, p in trainer.models.policy.named_parameters()
                            if "lora_" not in name})  # the SFT weights
        figures = real_update(trainer, *args, **kwargs)
        if not held:  # after the first optimizer step: AdamW's state exists
            held.update(held_bytes(trainer.models, trainer.optimizer))
        if trace:
            changes.append(policy_change(trainer.models.policy, initial))
        return figures

    def metrics(figures: dict, step: int) -> None:
        iterations.setdefault(step, {}).update({k: v for k, v in figures.items() if k in TRACED})

    stages.ppo.ppo_update = ppo_update
    real_build = stages.ppo.build_learner

    def build_learner(cfg, inputs):
        trainer = real_build(cfg, inputs)
        for name, parameter in trainer.models.policy.named_parameters():
            if any(part in name for part in freeze):
                parameter.requires_grad_(False)  # no gradient: AdamW steps over it
        return trainer

    stages.ppo.build_learner = build_learner
    clock = time.perf_counter()
    if method == "dpo":
        pairs = [load_validated(str(world / f"{name}.jsonl"), "preference", tokenizer=tokenizer,
                                budget=LengthBudget(cfg.dpo.max_prompt_length, cfg.dpo.max_length)).frame
                 for name in ("preferences", "preferences_eval")]
        result = train_dpo(cfg.dpo, DPOInputs(str(sft_folder), *pairs, eval_prompts), out)
    else:
        result = train_ppo(with_overrides(cfg.ppo, {"evaluation.every": None}),
                           PPOInputs(sft_location=str(sft_folder), reward_location=str(reward_folder),
                                     prompts=prompts, eval_prompts=eval_prompts), out,
                           Reporting(metrics=metrics))
    seconds = time.perf_counter() - clock
    table = result.evaluation
    gold = judge_evaluation(table)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"method": method, "settings": settings, **({"frozen": list(freeze)} if freeze else {}),
            "seed": getattr(cfg, section).seed, "seconds": seconds,
            "peak_memory_bytes": peak,
            "memory_kind": "cuda allocated" if torch.cuda.is_available() else "process max RSS",
            **held, "held_bytes": sum(held.values()) if held else None,
            "kl_budget": getattr(cfg, section).evaluation.kl_budget, **result.metrics, **gold,
            **({"trace": [iterations.get(i + 1, {}) | change for i, change in enumerate(changes)]} if trace else {}),
            **({"upstream": json.loads((state / UPSTREAM_METRICS).read_text())}
               if (state / UPSTREAM_METRICS).exists() else {})}


def served_reward(folder: Path) -> str:
    """`rlhf serve-reward` on `folder`, for as long as this process lives: its scoring URL."""
    import atexit
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-reward", "--checkpoint", str(folder),
                               "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(server.terminate)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return f"http://127.0.0.1:{port}/score"
        except httpx.HTTPError:
            time.sleep(0.5)
    sys.exit(f"rlhf serve-reward on {folder} did not answer (exit code {server.poll()})")


def table_of(rows: list[dict]) -> str:
    lines = ["| method | seed | gold win rate vs SFT | KL to SFT (budget) | reward-model win rate | wall time | "
             "held tensors | peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        judged_by_rm = (f"{r['eval/win_rate_rm']:.3f}" if "eval/win_rate_rm" in r else
                        f"(no reward model; by its functions {r['eval/win_rate_reward']:.3f})"
                        if "eval/win_rate_reward" in r else "(no reward model)")
        held = f"{r['held_bytes'] / 2**20:.2f} MiB" if r.get("held_bytes") else "-"
        lines.append(f"| {r['method']} | {r.get('seed', '')} | {r['eval/gold_win_rate']:.3f} ± "
                     f"{r['eval/gold_win_rate_se']:.3f} | {r['eval/kl']:.2f} ({r['kl_budget']:g}) | {judged_by_rm} | "
                     f"{r['seconds']:.0f} s | {held} | {r['peak_memory_bytes'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--state", default=str(REPO / ".rlhf" / "bench-quality"))
    parser.add_argument("--results", default=str(REPO / "bench" / "results"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a `ppo` field for every method (YAML value), after the method's own settings")
    parser.add_argument("--config-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted key of the whole config (YAML value), e.g. demo.num_heads=2; use a --state "
                             "of its own when it changes the demo world or the SFT and reward sections")
    parser.add_argument("--seeds", nargs="+", type=int, default=[None], metavar="SEED",
                        help="run each method once per training seed (default: the config's)")
    parser.add_argument("--tag", help="results file methods-<date>-<tag>.json")
    parser.add_argument("--trace", action="store_true",
                        help="keep each iteration's figures and the policy's weight change by part in the results")
    parser.add_argument("--freeze", nargs="+", default=[], metavar="PART",
                        help="diagnosis: keep the policy's parameters whose names hold PART as they are "
                             "(e.g. embed norm)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this method, print its row as JSON
    args = parser.parse_args(argv)
    state = Path(args.state)
    if args.one:
        import yaml

        extra = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
        overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.config_set)}
        print(json.dumps(run_one(args.config, args.one, METHODS[args.one] | extra, state, overrides, args.trace,
                                 tuple(args.freeze))))
        return 0
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            seeded = [] if seed is None else [f"--set=seed={seed}"]
            done = subprocess.run([sys.executable, "-m", "bench.methods", "--config", args.config,
                                   "--state", str(state),
                                   "--one", method, *(f"--set={item}" for item in args.set), *seeded,
                                   *(["--trace"] if args.trace else []),
                                   *(["--freeze", *args.freeze] if args.freeze else []),
                                   *(f"--config-set={item}" for item in args.config_set)],
                                  capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                sys.exit(f"{method} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(table_of(rows[-1:]).splitlines()[-1], flush=True)
    print("\n" + table_of(rows))
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"methods-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps({"config": args.config, "rows": rows}, indent=1))
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
