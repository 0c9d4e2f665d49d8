"""The update on a long-tailed length mix: padded against padding-free passes, micro-batches by rows
against micro-batches by tokens, float32 against bf16 autocast. `make bench-packing`.

    python -m bench.packing                       # writes bench/results/packing-<date>.json
    python -m bench.packing --mixes bench --repeats 3

The model is `make bench`'s (bench/ppo.py's `ModelShape`, a Llama of hidden 128 with a reward-model
critic); the batch is synthetic, so the lengths are what the mix says: `long-tail` has responses of
8-256 tokens (log-uniform: many short, a few long, as reasoning and tool-use rollouts are) after
prompts of 8-32; `bench` has `make bench`'s own shape (prompts of 8-32, responses of 32 tokens,
about one in sixteen ending early). Each setting runs PPO's whole update (`stages.rl.update.ppo_update`:
4 epochs x 4 minibatches of 16, one optimizer step each, as `make bench`) on the same batch in this
process, settings interleaved, `repeats` rounds after one warm-up; the figure is the median update.
The padding share is the update's own count (`perf/padding_share/update`). This is a benchmark, not
a test: nothing here asserts a speed.

It also times the decode loop (`decode`): every row run to the longest response against rows that
leave the batch as they end (`compact`, on with `ppo.padding_free`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from bench.ppo import REPO, ModelShape, build_assets, machine_type

SETTINGS = {
    "padded, rows": {"padding_free": False, "micro_batch_tokens": None},
    "padded, tokens": {"padding_free": False, "micro_batch_tokens": "auto"},
    "padding-free, rows": {"padding_free": True, "micro_batch_tokens": None},
    "padding-free, tokens": {"padding_free": True, "micro_batch_tokens": "auto"},
}
"""What is compared: the passes' layout, and how a minibatch is cut into micro-batches."""


