"""PPO's equations, each on a case worked out by hand (the numbers in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from stages.common.tensors import (
    binned,
    entropy_of,
    is_end,
    last_token_index,
    logprobs_of,
    masked_mean,
    masked_var,
    masked_whiten,
    response_mask,
    top_bins,
    truncate_after_eos,
)
from stages.math.ppo_math import (
    AGGREGATIONS,
    Correction,
    KLController,
    PolicyClip,
    Totals,
    aggregate,
    apply_eos_penalty,
    binned_kl,
    clipped_policy_loss,
    clipped_value_loss,
    discounted_returns,
    explained_variance,
    gae,
    group_baselined,
    grpo_advantages,
    kl_estimate,
    loss_denominator,
    mismatch_weights,
    overlong_penalty,
    policy_ratio,
    rloo_advantages,
    sequence_rewards,
    teacher_rewards,
    token_rewards,
    weighted_reward,
)

EOS, PAD = 2, 0


def test_gae_on_three_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma = 1, lambda = 0.95:
    #   t=2: delta = 1 - 0.7 = 0.3                       A = 0.3
    #   t=1: delta = 0 + 0.7 - 0.6 = 0.1                 A = 0.1 + 0.95 * 0.3   = 0.385
    #   t=0: delta = 0 + 0.6 - 0.5 = 0.1                 A = 0.1 + 0.95 * 0.385 = 0.46575
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert advantages.tolist()[0] == pytest.approx([0.46575, 0.385, 0.3])
    assert returns.tolist()[0] == pytest.approx([0.96575, 0.985, 1.0])
    # gamma = 0.9, lambda = 0.5:
    #   t=2: A = 0.3;  t=1: delta = 0.9*0.7 - 0.6 = 0.03, A = 0.03 + 0.45*0.3 = 0.165
    #   t=0: delta = 0.9*0.6 - 0.5 = 0.04, A = 0.04 + 0.45*0.165 = 0.11425
    advantages, _ = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert advantages.tolist()[0] == pytest.approx([0.11425, 0.165, 0.3])


def test_gae_stops_at_the_end_of_the_response():
    # EOS at t=1: the value after it is not bootstrapped and t=2 gets no advantage.
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 9.9]])
    advantages, returns = gae(rewards, values, torch.tensor([[1.0, 1.0, 0.0]]), gamma=1.0, lam=1.0)
    # t=1: delta = 1 - 0.6 = 0.4; t=0: delta = 0.6 - 0.5 = 0.1, A = 0.1 + 0.4 = 0.5
    assert advantages.tolist()[0] == pytest.approx([0.5, 0.4, 0.0])
    assert returns.tolist()[0] == pytest.approx([1.0, 1.0, 0.0])


def test_masks_under_early_eos():
    responses = torch.tensor([[5, EOS, 7, EOS], [5, 6, 7, 8], [EOS, 6, EOS, 8]])
    mask = response_mask(responses, [EOS])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert (truncate_after_eos(responses, [EOS], PAD).tolist()
            == [[5, EOS, PAD, PAD], [5, 6, 7, 8], [EOS, PAD, PAD, PAD]])
    assert last_token_index(mask).tolist() == [1, 3, 0]


def test_a_response_ends_at_the_first_of_several_end_tokens():
    # Llama 3 stops at <|eot_id|> or <|end_of_text|>; ChatML at <|im_end|> or <|endoftext|>.
    EOT, END = 7, 8
    responses = torch.tensor([[5, END, 6, EOT], [5, 6, EOT, END], [5, 6, 6, 6]])
    assert response_mask(responses, [EOT, END]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert (truncate_after_eos(responses, [EOT, END], PAD).tolist()
            == [[5, END, PAD, PAD], [5, 6, EOT, PAD], [5, 6, 6, 6]])
    assert is_end(responses, [EOT, END]).any(dim=1).tolist() == [True, True, False]


def test_losses_over_a_given_token_count_add_up_across_micro_batches():
    # Two micro-batches of one minibatch: 3 tokens and 1 token. Their losses over the minibatch's
    # 4 tokens add up to the loss of the whole minibatch; per-micro-batch means (2/3 and 1/3 weights
    # by sequence count) would not: (1+2+3)/3 * 1/2 + 10 * 1/2 = 6 != 4.
    advantages = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logprobs = torch.zeros(2, 3)
    whole = clipped_policy_loss(logprobs, logprobs, advantages, mask, PolicyClip(low=0.2)).loss  # -(1+2+3+10)/4 = -4
    parts = [clipped_policy_loss(logprobs[i:i + 1], logprobs[i:i + 1], advantages[i:i + 1], mask[i:i + 1],
                                 PolicyClip(low=0.2, totals=Totals(4.0, 4.0))).loss for i in range(2)]
    assert whole.item() == pytest.approx(-4.0) and sum(parts).item() == pytest.approx(-4.0)
    value_parts = [clipped_value_loss(torch.zeros(1, 3), torch.zeros(1, 3), advantages[i:i + 1], mask[i:i + 1], 0.2,
                                      num_tokens=4.0)[0] for i in range(2)]
    # 0.5 * (1 + 4 + 9 + 100) / 4 = 14.25
    assert sum(value_parts).item() == pytest.approx(14.25)


def test_clipped_objective_four_cases_and_where_the_gradient_vanishes():
    eps = 0.2
    # (advantage, ratio) -> expected loss term and whether the token still has a gradient
    cases = [(+1.0, 1.5, -1.2, False),  # A > 0, rho > 1 + eps: clipped, no gradient
             (+1.0, 0.5, -0.5, True),   # A > 0, rho < 1 - eps: unclipped (min keeps the worse term)
             (-1.0, 1.5, +1.5, True),   # A < 0, rho > 1 + eps: unclipped
             (-1.0, 0.5, +0.8, False)]  # A < 0, rho < 1 - eps: clipped, no gradient
    for advantage, ratio, expected, has_gradient in cases:
        old = torch.tensor([[-1.0]])
        new = (old + math.log(ratio)).clone().requires_grad_(True)
        out = clipped_policy_loss(new, old, torch.tensor([[advantage]]), torch.ones(1, 1), PolicyClip(low=eps))
        assert out.loss.item() == pytest.approx(expected), (advantage, ratio)
        out.loss.backward()
        # d(-A * rho)/d log pi = -A * rho when unclipped
        assert new.grad.item() == pytest.approx(-advantage * ratio if has_gradient else 0.0), (advantage, ratio)
        assert out.clip_fraction.item() == (0.0 if has_gradient else 1.0)
        assert out.ratio.item() == pytest.approx(ratio)


def test_clip_higher_gives_rising_tokens_more_room_than_falling_ones():
    # eps_low 0.2, eps_high 0.28 (DAPO's): (advantage, ratio) -> loss term, gradient kept?
    cases = [(+1.0, 1.25, -1.25, True),   # inside [0.8, 1.28]: unclipped (symmetric 0.2 would clip it at -1.2)
             (+1.0, 1.40, -1.28, False),  # above 1 + eps_high: clipped at 1.28
             (-1.0, 0.75, +0.80, False),  # below 1 - eps_low: clipped at 0.8, as with the symmetric clip
             (-1.0, 1.25, +1.25, True)]   # A < 0 above 1: the min keeps the unclipped, worse term
    for advantage, ratio, expected, has_gradient in cases:
        old = torch.tensor([[-1.0]])
        new = (old + math.log(ratio)).clone().requires_grad_(True)
        out = clipped_policy_loss(new, old, torch.tensor([[advantage]]), torch.ones(1, 1), PolicyClip(low=0.2,
                                                                                                      high=0.28))
        assert out.loss.item() == pytest.approx(expected), (advantage, ratio)
        out.loss.backward()
        assert new.grad.item() == pytest.approx(-advantage * ratio if has_gradient else 0.0), (advantage, ratio)
    symmetric = clipped_policy_loss(torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.ones(1, 1),
                                    torch.ones(1, 1), PolicyClip(low=0.2))
    assert symmetric.loss.item() == pytest.approx(-1.2) and symmetric.clip_fraction.item() == 1.0


def test_loss_aggregations_on_two_responses_of_three_tokens_and_one():
    # per-token terms 1, 2, 3 (response 1) and 10 (response 2): 16 over 4 tokens, 2 responses
    terms = torch.tensor([[1.0, 2.0, 3.0], [10.0, 7.0, 7.0]])  # the 7s are padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    expected = {"token-mean": 16 / 4,                        # every token alike
                "seq-mean-token-mean": (6 / 3 + 10 / 1) / 2,  # = 6: the one-token response weighs 3x per token
                "seq-mean-token-sum": (6 + 10) / 2,           # = 8
                "seq-mean-token-sum-norm": 16 / (2 * 4)}      # = 2: a constant length 4 (Dr. GRPO)
    for aggregation in AGGREGATIONS:
        whole = aggregate(terms, mask, aggregation, length=4)
        assert whole.item() == pytest.approx(expected[aggregation]), aggregation
        # micro-batches of one response each, over the minibatch's denominator, add up to the whole
        denominator = sum(loss_denominator(mask[i:i + 1], aggregation, 4) for i in range(2))
        parts = [aggregate(terms[i:i + 1], mask[i:i + 1], aggregation, denominator, 4) for i in range(2)]
        assert sum(parts).item() == pytest.approx(expected[aggregation]), aggregation
    # a response with no counted token (masked out: truncated) is no sequence of the mean
    assert loss_denominator(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), "seq-mean-token-sum").item() == 1.0
    with pytest.raises(ValueError, match="constant length"):
        loss_denominator(mask, "seq-mean-token-sum-norm")


GSPO = PolicyClip(low=0.2, level="sequence", aggregation="seq-mean-token-mean")


def test_gspo_ratio_is_the_geometric_mean_of_a_sequences_token_ratios_and_clips_whole_sequences():
    # token log-ratios 0.2 and -0.4 (and a padding slot of 5.0): mean -0.1 -> s = e^-0.1 on both real tokens
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    new = (old + torch.tensor([[0.2, -0.4, 5.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ratio = policy_ratio(new, old, mask, "sequence")
    assert ratio[0, :2].tolist() == pytest.approx([math.exp(-0.1)] * 2)
    assert policy_ratio(new, old, mask, "token")[0, :2].tolist() == pytest.approx([math.exp(0.2), math.exp(-0.4)])
    # unclipped, A = 1, seq-mean-token-mean: L = -mean_t s; d/d log pi_t = -s / 2 on each real token, as
    # GSPO's d(-s)/d log pi_t = -s * (1/|y|) gives
    out = clipped_policy_loss(new, old, torch.ones(1, 3), mask, GSPO)
    assert out.loss.item() == pytest.approx(-math.exp(-0.1))
    out.loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-math.exp(-0.1) / 2] * 2 + [0.0])
    # log-ratios 0.5 and 0.1: s = e^0.3 = 1.35 > 1.2 with A > 0: the whole sequence is clipped, no gradient on
    # either token, though the second token's own ratio, e^0.1 = 1.105, is inside the clip range
    new = (old + torch.tensor([[0.5, 0.1, 0.0]])).requires_grad_(True)
    out = clipped_policy_loss(new, old, torch.ones(1, 3), mask, GSPO)
    assert out.loss.item() == pytest.approx(-1.2) and out.clip_fraction.item() == 1.0
    out.loss.backward()
    assert new.grad.abs().sum().item() == 0.0


def test_overlong_penalty_falls_linearly_over_the_buffer():
    # limit 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token, -1 at the limit
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])


def test_truncated_weights_per_token_and_per_sequence_stop_at_the_bounds():
    # Trainer log-probs against an engine's on two tokens and a padding slot:
    # token 1: -1.0 - (-1.5) = +0.5 -> e^0.5 = 1.6487, truncated at 1.5; token 2: -2.0 - (-1.0) = -1 -> e^-1 = 0.3679.
    logprobs = torch.tensor([[-1.0, -2.0, -0.3]])
    engine = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    token = mismatch_weights(logprobs, engine, mask, Correction("tis", "token", 0.0, 1.5))
    assert token.tolist()[0] == pytest.approx([1.5, math.exp(-1.0), 0.0])
    # TRL's `token_truncate` clamps from below too: with C_min 0.5, token 2's 0.3679 becomes 0.5
    floor = mismatch_weights(logprobs, engine, mask, Correction("tis", "token", 0.5, 1.5))
    assert floor.tolist()[0] == pytest.approx([1.5, 0.5, 0.0])
    # sequence: one weight e^(0.5 - 1) = e^-0.5 = 0.6065 on each real token (the padding's -0.3 + 9 is left out)
    sequence = mismatch_weights(logprobs, engine, mask, Correction("tis", "sequence", 0.0, 1.5))
    assert sequence.tolist()[0] == pytest.approx([math.exp(-0.5), math.exp(-0.5), 0.0])
    # a sequence-level product far above the bound is truncated without overflowing
    far = mismatch_weights(torch.full((1, 200), 0.0), torch.full((1, 200), -5.0), torch.ones(1, 200),
                           Correction("tis", "sequence", 0.0, 2.0))
    assert far.max().item() == pytest.approx(2.0)
    # the same policy on both sides: every weight is 1, and the weighted loss is the unweighted one
    same = mismatch_weights(logprobs, logprobs, mask, Correction("tis", "token", 0.0, 2.0))
    assert same.tolist()[0] == [1.0, 1.0, 0.0]
    assert mismatch_weights(logprobs, engine, mask, Correction("none", "token", 0.0, math.inf)).tolist()[0] == [1] * 3


def test_masked_weights_drop_what_lies_outside_the_bounds_per_token_and_per_sequence():
    """MIS as TRL's `token_mask` / `sequence_mask` and verl's rejection sampling write it: w = rho inside
    [low, high], 0 outside. Three tokens, rho = 0.25, 1.5, 3 (log-probs differ by log rho):
      token, [0, 2]:  0.25, 1.5, 0        (3 > 2: masked, where truncation would have given 2)
      token, [0.5, 2]: 0, 1.5, 0          (0.25 < 0.5 too)
      sequence, [0, 2]: rho = 0.25 * 1.5 * 3 = 1.125 on each token, inside: kept whole
      sequence, [0, 1]: 1.125 > 1, the whole sequence masked."""
    rho = torch.tensor([[0.25, 1.5, 3.0], [1.0, 1.0, 1.0]])
    engine = torch.full((2, 3), -2.0)
    logprobs = engine + rho.log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = mismatch_weights(logprobs, engine, mask, Correction("mis", "token", 0.0, 2.0))
    assert torch.allclose(token, torch.tensor([[0.25, 1.5, 0.0], [1.0, 1.0, 0.0]]))
    two_sided = mismatch_weights(logprobs, engine, mask, Correction("mis", "token", 0.5, 2.0))
    assert torch.allclose(two_sided, torch.tensor([[0.0, 1.5, 0.0], [1.0, 1.0, 0.0]]))
    sequence = mismatch_weights(logprobs, engine, mask, Correction("mis", "sequence", 0.0, 2.0))
    assert torch.allclose(sequence, torch.tensor([[1.125] * 3, [1.0, 1.0, 0.0]]))
    tight = mismatch_weights(logprobs, engine, mask, Correction("mis", "sequence", 0.0, 1.0))
    assert torch.allclose(tight, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0]]))
    # a masked token adds nothing to the loss and takes no gradient: A = 1 on every token, ratio 1
    current = logprobs.clone().requires_grad_(True)
    loss = clipped_policy_loss(current, logprobs, torch.ones(2, 3), mask, PolicyClip(low=0.2), token)
    loss.loss.backward()
    assert current.grad[0, 2].item() == 0.0 and current.grad[0, 1].item() != 0.0


def test_icepop_keeps_tokens_whose_ratio_lies_in_half_to_five_and_masks_the_rest():
    """IcePop's M(k) = k if k in [alpha, beta] else 0 with alpha 0.5, beta 5 (the kind's bounds):
    rho = 0.4, 0.5, 4.0, 6.0 -> 0, 0.5, 4.0, 0. A sequence-level IcePop is refused by the config."""
    from rlhf.sections.ppo import CorrectionConfig

    settings = CorrectionConfig(kind="icepop")
    assert settings.resolved_bounds == (0.5, 5.0)
    rho = torch.tensor([[0.4, 0.5, 4.0, 6.0]])
    engine = torch.full((1, 4), -3.0)
    weights = mismatch_weights(engine + rho.log(), engine, torch.ones(1, 4), Correction("icepop", "token",
                                                                                         *settings.resolved_bounds))
    assert weights.tolist()[0] == pytest.approx([0.0, 0.5, 4.0, 0.0])
    with pytest.raises(ValueError, match="icepop masks single tokens"):
        CorrectionConfig(kind="icepop", level="sequence")
    with pytest.raises(ValueError, match="must lie below"):
        CorrectionConfig(kind="mis", bounds=[2.0, 2.0])
    assert CorrectionConfig().resolved_bounds == (0.0, 2.0)
    assert CorrectionConfig(kind="mis", bounds=[0.5, 3.0]).resolved_bounds == (0.5, 3.0)


def test_a_rollout_sampled_one_update_ago_is_clipped_near_the_updates_start_and_weighted_to_its_sampler():
    """Decoupled PPO as `ppo.rollout.max_staleness: 1` trains (stages.envs.ahead): the server
    drew the tokens with v0 (behaviour), the trainer recomputed the old log-probs under v1, where the
    update starts (proximal), and the update has moved the policy to theta. Two tokens, cap 2:
      token 1: pi_v0 0.5, pi_v1 0.4, pi_theta 0.6, A = +1: ratio 0.6 / 0.4 = 1.5, clipped to 1.2;
               weight 0.4 / 0.5 = 0.8; term -0.8 * min(1.5, 1.2) = -0.96
      token 2: pi_v0 0.1, pi_v1 0.3, pi_theta 0.3, A = -1: ratio 1; weight 3, truncated to 2;
               term -2 * (-1) = +2
    token mean: (-0.96 + 2) / 2 = 0.52. Clipping against the sampler's v0 instead would have given
    token 1 a ratio of 1.2 (inside the clip, -1.2) and no weight: the loss would follow v0, not v1."""
    behaviour = torch.tensor([[0.5, 0.1]]).log()
    proximal = torch.tensor([[0.4, 0.3]]).log()
    current = torch.tensor([[0.6, 0.3]]).log()
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    weights = mismatch_weights(proximal, behaviour, mask, Correction("tis", "token", 0.0, 2.0))
    assert weights.tolist()[0] == pytest.approx([0.8, 2.0])
    loss = clipped_policy_loss(current, proximal, advantages, mask, PolicyClip(low=0.2), weights)
    assert loss.loss.item() == pytest.approx(0.52)
    assert loss.ratio.tolist()[0] == pytest.approx([1.5, 1.0])


def test_importance_weights_scale_each_tokens_policy_loss_term():
    # Ratio 1 (old = new), advantages 2 and -4 -> terms -2 and +4; weights 0.5 and 1.5 -> (-1 + 6) / 2 = 2.5
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    advantages, mask = torch.tensor([[2.0, -4.0]]), torch.ones(1, 2)
    weights = torch.tensor([[0.5, 1.5]])
    out = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask, PolicyClip(low=0.2), weights)
    assert out.loss.item() == pytest.approx(2.5)
    out.loss.backward()
    # d/d log pi of w * (-A * rho) / 2 at rho = 1: -w * A / 2 -> -0.5 and +3.0
    assert logprobs.grad.tolist()[0] == pytest.approx([-0.5, 3.0])
    unweighted = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask, PolicyClip(low=0.2)).loss
    assert unweighted.item() == pytest.approx(1.0)  # (-2 + 4) / 2


def test_clipped_value_loss():
    old, returns, mask = torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    # V = 1.5 moved beyond eps = 0.2: clipped V = 1.2; errors 0.25 vs 0.64 -> 0.5 * 0.64 = 0.32, no gradient
    values = torch.tensor([[1.5]], requires_grad=True)
    loss, clipped = clipped_value_loss(values, old, returns, mask, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.32) and clipped.item() == 1.0 and values.grad.item() == 0.0
    # V = 1.1 within the clip range: 0.5 * 0.81 = 0.405, gradient V - R = -0.9
    values = torch.tensor([[1.1]], requires_grad=True)
    loss, clipped = clipped_value_loss(values, old, returns, mask, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.405) and clipped.item() == 0.0 and values.grad.item() == pytest.approx(-0.9)


def test_adaptive_kl_controller():
    controller = KLController(0.1, target=6.0, horizon=10000)
    # e = clip(9/6 - 1, -0.2, 0.2) = 0.2 -> beta = 0.1 * (1 + 0.2 * 64 / 10000) = 0.100128
    assert controller.update(9.0, 64) == pytest.approx(0.100128)
    controller = KLController(0.1, target=6.0, horizon=10000)
    # e = clip(3/6 - 1) = -0.2 -> 0.1 * (1 - 0.00128) = 0.099872
    assert controller.update(3.0, 64) == pytest.approx(0.099872)
    # e = 6.6/6 - 1 = 0.1 (inside the clip) -> 0.1 * (1 + 0.1 * 100 / 1000) = 0.101
    assert KLController(0.1, target=6.0, horizon=1000).update(6.6, 100) == pytest.approx(0.101)
    assert KLController(0.1).update(100.0, 64) == 0.1  # fixed coefficient


def test_whitening():
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # mean 2.5, unbiased var 5/3, std 1.290994
    expected = [-1.161895, -0.387298, 0.387298, 1.161895, 0.0]
    assert masked_whiten(x, mask).tolist()[0] == pytest.approx(expected, abs=1e-5)
    assert masked_whiten(x, mask, shift_mean=False).tolist()[0] == pytest.approx(
        [e + 2.5 for e in expected[:4]] + [0.0], abs=1e-5)


def test_the_score_is_the_weighted_sum_of_the_terms():
    # reward model 1.0 x [1, -2, 0.5]; a rule -0.5 x [0, 0 (no reward), 2]: [1 + 0, -2 + 0, 0.5 - 1]
    terms = {"reward_model": torch.tensor([1.0, -2.0, 0.5]), "rule": torch.tensor([0.0, 0.0, 2.0])}
    assert weighted_reward(terms, {"reward_model": 1.0, "rule": -0.5}).tolist() == [1.0, -2.0, -0.5]
    # the reward model alone at weight 1 is the score itself, bit for bit
    alone = torch.tensor([0.1234567, -3.3])
    assert weighted_reward({"reward_model": alone}, {"reward_model": 1.0}).equal(alone)
    # a NaN score stays NaN: the stage's non-finite check must see it
    assert weighted_reward({"reward_model": torch.tensor([float("nan")])}, {"reward_model": 1.0}).isnan().all()
    # a function's NaN is "no reward": the same sum as its 0 above; the reward model's NaN still stays
    terms["rule"] = torch.tensor([0.0, float("nan"), 2.0])
    assert weighted_reward(terms, {"reward_model": 1.0, "rule": -0.5}, no_reward={"rule"}).tolist() == [1.0, -2.0, -0.5]
    terms["reward_model"] = torch.tensor([float("nan"), -2.0, 0.5])
    assert weighted_reward(terms, {"reward_model": 1.0, "rule": -0.5}, no_reward={"rule"})[0].isnan()


def test_eos_penalty():
    scores, has_eos = torch.tensor([1.0, 2.0]), torch.tensor([True, False])
    assert apply_eos_penalty(scores, has_eos, -3.0).tolist() == [1.0, -3.0]
    assert apply_eos_penalty(scores, has_eos, None).tolist() == [1.0, 2.0]


def test_kl_estimators_and_token_rewards():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1) - 1 + 1)  # 0.367879
    assert kl_estimate(ref, logp, "k3").item() >= 0
    rewards = token_rewards(torch.tensor([2.0]), torch.tensor([[0.1, 0.2, 0.3, 0.4]]), 0.5,
                            torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # -beta * KL on real tokens, the score added at the last real one (t=2), nothing after
    assert rewards.tolist()[0] == pytest.approx([-0.05, -0.1, 1.85, 0.0])


def test_the_teachers_term_is_the_negative_reverse_kl_worked_by_hand_on_a_vocabulary_of_three():
    """Student p = (1/2, 1/4, 1/4), teacher q = (1/4, 1/2, 1/4) at one position, as logits.
    KL(p || q) = 1/2 ln(2) + 1/4 ln(1/2) + 1/4 ln(1) = ln(2) / 4 = 0.1733.
    The term on a sampled token y is w (ln q(y) - ln p(y)): y = 0 gives -w ln 2, y = 1 gives +w ln 2, y = 2
    gives 0; weighted by how often the student samples each, its mean is -w KL(p || q)."""
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    tokens = torch.tensor([[0, 1, 2]])  # (1, 3): one response sampling each token once
    mask = torch.ones(1, 3)
    student = logprobs_of(p.log().expand(1, 3, 3), tokens, temperature=1.0)  # (1, 3) ln p(y_t)
    teacher = logprobs_of(q.log().expand(1, 3, 3), tokens, temperature=1.0)  # (1, 3) ln q(y_t)
    w = 0.5
    rewards = teacher_rewards(student, teacher, w, mask)
    ln2 = math.log(2)
    assert rewards.tolist()[0] == pytest.approx([-w * ln2, w * ln2, 0.0], abs=1e-6)
    direct = (p * (p / q).log()).sum().item()  # KL(p || q) from the two distributions
    assert direct == pytest.approx(ln2 / 4)
    # Unbiased: the student's own sampling weights give -w KL exactly, for k1 and for k3.
    for estimator in ("k1", "k3"):
        mean = (p * teacher_rewards(student, teacher, w, mask, estimator)[0]).sum().item()
        assert mean == pytest.approx(-w * direct, abs=1e-6), estimator
    # k3 on the sampled tokens by hand: (q/p - 1) - ln(q/p) = (1/2 - 1) + ln 2, (2 - 1) - ln 2, 0.
    assert (-teacher_rewards(student, teacher, 1.0, mask, "k3")).tolist()[0] == pytest.approx(
        [ln2 - 0.5, 1 - ln2, 0.0], abs=1e-6)
    # Masked tokens (a tool's answer, padding) carry no term.
    assert teacher_rewards(student, teacher, w, torch.tensor([[1.0, 0.0, 1.0]])).tolist()[0][1] == 0.0


def test_the_top_k_loss_is_the_kl_over_the_teachers_top_k_tokens_and_the_rest_worked_by_hand():
    """Vocabulary of four: student p = (.5, .25, .15, .1), teacher q = (.1, .6, .2, .1). The teacher's top 2 are
    tokens 1 and 2; the bins are {1}, {2} and the rest {0, 3}: p = (.25, .15, .6), q = (.6, .2, .2).
    KL = .25 ln(.25/.6) + .15 ln(.15/.2) + .6 ln(.6/.2) = 0.39715."""
    p, q = torch.tensor([0.5, 0.25, 0.15, 0.1]), torch.tensor([0.1, 0.6, 0.2, 0.1])
    ids, teacher = top_bins(q.log().view(1, 1, 4), k=2)  # log-probs of a distribution
    assert ids.tolist() == [[[1, 2]]] and teacher.exp().tolist()[0][0] == pytest.approx([0.6, 0.2, 0.2])
    logits = p.log().view(1, 1, 4).clone().requires_grad_(True)
    kl = binned_kl(binned(torch.log_softmax(logits, -1), ids), teacher)
    by_hand = 0.25 * math.log(0.25 / 0.6) + 0.15 * math.log(0.15 / 0.2) + 0.6 * math.log(0.6 / 0.2)
    assert kl.item() == pytest.approx(by_hand, abs=1e-6)
    kl.sum().backward()  # a loss through the policy's logits: it lowers the rest's logits, raises token 1's
    assert logits.grad[0, 0, 1] < 0 < logits.grad[0, 0, 0]
    # The teacher's bins as the policy's: no loss, no gradient; bins that hold all the mass stay finite.
    same = binned_kl(teacher, teacher)
    assert same.item() == 0.0
    ids, every = top_bins(q.log().view(1, 1, 4), k=10)  # k past the vocabulary: the top 3 and the last token
    assert ids.shape[-1] == 3 and torch.isfinite(binned_kl(binned(p.log().view(1, 1, 4), ids), every)).all()


def test_logprobs_and_entropy_use_temperature_scaled_logits():
    logits = torch.tensor([[[2.0, 0.0]]])
    # T = 2: softmax([1, 0]) = [e/(e+1), 1/(e+1)] = [0.731059, 0.268941]
    assert logprobs_of(logits, torch.tensor([[0]]), 2.0).item() == pytest.approx(math.log(0.731059), abs=1e-5)
    p = torch.tensor([0.731059, 0.268941])
    assert entropy_of(logits, 2.0).item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def test_explained_variance():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


# --- critic-free estimators: by hand -----------------------------------------------------------


def test_grpo_normalises_within_each_group_and_dr_grpo_only_centres():
    rewards = torch.tensor([1.0, 2.0, 6.0, 5.0, 5.0, 5.0])  # two prompts, three responses each
    mask = torch.tensor([[1.0, 1.0]] * 5 + [[1.0, 0.0]])
    # group 1: mean 3, unbiased std sqrt((4 + 1 + 9) / 2) = sqrt(7); group 2: all equal, so all 0
    advantages = grpo_advantages(rewards, mask, group_size=3)
    root7 = math.sqrt(7.0)
    assert advantages[:3, 0].tolist() == pytest.approx([-2 / root7, -1 / root7, 3 / root7], rel=1e-5)
    assert advantages[:, 1].tolist() == advantages[:, 0].tolist()[:5] + [0.0]  # every token alike; masked after EOS
    assert advantages[3:].abs().max() == 0.0
    assert grpo_advantages(rewards, mask, 3, std_normalize=False)[:3, 0].tolist() == pytest.approx([-2.0, -1.0, 3.0])


def test_rloo_subtracts_the_mean_of_the_other_responses():
    rewards = torch.tensor([1.0, 2.0, 6.0])
    # leave-one-out means: (2 + 6) / 2 = 4, (1 + 6) / 2 = 3.5, (1 + 2) / 2 = 1.5
    assert rloo_advantages(rewards, torch.ones(3, 2), 3)[:, 0].tolist() == pytest.approx([-3.0, -1.5, 4.5])
    # the sequence reward keeps the KL penalty: 1 - 0.1 * (0.5 + 0.5), the token after EOS not counted
    kl = torch.tensor([[0.5, 0.5, 7.0]])
    assert (sequence_rewards(torch.tensor([1.0]), kl, 0.1, torch.tensor([[1.0, 1.0, 0.0]])).tolist()
            == pytest.approx([0.9]))
    with pytest.raises(ValueError, match="two responses"):
        rloo_advantages(rewards, torch.ones(3, 2), 1)


def test_discounted_returns_and_the_group_baseline():
    # gamma 0.5: G_2 = 1, G_1 = -0.1 + 0.5 * 1 = 0.4, G_0 = 0 + 0.5 * 0.4 = 0.2
    returns = discounted_returns(torch.tensor([[0.0, -0.1, 1.0]]), torch.ones(1, 3), gamma=0.5)
    assert returns.tolist()[0] == pytest.approx([0.2, 0.4, 1.0])
    # nothing is carried back from after the end token
    returns = discounted_returns(torch.tensor([[0.0, 1.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]), gamma=1.0)
    assert returns.tolist()[0] == pytest.approx([1.0, 1.0, 0.0])
    assert group_baselined(torch.tensor([1.0, 3.0, 10.0, 20.0]), 2).tolist() == [-1.0, 1.0, -5.0, 5.0]
    with pytest.raises(ValueError, match="groups of 3"):
        group_baselined(torch.tensor([1.0, 3.0, 10.0, 20.0]), 3)


# --- critic-free estimators: against verl's formulas --------------------------------------------
# The reference is verl's `verl/trainer/ppo/core_algos.py` (compute_grpo_outcome_advantage,
# compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
# compute_reinforce_plus_plus_baseline_outcome_advantage), restated here loop by loop as it
# computes them: prompts grouped through an index array, token-level rewards summed to a
# sequence score, torch.std, eps 1e-6, the running return reset at the response mask.


def _verl_group_stats(scores, index):
    groups = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(scores[i])
    return {key: torch.stack(members) for key, members in groups.items()}


def _verl_grpo(token_level_rewards, response_mask, index, norm_by_std=True, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1).clone()
    groups = _verl_group_stats(scores, index)
    out = scores.clone()
    for i, key in enumerate(index):
        members = groups[key]
        mean, std = (members.mean(), members.std()) if len(members) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        out[i] = (scores[i] - mean) / (std + epsilon) if norm_by_std else scores[i] - mean
    return out.unsqueeze(-1) * response_mask


def _verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1).clone()
    groups = _verl_group_stats(scores, index)
    out = scores.clone()
    for i, key in enumerate(index):
        n = len(groups[key])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - groups[key].mean() * n / (n - 1)
    return out.unsqueeze(-1) * response_mask


def _verl_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return _verl_whiten(returns, response_mask) * response_mask


def _verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1).clone()
    groups = _verl_group_stats(scores, index)
    out = torch.stack([scores[i] - (groups[key].mean() if len(groups[key]) > 1 else 0.0)
                       for i, key in enumerate(index)])
    out = out.unsqueeze(-1).tile([1, token_level_rewards.shape[1]]) * response_mask
    return _verl_whiten(out, response_mask) * response_mask


def _random_episodes(seed, groups=5, group_size=4, steps=7):
    generator = torch.Generator().manual_seed(seed)
    n = groups * group_size
    scores = torch.randn(n, generator=generator) * 2
    kl = torch.rand(n, steps, generator=generator) * 0.3
    lengths = torch.randint(1, steps + 1, (n,), generator=generator)
    mask = (torch.arange(steps) < lengths.unsqueeze(1)).float()
    index = [f"prompt-{i // group_size}" for i in range(n)]
    return scores, kl * mask, mask, index, group_size


def _verl_token_rewards(scores, kl, beta, mask):
    rewards = -beta * kl * mask
    for row, length in enumerate(mask.sum(1).long()):
        rewards[row, length - 1] += scores[row]
    return rewards


@pytest.mark.parametrize("seed", range(5))
def test_grpo_and_rloo_match_verl(seed):
    scores, kl, mask, index, k = _random_episodes(seed)
    outcome = _verl_token_rewards(scores, kl, 0.0, mask)
    assert torch.allclose(grpo_advantages(scores, mask, k), _verl_grpo(outcome, mask, index), atol=1e-5)
    assert torch.allclose(grpo_advantages(scores, mask, k, std_normalize=False),
                          _verl_grpo(outcome, mask, index, norm_by_std=False), atol=1e-5)
    # RLOO with the KL penalty in the reward, as verl takes it with use_kl_in_reward
    beta = 0.2
    penalised = _verl_token_rewards(scores, kl, beta, mask)
    ours = rloo_advantages(sequence_rewards(scores, kl, beta, mask), mask, k)
    assert torch.allclose(ours, _verl_rloo(penalised, mask, index), atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_reinforce_plus_plus_matches_verl(seed):
    scores, kl, mask, index, k = _random_episodes(seed)
    for beta, gamma in [(0.0, 1.0), (0.2, 1.0), (0.2, 0.9)]:
        returns = discounted_returns(token_rewards(scores, kl, beta, mask), mask, gamma)
        ours = masked_whiten(returns, mask)
        assert torch.allclose(ours, _verl_reinforce_pp(_verl_token_rewards(scores, kl, beta, mask), mask, gamma),
                              atol=1e-5)
    # The -baseline variant: verl whitens the outcome score minus its group mean. We take the KL
    # per token after the baseline as OpenRLHF's reinforce_baseline does; without KL the two agree.
    returns = discounted_returns(token_rewards(group_baselined(scores, k), kl, 0.0, mask), mask, 1.0)
    assert torch.allclose(masked_whiten(returns, mask),
                          _verl_reinforce_pp_baseline(_verl_token_rewards(scores, kl, 0.0, mask), mask, index),
                          atol=1e-5)
    assert masked_mean(masked_whiten(returns, mask), mask).abs() < 1e-5
    assert masked_var(masked_whiten(returns, mask), mask) == pytest.approx(1.0, abs=1e-4)
