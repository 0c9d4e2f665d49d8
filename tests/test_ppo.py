"""The PPO stage on a tiny world: the score rises, a killed run resumes to the same end,
LoRA uses the adapter-disabled reference, and a non-finite loss stops with a clear message."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.config import with_overrides
from rlhf.sections.base import LoRAConfig
from rlhf.sections.ppo import PPOConfig
from stages.common.batches import Sequences
from stages.common.errors import NonFiniteLossError
from stages.common.reporting import Reporting
from stages.rl.ppo_models import load_models, reference_policy
from stages.runtime.forward import forward_response
from stages.runtime.models import load_tokenizer, position_ids_for
from tests.helpers import AUTO_RESOLVED, killed_and_resumed, plain_scores, ppo_scoring, run_ppo, single_turn_rollout


def _cfg(tiny_config, **changes):
    return with_overrides(tiny_config.ppo, AUTO_RESOLVED | changes)


def test_score_rises_over_a_short_run(tiny_config, trained, tmp_path):
    cfg = _cfg(tiny_config, num_iterations=24, rollout_batch_size=16, num_minibatches=2, learning_rate=1e-3,
               checkpoint_every=100, kl={"target": None, "init_coef": 0.01}, evaluation={"kl_budget": 0.05})
    samples, warnings, rollouts = [], [], {}
    result = run_ppo(cfg, trained, tmp_path, Reporting(samples=lambda t, i: samples.append(i), warning=warnings.append,
                                                     rollouts=lambda t, i: rollouts.update({i: t})))
    scores = [row["rollout/score"] for row in result.history]
    assert np.mean(scores[-6:]) > np.mean(scores[:6]) + 0.3, scores
    # The reward normalisation is refitted on the first rollouts: PPO starts at mean 0, std 1.
    assert abs(result.history[0]["rollout/score"]) < 1e-5 and abs(result.history[0]["rollout/score_std"] - 1) < 1e-5
    assert {"normalization/gain", "normalization/bias"} <= set(result.metrics)
    assert max(row["train/initial_ratio_deviation"] for row in result.history) <= 1e-5
    assert len(result.history) == 24 and samples == [2 * k for k in range(1, 13)]
    for key in ("rollout/kl", "rollout/kl_coef", "rollout/entropy", "train/policy_loss", "train/value_loss",
                "train/clip_fraction", "train/approx_kl", "train/explained_variance", "train/ratio_mean",
                "train/ratio_max", "rollout/response_length", "rollout/eos_rate", "train/learning_rate",
                "time/generate", "time/forward", "time/values", "time/reference", "time/score", "time/advantages",
                "time/train", "time/tokens_per_second", "rollout/non_score_reward",
                "rollout/score_std", "train/initial_ratio_deviation"):
        assert key in result.history[-1], key
    assert result.history[-1]["train/learning_rate"] < result.history[0]["train/learning_rate"]  # linear decay
    # Every iteration's episodes reach the caller, with the figures the history summarises.
    assert sorted(rollouts) == list(range(1, 25))
    for row in result.history:
        table = rollouts[row["iteration"]]
        assert list(table.columns) == ["prompt_messages", "response", "score", "kl"] and len(table) == 16
        assert table["score"].mean() == pytest.approx(row["rollout/score"], abs=1e-5)
        assert table["kl"].mean() == pytest.approx(row["rollout/kl"], rel=1e-4, abs=1e-6)
        assert json.loads(table["prompt_messages"][0])[-1]["role"] == "user"
    files = {p.name for p in result.checkpoint.iterdir()}
    assert "model.safetensors" in files and not any("value" in name for name in files)
    assert AutoModelForCausalLM.from_pretrained(result.checkpoint).config.model_type == "llama"
    assert {"eval/score", "eval/score_sft", "eval/kl", "eval/win_rate_rm"} <= set(result.metrics)
    assert len(result.evaluation) == len(trained["eval_prompts"]) * cfg.evaluation.samples_per_prompt
    # kl_budget acts on the rollouts and on the final policy alike
    assert result.metrics["eval/kl"] > cfg.evaluation.kl_budget and warnings[-1] == (
        f"the final policy's mean KL per sequence on the held-out prompts, {result.metrics['eval/kl']:.2f}, is over "
        f"the budget of {cfg.evaluation.kl_budget}")
    assert any("is over the budget of 0.05" in w and w.startswith("iteration ") for w in warnings)


@pytest.mark.parametrize("normalize_critic, estimator", [(False, "gae"), (True, "gae"), (None, "grpo")])
def test_killed_run_resumes_from_its_checkpoint_to_the_same_end(tiny_config, trained, tmp_path, normalize_critic,
                                                                estimator):
    critic = {} if normalize_critic is None else {"critic": {"normalize": normalize_critic}}
    cfg = _cfg(tiny_config, num_iterations=6, checkpoint_every=3, **critic,
               advantage_estimator=estimator, samples_per_prompt=1 if estimator == "gae" else 2)
    reference, resumed = killed_and_resumed(cfg, trained, tmp_path, mid_swap=estimator == "grpo")
    assert [row["rollout/score"] for row in resumed.history] == [row["rollout/score"] for row in reference.history]
    assert resumed.metrics == reference.metrics
    a = (tmp_path / "whole" / "checkpoint" / "model.safetensors").read_bytes()
    b = (tmp_path / "interrupted" / "checkpoint" / "model.safetensors").read_bytes()
    assert a == b


def test_evaluations_every_eval_every_iterations_leave_training_as_it_was(tiny_config, trained, tmp_path):
    plain = run_ppo(_cfg(tiny_config, num_iterations=4, evaluation={"every": None}), trained, tmp_path / "plain")
    logged, tables, progress = {}, {}, []
    cfg = _cfg(tiny_config, num_iterations=4, evaluation={"every": 2})
    result = run_ppo(cfg, trained, tmp_path / "evaluated", Reporting(
        metrics=lambda figures, i: logged.setdefault(i, {}).update(figures),
        evaluation=lambda table, i: tables.update({i: table}),
        progress=lambda done, total: progress.append((done, total))))
    assert sorted(tables) == [2]  # the last evaluation is the stage's result, not a midway report
    assert list(tables[2]["sft_response"]) == list(result.evaluation["sft_response"])  # one baseline for all
    assert {"eval/win_rate_rm", "eval/kl", "eval/score"} <= set(logged[2]) and "eval/kl" in result.history[1]
    assert "eval/kl" not in logged[1] and "eval/kl" not in logged[3]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    # Sampling for the evaluation draws from its own seeds: the training run is the same to the bit.
    assert [r["rollout/score"] for r in result.history] == [r["rollout/score"] for r in plain.history]
    assert result.metrics == plain.metrics
    assert ((tmp_path / "plain" / "checkpoint" / "model.safetensors").read_bytes()
            == (tmp_path / "evaluated" / "checkpoint" / "model.safetensors").read_bytes())
    # The baseline is the SFT policy's, even when the reference is refreshed along the way.
    refreshed = run_ppo(_cfg(tiny_config, num_iterations=2, ref_refresh_every=1), trained, tmp_path / "refreshed")
    assert list(refreshed.evaluation["sft_response"]) == list(plain.evaluation["sft_response"])


def test_normalize_critic_maps_the_critic_like_the_scorer_maps_raw_scores(tiny_config, trained):
    models = load_models(_cfg(tiny_config, critic={"kind": "reward"}), trained["sft"], trained["reward"])
    tokenizer = models.tokenizer
    queries = tokenizer(["<s><|user|>Describe the cat.<|assistant|>"], return_tensors="pt", add_special_tokens=False)
    responses = tokenizer(["The cat is warm.</s>"], return_tensors="pt", add_special_tokens=False)
    inputs = (None, Sequences(queries["input_ids"], queries["attention_mask"], responses["input_ids"],
                              responses["attention_mask"]), models.passes("test"))
    with torch.no_grad():
        raw = models.critic.values(*inputs)  # (1, T)
    mapped = models.critic.adopt_normalization(gain=0.4, bias=-1.5, values=raw)
    torch.testing.assert_close(mapped, 0.4 * raw - 1.5)
    with torch.no_grad():
        torch.testing.assert_close(models.critic.values(*inputs), mapped, rtol=1e-5, atol=1e-5)


def test_left_padding_does_not_change_log_probs(tiny_config, trained):
    models = load_models(_cfg(tiny_config), trained["sft"], trained["reward"])
    tokenizer = models.tokenizer
    prompts = ["<s><|user|>Describe the cat.<|assistant|>",
               "<s><|user|>What do you think of our river? Please.<|assistant|>"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert batch["attention_mask"][0, 0] == 0  # the shorter prompt is left-padded
    assert position_ids_for(batch["attention_mask"])[0].tolist()[-1] == batch["attention_mask"][0].sum() - 1
    responses = tokenizer(["The cat is warm.</s>", "The river is calm.</s>"], return_tensors="pt", padding=True,
                          padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        padded, _ = forward_response(models.policy, Sequences(batch["input_ids"], batch["attention_mask"],
                                                              responses["input_ids"], responses["attention_mask"]),
                                     models.passes("test"))
        alone = tokenizer([prompts[0]], return_tensors="pt", add_special_tokens=False)
        single, _ = forward_response(models.policy, Sequences(alone["input_ids"], alone["attention_mask"],
                                                              responses["input_ids"][:1],
                                                              responses["attention_mask"][:1]), models.passes("test"))
    n = int(responses["attention_mask"][0].sum())
    assert torch.allclose(padded[0, :n], single[0, :n], atol=1e-4)


def test_lora_reference_is_the_policy_with_adapters_disabled(tiny_config, trained, tmp_path):
    from stages.rl.rollout import policy_sampler

    cfg = _cfg(tiny_config, lora=LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), num_iterations=2)
    models = load_models(cfg, trained["sft"], trained["reward"])
    assert models.reference is None
    frame = trained["prompts"].head(4)
    batch = single_turn_rollout(models, policy_sampler(models), list(frame["prompt"]), cfg.sampling)
    assert torch.allclose(batch.logprobs, batch.ref_logprobs, atol=1e-5)  # LoRA starts as a no-op
    trainable = sum(p.numel() for p in models.policy.parameters() if p.requires_grad)
    assert trainable < 0.2 * sum(p.numel() for p in models.policy.parameters())
    with reference_policy(models) as reference:
        assert reference is models.policy
    result = run_ppo(cfg, trained, tmp_path)
    from safetensors import safe_open

    with safe_open(str(result.checkpoint / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    assert names and not any("lora" in name for name in names)  # adapters merged into plain weights
    merged = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    sft = AutoModelForCausalLM.from_pretrained(trained["sft"], use_safetensors=True)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], sft.state_dict()[q])  # the trained adapter is in them


def test_value_head_on_the_policy_body(tiny_config, trained, tmp_path):
    result = run_ppo(_cfg(tiny_config, critic={"kind": "shared"}, num_iterations=2), trained, tmp_path)
    assert np.isfinite(result.history[-1]["train/value_loss"])


@pytest.mark.parametrize("critic", ["shared", "reward"])
def test_critic_warm_up_trains_the_critic_and_leaves_the_policy_as_it_was(tiny_config, trained, tmp_path, critic):
    from safetensors.torch import load_file

    cfg = _cfg(tiny_config, critic={"kind": critic, "freeze_policy_iterations": 2}, num_iterations=3,
               checkpoint_every=2, learning_rate=1e-3)
    states = {}

    def keep_state(figures, iteration):
        if iteration == 3:  # the state saved after iteration 2, before iteration 3's checkpoint replaces it
            states.update(load_file(str(tmp_path / "state" / "policy.safetensors")),
                          critic=load_file(str(tmp_path / "state" / "critic.safetensors")),
                          optimizer=torch.load(tmp_path / "state" / "optimizer.pt"))

    result = run_ppo(cfg, trained, tmp_path, Reporting(metrics=keep_state))
    critic_after_two, optimizer_after_two = states.pop("critic"), states.pop("optimizer")
    models = load_models(cfg, trained["sft"], trained["reward"])
    # Adam stepped only the critic: the policy's parameters (first in the optimizer) have no state yet,
    # so its first real update is not scaled by moments gathered from zero gradients.
    n_policy = sum(1 for p in models.policy.parameters() if p.requires_grad)
    assert sorted(optimizer_after_two["state"]) == list(range(n_policy, len(models.trainable())))
    sft, initial_critic = models.policy.state_dict(), models.critic.state_dict()
    for name, weight in states.items():  # the policy, bit for bit, after two warm-up iterations
        assert torch.equal(weight, sft[name]), name
    assert all(abs(row["rollout/kl"]) < 1e-4 for row in result.history[:2])  # sampling pass vs a fresh forward
    assert any(not torch.equal(critic_after_two[name], initial_critic[name]) for name in critic_after_two)
    final = load_file(str(result.checkpoint / "model.safetensors"))
    assert any(not torch.equal(final[name], sft[name]) for name in final)  # iteration 3 trains it


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++", "reinforce++-baseline"])
def test_critic_free_estimators_sample_groups_and_train_no_critic(tiny_config, trained, tmp_path, estimator):
    cfg = _cfg(tiny_config, num_iterations=2, rollout_batch_size=8, samples_per_prompt=4, advantage_estimator=estimator,
               evaluation={"every": None}, kl={"init_coef": 0.1, "target": None})
    models = load_models(cfg, trained["sft"], trained["reward"])
    assert not models.critic.learns and models.trainable() == [p for p in models.policy.parameters() if p.requires_grad]
    rollouts = {}
    result = run_ppo(cfg, trained, tmp_path, Reporting(rollouts=lambda t, i: rollouts.update({i: t})))
    for table in rollouts.values():  # 2 prompts a batch, each answered 4 times on consecutive rows
        prompts = list(table["prompt_messages"])
        assert len(prompts) == 8 and all(len(set(prompts[g:g + 4])) == 1 for g in (0, 4)) and prompts[0] != prompts[4]
    figures = result.history[-1]
    assert not {"train/value_loss", "train/value_clip_fraction", "train/explained_variance",
                "train/critic_grad_norm"} & set(figures)
    # GRPO's KL is a loss term at beta, not a reward; the others pay it in the reward
    assert ("train/kl_loss" in figures) == (estimator == "grpo")
    assert (figures["rollout/non_score_reward"] == 0.0) == (estimator == "grpo")
    assert not (tmp_path / "state" / "critic.safetensors").exists()
    assert {"eval/win_rate_rm", "eval/kl"} <= set(result.metrics)


def test_group_estimators_need_groups_of_whole_responses():
    with pytest.raises(ValueError, match="samples_per_prompt to 2 or more"):
        PPOConfig(advantage_estimator="rloo", samples_per_prompt=1)
    with pytest.raises(ValueError, match=r"samples_per_prompt \(3\) must divide rollout_batch_size \(64\)"):
        PPOConfig(advantage_estimator="grpo", samples_per_prompt=3)
    with pytest.raises(ValueError, match=r"'reinforce\+\+' learns no critic; leave the critic section out"):
        PPOConfig(advantage_estimator="reinforce++", critic={"freeze_policy_iterations": 1})
    assert PPOConfig(advantage_estimator="reinforce++").critic is None and PPOConfig().critic.kind == "reward"
    assert PPOConfig(advantage_estimator="reinforce++").samples_per_prompt == 1  # the batch is its baseline


@pytest.mark.parametrize("estimator, group, beta", [("gae", 1, 0.05), ("reinforce++", 1, 0.05), ("grpo", 4, 0.2),
                                                    ("rloo", 4, 0.05), ("reinforce++-baseline", 4, 0.05)])
def test_choosing_an_estimator_alone_gives_a_config_that_runs(estimator, group, beta):
    """The run form's one field: `auto` group size and KL coefficient follow the estimator, explicit ones stay."""
    from rlhf.config import load_config

    cfg = load_config("configs/demo.yaml", {"ppo.advantage_estimator": estimator})
    assert (cfg.ppo.samples_per_prompt, cfg.ppo.kl.init_coef) == (group, beta)
    explicit = load_config("configs/demo.yaml", {"ppo.advantage_estimator": estimator, "ppo.samples_per_prompt": 8,
                                                 "ppo.kl.init_coef": 0.1})
    assert (explicit.ppo.samples_per_prompt, explicit.ppo.kl.init_coef) == (8, 0.1)
    # resolved once: a dumped config reads back the same
    assert PPOConfig.model_validate(cfg.ppo.model_dump()) == cfg.ppo


