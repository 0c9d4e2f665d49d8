"""The final evaluation: win rates with their standard error over prompts, and an SFT baseline
sampled with common random numbers, so two PPO runs are judged against the same responses."""

from __future__ import annotations

import pytest

from rlhf.evaluation import win_rate
from tests.helpers import AUTO_RESOLVED


def test_win_rate_counts_ties_half_and_takes_its_error_over_prompts():
    # prompt a: win, tie -> 0.75; prompt b: win, loss -> 0.5. Mean 0.625;
    # SE = std([0.75, 0.5], ddof=1) / sqrt(2) = 0.17678 / 1.41421 = 0.125
    rate, se = win_rate([1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 2.0], ["a", "a", "b", "b"])
    assert rate == pytest.approx(0.625) and se == pytest.approx(0.125)


def test_the_sft_baseline_is_the_same_for_runs_with_different_training_seeds(tiny_config, trained):
    from rlhf.config import with_overrides
    from stages.rl.evaluation import HeldOut, evaluate
    from stages.rl.ppo_models import load_models
    from stages.rl.rollout import policy_sampler, single_turn

    tables = []
    for seed in (0, 1):
        cfg = with_overrides(tiny_config.ppo, AUTO_RESOLVED | {"seed": seed, "evaluation.samples_per_prompt": 2})
        models = load_models(cfg, trained["sft"], trained["reward"])
        held_out = HeldOut.sample(models, trained["eval_prompts"], cfg.evaluation, cfg.sampling, single_turn(models))
        metrics, table = evaluate(models, policy_sampler(models), held_out, cfg.evaluation, cfg.sampling)
        tables.append(table)
        assert 0 <= metrics["eval/win_rate_rm"] <= 1 and metrics["eval/win_rate_rm_se"] > 0
    assert list(tables[0]["sft_response"]) == list(tables[1]["sft_response"])
    other = with_overrides(tiny_config.ppo, AUTO_RESOLVED | {"evaluation.seed": 7, "evaluation.samples_per_prompt": 2})
    models = load_models(other, trained["sft"], trained["reward"])
    held_out = HeldOut.sample(models, trained["eval_prompts"], other.evaluation, other.sampling,
                              single_turn(models))
    _, moved = evaluate(models, policy_sampler(models), held_out, other.evaluation, other.sampling)
    assert list(moved["sft_response"]) != list(tables[0]["sft_response"])
