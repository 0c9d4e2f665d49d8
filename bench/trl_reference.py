"""The reference side of `bench/ppo.py`: TRL 1.12.0's PPOTrainer on the benchmark's model and prompts.

Runs in the benchmark's own environment (.bench-venv, bench/requirements-trl.txt), which has
TRL 1.12.0 but not this project; it reads the folders `bench/ppo.py` built and prints one
`RESULT=` line (per-iteration rows and peak memory) in the same format as our side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bench.ppo import Work, peak_memory_mb  # noqa: E402  (standard library only)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", required=True)
    parser.add_argument("--work", required=True, help="JSON of bench.ppo.Work")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    args = parser.parse_args()
    assets, work = Path(args.assets), Work(**json.loads(args.work))

    import torch
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(assets / "policy", padding_side="left")
    prompts = [json.loads(line)["prompt"] for line in (assets / "prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]})

    def value_like(folder: str):
        return AutoModelForSequenceClassification.from_pretrained(assets / folder, num_labels=1)

    class IterationClock(TrainerCallback):
        """One PPOTrainer step is one PPO iteration (rollout, then all epochs and minibatches)."""

        def __init__(self):
            self.marks: list[float] = []

        def on_train_begin(self, *_, **__):
            self.marks.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            self.marks.append(time.perf_counter())

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
            seed=work.seed, dataloader_num_workers=0)
        trainer = PPOTrainer(
            args=config, processing_class=tokenizer,
            model=AutoModelForCausalLM.from_pretrained(assets / "policy"),
            ref_model=AutoModelForCausalLM.from_pretrained(assets / "policy"),
            reward_model=value_like("reward"), value_model=value_like("reward"),
            train_dataset=dataset, eval_dataset=dataset.select(range(8)), callbacks=[clock])
        trainer.train()
    seconds = [b - a for a, b in zip(clock.marks, clock.marks[1:])][args.warmup:]
    assert len(seconds) == args.iterations, clock.marks
    # TRL does not report how many tokens it generated; every response counts in full (an upper bound).
    rows = [{"seconds": s, "generated_tokens": work.episodes * work.response_length} for s in seconds]
    print("RESULT=" + json.dumps({"rows": rows, "peak_memory_mb": peak_memory_mb()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