def test_warm_up_must_leave_iterations_to_train():
    with pytest.raises(ValueError, match="freeze_policy_iterations"):
        PPOConfig(num_iterations=2, critic={"freeze_policy_iterations": 2})


def test_a_reference_refresh_under_lora_is_refused():
    with pytest.raises(ValueError, match="ref_refresh_every cannot act with lora"):
        PPOConfig(lora=LoRAConfig(), ref_refresh_every=10)


def test_non_finite_loss_stops_naming_the_iteration_and_keeps_the_last_checkpoint(tiny_config, trained, tmp_path,
                                                                                  monkeypatch):
    from stages.rewards.scoring import RewardScorer

    calls = {"n": 0}
    original = RewardScorer.raw_scores

    def poisoned(self, sequences, batch_size=64):
        calls["n"] += 1
        scores = original(self, sequences, batch_size)
        return scores * float("nan") if calls["n"] == 3 else scores

    monkeypatch.setattr(RewardScorer, "raw_scores", poisoned)
    with pytest.raises(NonFiniteLossError, match="at iteration 3"):
        # no evaluations between iterations: they would score too, and move the poisoned call
        run_ppo(_cfg(tiny_config, num_iterations=4, checkpoint_every=2, evaluation={"every": None}), trained, tmp_path)
    assert json.loads((tmp_path / "state" / "loop.json").read_text())["iteration"] == 2


