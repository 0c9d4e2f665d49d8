"""The policy-loss options of the RL stage (clip-higher, loss aggregation, GSPO, batch-whitened group
advantages, truncated responses masked, the overlong penalty, dynamic sampling) in short PPO runs on
the tiny world, and the configurations each one refuses. Their equations: tests/test_ppo_math.py;
against TRL's own loss: tests/test_peer_losses.py."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from rlhf.config import with_overrides
from stages.common.reporting import Reporting
from stages.math.ppo_math import groups_with_signal
from tests.helpers import AUTO_RESOLVED, run_ppo

RULE = {"terms": [{"name": "on_subject", "function": "rlhf.demo.rewards:names_the_subject"}]}
"""The demo's on-subject rule alone: 1, 0 or -1 per response, so many groups score alike."""


def _grpo(tiny_config, **changes):
    return with_overrides(tiny_config.ppo, AUTO_RESOLVED | {
        "advantage_estimator": "grpo", "samples_per_prompt": 4, "rollout_batch_size": 16, "num_minibatches": 2,
        "num_iterations": 2, "checkpoint_every": 100, "evaluation": {"every": None}} | changes)


def test_groups_with_signal_are_those_whose_scores_differ():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0,   # all equal: no signal
                           1.0, 0.0, 1.0, 1.0,   # one differs
                           -3.0, -3.0, -3.0, -3.0])  # every response cut off and penalised alike
    assert groups_with_signal(scores, 4).tolist() == [False, True, False]


OPTIONS = {
    "clip-higher": {"clip_range": [0.2, 0.28]},
    "seq-mean-token-mean": {"loss_aggregation": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"loss_aggregation": "seq-mean-token-sum"},
    "dr-grpo": {"loss_aggregation": "seq-mean-token-sum-norm", "group_normalization": "mean"},
    "gspo": {"ratio_level": "sequence", "loss_aggregation": "seq-mean-token-mean", "clip_range": [3e-4, 4e-4]},
    "batch-normalized": {"group_normalization": "batch"},
    "mask-truncated": {"mask_truncated_responses": True},
    "overlong": {"reward": {"overlong": {"buffer": 4}}},
}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_trains_the_policy(tiny_config, trained, tmp_path, option):
    cfg = _grpo(tiny_config, **OPTIONS[option])
    result = run_ppo(cfg, trained, tmp_path)
    assert len(result.history) == 2
    last = result.history[-1]
    assert all(math.isfinite(last[key]) for key in ("train/policy_loss", "train/grad_norm", "rollout/kl"))
    assert last["train/grad_norm"] > 0  # the policy learned something from the option's loss
    if option == "overlong":
        assert "rollout/reward/overlong" in last and last["rollout/reward/overlong"] <= 0
    if option == "gspo":  # one ratio per sequence, clipped at 4e-4: most tokens sit in clipped sequences
        assert last["train/clip_fraction"] > 0


def test_dynamic_sampling_fills_the_batch_with_groups_that_differ(tiny_config, trained, tmp_path):
    cfg = _grpo(tiny_config, reward=RULE, num_iterations=3, dynamic_sampling={"max_rounds": 4})
    rollouts, warnings = {}, []
    result = run_ppo(cfg, trained, tmp_path, Reporting(rollouts=lambda table, i: rollouts.update({i: table}),
                                                       warning=warnings.append))
    for row in result.history:
        iteration = int(row["iteration"])
        table: pd.DataFrame = rollouts[iteration]
        assert len(table) == cfg.rollout_batch_size  # full, whatever was dropped
        differ = groups_with_signal(torch.tensor(table["reward/on_subject"].fillna(0.0).to_numpy()), 4)
        # the groups that differ come first; groups without signal only fill what the rounds could not
        assert differ.float().mean().item() == pytest.approx(1.0 - row["rollout/filled_share"])
        assert 1 <= row["rollout/sampling_rounds"] <= 4 and 0 <= row["rollout/filtered_share"] <= 1
        if row["rollout/filled_share"] > 0:
            assert row["rollout/sampling_rounds"] == 4
            assert any(f"iteration {iteration}: dynamic sampling took its 4 rounds" in w for w in warnings)
    assert any(row["rollout/filtered_share"] > 0 for row in result.history), "no group was dropped: nothing tested"


REFUSED = [
    ({"advantage_estimator": "gae", "samples_per_prompt": 1, "dynamic_sampling": {}}, "needs groups"),
    ({"group_normalization": "batch", "advantage_estimator": "reinforce++", "samples_per_prompt": 1},
     "group_normalization 'batch' cannot act"),
    ({"loss_aggregation_length": 8}, "loss_aggregation_length was merged: loss_aggregation 'seq-mean-token-sum-norm'"),
    ({"clip_range": [0.2, 0.1]}, "the upper epsilon is below the lower one"),
    ({"clip_range_high": 0.28}, r"clip_range_high was merged: clip_range: \[low, high\]"),
    ({"reward": {"overlong": {"buffer": 64}}, "sampling": {"response_length": 64}}, "must be shorter"),
    ({"reward": RULE | {"overlong": {},
                        "terms": [{"name": "overlong", "function": "rlhf.demo.rewards:length_penalty"}]}},
     "name of reward.overlong's term"),
]


@pytest.mark.parametrize("changes,reason", REFUSED)
def test_an_option_that_cannot_act_is_refused_with_the_reason(tiny_config, changes, reason):
    with pytest.raises(ValidationError, match=reason):
        _grpo(tiny_config, **changes)
