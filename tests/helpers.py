"""Helpers the tests (and the launch stress benchmark) share; test files import from here, never from each other."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

# The demo world's datasets, with the contract each is validated against.
DATASETS = (("sft", "sft"), ("sft_eval", "sft"), ("preferences", "preference"), ("preferences_eval", "preference"),
            ("prompts", "prompt"), ("prompts_eval", "prompt"))


def world_frames(world: Path, tokenizer) -> dict[str, pd.DataFrame]:
    """Every demo-world dataset, validated under the tiny config's length budget (32 prompt, 64 total tokens)."""
    from schemas.validate import LengthBudget, load_validated

    budget = LengthBudget(32, 64)
    return {name: load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer, budget=budget).frame
            for name, kind in DATASETS}


def train_upstream(cfg, world: Path, frames: dict[str, pd.DataFrame], root: Path) -> tuple[str, str]:
    """Tiny SFT (40 steps) and reward (30 steps) checkpoints, the upstream of the PPO and DPO tests; their paths."""
    from stages.reward import RewardInputs, train_reward
    from stages.sft import SFTInputs, train_sft

    sft = train_sft(cfg.sft.model_copy(update={"max_steps": 40}),
                    SFTInputs(str(world / "model"), frames["sft"], frames["sft_eval"]), root / "sft")
    reward = train_reward(cfg.reward.model_copy(update={"max_steps": 30}),
                          RewardInputs(str(sft.checkpoint), str(sft.checkpoint), frames["preferences"],
                                       frames["preferences_eval"], frames["prompts_eval"]), root / "reward")
    return str(sft.checkpoint), str(reward.checkpoint)
