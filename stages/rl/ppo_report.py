"""What a PPO iteration reports: its figures (`iteration_figures`; the reward terms', the critic's and
the teacher's own are theirs to give), the warnings they raise (`warnings_of`), and the episodes and
samples tables (`report_iteration`)."""

from __future__ import annotations

import json
import time

import pandas as pd
import torch

from rlhf.sections.ppo import PPOConfig
from schemas.adapters import last_user_message
from stages.common.reporting import Reporting
from stages.common.tensors import masked_mean
from stages.envs.episode import episode_figures, transcript
from stages.math.ppo_math import Correction, sampler_log_ratio
from stages.rl.advantages import correction_of
from stages.rl.batch import TrainingBatch
from stages.rl.ppo_state import LoopState
from stages.rl.rollout import Rollouts
from stages.rl.update import Learner
from stages.runtime.collectives import gathered
from stages.runtime.models import Precision, resolve_precision, rounds_to_16_bits


def initial_ratio_threshold(cfg: PPOConfig, precision: Precision) -> float:
    """`warn_initial_ratio_deviation`, or its default: in fp32 a rollout and a fresh forward agree to
    ~1e-6; in 16 bits, shapes that differ between the rollout and the update round differently."""
    if cfg.warnings.initial_ratio_deviation is not None:
        return cfg.warnings.initial_ratio_deviation
    return 5e-2 if rounds_to_16_bits(cfg, precision) else 1e-3


FAILED_SHARE_WARNING = 0.1
"""A share of failed episodes above which an iteration warns."""

RECOMPILES_SETTLE = 5
"""Iterations after which a compiled run should have met every shape bucket its lengths reach: one
that still compiles graphs in `RECOMPILES_SETTLE - 2` iterations in a row warns."""


def warnings_of(cfg: PPOConfig, figures: dict[str, float], first_length: float, iteration: int,
              previous_length: float | None = None, earlier: list[dict[str, float]] = ()) -> list[str]:
    """This iteration's warnings from its `figures`, and the `earlier` iterations' (the run's history)."""
    found = []
    length = figures["rollout/response_length"]
    if previous_length is not None and length < (1 - cfg.warnings.length_collapse) * previous_length:
        found.append(f"mean response length collapsed from {previous_length:.1f} to {length:.1f} tokens in one "
                     "iteration: the policy is learning to stop early (check the value loss and the KL)")
    if figures["rollout/kl"] > cfg.evaluation.kl_budget:
        found.append(f"mean KL per sequence {figures['rollout/kl']:.2f} is over the budget of "
                     f"{cfg.evaluation.kl_budget}")
    drift = abs(figures["rollout/response_length"] - first_length) / max(first_length, 1e-6)
    if drift > cfg.warnings.length_drift:
        found.append(f"mean response length {figures['rollout/response_length']:.1f} drifted {drift:.0%} "
                     f"from {first_length:.1f}")
    if figures.get("rollout/filled_share", 0.0) > 0:
        found.append(f"dynamic sampling took its {cfg.dynamic_sampling.max_rounds} rounds and still filled "
                     f"{figures['rollout/filled_share']:.0%} of the batch with groups whose scores are all equal (no "
                     f"signal; {figures['rollout/filtered_share']:.0%} of the groups sampled were): raise "
                     "dynamic_sampling.max_rounds, or give the reward more spread")
    if figures.get("rollout/failed_share", 0.0) > FAILED_SHARE_WARNING:
        found.append(f"{figures['rollout/failed_share']:.0%} of the episodes failed (left out of the update; the "
                     "samples table's episodes say why; environment.max_failed_share stops the run)")
    recent = [f.get("perf/recompiles", 0.0) for f in list(earlier)[-(RECOMPILES_SETTLE - 3):]] + [
        figures.get("perf/recompiles", 0.0)]
    if iteration > RECOMPILES_SETTLE and len(recent) == RECOMPILES_SETTLE - 2 and all(recent):
        found.append(f"compiled passes are still recompiling ({figures['perf/recompiles']:.0f} graphs this "
                     f"iteration, {figures.get('time/compile', 0.0):.1f} s): the shapes keep changing past their "
                     "buckets (set ppo.compile: false, or report the shapes)")
    if figures["rollout/eos_rate"] < cfg.warnings.eos_rate:
        found.append(f"only {figures['rollout/eos_rate']:.0%} of responses end with EOS")
    if figures["train/ratio_max"] > cfg.warnings.ratio_max:
        found.append(f"policy ratio reached {figures['train/ratio_max']:.1f} (threshold {cfg.warnings.ratio_max})")
    threshold = initial_ratio_threshold(cfg, resolve_precision(cfg.precision))
    if figures["train/initial_ratio_deviation"] > threshold:
        deviation = figures["train/initial_ratio_deviation"]
        found.append(f"before the first update the policy ratio was already {deviation:.2g} "
                     f"from 1 (threshold {threshold:g}): rollout and training compute different policies (dropout "
                     "left on, or precision drift; try ppo.old_logprobs: recompute)")
    return [f"iteration {iteration}: {message}" for message in found]


