"""PPO's advantage step: from one iteration's scored rollout to the `Estimated` the update trains on.
The KL to the reference per token, where its coefficient goes (`kl_weights`), the advantages of
`advantage_estimator` (the table `stages.math.ppo_math.ESTIMATORS`), the engine-mismatch weights and
the tokens the losses count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from rlhf.config_ppo import PPOConfig
from stages.math.ppo_math import (
    EstimatorInputs,
    engine_importance_weights,
    estimator_named,
    failed_at_group_mean,
    kl_estimate,
    teacher_rewards,
)
from stages.rewards.scoring import Scores
from stages.rl.batch import Rollout, Sampled, TrainingBatch
from stages.runtime.collectives import whiten_over_processes


@dataclass(frozen=True)
class KLWeights:
    """Where the KL controller's coefficient beta goes this iteration."""

    beta: float
    """The controller's coefficient."""
    in_reward: float
    """The per-token KL penalty's weight in the reward: beta, or 0 where the KL is a loss term (GRPO)."""
    in_loss: float
    """The k3 KL loss term's weight: `kl.loss_coef`, plus beta where the KL is a loss term."""


def kl_weights(cfg: PPOConfig, beta: float) -> KLWeights:
    """GRPO (`kl_in_loss`) keeps the reward the score alone and adds beta to the loss term's weight."""
    if cfg.kl_in_loss:
        return KLWeights(beta=beta, in_reward=0.0, in_loss=cfg.kl.loss_coef + beta)
    return KLWeights(beta=beta, in_reward=beta, in_loss=cfg.kl.loss_coef)


@dataclass(frozen=True, kw_only=True)
class Estimated:
    """One iteration's rollout with what was scored and estimated on it: what the update trains on
    and the iteration's figures report."""

    iteration: int
    batch: TrainingBatch
    messages: list[list[dict]]
    """Each episode's prompt as chat messages."""
    scores: Scores
    kl: torch.Tensor
    """(B, T) the per-token KL estimate (`kl.estimator`) to the reference, masked."""
    weights: KLWeights
    teacher_kl: torch.Tensor | None = None
    """(B, T) the per-token KL to the teacher (`teacher.kl_estimator`), masked; None without a teacher."""

    @property
    def sequence_kl(self) -> torch.Tensor:
        """Each response's KL to the reference, summed over its tokens. # (B,)"""
        return self.kl.sum(1)


def estimate(accelerator: Accelerator, cfg: PPOConfig, iteration: int, sampled: Sampled,
             weights: KLWeights) -> Estimated:
    """The KL, the advantages (and GAE's returns), the engine weights and the loss mask of a scored rollout."""
    batch, scores = sampled.batch, sampled.scores
    if scores.dropped is not None:  # a response a server never scored trains nothing, as a failed episode
        kept = (~scores.dropped).unsqueeze(1).to(batch.trainable.dtype)  # (B, 1)
        batch = dataclasses.replace(batch, trainable=batch.trainable * kept)
    kl = kl_estimate(batch.logprobs, batch.ref_logprobs, cfg.kl.estimator) * batch.trainable  # (B, T)
    teacher_kl = None if cfg.teacher is None else kl_estimate(
        batch.logprobs, batch.teacher_logprobs, cfg.teacher.kl_estimator) * batch.trainable  # (B, T)
    advantages, returns = advantages_and_returns(accelerator, cfg, batch, kl, scores.reward, weights.in_reward,
                                                 scores.dropped)
    trained = TrainingBatch.of(batch, advantages=advantages, returns=returns,
                               engine_weights=engine_weights(batch, cfg), loss_mask=loss_mask(batch, cfg))
    return Estimated(iteration=iteration, batch=trained, messages=sampled.messages, scores=scores, kl=kl,
                     weights=weights, teacher_kl=teacher_kl)


def advantages_and_returns(accelerator: Accelerator, cfg: PPOConfig, batch: Rollout, kl: torch.Tensor,
                           reward: torch.Tensor, beta: float, dropped: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The advantage of every response token under `cfg.advantage_estimator`, and for GAE the
    returns the critic regresses on (None otherwise). Whitening is over all processes' tokens
    (collective); the group estimators need no other process, as each holds whole groups, unless
    `group_batch_normalize` whitens them over the batch. `kl` is per token and masked, `reward` the
    scores' weighted sum, `beta` the KL's weight in the reward, `dropped` the responses a remote
    term gave no score (they train nothing). A teacher (`cfg.teacher`) adds its term to every token's
    reward (`teacher_rewards`), unless its `top_k` makes it a loss term (`stages.rl.update`).
    # -> (B, T), (B, T) | None"""
    estimator = estimator_named(cfg.advantage_estimator)
    failed = torch.tensor([e.status == "failed" for e in batch.episodes], device=reward.device)  # (B,)
    if dropped is not None:
        failed = failed | dropped
    inputs = EstimatorInputs(scores=reward, kl=kl, beta=beta, mask=batch.trainable, values=batch.values,
                             group_size=cfg.samples_per_prompt, gamma=cfg.gamma,
                             lam=cfg.critic.lam if cfg.critic is not None else 0.95,
                             whiten_rewards=cfg.critic is not None and cfg.critic.whiten_rewards,
                             std_normalize=cfg.group_std_normalize, turn_rewards=batch.turn_rewards,
                             dense=None if cfg.teacher is None or cfg.teacher.top_k else teacher_rewards(
                                 batch.logprobs, batch.teacher_logprobs, cfg.teacher.weight, batch.trainable,
                                 cfg.teacher.kl_estimator))
    if failed.any():  # a failed or dropped episode trains nothing and leaves its group's baseline alone
        held = failed_at_group_mean(reward, failed, cfg.samples_per_prompt, inputs.episode_scores())
        inputs = dataclasses.replace(inputs, scores=held)

    def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        return whiten_over_processes(accelerator, x, mask, shift_mean=shift_mean)

    advantages, returns = estimator.estimate(inputs, whiten)
    if estimator.whitened or cfg.group_batch_normalize:
        advantages = whiten(advantages, batch.trainable)
    return advantages, returns


def engine_weights(batch: Rollout, cfg: PPOConfig) -> torch.Tensor | None:
    """Truncated importance weights pi_train / pi_engine for tokens another engine sampled
    (`vllm.importance_sampling`); None where the trainer sampled or the correction is off. # (B, T)"""
    if batch.engine_logprobs is None or cfg.vllm.importance_sampling is None:
        return None
    return engine_importance_weights(batch.logprobs, batch.engine_logprobs, batch.trainable,
                                     cfg.vllm.importance_sampling, cfg.vllm.importance_sampling_cap)


def loss_mask(batch: Rollout, cfg: PPOConfig) -> torch.Tensor | None:
    """The tokens the loss terms count: with `mask_truncated_responses`, the response mask less the
    responses cut off without an end token; None (the response mask) otherwise. # (B, T)"""
    if not cfg.mask_truncated_responses:
        return None
    return batch.trainable * batch.has_eos.unsqueeze(1)
