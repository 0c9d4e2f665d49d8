"""Shared fixtures: a tiny demo world built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rlhf.config import load_config  # noqa: E402
from rlhf.demo_world import build_world  # noqa: E402

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def tiny_config():
    return load_config("configs/tiny.yaml")


@pytest.fixture(scope="session")
def world(tmp_path_factory, tiny_config) -> Path:
    return build_world(tmp_path_factory.mktemp("worlds"), tiny_config.demo)


@pytest.fixture(scope="session")
def tokenizer(world):
    from stages.models import load_tokenizer

    return load_tokenizer(str(world / "model"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, world, tiny_config, tokenizer):
    """Tiny SFT and reward checkpoints, trained once per session, for the PPO tests."""
    from schemas.validate import LengthBudget, load_validated
    from stages.reward import RewardInputs, train_reward
    from stages.sft import SFTInputs, train_sft

    root = tmp_path_factory.mktemp("trained")
    budget = LengthBudget(32, 64)

    def data(name, kind):
        return load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer, budget=budget).frame

    sft_cfg = tiny_config.sft.model_copy(update={"max_steps": 40})
    sft = train_sft(sft_cfg, SFTInputs(str(world / "model"), data("sft", "sft"), data("sft_eval", "sft")), root / "sft")
    reward_cfg = tiny_config.reward.model_copy(update={"max_steps": 30})
    reward = train_reward(reward_cfg, RewardInputs(str(sft.checkpoint), str(sft.checkpoint), data("preferences", "preference"),
                                                   data("preferences_eval", "preference"), data("prompts_eval", "prompt")),
                          root / "reward")
    return {"sft": str(sft.checkpoint), "reward": str(reward.checkpoint),
            "prompts": data("prompts", "prompt"), "eval_prompts": data("prompts_eval", "prompt")}