def iteration_figures(learner: Learner, rollouts: Rollouts, batch: TrainingBatch, train: dict[str, float],
                      timings: dict[str, float], started: float) -> dict[str, float]:
    """What one iteration logs, this process's share (`over_processes` combines them); `started`:
    the iteration's start on the `time.perf_counter` clock."""
    scores, kl, accelerator, cfg, models = batch.scores, batch.kl, learner.accelerator, learner.cfg, learner.models
    figures = {
        "rollout/score": scores.reported.mean().item(),
        "rollout/score_std": gathered(accelerator, scores.reported).std().item(),  # over all processes' scores
        "rollout/score_used": scores.reward.mean().item(),
        "rollout/non_score_reward": (-batch.kl_weights.in_reward * kl).sum(1).mean().item(),
        "rollout/kl": batch.sequence_kl.mean().item(),
        "rollout/kl_coef": batch.kl_weights.beta,
        "rollout/entropy": masked_mean(batch.entropy, batch.trainable).item(),
        "rollout/response_length": batch.trainable.sum(1).float().mean().item(),
        "rollout/eos_rate": batch.has_eos.float().mean().item(),
        **{f"train/{k}": v for k, v in train.items()},
        "train/learning_rate": learner.scheduler.get_last_lr()[0],
        **{f"time/{k}": v for k, v in timings.items()},
        **models.counts.shares(),  # perf/padding_share/<phase>: positions computed that held no token
        **models.compiler.figures(),  # perf/recompiles, time/compile: when the passes are compiled
        **rollouts.scoring.figures(scores),  # the reward model's raw mean; each term besides it
        **models.teacher.figures(batch.logprobs, batch.teacher, batch.trainable),  # on-policy distillation
        **models.critic.figures(batch),  # explained variance
    }
    if cfg.rollout_engine == "vllm":  # the engine's log-probs against the trainer's
        gap = (batch.logprobs - batch.engine_logprobs).abs() * batch.trainable  # (B, T)
        figures |= {"rollout/vllm_logprob_gap": masked_mean(gap, batch.trainable).item(),
                    "rollout/vllm_logprob_gap_max": gap.max().item()}
        figures |= mismatch_figures(batch, correction_of(cfg))
    if rollouts.source.multi_turn:
        figures |= episode_figures(batch.episodes, "rollout")
    elapsed = time.perf_counter() - started
    return figures | {"time/iteration": elapsed,
                      "time/tokens_per_second": batch.mask.sum().item() * accelerator.num_processes / elapsed}


def mismatch_figures(batch: TrainingBatch, correction: Correction) -> dict[str, float]:
    """How far the vLLM server's tokens are from the trainer's policy, and what `rollout.correction` did
    with them: the ratio's 5/50/95th percentiles, the weights' mean and spread, the share of tokens the
    bounds truncated (`tis`) and the share they masked (`mis`, `icepop`)."""
    if correction.kind == "none" or not batch.trainable.any():
        return {}
    trainable = batch.trainable.bool()  # (B, T)
    log_ratio = sampler_log_ratio(batch.logprobs, batch.engine_logprobs, batch.trainable, correction.level)
    ratio = log_ratio[trainable].exp()  # (tokens,)
    weights = batch.engine_weights[trainable]  # (tokens,)
    low, high = correction.low, correction.high
    outside = ((ratio < low) | (ratio > high)).float()
    masking = correction.kind in ("mis", "icepop")
    p05, p50, p95 = torch.quantile(ratio.float(), torch.tensor([0.05, 0.5, 0.95])).tolist()
    return {"rollout/engine_importance_weight": weights.mean().item(),
            "rollout/engine_importance_weight_std": weights.std().item() if len(weights) > 1 else 0.0,
            "rollout/engine_importance_weight_capped": 0.0 if masking else outside.mean().item(),
            "rollout/engine_masked_share": outside.mean().item() if masking else 0.0,
            "rollout/engine_ratio_p05": p05, "rollout/engine_ratio_p50": p50, "rollout/engine_ratio_p95": p95}


def report_iteration(reporting: Reporting, rollouts: Rollouts, loop: LoopState, batch: TrainingBatch,
                     figures: dict[str, float], iteration: int) -> None:
    """Warnings, figures, every episode (a source of multi-turn episodes: with its conversation and
    status), and now and then a few samples to read."""
    cfg, scores, messages = rollouts.cfg, batch.scores, batch.messages
    previous_length = loop.history[-1]["rollout/response_length"] if loop.history else None
    for message in warnings_of(cfg, figures, loop.first_length, iteration, previous_length, loop.history):
        reporting.warning(message)
    reporting.metrics(figures, iteration)
    # With reward functions, servers or the overlong penalty each term is a column too (`reward/<name>`; NaN
    # where a function gave none or a server's score never arrived).
    terms = {f"reward/{name}": values.cpu().numpy() for name, values in scores.terms.items()} \
        if cfg.reward.functions or cfg.reward.remotes or cfg.reward.overlong else {}
    teacher = rollouts.models.teacher.columns(batch.logprobs, batch.teacher, batch.trainable)
    # A multi-turn episode's whole conversation, tool results marked `[tool <name>]`, and its status.
    turns = {} if not rollouts.source.multi_turn else {
        "episode": [transcript(e) for e in batch.episodes], "status": [e.status for e in batch.episodes],
        **{c: [e.columns.get(c) for e in batch.episodes] for c in cfg.reward.columns}}
    reporting.rollouts(pd.DataFrame({"prompt_messages": [json.dumps(m) for m in messages], "response": batch.texts,
                                     "score": scores.reported.cpu().numpy(), **terms,
                                     "kl": batch.sequence_kl.cpu().numpy(), **teacher, **turns}), iteration)
    every = cfg.evaluation.every or cfg.num_iterations  # with each evaluation, and at the end
    if iteration % every == 0 or iteration == cfg.num_iterations:
        shown = slice(0, cfg.num_logged_samples)
        reporting.samples(pd.DataFrame({"user": [last_user_message(m) for m in messages[shown]],
                                        "response": batch.texts[shown],
                                        "score": scores.reported[shown].cpu().numpy(),
                                        **{name: values[shown] for name, values in terms.items()},
                                        **{name: values[shown] for name, values in turns.items()}}), iteration)
