"""The reference side of `bench/ppo.py`: TRL 1.12.0's PPOTrainer on the benchmark's model and prompts.

Runs in the benchmark's own environment (.bench-venv, bench/requirements-trl.txt), which has
TRL 1.12.0 but not this project; it reads the folders `bench/ppo.py` built and prints one
`RESULT=` line (per-iteration rows and peak memory) in the same format as our side.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bench.flops import PhaseFlops  # noqa: E402  (torch, imported late)
from bench.ppo import Work, peak_memory_mb  # noqa: E402  (standard library only)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", required=True)
    parser.add_argument("--work", required=True, help="JSON of bench.ppo.Work")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--compile", choices=["no", "args", "accelerate"], default="no",
                        help="args: PPOConfig(torch_compile=True), as a user asks TRL to compile; accelerate: also "
                        "ACCELERATE_DYNAMO_BACKEND=inductor, what `accelerate launch --dynamo_backend inductor` sets")
    parser.add_argument("--count-flops", action="store_true", help="count the warm-up step's FLOPs by phase")
    args = parser.parse_args()
    if args.compile == "accelerate":
        os.environ["ACCELERATE_DYNAMO_BACKEND"] = "inductor"
    assets, work = Path(args.assets), Work(**json.loads(args.work))

    import torch
    import trl.experimental.ppo.ppo_trainer as trl_ppo
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    phases = defaultdict(float)
    flops = PhaseFlops(outside="update")  # the first (warm-up) step's FLOPs by phase; the update is what is left
    lengths = []

    def timed(phase_of, function):
        """`function`, its seconds added to the phase `phase_of(*args)` names (None: not counted), its FLOPs too."""
        def wrapper(*call_args, **kwargs):
            phase, start = phase_of(*call_args), time.perf_counter()
            try:
                with flops.phase(phase or "update"):
                    return function(*call_args, **kwargs)
            finally:
                if phase:
                    phases[phase] += time.perf_counter() - start
        return wrapper

    def score_lengths(model, query_responses, pad_token_id, *_):
        """The first step's sequences' real tokens (what the reward model scores: prompt and response)."""
        if model is reward_model and not lengths:
            lengths.extend((query_responses != pad_token_id).sum(1).tolist())
        return "score" if model is reward_model else "values"

    # The rollout's parts, as TRL's PPOTrainer.train calls them by module-level name; in the update the
    # same `forward` runs with gradients, and is left in the update's time.
    trl_ppo.batch_generation = timed(lambda *_: "generate", trl_ppo.batch_generation)
    trl_ppo.forward = timed(lambda *_: None if torch.is_grad_enabled() else "reference", trl_ppo.forward)
    trl_ppo.get_reward = timed(score_lengths, trl_ppo.get_reward)
    trl_ppo.gc = SimpleNamespace(collect=timed(lambda *_: "gc", gc.collect))
    PPOTrainer.log = timed(lambda *_: "logging", PPOTrainer.log)
    tokenizer = AutoTokenizer.from_pretrained(assets / "policy", padding_side="left")
    prompts = [json.loads(line)["prompt"] for line in (assets / "prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]})

    def value_like(folder: str):
        return AutoModelForSequenceClassification.from_pretrained(assets / folder, num_labels=1)

    class IterationClock(TrainerCallback):
        """One PPOTrainer step is one PPO iteration (rollout, then all epochs and minibatches)."""

        def __init__(self):
            self.marks: list[float] = []
            self.phases: list[dict[str, float]] = []

        def on_train_begin(self, *_, **__):
            self.marks.append(time.perf_counter())
            phases.clear()
            if args.count_flops and args.warmup and args.compile == "no":  # compiled modules would be traced
                flops.start()

        def on_step_end(self, *_, **__):
            self.marks.append(time.perf_counter())
            flops.stop()
            self.phases.append(dict(phases))
            phases.clear()

    clock = IterationClock()
    total = args.warmup + args.iterations
    with tempfile.TemporaryDirectory() as out:
        config = PPOConfig(
            # TRL 1.12: the rollout batch is per_device_train_batch_size x gradient_accumulation_steps, split
            # into num_mini_batches optimizer steps per epoch.
            output_dir=out, per_device_train_batch_size=work.episodes, gradient_accumulation_steps=1,
            num_mini_batches=work.minibatches, num_ppo_epochs=work.ppo_epochs, response_length=work.response_length,
            total_episodes=work.episodes * total, local_rollout_forward_batch_size=work.episodes,
            learning_rate=work.learning_rate, kl_coef=work.kl_coef, temperature=work.temperature, stop_token="eos",
            num_sample_generations=0, report_to=[], save_strategy="no", logging_steps=10_000, use_cpu=True,
            seed=work.seed, dataloader_num_workers=0, torch_compile=args.compile != "no")
        reward_model = value_like("reward")
        trainer = PPOTrainer(
            args=config, processing_class=tokenizer,
            model=AutoModelForCausalLM.from_pretrained(assets / "policy"),
            ref_model=AutoModelForCausalLM.from_pretrained(assets / "policy"),
            reward_model=reward_model, value_model=value_like("reward"),
            train_dataset=dataset, eval_dataset=dataset.select(range(8)), callbacks=[clock])
        # Whether TRL's PPOTrainer compiled what it trains: accelerate's `prepare` wraps it in torch.compile's module.
        compiled = isinstance(trainer.model, torch._dynamo.eval_frame.OptimizedModule)
        trainer.train()
    seconds = [b - a for a, b in itertools.pairwise(clock.marks)][args.warmup:]
    assert len(seconds) == args.iterations, clock.marks
    # TRL does not report how many tokens it generated; every response counts in full (an upper bound).
    rows = [{"seconds": s, **p, "update": s - sum(p.values()), "generated_tokens": work.episodes * work.response_length}
            for s, p in zip(seconds, clock.phases[args.warmup:], strict=True)]
    warmup = [b - a for a, b in itertools.pairwise(clock.marks)][:args.warmup]
    counted = {"flops": dict(flops.by_phase), "lengths": lengths} if flops.by_phase else {}
    print("RESULT=" + json.dumps({"rows": rows, "peak_memory_mb": peak_memory_mb(), "compiled": compiled,
                                  "warmup_seconds": sum(warmup), **counted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
