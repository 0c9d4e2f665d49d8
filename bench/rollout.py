"""Rollout engines: sampling throughput and whole PPO iterations, transformers against vLLM.

    python -m bench.rollout                (or: make bench-rollout; needs `make vllm-env`)

1. Sampling: the same prompts (the demo world's, `--prompts` of them) answered with `--new-tokens`
   new tokens each at temperature 1, by
     - `hf`: `HFSampler` as PPO samples (its KV-cached decode loop, keeping log-probs),
     - `hf generate`: transformers' `generate` (`HFSampler` without log-probs),
     - `vllm`: `VLLMSampler`, a vLLM server from `.vllm-venv` spoken to over HTTP as PPO does;
   on two models: the demo world's (2 heads of 32, which vLLM's CPU build serves) and a ~100M
   Llama built from config (`bench.scale.build_checkpoint`: hidden 768, 16 layers, random
   weights). Tokens/s counts the tokens generated (up to and including an end token) over the
   wall time of the call; the mean of `--repeats` calls after one warm-up call. vLLM's start (a
   new server, loading the model) is reported apart.
2. PPO: whole iterations of the PPO stage on the ~100M model (`WORK`: four models, the critic
   from the reward checkpoint) as each of `--ppo-variants` (`PPO_VARIANTS`: `hf`, `vllm`, and
   `vllm-ahead`, `ppo.rollout.max_staleness: 1`), each in a process of its own; the split per
   iteration (sampling, the trainer's waits for it, the trainer's forward passes, scoring, the
   update, the weight sync) as means over the iterations after the first, and the share of the
   server's sampling hidden behind the trainer's work. The server's start is part of the stage
   but not of an iteration; it is reported apart.

Prints Markdown tables and writes `bench/results/rollout-<date>[-<tag>].json`. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WORK = {"sampling.response_length": 64, "rollout_batch_size": 32, "num_iterations": 4, "num_ppo_epochs": 1,
        "num_minibatches": 1, "evaluation.every": None, "evaluation.samples_per_prompt": 1, "checkpoint_every": 100,
        "critic.kind": "reward", "missing_eos_score": None, "precision": "fp32", "micro_batch_size": None,
        "sampling.micro_batch_size": None, "max_prompt_length": 32}
"""The PPO work of each engine: 32 responses per iteration (of up to `--ppo-response-lengths` tokens), one
optimizer step."""


def sampling_rows(model: str, name: str, prompts: list[str], new_tokens: int, repeats: int) -> list[dict]:
    """Tokens/s of each engine on `model`'s folder (this process; vLLM in its own server)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.sections.base import VLLMConfig
    from stages.common.tensors import response_mask
    from stages.engines.sampler import HFSampler, Sampling
    from stages.engines.vllm_server import VLLMSampler
    from stages.runtime.models import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    stop_ids = stop_token_ids(policy)
    rows = []

    def measure(engine: str, sampler, sampling: Sampling, started: float | None = None) -> None:
        torch.manual_seed(0)
        sampler.generate(prompts, sampling)  # warm-up
        rates = []
        for _ in range(repeats):
            clock = time.perf_counter()
            responses = sampler.generate(prompts, sampling).responses
            seconds = time.perf_counter() - clock
            rates.append(response_mask(responses, stop_ids).sum().item() / seconds)
        rows.append({"model": name, "engine": engine, "tokens_per_second": sum(rates) / len(rates),
                     "tokens_per_second_each": rates, "engine_start_seconds": started,
                     "parameters": sum(p.numel() for p in policy.parameters())})
        print(f"{name}, {engine}: {rows[-1]['tokens_per_second']:.0f} tokens/s", flush=True)

    hf = HFSampler(model=policy, tokenizer=tokenizer, stop_ids=stop_ids)
    measure("hf", hf, Sampling(new_tokens, 1.0, logprobs=True))
    measure("hf generate", hf, Sampling(new_tokens, 1.0, logprobs=False))
    clock = time.perf_counter()
    log = Path(model).parent / "vllm-bench.log"
    vllm = VLLMSampler.start(hf, VLLMConfig(), 0, log)
    try:
        measure("vllm", vllm, Sampling(new_tokens, 1.0), started=time.perf_counter() - clock)
    finally:
        vllm.close()
    return rows