def test_truncated_responses_are_scored_as_they_are_then_penalised(tiny_config, trained):
    from stages.rl.rollout import policy_sampler

    models = load_models(_cfg(tiny_config), trained["sft"], trained["reward"])
    prompts = trained["prompts"].head(4)
    messages = [json.loads(m) for m in prompts["prompt_messages"]]
    torch.manual_seed(0)
    cfg = _cfg(tiny_config, sampling={"response_length": 2})
    batch = single_turn_rollout(models, policy_sampler(models), list(prompts["prompt"]), cfg.sampling)
    batch = dataclasses.replace(batch, messages=messages)
    assert not batch.has_eos.any()  # two tokens never finish a demo reply
    as_they_are = models.scorer.score(messages, batch.texts, normalized=False, complete=[False] * 4)
    completed = models.scorer.score(messages, batch.texts, normalized=False)
    raw = ppo_scoring(cfg, models).raw_scores(batch, {})
    torch.testing.assert_close(raw["reward_model"], as_they_are)
    assert not torch.allclose(raw["reward_model"], completed)  # an appended EOS would have changed the score
    assert ppo_scoring(cfg, models).scores_of(raw, batch, {}, {}).reward.tolist() == [-3.0] * 4  # missing_eos_score
    unpenalised = ppo_scoring(_cfg(tiny_config, missing_eos_score=None), models).scores_of(raw, batch, {}, {})
    torch.testing.assert_close(unpenalised.reward, unpenalised.reported)


