"""The policy losses against a peer's own code: TRL's `GRPOTrainer._compute_loss` (the TRL this
project locks), run on the same batch of log-probs, advantages and masks as ours. Where the two
must agree (one process, one micro-batch, advantages constant over each response), the loss and
its gradient with respect to every token's log-prob agree to float32 rounding.

TRL's names for ours:
    loss_type bnpo, dapo    loss_aggregation token-mean
    loss_type grpo          loss_aggregation seq-mean-token-mean
    loss_type dr_grpo       loss_aggregation seq-mean-token-sum-norm, length max_completion_length
    epsilon, epsilon_high   clip_range, clip_range_high
    importance_sampling_level sequence (GSPO)   ratio_level sequence
    beta (a k3 KL term in the loss)             kl_loss_coef with the k3 estimator, aggregated alike
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from stages.math.ppo_math import PolicyClip, aggregate, clipped_policy_loss, kl_estimate

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

B, T, MAX_LENGTH = 6, 7, 9
"""Responses, their padded length, and TRL's `max_completion_length` (Dr. GRPO's constant)."""


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 6, 2, 5])
    mask = (torch.arange(T) < lengths[:, None]).float()  # (B, T)
    old = -torch.rand(B, T, generator=generator) * 3  # (B, T)
    # log-ratios spread across both clip bounds (|log 1.2| = 0.18)
    new = old + 0.3 * torch.randn(B, T, generator=generator)
    reference = old + 0.2 * torch.randn(B, T, generator=generator)
    advantages = torch.randn(B, generator=generator)  # (B,): one per response, as GRPO's
    return new, old, reference, advantages, mask


def _trl_loss(loss_type: str, level: str, epsilon: float, epsilon_high: float, beta: float,
              logprobs: torch.Tensor, old, reference, advantages, mask) -> torch.Tensor:
    """TRL's own `_compute_loss` on these log-probs: the model's forward is the one thing replaced."""
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon_high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LENGTH, accelerator=accelerator,
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": reference,
              "num_items_in_batch": mask.sum()}
    return grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)


CASES = [  # (TRL loss_type, importance level, ours: aggregation, ratio level)
    ("bnpo", "token", "token-mean", "token"),
    ("dapo", "token", "token-mean", "token"),
    ("grpo", "token", "seq-mean-token-mean", "token"),
    ("dr_grpo", "token", "seq-mean-token-sum-norm", "token"),
    ("grpo", "sequence", "seq-mean-token-mean", "sequence"),  # GSPO
]


@pytest.mark.parametrize("loss_type,level,aggregation,ratio_level", CASES)
@pytest.mark.parametrize("epsilon_high", [0.2, 0.28])  # symmetric, and clip-higher
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_policy_losses_and_their_gradients_match_trls(loss_type, level, aggregation, ratio_level, epsilon_high, beta):
    new, old, reference, advantages, mask = _batch(seed=sum(map(ord, loss_type + level)))

    theirs_logprobs = new.clone().requires_grad_(True)
    theirs = _trl_loss(loss_type, level, 0.2, epsilon_high, beta, theirs_logprobs, old, reference, advantages, mask)
    theirs.backward()

    ours_logprobs = new.clone().requires_grad_(True)
    token_advantages = advantages[:, None] * mask  # (B, T): the same advantage on every token of a response
    clip = PolicyClip(low=0.2, high=epsilon_high, level=ratio_level, aggregation=aggregation, length=MAX_LENGTH)
    ours = clipped_policy_loss(ours_logprobs, old, token_advantages, mask, clip).loss
    if beta:
        ours = ours + beta * aggregate(kl_estimate(ours_logprobs, reference, "k3"), mask, aggregation,
                                       length=MAX_LENGTH)
    ours.backward()

    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours_logprobs.grad * mask, theirs_logprobs.grad * mask, rtol=1e-4, atol=1e-6)
    assert ours_logprobs.grad.abs().sum() > 0  # a batch where the loss has a gradient to compare


def test_the_cross_check_fails_on_a_broken_formula():
    """The comparison discriminates: a symmetric clip where TRL clips higher differs from TRL's loss."""
    new, old, reference, advantages, mask = _batch(seed=3)
    theirs = _trl_loss("bnpo", "token", 0.2, 0.28, 0.0, new, old, reference, advantages, mask)
    ours = clipped_policy_loss(new, old, advantages[:, None] * mask, mask, PolicyClip(low=0.2, high=0.2)).loss
    assert ours.item() != pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