def lengths(mix: str, n: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Prompt and response lengths of `n` rows for a mix."""
    prompts = torch.randint(8, 33, (n,), generator=generator).tolist()
    if mix == "long-tail":  # log-uniform over 8-256
        u = torch.rand(n, generator=generator)
        responses = [int(round(math.exp(math.log(8) + x * (math.log(256) - math.log(8))))) for x in u.tolist()]
    else:  # `make bench`'s: 32 tokens, about one in sixteen ended early
        ended = torch.rand(n, generator=generator) < 1 / 16
        early = torch.randint(1, 32, (n,), generator=generator)
        responses = [int(e) if stop else 32 for stop, e in zip(ended.tolist(), early.tolist(), strict=True)]
    return prompts, responses


def synthetic_episodes(learner, prompt_lengths: list[int], response_lengths: list[int], seed: int):
    """A training batch of these lengths: random ids, the policy's own log-probs (a ratio of 1 at the
    first step), random advantages and returns. What the update reads of an iteration."""
    from stages.common.batches import Sequences
    from stages.common.tensors import logprobs_of
    from stages.rewards.scoring import Scores
    from stages.rl.batch import KLWeights, TrainingBatch
    from stages.rl.ppo_models import policy_and_values
    from stages.rl.teacher import Marks

    generator = torch.Generator().manual_seed(seed)
    n, width, steps = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    vocab = learner.models.policy.config.vocab_size
    queries = torch.randint(4, vocab, (n, width), generator=generator)
    responses = torch.randint(4, vocab, (n, steps), generator=generator)
    query_mask = torch.tensor([[0] * (width - a) + [1] * a for a in prompt_lengths])
    mask = torch.tensor([[1.0] * b + [0.0] * (steps - b) for b in response_lengths])
    pad = learner.models.tokenizer.pad_token_id
    queries, responses = queries.masked_fill(query_mask == 0, pad), responses.masked_fill(mask == 0, pad)
    with torch.no_grad():
        logits, values = policy_and_values(learner.models, Sequences(queries, query_mask, responses, mask),
                                           phase="setup")
    logprobs = logprobs_of(logits, responses) * mask
    nothing = torch.zeros(n)
    scores = Scores(terms={}, reward=nothing, reported=nothing, dropped=nothing.bool(), raw={})
    return TrainingBatch(queries=queries, query_mask=query_mask, responses=responses, mask=mask, logprobs=logprobs,
                         ref_logprobs=logprobs, values=values * mask, entropy=torch.zeros_like(mask),
                         engine_logprobs=logprobs, teacher=Marks(), has_eos=torch.ones(n, dtype=torch.bool),
                         episodes=[None] * n, messages=[[]] * n, trainable=mask, turn_rewards=torch.zeros_like(mask),
                         restarts=torch.zeros_like(mask),
                         scores=scores, kl=torch.zeros_like(mask),
                         advantages=torch.randn(n, 1, generator=generator) * mask,
                         returns=torch.randn(n, steps, generator=generator) * mask,
                         engine_weights=torch.ones_like(mask), counted=mask,
                         kl_weights=KLWeights(beta=0.0, in_reward=0.0, in_loss=0.0))


def learners(assets: Path, config_file: str, precisions: list[str], out: Path) -> dict:
    """One learner per (precision, setting), all started from the same checkpoints."""
    from rlhf.config import load_config, with_overrides
    from stages.ppo import PPOInputs, build_learner

    base = load_config(config_file).ppo
    prompts = pd.read_json(assets / "prompts.jsonl", lines=True)
    inputs = PPOInputs(sft_location=str(assets / "policy"), reward_location=str(assets / "reward"),
                       prompts=prompts, eval_prompts=prompts.head(4))
    built = {}
    for precision in precisions:
        for name, setting in SETTINGS.items():
            cfg = with_overrides(base, setting | {
                "precision": precision, "micro_batch_size": None, "sampling.micro_batch_size": None,
                "sharded_sampling": "whole", "max_prompt_length": 32, "sampling.response_length": 256})
            built[(precision, name)] = build_learner(cfg, inputs)
    return built


def measure(built: dict, mixes: list[str], repeats: int, seed: int = 0) -> list[dict]:
    """Median seconds of a whole update per (mix, precision, setting), the settings interleaved."""
    from stages.rl.update import ppo_update

    rows = []
    for mix in mixes:
        prompt_lengths, response_lengths = lengths(mix, 64, torch.Generator().manual_seed(seed))
        episodes = {key: synthetic_episodes(learner, prompt_lengths, response_lengths, seed)
                    for key, learner in built.items()}
        seconds = {key: [] for key in built}
        shares = {}
        for round_ in range(repeats + 1):  # round 0 warms up
            for key, learner in built.items():
                learner.models.counts.reset()
                start = time.perf_counter()
                ppo_update(learner, episodes[key], iteration=99)
                if round_:
                    seconds[key].append(time.perf_counter() - start)
                shares[key] = learner.models.counts.shares().get("perf/padding_share/update", 0.0)
        real = sum(prompt_lengths) + sum(response_lengths)
        for (precision, setting), times in seconds.items():
            rows.append({"mix": mix, "precision": precision, "setting": setting, "seconds": statistics.median(times),
                         "spread": (max(times) - min(times)) / statistics.median(times),
                         "padding_share": shares[(precision, setting)], "real_tokens": real})
    for row in rows:
        padded = next(r for r in rows if r["mix"] == row["mix"] and r["precision"] == "fp32"
                      and r["setting"] == "padded, rows")
        row["speedup_vs_padded_fp32"] = padded["seconds"] / row["seconds"]
    return rows


def decode(learner, prompts: list[str], repeats: int, stop_share: float = 1 / 40) -> list[dict]:
    """The decode loop on 64 prompts, up to 256 new tokens, with and without `compact`: a random
    model rarely ends a response, so every `1 / stop_share`-th vocabulary id counts as an end token
    here, which makes response lengths geometric (mean ~40, long-tailed) as trained policies' are.
    Median seconds of `repeats` rounds after a warm-up, the same seed for both."""
    from stages.engines.sampler import HFSampler, Sampling

    models = learner.models
    vocab = models.policy.config.vocab_size
    stops = list(range(4, vocab, round(1 / stop_share)))
    rows = []
    seconds: dict[bool, list[float]] = {False: [], True: []}
    outputs = {}
    for round_ in range(repeats + 1):
        for compact in (False, True):
            sampler = HFSampler(model=models.policy, tokenizer=models.tokenizer, stop_ids=stops, compact=compact)
            torch.manual_seed(round_)
            start = time.perf_counter()
            outputs[compact] = sampler.generate(prompts, Sampling(256, temperature=1.0))
            if round_:
                seconds[compact].append(time.perf_counter() - start)
    for compact in (False, True):
        out = outputs[compact]
        lengths = (out.responses != models.tokenizer.pad_token_id).sum(1).float()
        rows.append({"mix": "decode, geometric lengths", "precision": "fp32",
                     "setting": "rows leave as they end" if compact else "every row to the longest",
                     "seconds": statistics.median(seconds[compact]),
                     "spread": (max(seconds[compact]) - min(seconds[compact])) / statistics.median(seconds[compact]),
                     "computed_positions": out.computed_tokens, "mean_length": lengths.mean().item(),
                     "max_length": lengths.max().item()})
    rows[1]["speedup"] = rows[0]["seconds"] / rows[1]["seconds"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/bench.yaml")
    parser.add_argument("--mixes", nargs="+", default=["long-tail", "bench"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="results file (default bench/results/packing-<date>.json)")
    args = parser.parse_args(argv)

    from stages.runtime.models import set_determinism

    set_determinism(False, 2)
    with tempfile.TemporaryDirectory() as root:
        assets, _, threads = build_assets(args.config, {}, ModelShape(max_position_embeddings=512), Path(root))
        built = learners(assets, args.config, args.precisions, Path(root) / "out")
        rows = measure(built, args.mixes, args.repeats)
        prompts = pd.read_json(assets / "prompts.jsonl", lines=True)["prompt"].head(64).tolist()
        sampled = decode(built[("fp32", "padded, rows")], prompts, args.repeats)
    print(f"{'mix':>10} {'precision':>10} {'setting':>22} {'s/update':>9} {'padding':>8} {'speedup':>8}")
    for row in rows:
        print(f"{row['mix']:>10} {row['precision']:>10} {row['setting']:>22} {row['seconds']:9.3f} "
              f"{row['padding_share']:8.1%} {row['speedup_vs_padded_fp32']:7.2f}x")
    for row in sampled:
        print(f"decode, geometric lengths (mean {row['mean_length']:.0f}, max {row['max_length']:.0f}): "
              f"{row['setting']}: {row['seconds']:.2f} s, {row['computed_positions']} positions"
              + (f", {row['speedup']:.2f}x" if "speedup" in row else ""))
    date = datetime.date.today().isoformat()
    path = Path(args.out) if args.out else REPO / "bench" / "results" / f"packing-{date}.json"
    path.write_text(json.dumps({"date": date, "machine": machine_type(threads), "torch": torch.__version__,
                                "model": ModelShape().__dict__, "rows": rows, "decode": sampled}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