def test_the_reward_model_reads_the_policys_prompt_ids_and_packed_rows_as_rendered_padded_ones(tiny_config, trained):
    """The tiny world's reward model shares the policy's tokenizer: the rollout's prompt ids are what
    rendering the prompts again gives, so they are read as they are; the responses are encoded from
    their texts (a sampled token sequence need not be the one its text encodes to: 5 of these 8);
    and the scores, packed (`padding_free`) or padded, re-rendered or not, are the same."""
    from stages.rl.rollout import policy_sampler

    models = load_models(_cfg(tiny_config, padding_free=True), trained["sft"], trained["reward"])
    scorer = models.scorer
    assert scorer.policy_tokens and scorer.padding_free is True
    prompts = trained["prompts"].head(8)
    messages = [json.loads(m) for m in prompts["prompt_messages"]]
    torch.manual_seed(0)
    batch = single_turn_rollout(models, policy_sampler(models), list(prompts["prompt"]), _cfg(tiny_config).sampling)
    assert batch.has_eos.any() and batch.mask.sum(1).min() < batch.mask.sum(1).max()
    prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(batch.queries, batch.query_mask, strict=True)]
    rendered = scorer.encode(messages, batch.texts, batch.has_eos.tolist())
    assert scorer.encode(messages, batch.texts, batch.has_eos.tolist(), prompt_ids) == rendered
    sampled = [p + r[m > 0].tolist() for p, r, m in zip(prompt_ids, batch.responses, batch.mask, strict=True)]
    assert sum(a != b for a, b in zip(sampled, rendered, strict=True)) == 5
    batch, scoring = dataclasses.replace(batch, messages=messages), ppo_scoring(_cfg(tiny_config), models)
    packed = scoring.raw_scores(batch, {})["reward_model"]
    scorer.padding_free, scorer.policy_tokens = False, False
    padded = scoring.raw_scores(batch, {})["reward_model"]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_on_the_cpu_keeps_float32_weights_and_a_bf16_reference(tiny_config, trained, tmp_path):
    cfg = _cfg(tiny_config, num_iterations=2, precision="bf16-mixed", frozen_dtype="bfloat16")
    models = load_models(cfg, trained["sft"], trained["reward"])
    assert {p.dtype for p in models.trainable()} == {torch.float32}
    assert models.reference.dtype == torch.bfloat16 and models.scorer.model.dtype == torch.bfloat16
    result = run_ppo(cfg, trained, tmp_path)
    old_logprobs = result.tags.pop("rlhf.old_logprobs")
    assert result.tags == {"rlhf.trainable_dtype": "float32", "rlhf.autocast_dtype": "bfloat16",
                           "rlhf.checkpoint_dtype": "float32", "rlhf.held_as": "one process"}
    # old_logprobs: auto compared the first batch's sampled log-probs with the update's bf16 pass, found them
    # past 1e-3 and recomputed them; what is left is bf16 rounding (measured 0 with the reward-model critic,
    # 4e-3 with the shared value head)
    assert old_logprobs.startswith("recompute (auto: the first batch's sampled log-probs were at most"), old_logprobs
    assert "past the tolerance 0.001" in old_logprobs
    assert max(row["train/initial_ratio_deviation"] for row in result.history) <= 2e-2
    assert np.isfinite(result.history[-1]["train/policy_loss"])


