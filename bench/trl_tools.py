"""The reference side of `bench/tools.py --settings trl`: TRL 1.12.0's GRPOTrainer with tools on the demo's
tool world, trained from our SFT checkpoint, its policy copied every `snapshot_every` iterations for the
shared evaluation, with its training clock (each step counted from the end of the one before, the copy
excluded).

Runs in the benchmark's own environment (.bench-venv, bench/requirements-trl.txt), which has TRL but
not this project's dependencies; it imports the world's tool and reward functions (`rlhf.demo.tools`,
`rlhf.demo.rewards`: standard library only), as a TRL user would pass their own.

Two things TRL needs that the demo's tokenizer does not carry, added to the copy this script loads
(the world's tokenizer and fingerprint are untouched):
- a chat template that renders an assistant message's `tool_calls` (TRL builds its messages that way;
  ours writes the call in the content), into exactly the text our demonstrations carry, so the SFT
  policy sees the same tokens either way (checked below);
- a `response_template` (transformers' response parsing) for the demo's Hermes-style
  `<tool_call>{json}</tool_call>` calls, as TRL ships for Qwen3.
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

from rlhf.demo.rewards import names_the_subject, uses_liked_adjectives  # noqa: E402  (standard library only)
from rlhf.demo.tools import TOOL_NAME, call_text, liked_text  # noqa: E402

ASSISTANT = "<|assistant|>{{ message['content'] }}{{ eos_token }}"
ASSISTANT_WITH_CALLS = ("<|assistant|>{{ message['content'] }}{% for call in message.get('tool_calls', []) %}"
                        "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']}"
                        " | tojson }}</tool_call>{% endfor %}{{ eos_token }}")
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}


def tool_calling_tokenizer(folder: str):
    """The SFT folder's tokenizer with `tool_calls` rendered as the demonstrations write calls, and parsed back."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if ASSISTANT not in tokenizer.chat_template:
        raise SystemExit(f"{folder}: not the demo's tools chat template")
    tokenizer.chat_template = tokenizer.chat_template.replace(ASSISTANT, ASSISTANT_WITH_CALLS)
    tokenizer.response_template = RESPONSE_TEMPLATE
    asked = [{"role": "user", "content": "Describe my cat."}]
    answer = {"role": "tool", "name": TOOL_NAME, "content": liked_text("warm calm kind")}
    as_content = asked + [{"role": "assistant", "content": call_text("cat")}, answer]
    as_calls = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"subject": "cat"}}}]}, answer]
    if tokenizer.apply_chat_template(as_content, tokenize=False) != tokenizer.apply_chat_template(as_calls,
                                                                                                   tokenize=False):
        raise SystemExit("the tool-call rendering differs from the demonstrations'")
    return tokenizer


class ToolWorld:
    """One episode's environment: the prompt record's `liked` adjectives, told by `preferences`."""

    def __init__(self):
        self.answer = ""

    def reset(self, **row) -> None:
        self.answer = liked_text(row["liked"])

    def preferences(self, subject: str) -> str:
        """Look up which adjectives this user likes to hear about a subject.

        Args:
            subject: the thing the user asked about.
        """
        return self.answer


def final_answers(completions: list[list[dict]]) -> list[str]:
    """Each completion's last assistant message: the episode's answer, what our reward terms score."""
    return [next((m["content"] for m in reversed(c) if m["role"] == "assistant"), "") for c in completions]


def liked_reward(prompts, completions, liked, **_):
    """`rlhf.demo.rewards:uses_liked_adjectives` on the final answers (the config's first reward term)."""
    return uses_liked_adjectives(prompts, final_answers(completions), liked)


def subject_reward(prompts, completions, **_):
    """`rlhf.demo.rewards:names_the_subject` on the final answers (its second); None where it cannot tell."""
    return names_the_subject(prompts, final_answers(completions))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", required=True, help="the SFT checkpoint folder")
    parser.add_argument("--prompts", required=True, help="JSONL: `messages` (the prompt's) and `liked` per line")
    parser.add_argument("--out", required=True, help="where the final policy and the copies are saved")
    parser.add_argument("--settings", required=True, help="JSON: the work and GRPO settings")
    args = parser.parse_args()
    s = json.loads(args.settings)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps_per_iteration = s["minibatches"] * s["ppo_epochs"]

    class Snapshots(TrainerCallback):
        """`steps_per_iteration` optimizer steps are one of our iterations: the clock after each, weights every
        `every` iterations."""

        def __init__(self, policy, every: int):
            self.policy, self.every = policy, every
            self.clock: dict[int, float] = {}
            self.copies: dict[int, dict] = {}
            self.elapsed, self.mark = 0.0, 0.0

        def on_train_begin(self, *_, **__):
            self.mark = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            self.elapsed += time.perf_counter() - self.mark
            if state.global_step % steps_per_iteration == 0:
                iteration = state.global_step // steps_per_iteration
                self.clock[iteration] = self.elapsed
                if iteration % self.every == 0:
                    self.copies[iteration] = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
            self.mark = time.perf_counter()

    torch.set_num_threads(s["threads"])
    tokenizer = tool_calling_tokenizer(args.policy)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["messages"], "liked": r["liked"]} for r in rows])
    with tempfile.TemporaryDirectory() as scratch:
        config = GRPOConfig(
            output_dir=scratch, per_device_train_batch_size=s["episodes"] // s["minibatches"],
            steps_per_generation=s["minibatches"], num_iterations=s["ppo_epochs"], num_generations=s["group"],
            max_steps=s["iterations"] * steps_per_iteration, max_completion_length=s["episode_tokens"],
            max_tool_calling_iterations=s["max_turns"] - 1, learning_rate=s["learning_rate"],
            lr_scheduler_type="linear", warmup_steps=0, epsilon=s["clip_range"], beta=s["beta"],
            loss_type="dapo", temperature=s["temperature"], max_grad_norm=1.0, report_to=[], save_strategy="no",
            logging_steps=10_000, use_cpu=True, seed=s["seed"], dataloader_num_workers=0,
            log_completions=False)
        policy = AutoModelForCausalLM.from_pretrained(args.policy)
        snapshots = Snapshots(policy, s["snapshot_every"])
        trainer = GRPOTrainer(model=policy, reward_funcs=[liked_reward, subject_reward], args=config,
                              train_dataset=dataset, processing_class=tokenizer, environment_factory=ToolWorld,
                              callbacks=[snapshots])
        trainer.train()
        policy.save_pretrained(args.out)
        for iteration, weights in snapshots.copies.items():
            policy.load_state_dict(weights)
            policy.save_pretrained(Path(args.out) / f"iteration-{iteration}")
    print("RESULT=" + json.dumps({"out": args.out, "clock": snapshots.clock}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
