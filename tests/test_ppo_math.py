"""PPO's equations, each on a case worked out by hand (the numbers in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from stages.ppo_math import (KLController, apply_eos_penalty, clipped_policy_loss, clipped_value_loss, entropy_of, is_end,
                             explained_variance, gae, kl_estimate, last_token_index, logprobs_of, masked_whiten,
                             response_mask, token_rewards, truncate_after_eos)

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
    assert truncate_after_eos(responses, [EOS], PAD).tolist() == [[5, EOS, PAD, PAD], [5, 6, 7, 8], [EOS, PAD, PAD, PAD]]
    assert last_token_index(mask).tolist() == [1, 3, 0]


def test_a_response_ends_at_the_first_of_several_end_tokens():
    # Llama 3 stops at <|eot_id|> or <|end_of_text|>; ChatML at <|im_end|> or <|endoftext|>.
    EOT, END = 7, 8
    responses = torch.tensor([[5, END, 6, EOT], [5, 6, EOT, END], [5, 6, 6, 6]])
    assert response_mask(responses, [EOT, END]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert truncate_after_eos(responses, [EOT, END], PAD).tolist() == [[5, END, PAD, PAD], [5, 6, EOT, PAD], [5, 6, 6, 6]]
    assert is_end(responses, [EOT, END]).any(dim=1).tolist() == [True, True, False]


def test_losses_over_a_given_token_count_add_up_across_micro_batches():
    # Two micro-batches of one minibatch: 3 tokens and 1 token. Their losses over the minibatch's
    # 4 tokens add up to the loss of the whole minibatch; per-micro-batch means (2/3 and 1/3 weights
    # by sequence count) would not: (1+2+3)/3 * 1/2 + 10 * 1/2 = 6 != 4.
    advantages = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logprobs = torch.zeros(2, 3)
    whole = clipped_policy_loss(logprobs, logprobs, advantages, mask, 0.2).loss  # -(1+2+3+10)/4 = -4
    parts = [clipped_policy_loss(logprobs[i:i + 1], logprobs[i:i + 1], advantages[i:i + 1], mask[i:i + 1], 0.2,
                                 num_tokens=4.0).loss for i in range(2)]
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
        out = clipped_policy_loss(new, old, torch.tensor([[advantage]]), torch.ones(1, 1), eps)
        assert out.loss.item() == pytest.approx(expected), (advantage, ratio)
        out.loss.backward()
        # d(-A * rho)/d log pi = -A * rho when unclipped
        assert new.grad.item() == pytest.approx(-advantage * ratio if has_gradient else 0.0), (advantage, ratio)
        assert out.clip_fraction.item() == (0.0 if has_gradient else 1.0)
        assert out.ratio.item() == pytest.approx(ratio)


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