def test_a_ratio_off_1_before_the_first_update_is_warned_about(tiny_config):
    from stages.rl.ppo_report import warnings_of

    figures = {"rollout/kl": 1.0, "rollout/response_length": 8.0, "rollout/eos_rate": 1.0, "train/ratio_max": 1.0,
               "train/initial_ratio_deviation": 0.03}
    (message,) = warnings_of(_cfg(tiny_config), figures, 8.0, 5)
    assert message.startswith("iteration 5: before the first update the policy ratio was already 0.03 from 1")


def test_a_length_collapse_within_one_iteration_is_warned_about(tiny_config):
    from stages.rl.ppo_report import warnings_of

    figures = {"rollout/kl": 1.0, "rollout/response_length": 2.6, "rollout/eos_rate": 1.0, "train/ratio_max": 1.0,
               "train/initial_ratio_deviation": 0.0}
    found = warnings_of(_cfg(tiny_config, warnings={"length_drift": 0.9}), figures, 8.0, 2, previous_length=8.0)
    assert found == ["iteration 2: mean response length collapsed from 8.0 to 2.6 tokens in one iteration: the "
                     "policy is learning to stop early (check the value loss and the KL)"]
    assert warnings_of(_cfg(tiny_config, warnings={"length_drift": 0.9}), figures, 8.0, 2, previous_length=3.0) == []


