"""`critic: reward-lora`: LoRA adapters and a value head on the reward model the scorer holds, one
copy of the reward model where `critic: reward` holds two, and scores that never see the adapters;
and a LoRA policy's own frozen weights held in `frozen_dtype`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.config import with_overrides
from rlhf.sections.base import LoRAConfig
from stages.common.batches import Sequences
from stages.common.reporting import Reporting
from stages.memory.shapes import model_shape
from stages.rewards.scoring import RewardScorer, last_token_scores
from stages.rl.ppo_models import RewardCritic, RewardLoRACritic, load_models
from tests.helpers import killed_and_resumed, run_ppo


def _cfg(tiny_config, **changes):
    return with_overrides(tiny_config.ppo, {"critic.kind": "reward-lora"} | changes)


def _held_parameters(models) -> dict[int, torch.nn.Parameter]:
    """Every parameter of the models a run holds, each once."""
    held = (models.policy, models.critic, models.reference, models.scorer.model)
    return {id(p): p for module in held if module is not None for p in module.parameters()}


def _inputs(models):
    tokenizer = models.tokenizer
    queries = tokenizer(["<s><|user|>Describe the cat.<|assistant|>",
                         "<s><|user|>Describe our river. Please.<|assistant|>"],
                        return_tensors="pt", padding=True, add_special_tokens=False)
    responses = tokenizer(["The cat is warm.</s>", "The river is calm and cold.</s>"], return_tensors="pt",
                          padding=True, padding_side="right", add_special_tokens=False)
    return (None, Sequences(queries["input_ids"], queries["attention_mask"], responses["input_ids"],
                            responses["attention_mask"]), models.passes("test"))


def test_the_critic_trains_only_its_adapters_and_value_head_on_the_scorers_own_weights(tiny_config, trained):
    models = load_models(_cfg(tiny_config, frozen_dtype="bfloat16"), trained["sft"], trained["reward"])
    critic, reward_model = models.critic, models.scorer.model
    assert isinstance(critic, RewardLoRACritic) and critic.scorer is models.scorer
    in_policy = {id(p) for p in models.policy.parameters()}
    trained_in_critic = {id(p) for p in models.trainable() if id(p) not in in_policy}
    adapters = {name: p for name, p in reward_model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    # What the optimizer trains of the critic: its value head and the adapters in the reward model, nothing else.
    assert trained_in_critic == {id(critic.head.weight)} | {id(p) for p in adapters.values()}
    assert {id(p) for p in critic.parameters()} == trained_in_critic
    assert {p.dtype for p in critic.parameters()} == {torch.float32}
    assert {p.dtype for p in reward_model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert not reward_model.score.weight.requires_grad and critic.head.weight is not reward_model.score.weight
    # Scoring switches the adapters off and leaves them as they were: trainable.
    models.scorer.score(["Describe the cat."], ["The cat is warm."])
    assert {name for name, p in reward_model.named_parameters() if p.requires_grad} == set(adapters)


def test_fresh_adapters_give_the_values_of_the_critic_copied_from_the_reward_model(tiny_config, trained):
    """Both critics read the reward model's score head at every response position; a fresh adapter
    (B = 0) changes nothing, so they start alike."""
    lora = load_models(_cfg(tiny_config), trained["sft"], trained["reward"])
    whole = load_models(_cfg(tiny_config, **{"critic.kind": "reward"}), trained["sft"], trained["reward"])
    assert isinstance(whole.critic, RewardCritic)
    with torch.no_grad():
        values = lora.critic.values(*_inputs(lora))  # (2, T)
        torch.testing.assert_close(values, whole.critic.values(*_inputs(whole)), atol=1e-5, rtol=1e-5)
    mapped = lora.critic.adopt_normalization(gain=0.4, bias=-1.5, values=values)  # as `critic.normalize` does
    with torch.no_grad():
        torch.testing.assert_close(lora.critic.values(*_inputs(lora)), mapped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mapped, 0.4 * values - 1.5)
    assert lora.scorer.model.score.weight.equal(whole.scorer.model.score.weight)  # the scorer's head untouched


def test_a_reward_model_with_another_tokenizer_is_refused(tiny_config, trained, tmp_path):
    import shutil

    from stages.runtime.models import load_tokenizer

    folder = tmp_path / "reward-other-tokenizer"
    shutil.copytree(trained["reward"], folder)
    other = load_tokenizer(str(folder))
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    other.save_pretrained(folder)
    with pytest.raises(ValueError,
                       match="ppo.critic.kind = 'reward-lora' needs the reward model .* to share the policy's"):
        load_models(_cfg(tiny_config), trained["sft"], str(folder))


def test_a_run_holds_one_copy_of_the_reward_model(tiny_config, trained):
    lora = load_models(_cfg(tiny_config), trained["sft"], trained["reward"])
    whole = load_models(_cfg(tiny_config, **{"critic.kind": "reward"}), trained["sft"], trained["reward"])
    reward_parameters = sum(p.numel() for p in whole.scorer.model.parameters())
    critic_parameters = sum(p.numel() for p in lora.critic.parameters())
    held = {name: sum(p.numel() for p in _held_parameters(m).values())
            for name, m in (("lora", lora), ("whole", whole))}
    # `reward`: policy, reference, reward model and a second reward model; `reward-lora`: the adapters and head instead.
    assert held["whole"] - held["lora"] == reward_parameters - critic_parameters
    # the critic trains what the memory plan counts for it: its adapters and a score-sized head
    shape = model_shape(trained["reward"])
    assert critic_parameters == shape.lora_parameters(_cfg(tiny_config).critic.lora, classifier=True) + shape.hidden
    assert critic_parameters < 0.2 * reward_parameters  # tiny here (width 64); about 0.3% of an 8B model's


def test_training_the_critic_leaves_the_reward_model_and_its_scores_as_they_were(tiny_config, trained, tmp_path,
                                                                               monkeypatch):
    import stages.ppo

    kept, real_load = {}, stages.ppo.load_models
    monkeypatch.setattr(stages.ppo, "load_models", lambda *a, **k: kept.setdefault("models", real_load(*a, **k)))
    result = run_ppo(_cfg(tiny_config, num_iterations=3, learning_rate=3e-3), trained, tmp_path)
    models = kept["models"]
    fresh = RewardScorer.from_pretrained(trained["reward"])
    # The reward model's own weights, bit for bit (peft renames an adapted weight `base_layer`).
    own = {name.replace(".base_layer", ""): p
           for name, p in models.scorer.model.named_parameters() if "lora_" not in name}
    assert own.keys() == dict(fresh.model.named_parameters()).keys()
    assert all(torch.equal(p, fresh.model.get_parameter(name)) for name, p in own.items())
    assert any(p.abs().max() > 0 for name, p in models.scorer.model.named_parameters() if "lora_B" in name)
    assert not torch.equal(models.critic.head.weight, fresh.model.score.weight)  # the value head trained too

    table = result.evaluation
    messages = [json.loads(m) for m in table["prompt_messages"]]
    texts = list(table["policy_response"]) + list(table["sft_response"])
    raw = fresh.score(messages * 2, texts, normalized=False)  # PPO refitted its scorer's gain and bias
    torch.testing.assert_close(models.scorer.score(messages * 2, texts, normalized=False), raw, atol=1e-5, rtol=1e-5)
    # With the trained adapters on, the same model scores otherwise: the test would see a leak.
    batch = fresh.tokenizer.pad({"input_ids": fresh.encode(messages * 2, texts)}, return_tensors="pt")
    with torch.no_grad():
        adapted = last_token_scores(models.scorer.model, batch["input_ids"], batch["attention_mask"])
    assert (adapted - raw).abs().max() > 1e-2

    # The full-state checkpoint holds the critic's trained state only, not the reward model it sits on.
    saved = load_file(str(tmp_path / "state" / "critic.safetensors"))
    assert saved.keys() == dict(models.critic.named_parameters()).keys()
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in models.critic.parameters())
    assert sum(t.numel() for t in saved.values()) < 0.2 * sum(p.numel() for p in fresh.model.parameters())


def test_a_killed_run_resumes_to_the_same_end(tiny_config, trained, tmp_path):
    cfg = _cfg(tiny_config, num_iterations=6, checkpoint_every=3)
    reference, resumed = killed_and_resumed(cfg, trained, tmp_path)

    untimed = lambda figures: {k: v for k, v in figures.items() if not k.startswith("time/")}  # noqa: E731
    assert [untimed(row) for row in resumed.history] == [untimed(row) for row in reference.history]
    assert resumed.metrics == reference.metrics
    for name in ("checkpoint/model.safetensors", "state/critic.safetensors"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "interrupted" / name).read_bytes(), name


def test_a_lora_policy_holds_its_own_weights_in_frozen_dtype_and_hands_over_a_plain_float32_model(tiny_config, trained,
                                                                                               tmp_path):
    lora = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    cfg = _cfg(tiny_config, **{"critic.kind": "reward"}, lora=lora, frozen_dtype="bfloat16", num_iterations=3,
               learning_rate=3e-3)
    models = load_models(cfg, trained["sft"], trained["reward"])
    assert {p.dtype for p in models.policy.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in models.trainable()} == {torch.float32}
    warnings = []
    result = run_ppo(cfg, trained, tmp_path, Reporting(warning=warnings.append))
    # The policy computes in bf16, so the rollout's log-probs are recomputed as the update computes them;
    # what is left is bf16 rounding of shapes that differ (the output head's adapter adds to bf16 logits).
    assert max(row["train/initial_ratio_deviation"] for row in result.history) < 2e-2
    assert not [w for w in warnings if "policy ratio was already" in w]
    assert result.tags["rlhf.trainable_dtype"] == "float32"

    merged = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    assert merged.dtype == torch.float32 and not any("lora" in name for name, _ in merged.named_parameters())
    # Merged in float32: the bf16 weights the run held plus the whole adapter update, none of it rounded away.
    state = load_file(str(tmp_path / "state" / "policy.safetensors"))
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    update = (lora.alpha / lora.r) * state[f"{layer}.lora_B.default.weight"] @ state[f"{layer}.lora_A.default.weight"]
    assert update.abs().max() > 0
    torch.testing.assert_close(merged.get_parameter("model.layers.0.self_attn.q_proj.weight"),
                               state[f"{layer}.base_layer.weight"].float() + update, atol=1e-7, rtol=0)
