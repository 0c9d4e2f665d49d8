"""PPO's update: the epochs of minibatches over one iteration's `TrainingBatch`, each minibatch's
gradient accumulated over micro-batches and processes (`accumulate_gradients`) as one token mean,
the clipped policy loss from `stages.math.ppo_math` with the critic's value loss and the teacher's
loss term where they have one, and the optimizer step. A new policy loss is an equation in
`stages.math.ppo_math` and is applied here, in `_micro_batch_step`. `Learner` is what every process
trains with (built by `stages.ppo.build_learner`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from accelerate import Accelerator

from rlhf.sections.ppo import PPOConfig
from stages.common.errors import NonFiniteLossError
from stages.common.tensors import entropy_of, log_probs, masked_mean, picked
from stages.math.ppo_math import PolicyClip, Totals, aggregate, clipped_policy_loss, kl_estimate, loss_denominator
from stages.rl.batch import TrainingBatch, micro_batch
from stages.rl.ppo_models import Models
from stages.runtime.collectives import combined, gathered, sum_over_processes
from stages.runtime.packing import micro_batches_needed, split_by_tokens

# --- update -----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Learner:
    """What every process of a PPO run trains with: its models, their optimizer, schedule and loss
    scaling, built once by `stages.ppo.build_learner`."""

    cfg: PPOConfig
    accelerator: Accelerator
    models: Models
    actor_critic: torch.nn.Module
    """Policy and critic as one module: wrapped by DDP or FSDP2 on several processes, as is on one."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    """Loss scaling for fp16 autocast only; disabled, it passes losses and steps through unchanged."""

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter the optimizer steps: the policy's (or its adapters) and the critic's."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]


@dataclass
class UpdateStats:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **figures: float) -> None:
        for key, value in figures.items():
            self.values.setdefault(key, []).append(float(value))

    def means(self) -> dict[str, float]:
        return {key: combined(key, v, lambda v: float(np.mean(v))) for key, v in self.values.items()}


def ppo_update(learner: Learner, batch: TrainingBatch, iteration: int) -> dict[str, float]:
    """num_ppo_epochs passes of shuffled minibatches over this process's rollout, one optimizer step each.
    `initial_ratio_deviation`, max |ratio - 1| over the first minibatch before any step, checks that
    the update computes the policy the rollout sampled from (dropout off, same precision)."""
    cfg, optimizer, scaler, holding = learner.cfg, learner.optimizer, learner.scaler, learner.models.holding
    learner.actor_critic.train(True)
    holding.release(*learner.models.trained_modules())  # their parameters the shards, as the optimizer's are
    trained = learner.trained_parameters()
    policy_parameters = list(learner.models.policy.parameters())
    in_policy = {id(p) for p in policy_parameters}
    critic_parameters = [p for p in trained if id(p) not in in_policy]  # the value head or the critic model
    n = len(batch.responses)
    stats = UpdateStats()
    for epoch in range(cfg.num_ppo_epochs):
        for index, minibatch in enumerate(torch.randperm(n).split(n // cfg.num_minibatches)):
            figures = accumulate_gradients(learner, batch, minibatch.to(batch.responses.device), iteration)
            deviation = figures.pop("ratio_deviation_max")
            if epoch == 0 and index == 0:
                stats.add(initial_ratio_deviation=deviation)
            # Critic warm-up: no policy step at all, so Adam's moments and step count stay fresh.
            if iteration <= cfg.freeze_policy_iterations:
                for parameter in policy_parameters:
                    parameter.grad = None
            scaler.unscale_(optimizer)  # clipping reads true gradient norms (no-op without fp16 loss scaling)
            # Each model clipped on its own: a large value-loss gradient must not shrink the policy's step.
            grad_norm = holding.clip_grad_norm(policy_parameters, cfg.max_grad_norm)
            if critic_parameters:
                figures["critic_grad_norm"] = holding.clip_grad_norm(critic_parameters, cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            learner.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stats.add(**figures, grad_norm=grad_norm)
    return stats.means()


def accumulate_gradients(learner: Learner, batch: TrainingBatch, rows: torch.Tensor,
                         iteration: int) -> dict[str, float]:
    """Gradients of one minibatch (these `rows` of this process's rollout), accumulated over its
    micro-batches and averaged over processes (DDP: at the last one; FSDP2: at each, into shards).

    Every loss term is a mean over the minibatch's tokens on all processes together: each
    micro-batch's masked sum is divided by N / P, with N those tokens and P the process count,
    because DDP and FSDP2 divide the summed gradients by P. The gradient is then the same for every
    `micro_batch_size` and process count (tested to 1e-5). Returned figures are this process's
    sums on the same scale, so their mean over processes is the minibatch's token mean."""
    accelerator, cfg = learner.accelerator, learner.cfg
    counted = batch.counted[rows]  # (b, T)
    num_tokens = sum_over_processes(accelerator, counted.sum())
    num_tokens = num_tokens.clamp(min=1.0) / accelerator.num_processes
    denominator = num_tokens  # the policy and KL losses' `aggregate`: tokens, or sequences (x a length)
    if cfg.loss_aggregation != "token-mean":
        denominator = sum_over_processes(accelerator, loss_denominator(counted, cfg.loss_aggregation,
                                                                       cfg.aggregation_length))
        denominator = denominator.clamp(min=1.0) / accelerator.num_processes
    micro_batches = micro_batch_rows(learner, batch, rows)
    parts: dict[str, list[float]] = {}
    for position, micro_rows in enumerate(micro_batches):
        with learner.models.holding.accumulating(learner.actor_critic, last=position == len(micro_batches) - 1):
            micro = micro_batch(batch, micro_rows)
            figures = _micro_batch_step(learner, micro, Totals(num_tokens, denominator), iteration)
        for key, value in figures.items():
            parts.setdefault(key, []).append(value)
    return {key: combined(key, values, sum) for key, values in parts.items()}


def micro_batch_rows(learner: Learner, batch: TrainingBatch, rows: torch.Tensor) -> list[torch.Tensor]:
    """A minibatch's rows as micro-batches: `micro_batch_size` rows each, or, with `micro_batch_tokens`,
    rows of like length together, each micro-batch about the token budget, as many on every process
    (the count all agree on: DDP and FSDP2 synchronise per micro-batch) (collective)."""
    cfg = learner.cfg
    if cfg.micro_batch_tokens is None:
        return list(rows.split(cfg.micro_batch_size or len(rows)))
    budget = cfg.micro_batch_tokens  # `auto` resolved as the stage started (`stages.resolved`)
    prompt_lengths = batch.query_mask[rows].sum(dim=1).tolist()
    response_lengths = batch.mask[rows].sum(dim=1).long().tolist()
    needed = micro_batches_needed(prompt_lengths, response_lengths, budget, learner.models.packs)
    count = int(gathered(learner.accelerator, torch.tensor([needed], device=rows.device)).max())
    lengths = [a + b for a, b in zip(prompt_lengths, response_lengths, strict=True)]
    return [rows[torch.tensor(run, device=rows.device)] for run in split_by_tokens(lengths, min(count, len(rows)))]


def _micro_batch_step(learner: Learner, micro: TrainingBatch, totals: Totals, iteration: int) -> dict[str, float]:
    """Forward and backward of one micro-batch: its masked loss sums over the minibatch's
    `totals.tokens` (the policy and KL losses: over its `totals.denominator`, as `loss_aggregation`
    counts); the critic's value loss and the teacher's loss term where they have one."""
    cfg, models, counted, num_tokens = learner.cfg, learner.models, micro.counted, totals.tokens
    # Critic warm-up: the policy terms stay in the graph at weight 0 (every parameter gets a
    # gradient, as DDP needs); `ppo_update` then drops the policy's gradients before the step.
    warming_up = iteration <= cfg.freeze_policy_iterations
    logits, values = learner.actor_critic(*micro.sequences, warming_up)
    logps = log_probs(logits, cfg.sampling.temperature)  # (b, T, V): the policy loss's and the teacher loss's
    logprobs = picked(logps, micro.responses)
    clip = PolicyClip(low=cfg.clip_low, high=cfg.clip_high, level=cfg.ratio_level, aggregation=cfg.loss_aggregation,
                      length=cfg.aggregation_length, totals=totals)
    policy = clipped_policy_loss(logprobs, micro.logprobs, micro.advantages, counted, clip, micro.engine_weights)
    # Without an entropy bonus the entropy is a statistic only: no graph through the softmax.
    entropy = masked_mean(entropy_of(logits if cfg.entropy_coef else logits.detach(), cfg.sampling.temperature),
                          counted, num_tokens=num_tokens)
    policy_terms = policy.loss - cfg.entropy_coef * entropy
    figures = {}
    kl_loss_coef = micro.kl_weights.in_loss
    if kl_loss_coef > 0:
        kl_loss = aggregate(kl_estimate(logprobs, micro.ref_logprobs, "k3"), counted, clip.aggregation,
                            totals.denominator, clip.length)
        policy_terms = policy_terms + kl_loss_coef * kl_loss
        figures["kl_loss"] = kl_loss.item()

    def aggregated(per_token: torch.Tensor) -> torch.Tensor:  # a loss term as the policy loss aggregates
        return aggregate(per_token, counted, clip.aggregation, totals.denominator, clip.length)

    policy_terms, teacher_figures = models.teacher.with_loss(policy_terms, logps, micro.teacher, aggregated)
    loss, value_figures = models.critic.with_value_loss((0.0 if warming_up else 1.0) * policy_terms, values, micro,
                                                        cfg.critic, num_tokens)
    figures |= teacher_figures | value_figures
    if not torch.isfinite(loss):
        raise NonFiniteLossError(f"non-finite PPO loss ({loss.item()}) at iteration {iteration}; "
                                 "the last full-state checkpoint is kept")
    learner.scaler.scale(loss).backward()
    ratio = policy.ratio.detach()
    return figures | dict(policy_loss=policy.loss.item(), entropy=entropy.item(),
                          clip_fraction=policy.clip_fraction.item(), approx_kl=policy.approx_kl.item(),
                          ratio_mean=masked_mean(ratio, counted, num_tokens=num_tokens).item(),
                          ratio_max=(ratio * counted).max().item(),
                          ratio_deviation_max=((ratio - 1).abs() * micro.trainable).max().item())