def test_tokenizer_padding_sides_are_what_each_stage_needs(trained):
    assert load_tokenizer(trained["sft"]).padding_side == "left"  # generation
    assert load_tokenizer(trained["reward"], padding_side="right").padding_side == "right"


def test_critic_from_a_reward_model_with_another_tokenizer_is_refused(tiny_config, trained, tmp_path):
    import shutil

    folder = tmp_path / "reward-other-tokenizer"
    shutil.copytree(trained["reward"], folder)
    other = load_tokenizer(str(folder))
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    other.save_pretrained(folder)
    with pytest.raises(ValueError, match="share the policy's tokenizer"):
        load_models(_cfg(tiny_config, critic={"kind": "reward"}), trained["sft"], str(folder))
    load_models(_cfg(tiny_config, critic={"kind": "reward"}), trained["sft"], trained["reward"])  # same tokenizer: fine


def test_draw_samples_the_categorical_it_is_given():
    from stages.engines.sampler import draw

    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4)
    counts = torch.bincount(draw(probs).squeeze(1), minlength=4).float() / 20000
    assert counts[1] == 0  # a zero-probability token is never drawn
    assert torch.allclose(counts, probs[0], atol=0.01), counts


def test_sampling_pass_log_probs_and_values_equal_a_fresh_forward(tiny_config, trained):
    """What the rollout reuses from the KV-cached sampling steps is what a full forward computes."""
    from stages.common.tensors import entropy_of, logprobs_of, response_mask
    from stages.engines.sampler import Sampling
    from stages.rl.ppo_models import policy_and_values
    from stages.rl.rollout import policy_sampler

    cfg = _cfg(tiny_config, sampling={"temperature": 0.7}, critic={"kind": "shared"})
    models = load_models(cfg, trained["sft"], trained["reward"])
    models.train(False)
    torch.manual_seed(0)
    prompts = list(trained["prompts"]["prompt"][:8])  # prompts of different lengths: left padding
    sampled = policy_sampler(models).generate(prompts, Sampling(cfg.sampling.response_length, cfg.sampling.temperature))
    mask = response_mask(sampled.responses, models.stop_ids)
    assert (mask.sum(1) < sampled.responses.shape[1]).any()  # some responses ended early: truncation is covered
    with torch.inference_mode():
        logits, values = policy_and_values(models, Sequences(sampled.queries, sampled.query_mask, sampled.responses,
                                                             mask))
        sampled_values = models.critic.values(sampled.hidden, None, models.passes("test"))
    torch.testing.assert_close(sampled.logprobs * mask, logprobs_of(logits, sampled.responses, 0.7) * mask,
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(sampled.entropy * mask, entropy_of(logits, 0.7) * mask, atol=1e-4, rtol=0)
    torch.testing.assert_close(sampled_values * mask, values * mask, atol=1e-4, rtol=0)


def test_micro_batch_drops_only_columns_that_are_padding_in_every_row(tiny_config, trained):
    from stages.envs.episode import Episode, Segment
    from stages.rl.batch import KLWeights, TrainingBatch, micro_batch
    from stages.rl.teacher import Marks

    models = load_models(_cfg(tiny_config), trained["sft"], trained["reward"])
    pad, eos = models.tokenizer.pad_token_id, models.tokenizer.eos_token_id
    queries = torch.tensor([[pad, pad, 5, 6], [pad, pad, pad, 7], [1, 2, 3, 4]])
    query_mask = (queries != pad).long()
    responses = torch.tensor([[8, eos, pad, pad], [9, pad, pad, pad], [10, 11, 12, eos]])
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    per_token = torch.arange(12.0).view(3, 4)
    rows = zip(queries, query_mask, responses, mask, "abc", strict=True)
    episodes = [Episode(segments=[Segment(ids=q[m.bool()].tolist(), trainable=False),
                                  Segment(ids=r[k.bool()].tolist(), trainable=True)],
                        answer=text) for q, m, r, k, text in rows]
    batch = TrainingBatch(queries=queries, query_mask=query_mask, responses=responses, mask=mask, logprobs=per_token,
                          ref_logprobs=per_token, values=per_token, entropy=per_token, engine_logprobs=per_token,
                          teacher=Marks(), has_eos=torch.ones(3, dtype=torch.bool), messages=[[], [], []],
                          episodes=episodes, trainable=mask, turn_rewards=torch.zeros_like(mask),
                          restarts=torch.zeros_like(mask),
                          scores=plain_scores(torch.zeros(3)), kl=per_token, advantages=per_token, returns=per_token,
                          engine_weights=torch.ones_like(mask), counted=mask, kl_weights=KLWeights(0.0, 0.0, 0.0))
    micro = micro_batch(batch, torch.tensor([1, 0]))
    assert micro.queries.tolist() == [[pad, 7], [5, 6]] and micro.query_mask.tolist() == [[0, 1], [1, 1]]
    assert micro.responses.tolist() == [[9, pad], [8, eos]] and micro.values.tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert micro.advantages.tolist() == [[4.0, 5.0], [0.0, 1.0]] and micro.texts == ["b", "a"]  # every field, one rule
    assert [episode.answer for episode in micro.episodes] == ["b", "a"]
    # The trimmed rows give the model the same inputs at the same positions.
    with torch.inference_mode():
        full, _ = forward_response(models.policy, Sequences(queries[[1, 0]], query_mask[[1, 0]], responses[[1, 0]],
                                                            mask[[1, 0]]), models.passes("test"))
        trimmed, _ = forward_response(models.policy, micro.sequences, models.passes("test"))
    torch.testing.assert_close(trimmed * micro.mask[..., None], full[:, :2] * micro.mask[..., None], atol=1e-5, rtol=0)


def test_a_rollout_sampled_in_pieces_is_the_one_batch_a_full_pass_computes(tiny_config, trained):
    """`sampling.micro_batch_size`: pieces sampled and scored apart, then padded into one batch, hold
    the log-probs and values one pass over the joined batch computes (padding changes nothing)."""
    from stages.common.tensors import logprobs_of
    from stages.rl.ppo_models import policy_and_values
    from stages.rl.rollout import policy_sampler

    cfg = _cfg(tiny_config, sampling={"micro_batch_size": 3, "response_length": 12})
    models = load_models(cfg, trained["sft"], trained["reward"])
    prompts = list(trained["prompts"]["prompt"][:8])
    torch.manual_seed(0)
    timings: dict[str, float] = {}
    batch = single_turn_rollout(models, policy_sampler(models), prompts, cfg.sampling, timings)
    assert len(batch.texts) == 8 and batch.queries.shape[0] == 8 and timings["generate"] > 0
    assert [m[0]["content"] for m in batch.messages] == prompts
    with torch.no_grad():
        logits, values = policy_and_values(models, batch.sequences)
        with reference_policy(models) as reference:
            ref_logits, _ = forward_response(reference, batch.sequences, models.passes("test"))
    mask = batch.mask
    torch.testing.assert_close(logprobs_of(logits, batch.responses, cfg.sampling.temperature) * mask, batch.logprobs,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs_of(ref_logits, batch.responses, cfg.sampling.temperature) * mask,
                               batch.ref_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(values * mask, batch.values, atol=1e-5, rtol=0)
    # The pieces' responses were padded to the longest: nothing real was cut.
    assert models.tokenizer.batch_decode(batch.responses, skip_special_tokens=True) == batch.texts


def test_every_auto_is_resolved_as_the_stage_starts_and_reported(tiny_config, trained, tmp_path):
    """`train_ppo` resolves every `auto` before anything else (`stages.resolved`: here, on the tiny
    world's CPU, all at once, fp32, no warm-up for a critic from the reward model, the token budget of
    two rows) and the models' own probes as they load, and reports each as an `auto.<field>` param;
    explicit settings are not reported. `old_logprobs` is the first batch's to decide (its tag)."""
    reported = {}
    cfg = with_overrides(tiny_config.ppo, {"num_iterations": 1, "micro_batch_size": 2, "micro_batch_tokens": "auto",
                                           "padding_free": "auto"})
    assert cfg.sampling.micro_batch_size == "auto" and cfg.precision == cfg.old_logprobs == "auto"
    run_ppo(cfg, trained, tmp_path, Reporting(params=reported.update))
    longest = cfg.max_prompt_length + cfg.sampling.response_length
    assert reported == {"auto.sharded_sampling": "whole", "auto.sampling.micro_batch_size": None,
                        "auto.precision": "fp32",
                        "auto.micro_batch_tokens": 2 * longest, "auto.critic.freeze_policy_iterations": 0,
                        "auto.padding_free": "auto (each pass packed where it saves a tenth)"}