PPO_VARIANTS = {
    "hf": ({"rollout_engine": "hf"}, None),
    "vllm": ({"rollout_engine": "vllm"}, None),
    "vllm-ahead": ({"rollout_engine": "vllm", "rollout.max_staleness": 1}, None),
    "vllm-ahead-split": ({"rollout_engine": "vllm", "rollout.max_staleness": 1, "vllm.devices": "1"}, 1),
}
"""The PPO rows a run can take: (overrides, trainer threads; None: torch's default). `vllm-ahead`: the
server samples the next iteration's rollout while the trainer updates, both on every core;
`-split`: the server on the last core (`vllm.devices`), the trainer on one thread."""


def ppo_row(variant: str, checkpoint: str, world: Path, work: Path, response_length: int) -> dict:
    """The PPO stage as `variant` (`PPO_VARIANTS`) on the checkpoint, in this process; its row."""
    import shutil

    import torch

    from rlhf.config import load_config, with_overrides
    from schemas.validate import LengthBudget, load_validated
    from stages.ppo import PPOInputs, train_ppo
    from stages.runtime.models import load_tokenizer

    overrides, threads = PPO_VARIANTS[variant]
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = with_overrides(load_config("configs/tiny.yaml").ppo, WORK | overrides |
                         {"sampling.response_length": response_length})
    tokenizer = load_tokenizer(checkpoint)
    budget = LengthBudget(cfg.max_prompt_length, cfg.max_prompt_length + cfg.sampling.response_length)
    prompts, eval_prompts = (load_validated(str(world / f"{name}.jsonl"), "prompt", tokenizer=tokenizer,
                                            budget=budget).frame for name in ("prompts", "prompts_eval"))
    shutil.rmtree(work, ignore_errors=True)
    clock = time.perf_counter()
    result = train_ppo(cfg, PPOInputs(sft_location=checkpoint, reward_location=checkpoint,
                                      prompts=prompts, eval_prompts=eval_prompts), work)
    stage_seconds = time.perf_counter() - clock
    later = result.history[1:]  # sampling ahead starts with iteration 2
    mean = lambda key: sum(h.get(key, 0.0) for h in later) / len(later)  # noqa: E731
    phases = ("iteration", "generate", "rollout_wait", "forward", "score", "train", "sampling_wait", "weight_sync")
    row = {"engine": variant, "response_length_limit": response_length, "stage_seconds": stage_seconds,
           "iterations": len(result.history), "trainer_threads": torch.get_num_threads(),
           **{key: mean(f"time/{key}") for key in phases}, "response_length": mean("rollout/response_length")}
    row["sampling_tokens_per_second"] = cfg.rollout_batch_size * row["response_length"] / row["generate"]
    # the server's sampling hidden behind the trainer's work: 1 - what the trainer waited for it / what it took
    row["overlap"] = (1 - (row["rollout_wait"] + row["sampling_wait"]) / row["generate"] if cfg.rollout.max_staleness
                      else 0.0)
    if variant != "hf":
        row["vllm_logprob_gap_max"] = max(h["rollout/vllm_logprob_gap_max"] for h in result.history)
        row["staleness"] = [h.get("rollout/staleness", 0.0) for h in result.history]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench-rollout")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-ppo", action="store_true", help="the sampling table only")
    parser.add_argument("--ppo-response-lengths", nargs="+", type=int, default=[64], metavar="T",
                        help="PPO's `sampling.response_length`, one row per variant each")
    parser.add_argument("--ppo-variants", nargs="+", default=["hf", "vllm", "vllm-ahead"], choices=list(PPO_VARIANTS),
                        help="the PPO rows at each length (PPO_VARIANTS)")
    parser.add_argument("--skip-sampling", action="store_true", help="the PPO table only")
    parser.add_argument("--tag", help="results file rollout-<date>-<tag>.json")
    parser.add_argument("--sampling", nargs=2, metavar=("MODEL", "NAME"), help=argparse.SUPPRESS)  # a child
    parser.add_argument("--ppo", nargs=2, help=argparse.SUPPRESS)  # a child: this engine's PPO row at this length
    args = parser.parse_args()
    world = args.state / "world"
    if args.sampling:
        from schemas.validate import LengthBudget, load_validated
        from stages.runtime.models import load_tokenizer

        frame = load_validated(str(world / "prompts.jsonl"), "prompt", tokenizer=load_tokenizer(args.sampling[0]),
                               budget=LengthBudget(64, 64 + args.new_tokens)).frame
        prompts = list(frame["prompt"].head(args.prompts))
        rows = sampling_rows(args.sampling[0], args.sampling[1], prompts, args.new_tokens, args.repeats)
        print("ROWS=" + json.dumps(rows))
        return
    if args.ppo:
        variant, length = args.ppo[0], int(args.ppo[1])
        print("ROW=" + json.dumps(ppo_row(variant, str(args.state / "checkpoint-100m"), world, args.state / variant,
                                          length)))
        return

    import torch

    from bench.scale import build_checkpoint
    from rlhf.config import load_config
    from rlhf.demo.world import build_world

    args.state.mkdir(parents=True, exist_ok=True)
    built = build_world(args.state / "worlds", load_config("configs/tiny.yaml", {"demo.num_heads": 2}).demo)
    world.unlink(missing_ok=True)
    world.symlink_to(built)
    build_checkpoint(built, args.state / "checkpoint-100m", 768, 16)

    def child(*flags: str, key: str):
        done = subprocess.run([sys.executable, "-m", "bench.rollout", "--state", str(args.state), "--prompts",
                               str(args.prompts), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                               *flags], cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{flags} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        line = next(line for line in done.stdout.splitlines() if line.startswith(key))
        return json.loads(line[len(key):])

    sampling = [] if args.skip_sampling else [
        row for model, name in ((str(built / "model"), "demo model (2 heads of 32)"),
                                (str(args.state / "checkpoint-100m"), "~100M Llama"))
        for row in child("--sampling", model, name, key="ROWS=")]
    print(f"\nSampling: {args.prompts} prompts x {args.new_tokens} new tokens, temperature 1, float32, "
          f"{torch.get_num_threads()} threads\n")
    print("| model | engine | tokens/s | vs hf | engine start |")
    print("|---|---|---|---|---|")
    for row in sampling:
        base = next(r for r in sampling if r["model"] == row["model"] and r["engine"] == "hf")
        start = f"{row['engine_start_seconds']:.0f} s" if row["engine_start_seconds"] else "-"
        print(f"| {row['model']} ({row['parameters'] / 1e6:.1f}M) | {row['engine']} | {row['tokens_per_second']:.0f} | "
              f"{row['tokens_per_second'] / base['tokens_per_second']:.2f}x | {start} |")
    ppo = [] if args.skip_ppo else [child("--ppo", variant, str(length), key="ROW=")
                                    for length in args.ppo_response_lengths for variant in args.ppo_variants]
    if ppo:
        print("\nPPO on the ~100M Llama (four models), seconds per iteration (mean of iterations 2-4); with "
              "sampling ahead, sampling is the server's time beside the trainer's work, and the trainer "
              "waits only for what is not hidden (rollout wait + wait before the sync)\n")
        print("| response tokens | variant | trainer threads | iteration | sampling | trainer's waits | forward "
              "passes | scoring | update | weight sync | overlap | stage (with server start) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in ppo:
            waits = r["rollout_wait"] + r["sampling_wait"] if r["overlap"] else r["generate"]
            print(f"| {r['response_length_limit']} | {r['engine']} | {r['trainer_threads']} | {r['iteration']:.1f} | "
                  f"{r['generate']:.1f} | {waits:.1f} | {r['forward']:.1f} | {r['score']:.1f} | {r['train']:.1f} | "
                  f"{r['weight_sync']:.2f} | {r['overlap']:.0%} | {r['stage_seconds']:.0f} s |")
    out = (REPO / "bench" / "results"
           / f"rollout-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json")
    out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "work": WORK,
                               "prompts": args.prompts, "new_tokens": args.new_tokens, "sampling": sampling,
                               "ppo": ppo}, indent=2) + "\n")
    print(f"\nwritten: {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
