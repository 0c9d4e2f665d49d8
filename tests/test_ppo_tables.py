"""PPO's named choices are tables in `stages.math.ppo_math` (estimators, KL estimators, loss
aggregations): the config offers exactly the table's names, an unknown name is refused, and each
estimator in the table computes its published equation (the equations themselves are worked by
hand in tests/test_ppo_math.py). And the one batch type (`stages.rl.batch`): rows, concatenation and
trimming act on every field by the axis it declares."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from rlhf.config_ppo import KLConfig, PPOConfig
from stages.common.tensors import masked_whiten
from stages.envs.episode import Episode
from stages.math.ppo_math import (
    AGGREGATIONS,
    ESTIMATORS,
    KL_ESTIMATORS,
    EstimatorInputs,
    aggregate,
    discounted_returns,
    estimator_named,
    gae,
    group_baselined,
    grpo_advantages,
    kl_estimate,
    rloo_advantages,
    sequence_rewards,
    token_rewards,
)
from stages.rl.batch import Rollout, TrainingBatch, concat, micro_batch, rows_of


def _choices(model, name: str) -> tuple:
    return typing.get_args(model.model_fields[name].annotation)


def test_the_config_offers_exactly_the_tables_names():
    assert _choices(PPOConfig, "advantage_estimator") == tuple(ESTIMATORS)
    assert _choices(KLConfig, "estimator") == tuple(KL_ESTIMATORS)
    assert _choices(PPOConfig, "loss_aggregation") == tuple(AGGREGATIONS)


def test_unknown_names_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo2'; expected one of gae, grpo"):
        estimator_named("ppo2")
    with pytest.raises(ValueError, match="unknown KL estimator 'k2'"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k2")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "sum")


def _inputs(**changes) -> EstimatorInputs:
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    return EstimatorInputs(scores=torch.tensor([1.0, -0.5, 2.0, 0.25]), kl=torch.rand(4, 3) * mask, beta=0.1,
                           turn_rewards=changes.pop("turn_rewards", torch.zeros(4, 3)),
                           mask=mask, values=torch.rand(4, 3) * mask, group_size=2, gamma=0.9, lam=0.8,
                           **changes)


def test_each_estimator_in_the_table_is_its_equation():
    e = _inputs()
    rewards = token_rewards(e.scores, e.kl, e.beta, e.mask)
    expected = {
        "gae": gae(rewards, e.values, e.mask, e.gamma, e.lam),
        "grpo": (grpo_advantages(e.scores, e.mask, 2), None),
        "rloo": (rloo_advantages(sequence_rewards(e.scores, e.kl, e.beta, e.mask), e.mask, 2), None),
        "reinforce++": (discounted_returns(rewards, e.mask, e.gamma), None),
        "reinforce++-baseline": (discounted_returns(token_rewards(group_baselined(e.scores, 2), e.kl, e.beta, e.mask),
                                                    e.mask, e.gamma), None),
        "distill": (rewards * e.mask, None),  # each token's own reward: discount 0, no baseline
    }
    for name, (advantages, returns) in expected.items():
        got, got_returns = ESTIMATORS[name].estimate(e, masked_whiten)
        torch.testing.assert_close(got, advantages, rtol=0, atol=0, msg=name)
        assert (got_returns is None) == (returns is None), name
        if returns is not None:
            torch.testing.assert_close(got_returns, returns, rtol=0, atol=0)
    # Whitening: gae and the reinforce++ family over the batch; the group estimators only when asked.
    assert {name for name, estimator in ESTIMATORS.items() if estimator.whitened} == {
        "gae", "reinforce++", "reinforce++-baseline"}


def test_a_teachers_dense_term_is_each_tokens_reward_and_sums_into_the_group_estimators_scores():
    dense = torch.tensor([[-0.5, 0.25, 0.0], [0.5, -1.0, 0.0], [0.125, 0.0, 0.0], [0.0, 0.0, -0.25]])
    e, plain = _inputs(dense=dense), _inputs()
    torch.testing.assert_close(e.token_rewards(), plain.token_rewards() + dense * e.mask)
    torch.testing.assert_close(e.episode_scores(), e.scores + (dense * e.mask).sum(1))
    pure = dataclasses.replace(e, beta=0.0, scores=torch.zeros(4))  # no KL to the SFT policy, no reward terms
    distilled, returns = ESTIMATORS["distill"].estimate(pure, masked_whiten)
    torch.testing.assert_close(distilled, dense * e.mask)  # pure distillation: A_t = w (ln q - ln p) at t
    assert returns is None
    grpo, _ = ESTIMATORS["grpo"].estimate(e, masked_whiten)
    torch.testing.assert_close(grpo, grpo_advantages(e.scores + (dense * e.mask).sum(1), e.mask, 2))


def test_gae_whitens_its_rewards_with_the_whitening_it_is_given():
    e = _inputs(whiten_rewards=True)
    seen = []

    def whiten(x, mask, shift_mean=True):
        seen.append(shift_mean)
        return masked_whiten(x, mask, shift_mean)

    advantages, _ = ESTIMATORS["gae"].estimate(e, whiten)
    rewards = masked_whiten(token_rewards(e.scores, e.kl, e.beta, e.mask), e.mask, shift_mean=False)
    torch.testing.assert_close(advantages, gae(rewards, e.values, e.mask, e.gamma, e.lam)[0], rtol=0, atol=0)
    assert seen == [False]  # the rewards' scale, not their mean


def _rollout(prompt_width: int, steps: int, first: int) -> Rollout:
    """Two rows whose tensors count up from `first`, so every value says where it came from."""
    def counting(width: int) -> torch.Tensor:
        return torch.arange(first, first + 2 * width, dtype=torch.float).view(2, width)

    return Rollout(queries=counting(prompt_width).long(), query_mask=torch.ones(2, prompt_width, dtype=torch.long),
                   responses=counting(steps).long(), mask=torch.ones(2, steps), logprobs=counting(steps),
                   ref_logprobs=counting(steps), values=None, entropy=counting(steps),
                   has_eos=torch.tensor([True, False]), texts=[f"t{first}", f"u{first}"],
                   prompts=[f"p{first}", f"q{first}"], trainable=torch.ones(2, steps), turn_rewards=counting(steps),
                   episodes=[Episode(segments=[], answer=f"t{first}"), Episode(segments=[], answer=f"u{first}")])


def test_concat_pads_prompts_on_the_left_and_responses_on_the_right_and_joins_the_rest():
    joined = concat([_rollout(1, 3, 0), _rollout(2, 1, 100)], pad_id=-1)
    assert joined.queries.tolist() == [[-1, 0], [-1, 1], [100, 101], [102, 103]]
    assert joined.query_mask.tolist() == [[0, 1], [0, 1], [1, 1], [1, 1]]
    assert joined.responses.tolist() == [[0, 1, 2], [3, 4, 5], [100, -1, -1], [101, -1, -1]]
    assert joined.logprobs.tolist() == [[0, 1, 2], [3, 4, 5], [100, 0, 0], [101, 0, 0]]
    assert joined.has_eos.tolist() == [True, False, True, False]
    assert joined.texts == ["t0", "u0", "t100", "u100"] and joined.values is None
    assert [e.answer for e in joined.episodes] == joined.texts  # a per-row list, joined as the texts are


def test_concat_pads_a_response_field_of_several_figures_per_token_along_the_tokens():
    first, second = _rollout(1, 3, 0), _rollout(1, 1, 100)
    first.teacher_top = torch.arange(12).view(2, 3, 2)  # (2, 3, k=2): two ids per token
    second.teacher_top = torch.arange(100, 104).view(2, 1, 2)
    joined = concat([first, second], pad_id=-1)
    assert joined.teacher_top.shape == (4, 3, 2)
    assert joined.teacher_top[2].tolist() == [[100, 101], [0, 0], [0, 0]]  # the short rows padded after their token
    assert joined.teacher_bins is None  # a field no chunk holds stays None


def test_rows_and_micro_batches_take_every_field_including_the_training_ones():
    batch = _rollout(2, 3, 0)
    assert rows_of(batch, [1, 0]).prompts == ["q0", "p0"]
    batch.mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    trained = TrainingBatch.of(batch, advantages=torch.ones(2, 3), returns=None,
                               loss_mask=torch.tensor([[1.0, 0, 0], [1, 0, 0]]))
    micro = micro_batch(trained, torch.tensor([1]))
    assert micro.responses.tolist() == [[3]] and micro.advantages.tolist() == [[1.0]] and micro.texts == ["u0"]
    assert micro.counted.tolist() == [[1.0]]  # the loss mask, trimmed with the rest
