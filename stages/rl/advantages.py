"""PPO's advantage step: from one iteration's rollout and its scores to the `TrainingBatch` the update
trains on. The KL to the reference per token, where its coefficient goes (`kl_weights`), the
advantages of `advantage_estimator` (the table `stages.math.ppo_math.ESTIMATORS`), the engine-mismatch
weights and the tokens the losses count."""

from __future__ import annotations

import dataclasses

import torch
from accelerate import Accelerator

from rlhf.sections.ppo import PPOConfig
from stages.math.ppo_math import (
    Correction,
    EstimatorInputs,
    estimator_named,
    failed_at_group_mean,
    kl_estimate,
    mismatch_weights,
)
from stages.rewards.scoring import Scores
from stages.rl.batch import KLWeights, Rollout, TrainingBatch
from stages.rl.teacher import NoTeacher, Teacher
from stages.runtime.collectives import whiten_over_processes


def kl_weights(cfg: PPOConfig, beta: float) -> KLWeights:
    """GRPO (`kl_in_loss`) keeps the reward the score alone and adds beta to the loss term's weight."""
    if cfg.kl_in_loss:
        return KLWeights(beta=beta, in_reward=0.0, in_loss=cfg.kl.loss_coef + beta)
    return KLWeights(beta=beta, in_reward=beta, in_loss=cfg.kl.loss_coef)


def estimate(accelerator: Accelerator, cfg: PPOConfig, teacher: Teacher | NoTeacher, rollout: Rollout,
             scores: Scores, weights: KLWeights) -> TrainingBatch:
    """The KL, the advantages (and the critic's targets), the engine weights and the tokens the losses
    count, of a scored rollout. A response a server never scored trains nothing, as a failed episode."""
    kept = (~scores.dropped).unsqueeze(1).to(rollout.trainable.dtype)  # (B, 1)
    rollout = dataclasses.replace(rollout, trainable=rollout.trainable * kept)
    kl = kl_estimate(rollout.logprobs, rollout.ref_logprobs, cfg.kl.estimator) * rollout.trainable  # (B, T)
    inputs = estimator_inputs(cfg, rollout, scores.reward, kl, weights.in_reward,
                              teacher.dense_rewards(rollout.logprobs, rollout.teacher, rollout.trainable))
    failed = torch.tensor([e.status == "failed" for e in rollout.episodes], device=kl.device) | scores.dropped  # (B,)
    advantages, returns = advantages_and_returns(accelerator, cfg, inputs, failed)
    return TrainingBatch.of(rollout, scores=scores, kl=kl, advantages=advantages,
                            returns=rollout.values if returns is None else returns,  # no critic: its (zero) values
                            engine_weights=engine_weights(rollout, cfg), counted=counted(rollout, cfg),
                            kl_weights=weights)


def estimator_inputs(cfg: PPOConfig, rollout: Rollout, reward: torch.Tensor, kl: torch.Tensor, beta: float,
                     dense: torch.Tensor | None) -> EstimatorInputs:
    """What `cfg.advantage_estimator` reads of the rollout: `reward` the scores' weighted sum, `kl` per
    token and masked, `beta` the KL's weight in the reward, `dense` a reward on every token (a
    teacher's, `stages.rl.teacher`; None: none)."""
    critic = cfg.critic
    return EstimatorInputs(scores=reward, kl=kl, beta=beta, trainable=rollout.trainable, values=rollout.values,
                           group_size=cfg.samples_per_prompt, gamma=cfg.gamma,
                           lam=critic.lam if critic is not None else 0.95,
                           whiten_rewards=critic is not None and critic.whiten_rewards,
                           std_normalize=cfg.group_std_normalize, turn_rewards=rollout.turn_rewards, dense=dense)


def advantages_and_returns(accelerator: Accelerator, cfg: PPOConfig, inputs: EstimatorInputs,
                           failed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The advantage of every response token under `cfg.advantage_estimator`, and for GAE the
    returns the critic regresses on (None otherwise). Whitening is over all processes' tokens
    (collective); the group estimators need no other process, as each holds whole groups, unless
    `group_batch_normalize` whitens them over the batch. `failed` (B,): the episodes that failed or
    that a remote term gave no score (they train nothing). # -> (B, T), (B, T) | None"""
    estimator = estimator_named(cfg.advantage_estimator)
    if failed.any():  # a failed or dropped episode trains nothing and leaves its group's baseline alone
        held = failed_at_group_mean(inputs.scores, failed, cfg.samples_per_prompt, inputs.episode_scores())
        inputs = dataclasses.replace(inputs, scores=held)

    def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        return whiten_over_processes(accelerator, x, mask, shift_mean=shift_mean)

    advantages, returns = estimator.estimate(inputs, whiten)
    if estimator.whitened or cfg.group_batch_normalize:
        advantages = whiten(advantages, inputs.trainable)
    return advantages, returns


def correction_of(cfg: PPOConfig) -> Correction:
    """`rollout.correction` with its bounds resolved (the kind's where none are given)."""
    settings = cfg.rollout.correction
    return Correction(settings.kind, settings.level, *settings.resolved_bounds)


def engine_weights(rollout: Rollout, cfg: PPOConfig) -> torch.Tensor:
    """The importance weights for tokens the vLLM server sampled (`rollout.correction`: truncated or
    masked pi_train / pi_vllm); 1 where the trainer sampled. # (B, T)"""
    if cfg.rollout_engine != "vllm":
        return torch.ones_like(rollout.trainable)
    return mismatch_weights(rollout.logprobs, rollout.engine_logprobs, rollout.trainable, correction_of(cfg))


def counted(rollout: Rollout, cfg: PPOConfig) -> torch.Tensor:
    """The tokens the loss terms count: the model's own (`trainable`), less, with
    `mask_truncated_responses`, the responses cut off without an end token. # (B, T)"""
    if not cfg.mask_truncated_responses:
        return rollout.trainable
    return rollout.trainable * rollout.has_eos.unsqueeze(1)
