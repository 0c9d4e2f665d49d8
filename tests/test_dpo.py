"""The DPO stage on a tiny world: pairs encoded as the reward stage encodes them, the loss falls
from log 2, the policy is judged as PPO's is, and a killed run resumes from its trainer checkpoint."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from rlhf.config import with_overrides
from stages.common.reporting import Reporting
from stages.dpo import DPOInputs, encoded_pairs, train_dpo
from stages.runtime.models import encode_replies, load_tokenizer, stop_token_ids
from tests.helpers import ppo_inputs, resumes_past_torn_saves


def _inputs(trained, pairs):
    return DPOInputs(trained["sft"], pairs["train"], pairs["eval"], trained["eval_prompts"])


@pytest.fixture(scope="module")
def pairs(world, tiny_config, tokenizer):
    from schemas.validate import LengthBudget, load_validated

    budget = LengthBudget(tiny_config.dpo.max_prompt_length, tiny_config.dpo.max_length)
    return {role: load_validated(str(world / f"{name}.jsonl"), "preference", tokenizer=tokenizer, budget=budget).frame
            for role, name in (("train", "preferences"), ("eval", "preferences_eval"))}


def test_pairs_are_encoded_as_the_reward_stage_encodes_them(trained, pairs):
    tokenizer = load_tokenizer(trained["sft"])
    encoded = encoded_pairs(pairs["train"].head(3), tokenizer).to_dict()
    prompt_ids, chosen_ids = encode_replies(tokenizer, list(pairs["train"]["prompt"].head(3)),
                                            list(pairs["train"]["chosen"].head(3)))
    assert encoded["prompt_ids"] == prompt_ids and encoded["chosen_ids"] == chosen_ids
    ends = stop_token_ids(AutoModelForCausalLM.from_pretrained(trained["sft"]))
    assert all(ids[-1] in ends for ids in encoded["chosen_ids"] + encoded["rejected_ids"])  # a reply ends as SFT taught


def test_dpo_lowers_its_loss_and_is_judged_against_sft(tiny_config, trained, pairs, tmp_path):
    cfg = with_overrides(tiny_config.dpo, {"max_steps": 8, "evaluation.kl_budget": 1e-6})
    logged, warnings = [], []
    result = train_dpo(cfg, _inputs(trained, pairs), tmp_path,
                       Reporting(metrics=lambda m, i: logged.append(m), warning=warnings.append))
    metrics = result.metrics
    assert metrics["eval/loss_untrained"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference
    assert metrics["eval/loss"] < metrics["eval/loss_untrained"]
    assert 0.0 <= metrics["eval/preference_accuracy"] <= 1.0 and metrics["train/steps"] == 8
    assert metrics["eval/kl"] > 0 and "eval/win_rate_rm" not in metrics  # no reward model takes part
    assert list(result.evaluation.columns) == ["prompt", "prompt_messages", "policy_response", "sft_response", "kl"]
    assert len(result.evaluation) == len(trained["eval_prompts"]) * cfg.evaluation.samples_per_prompt
    assert any("train/rewards/margins" in m for m in logged)
    assert warnings and "over the budget" in warnings[-1]
    assert AutoModelForCausalLM.from_pretrained(result.checkpoint).config.model_type == "llama"


def test_the_sft_baseline_is_ppos_for_the_same_evaluation_settings(tiny_config, trained, pairs, tmp_path):
    """DPO and PPO judged against the same SFT responses: their win rates compare."""
    from stages.ppo import train_ppo

    dpo = train_dpo(tiny_config.dpo.model_copy(update={"max_steps": 2}), _inputs(trained, pairs), tmp_path / "dpo")
    ppo_cfg = with_overrides(tiny_config.ppo, {"num_iterations": 1, "sampling": tiny_config.dpo.sampling,
                                               "evaluation.every": None})
    ppo = train_ppo(ppo_cfg, ppo_inputs(trained),
                    tmp_path / "ppo")
    assert list(dpo.evaluation["sft_response"]) == list(ppo.evaluation["sft_response"])


def test_a_killed_dpo_run_resumes_from_its_trainer_checkpoint(tiny_config, trained, pairs, tmp_path):
    cfg = tiny_config.dpo.model_copy(update={"max_steps": 6, "checkpoint_every": 3})
    whole = train_dpo(cfg, _inputs(trained, pairs), tmp_path / "whole")

    class Killed(Exception):
        pass

    def die_at_four(figures, step):  # figures are logged every 2 steps; the checkpoint is at 3
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        train_dpo(cfg, _inputs(trained, pairs), tmp_path / "killed", Reporting(metrics=die_at_four))
    assert (tmp_path / "killed" / "trainer" / "checkpoint-3").is_dir()
    # and killed again, at each point of its save at step 6: each resumes from checkpoint-3
    swept, resumed, steps = resumes_past_torn_saves(
        lambda reporting: train_dpo(cfg, _inputs(trained, pairs), tmp_path / "killed", reporting),
        tmp_path / "killed", tmp_path / "whole", done=3, torn=6)
    assert len(swept) >= 10 and min(s for s, m in steps if "train/loss" in m) > 3, swept
    assert resumed.metrics["eval/loss"] == pytest.approx(whole.metrics["eval/loss"], rel=1e-5)
    assert list(resumed.evaluation["policy_response"]) == list(whole.evaluation["policy_response"])


def test_a_lora_policy_trains_float32_adapters_on_weights_held_in_frozen_dtype(tiny_config, trained, pairs, tmp_path):
    """`frozen_dtype: bfloat16` with LoRA: the policy's frozen weights (with the adapters off, TRL's
    reference) held in bf16 under float32 adapters; the hand-off merged in the SFT checkpoint's dtype."""
    import torch

    from stages.dpo import build_trainer

    cfg = with_overrides(tiny_config.dpo, {"max_steps": 6, "lora": {"r": 4}, "frozen_dtype": "bfloat16"})
    trainer = build_trainer(cfg, _inputs(trained, pairs), tmp_path / "built")
    held = {(p.requires_grad, p.dtype) for p in trainer.model.parameters()}
    assert held == {(True, torch.float32), (False, torch.bfloat16)}, held
    result = train_dpo(cfg, _inputs(trained, pairs), tmp_path / "run")
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_untrained"] == pytest.approx(0.6931, abs=1e-3)
    saved = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    assert {p.dtype for p in saved.parameters()} == {torch.float32}
    assert not any("lora" in name for name, _ in saved.named_parameters())
