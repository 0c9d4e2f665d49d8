"""The reference side of `bench/quality.py`: TRL 1.12.0's PPOTrainer trained to the end, its final
policy, and a copy every `snapshot_every` iterations, saved for the shared evaluation, with its
training clock: seconds after each iteration, each counted from the end of the one before (from
the start of training for the first), so taking the copies does not count.

Runs in the benchmark's own environment (.bench-venv, bench/requirements-trl.txt), which has
TRL 1.12.0 but not this project. Policy and reference start from the SFT folder; reward and
value models from the (gain-scaled) reward folder, as TRL's examples do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", required=True)
    parser.add_argument("--reward", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL with a rendered `prompt` per line")
    parser.add_argument("--out", required=True, help="where the final policy is saved")
    parser.add_argument("--settings", required=True, help="JSON: the work and PPO settings")
    args = parser.parse_args()
    s = json.loads(args.settings)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    class Snapshots(TrainerCallback):
        """One PPOTrainer step is one PPO iteration: the clock after each, the policy's weights every `every`."""

        def __init__(self, policy, every: int | None):
            self.policy, self.every = policy, every
            self.clock: dict[int, float] = {}
            self.copies: dict[int, dict] = {}
            self.elapsed, self.mark = 0.0, 0.0

        def on_train_begin(self, *_, **__):
            self.mark = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            self.elapsed += time.perf_counter() - self.mark
            self.clock[state.global_step] = self.elapsed
            if self.every and state.global_step % self.every == 0:
                self.copies[state.global_step] = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
            self.mark = time.perf_counter()

    torch.set_num_threads(s["threads"])
    tokenizer = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]})
    with tempfile.TemporaryDirectory() as scratch:
        config = PPOConfig(
            output_dir=scratch, per_device_train_batch_size=s["episodes"], gradient_accumulation_steps=1,
            num_mini_batches=s["minibatches"], num_ppo_epochs=s["ppo_epochs"], response_length=s["response_length"],
            total_episodes=s["episodes"] * s["iterations"], local_rollout_forward_batch_size=s["episodes"],
            learning_rate=s["learning_rate"], kl_coef=s["kl_coef"], temperature=s["temperature"], stop_token="eos",
            vf_coef=s["vf_coef"], cliprange=s["cliprange"], cliprange_value=s["cliprange_value"], gamma=s["gamma"],
            lam=s["lam"], missing_eos_penalty=s["missing_eos_penalty"] or None, num_sample_generations=0,
            report_to=[], save_strategy="no", logging_steps=10_000, use_cpu=True, seed=s["seed"],
            dataloader_num_workers=0)
        policy = AutoModelForCausalLM.from_pretrained(args.policy)
        snapshots = Snapshots(policy, s.get("snapshot_every"))
        trainer = PPOTrainer(
            args=config, processing_class=tokenizer, model=policy,
            ref_model=AutoModelForCausalLM.from_pretrained(args.policy),
            reward_model=AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1),
            value_model=AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1),
            train_dataset=dataset, eval_dataset=dataset.select(range(8)), callbacks=[snapshots])
        trainer.train()
        assert trainer.policy_model is policy
        policy.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        for iteration, weights in snapshots.copies.items():
            policy.load_state_dict(weights)
            policy.save_pretrained(Path(args.out) / f"iteration-{iteration}")
    print("RESULT=" + json.dumps({"out": args.out, "clock": snapshots.clock}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
