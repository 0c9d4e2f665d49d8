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

from rlhf.sections.ppo import KLConfig, PPOConfig
from stages.common.batches import concat, rows_of
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
from stages.rewards.scoring import Scores
from stages.rl.batch import KLWeights, Rollout, TrainingBatch, micro_batch
from stages.rl.teacher import Marks, TeacherMarks


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
                           trainable=mask, values=torch.rand(4, 3) * mask, group_size=2, gamma=0.9, lam=0.8,
                           **changes)


def test_each_estimator_in_the_table_is_its_equation():
    e = _inputs()
    rewards = token_rewards(e.scores, e.kl, e.beta, e.trainable)
    expected = {
        "gae": gae(rewards, e.values, e.trainable, e.gamma, e.lam),
        "grpo": (grpo_advantages(e.scores, e.trainable, 2), None),
        "rloo": (rloo_advantages(sequence_rewards(e.scores, e.kl, e.beta, e.trainable), e.trainable, 2), None),
        "reinforce++": (discounted_returns(rewards, e.trainable, e.gamma), None),
        "reinforce++-baseline": (discounted_returns(token_rewards(group_baselined(e.scores, 2), e.kl, e.beta,
                                                                  e.trainable), e.trainable, e.gamma), None),
        "distill": (rewards * e.trainable, None),  # each token's own reward: discount 0, no baseline
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
    torch.testing.assert_close(e.token_rewards(), plain.token_rewards() + dense * e.trainable)
    torch.testing.assert_close(e.episode_scores(), e.scores + (dense * e.trainable).sum(1))
    pure = dataclasses.replace(e, beta=0.0, scores=torch.zeros(4))  # no KL to the SFT policy, no reward terms
    distilled, returns = ESTIMATORS["distill"].estimate(pure, masked_whiten)
    torch.testing.assert_close(distilled, dense * e.trainable)  # pure distillation: A_t = w (ln q - ln p) at t
    assert returns is None
    grpo, _ = ESTIMATORS["grpo"].estimate(e, masked_whiten)
    torch.testing.assert_close(grpo, grpo_advantages(e.scores + (dense * e.trainable).sum(1), e.trainable, 2))


def test_gae_whitens_its_rewards_with_the_whitening_it_is_given():
    e = _inputs(whiten_rewards=True)
    seen = []

    def whiten(x, mask, shift_mean=True):
        seen.append(shift_mean)
        return masked_whiten(x, mask, shift_mean)

    advantages, _ = ESTIMATORS["gae"].estimate(e, whiten)
    rewards = masked_whiten(token_rewards(e.scores, e.kl, e.beta, e.trainable), e.trainable, shift_mean=False)
    torch.testing.assert_close(advantages, gae(rewards, e.values, e.trainable, e.gamma, e.lam)[0], rtol=0, atol=0)
    assert seen == [False]  # the rewards' scale, not their mean


def _rollout(prompt_width: int, steps: int, first: int, teacher: Marks | None = None) -> Rollout:
    """Two rows whose tensors count up from `first`, so every value says where it came from."""
    def counting(width: int) -> torch.Tensor:
        return torch.arange(first, first + 2 * width, dtype=torch.float).view(2, width)

    return Rollout(queries=counting(prompt_width).long(), query_mask=torch.ones(2, prompt_width, dtype=torch.long),
                   responses=counting(steps).long(), mask=torch.ones(2, steps), logprobs=counting(steps),
                   ref_logprobs=counting(steps), values=counting(steps), entropy=counting(steps),
                   engine_logprobs=counting(steps), teacher=teacher or Marks(), has_eos=torch.tensor([True, False]),
                   messages=[[{"role": "user", "content": f"p{first}"}], [{"role": "user", "content": f"q{first}"}]],
                   trainable=torch.ones(2, steps), turn_rewards=counting(steps), restarts=counting(steps),
                   figures={"rollout/x": first},
                   episodes=[Episode(segments=[], answer=f"t{first}"), Episode(segments=[], answer=f"u{first}")])


def test_concat_pads_prompts_on_the_left_and_responses_on_the_right_and_joins_the_rest():
    joined = concat([_rollout(1, 3, 0), _rollout(2, 1, 100)], pad_id=-1)
    assert joined.queries.tolist() == [[-1, 0], [-1, 1], [100, 101], [102, 103]]
    assert joined.query_mask.tolist() == [[0, 1], [0, 1], [1, 1], [1, 1]]
    assert joined.responses.tolist() == [[0, 1, 2], [3, 4, 5], [100, -1, -1], [101, -1, -1]]
    assert joined.logprobs.tolist() == [[0, 1, 2], [3, 4, 5], [100, 0, 0], [101, 0, 0]]
    assert joined.has_eos.tolist() == [True, False, True, False]
    assert joined.texts == ["t0", "u0", "t100", "u100"]
    assert [m[0]["content"] for m in joined.messages] == ["p0", "q0", "p100", "q100"]  # a per-row list
    assert joined.figures == {"rollout/x": 0} and joined.teacher == Marks()  # the batch's own; a teacher's none


def test_a_components_fields_nest_and_a_field_of_several_figures_per_token_pads_along_the_tokens():
    def marks(first: int, steps: int) -> TeacherMarks:
        return TeacherMarks(logprobs=torch.full((2, steps), float(first)),
                            top=torch.arange(first, first + 4 * steps).view(2, steps, 2),  # (2, steps, k=2)
                            bins=torch.zeros(2, steps, 3))

    joined = concat([_rollout(1, 3, 0, marks(0, 3)), _rollout(1, 1, 100, marks(100, 1))], pad_id=-1)
    assert joined.teacher.top.shape == (4, 3, 2)
    assert joined.teacher.top[2].tolist() == [[100, 101], [0, 0], [0, 0]]  # the short rows padded after their token
    assert joined.teacher.logprobs[2].tolist() == [100.0, 0.0, 0.0]
    assert rows_of(joined, [3]).teacher.top.tolist() == [[[102, 103], [0, 0], [0, 0]]]


def test_rows_and_micro_batches_take_every_field_including_the_training_ones():
    batch = _rollout(2, 3, 0)
    assert [m[0]["content"] for m in rows_of(batch, [1, 0]).messages] == ["q0", "p0"]
    batch.mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    scores = Scores(terms={"a": torch.tensor([1.0, 2.0])}, reward=torch.tensor([1.0, 2.0]),
                    reported=torch.tensor([1.0, 2.0]), dropped=torch.tensor([False, True]), raw={})
    trained = TrainingBatch.of(batch, scores=scores, kl=torch.zeros(2, 3), advantages=torch.ones(2, 3),
                               returns=torch.zeros(2, 3), engine_weights=torch.ones(2, 3),
                               counted=torch.tensor([[1.0, 0, 0], [1, 0, 0]]), kl_weights=KLWeights(0.1, 0.1, 0.0))
    micro = micro_batch(trained, torch.tensor([1]))
    assert micro.responses.tolist() == [[3]] and micro.advantages.tolist() == [[1.0]] and micro.texts == ["u0"]
    assert micro.counted.tolist() == [[1.0]]  # the counted tokens, trimmed with the rest
    assert micro.scores.terms["a"].tolist() == [2.0] and micro.scores.dropped.tolist() == [True]  # nested rows
    assert micro.kl_weights == trained.kl_weights  # the batch's own, kept
