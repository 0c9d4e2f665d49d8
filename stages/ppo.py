"""Stage 3: PPO fine-tuning of the SFT policy against the frozen, normalised reward model.

One iteration of `train_ppo` reads top to bottom:

    rollout    sample `samples_per_prompt` responses to each of a batch of prompts (with
               `rollout.max_staleness`, sampled on the vLLM server while earlier iterations
               trained: `stages.rl.sampling_ahead`); keep log-probs, values (GAE only),
               reference log-probs, all under the models as they are now
    score      the reward's terms: the reward model scores prompt + response text (EOS penalty,
               optional clipping), Python reward functions score the texts; their weighted sum
    advantage  gae          r_t = -beta * KL_t, plus the score on the last response token;
                            GAE(gamma, lambda); returns = A + V; A whitened
               grpo         (score - group mean) / group std on every token; KL goes to the loss
               rloo         R = score - beta * sum KL; R minus the mean of the group's others
               reinforce++  discounted returns of r_t (score minus group mean for -baseline); whitened
    update     num_ppo_epochs x shuffled minibatches (micro-batches accumulate):
               loss = -L_clip [+ c1 L_V] - c2 H [+ c3 KL]; grad-norm clip; AdamW, warmup + linear decay
    sync       the policy's weights to the sampler (a vLLM server; nothing in flight)
    control    adaptive (or fixed) KL coefficient; optional reference refresh
every `eval_every` iterations and after the last one
    evaluate   held-out prompts: the policy against the SFT policy's responses

On several processes (`accelerate launch`) each samples and scores its share of the rollout
batch with its own seed; advantage whitening, the KL controller and the logged figures use
statistics over all processes (`stages.runtime.collectives`), and DDP or FSDP2 averages the gradients, so
one iteration does the work of the single-process iteration with the same `rollout_batch_size`.
Whether the processes hold whole models (DDP) or shards of them (FSDP2) is `stages.runtime.holding`'s
business: the loop below reads the same either way.

The equations live in `stages.rl.ppo_math`, the update in `stages.rl.update`, the models and the critic
in `stages.rl.ppo_models`, the scores in `stages.rl.ppo_scores` (the reward model's in `stages.rl.scoring`),
full-state checkpoints in `stages.rl.ppo_state`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
from accelerate import Accelerator
from transformers import get_scheduler

from rlhf.config_ppo import PPOConfig
from schemas.adapters import last_user_message
from stages.common.errors import StageUserError
from stages.common.reporting import Reporting, timed
from stages.common.tensors import masked_mean
from stages.engines.sampler import Generation
from stages.engines.vllm_server import sampler_for
from stages.memory.phases import Counts
from stages.memory.plan import with_micro_batches
from stages.rl.evaluation import (
    HeldOut,
    evaluate,
    evaluate_midway,
    warn_over_kl_budget,
)
from stages.rl.ppo_math import (
    KLController,
    discounted_returns,
    engine_importance_weights,
    explained_variance,
    gae,
    group_baselined,
    groups_with_signal,
    grpo_advantages,
    kl_estimate,
    rloo_advantages,
    sequence_rewards,
    token_rewards,
)
from stages.rl.ppo_models import ActorCritic, load_models, rounds_to_16_bits
from stages.rl.ppo_rollout import Prompts, Rollout, concat_rollouts, policy_sampler, prompt_batch, rollout, rollout_rows
from stages.rl.ppo_state import (
    LoopState,
    load_state,
    save_state_everywhere,
)
from stages.rl.ppo_scores import (
    adopt_normalization,
    first_normalization,
    function_judge,
    function_terms,
    raw_scores,
    scores_of,
)
from stages.rl.reward_functions import load_reward_functions
from stages.rl.sampling_ahead import SamplingAhead
from stages.rl.scoring import Scores, concat_scores
from stages.rl.update import Episodes, PPOTrainer, ppo_update
from stages.runtime.collectives import (
    gathered,
    over_processes,
    sum_over_processes,
    whiten_over_processes,
)
from stages.runtime.holding import held_as, holding_for
from stages.runtime.models import Precision, resolve_precision, saved_dtype_and_tags


@dataclass(frozen=True)
class PPOInputs:
    sft_location: str
    """The SFT checkpoint: the policy's start and the reference it is kept near."""
    reward_location: str | None
    """The reward checkpoint that scores (and, with `ppo.critic.kind: reward`, starts the critic); None
    where the reward has no reward-model term (`reward.terms` all functions)."""
    prompts: pd.DataFrame
    """Validated prompts to train on."""
    eval_prompts: pd.DataFrame
    """Validated held-out prompts for the evaluations (every `eval_every` iterations and at the end)."""


@dataclass(frozen=True)
class PPOResult:
    checkpoint: Path
    """The final policy as a plain Hugging Face folder (no value head, LoRA merged)."""
    metrics: dict[str, float]
    history: list[dict[str, float]]
    """Per-iteration figures, for curves and plots."""
    evaluation: pd.DataFrame
    """Held-out prompts with PPO and SFT responses, their scores and the KL of the PPO response."""
    tags: dict[str, str] = field(default_factory=dict)
    """Run tags: precision (`rlhf.trainable_dtype`, `rlhf.autocast_dtype`, `rlhf.checkpoint_dtype`) and `rlhf.held_as`."""


# --- sample -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampled:
    """This process's share of one iteration's episodes: sampled and scored."""

    batch: Rollout
    messages: list[list[dict]]
    """Each episode's prompt as chat messages."""
    scores: Scores
    rounds: int = 1
    """Sampling rounds it took (more than one with `dynamic_sampling`), each `Prompts.per_iteration` prompts."""


def round_picks(trainer: PPOTrainer, prompts: Prompts, cursor: int) -> list[int]:
    """This process's share of the next `prompts.per_iteration` prompts from `cursor`, each repeated
    `samples_per_prompt` times (a prompt's group on consecutive rows): indices into `prompts`."""
    cfg, accelerator = trainer.cfg, trainer.accelerator
    local = prompts.per_iteration // accelerator.num_processes
    picks = prompt_batch(cfg.seed, len(prompts.texts), cursor, prompts.per_iteration)
    return [i for i in picks[accelerator.process_index * local:][:local] for _ in range(cfg.samples_per_prompt)]


def sample_round(trainer: PPOTrainer, loop: LoopState, prompts: Prompts, cursor: int, iteration: int,
                 timings: dict[str, float], sampled: list[Generation] | None = None) -> Sampled:
    """One round: the prompts of `round_picks`, sampled (unless `sampled` earlier, by `SamplingAhead`)
    and scored. The first round of a run fits the reward normalisation (collective, as are the
    reward functions)."""
    cfg, models, accelerator = trainer.cfg, trainer.models, trainer.accelerator
    picks = round_picks(trainer, prompts, cursor)
    messages = [prompts.messages[i] for i in picks]
    batch = rollout(models, trainer.sampler, [prompts.texts[i] for i in picks], cfg.sampling, timings, sampled)
    raw = raw_scores(models.scorer, batch, messages, timings) if models.scorer is not None else None
    if models.scorer is not None and loop.normalization is None:
        loop.normalization = first_normalization(accelerator, models.scorer, raw, cfg)
        batch = adopt_normalization(models, loop.normalization, batch)
    functions = function_terms(trainer, messages, batch.texts, [prompts.columns[i] for i in picks], iteration, timings)
    return Sampled(batch, messages, scores_of(raw, batch, models.scorer, cfg, functions))


def sample_until_full(trainer: PPOTrainer, loop: LoopState, prompts: Prompts, iteration: int,
                      timings: dict[str, float]) -> tuple[Sampled, dict[str, float]]:
    """DAPO's dynamic sampling: rounds of `sample_round` until every process holds its share of
    groups whose scores differ (`groups_with_signal`), at most `dynamic_sampling.max_rounds`; the
    batch is those groups, in the order sampled, filled up with groups without signal where the
    rounds ran out. Every process takes the same number of rounds (collective). Figures: the
    share of sampled groups dropped, the rounds taken, the share of the batch filled without signal."""
    cfg, accelerator = trainer.cfg, trainer.accelerator
    size, groups = cfg.samples_per_prompt, prompts.per_iteration // accelerator.num_processes
    rounds: list[Sampled] = []
    while len(rounds) < cfg.dynamic_sampling.max_rounds:
        spent = {}
        rounds.append(sample_round(trainer, loop, prompts, loop.cursor + len(rounds) * prompts.per_iteration,
                                   iteration, spent))
        for phase, seconds in spent.items():
            timings[phase] = timings.get(phase, 0.0) + seconds
        signal = torch.cat([groups_with_signal(r.scores.used, size) for r in rounds])  # (G * rounds,)
        full = torch.tensor(float(signal.sum() >= groups), device=accelerator.device)
        if sum_over_processes(accelerator, full).item() == accelerator.num_processes:
            break
    order = torch.cat([signal.nonzero().flatten(), (~signal).nonzero().flatten()])[:groups].tolist()
    rows = [group * size + j for group in order for j in range(size)]
    batch = rollout_rows(concat_rollouts([r.batch for r in rounds], trainer.models.tokenizer.pad_token_id), rows)
    messages = [m for r in rounds for m in r.messages]
    figures = {"rollout/filtered_share": 1.0 - signal.float().mean().item(), "rollout/sampling_rounds": len(rounds),
               "rollout/filled_share": max(groups - int(signal.sum()), 0) / groups}
    return Sampled(batch, [messages[i] for i in rows], concat_scores([r.scores for r in rounds]).rows(rows),
                   len(rounds)), figures


def sample_ahead(trainer: PPOTrainer, ahead: SamplingAhead, loop: LoopState, prompts: Prompts, iteration: int,
                 timings: dict[str, float]) -> tuple[Sampled, dict[str, float]]:
    """This iteration's round, sampled earlier on the server (`stages.rl.sampling_ahead`), after
    submitting the next iterations' (so the server samples them while this one trains), then scored
    under the models as they are now. Timed: `rollout_wait`, this iteration's wait for its rollout;
    `generate`, the server's seconds on it, spent beside earlier work."""
    per_iteration = prompts.per_iteration

    def texts_of(k: int) -> list[str]:  # every iteration takes one round: no dynamic sampling here
        return [prompts.texts[i] for i in round_picks(trainer, prompts, loop.cursor + (k - iteration) * per_iteration)]

    ahead.fill(iteration, trainer.cfg.num_iterations, texts_of)
    with timed(timings, "rollout_wait"):
        earlier = ahead.take(iteration)
    timings["generate"] = earlier.seconds
    sampled = sample_round(trainer, loop, prompts, loop.cursor, iteration, timings, earlier.generations)
    return sampled, {"rollout/staleness": float(iteration - 1 - earlier.version)}


# --- advantage --------------------------------------------------------------------------------


def advantages_and_returns(accelerator: Accelerator, batch: Rollout, kl: torch.Tensor, scores: Scores, beta: float,
                           cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The advantage of every response token under `cfg.advantage_estimator`, and for GAE the
    returns the critic regresses on (None otherwise). Whitening is over all processes' tokens
    (collective); the group estimators need no other process, as each holds whole groups, unless
    `group_batch_normalize` whitens them over the batch.
    `kl` is per token and masked. # -> (B, T), (B, T) | None"""
    mask, group_size = batch.mask, cfg.samples_per_prompt
    if cfg.advantage_estimator == "gae":
        rewards = token_rewards(scores.used, kl, beta, mask)
        if cfg.critic.whiten_rewards:
            rewards = whiten_over_processes(accelerator, rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, batch.values, mask, cfg.gamma, cfg.critic.lam)
        return whiten_over_processes(accelerator, advantages, mask), returns
    if cfg.advantage_estimator in ("grpo", "rloo"):
        if cfg.advantage_estimator == "grpo":  # the KL is a loss term: the reward is the score alone
            advantages = grpo_advantages(scores.used, mask, group_size, cfg.group_std_normalize)
        else:
            advantages = rloo_advantages(sequence_rewards(scores.used, kl, beta, mask), mask, group_size)
        return (whiten_over_processes(accelerator, advantages, mask) if cfg.group_batch_normalize else advantages), None
    outcome = group_baselined(scores.used, group_size) if cfg.advantage_estimator == "reinforce++-baseline" \
        else scores.used
    returns = discounted_returns(token_rewards(outcome, kl, beta, mask), mask, cfg.gamma)
    return whiten_over_processes(accelerator, returns, mask), None


def engine_weights(batch: Rollout, cfg: PPOConfig) -> torch.Tensor | None:
    """Truncated importance weights pi_train / pi_engine for tokens another engine sampled
    (`vllm.importance_sampling`); None where the trainer sampled or the correction is off. # (B, T)"""
    if batch.engine_logprobs is None or cfg.vllm.importance_sampling is None:
        return None
    return engine_importance_weights(batch.logprobs, batch.engine_logprobs, batch.mask, cfg.vllm.importance_sampling,
                                     cfg.vllm.importance_sampling_cap)


def loss_mask(batch: Rollout, cfg: PPOConfig) -> torch.Tensor | None:
    """The tokens the loss terms count: with `mask_truncated_responses`, the response mask less the
    responses cut off without an end token; None (the response mask) otherwise. # (B, T)"""
    if not cfg.mask_truncated_responses:
        return None
    return batch.mask * batch.has_eos.unsqueeze(1)


# --- the stage --------------------------------------------------------------------------------


def initial_ratio_threshold(cfg: PPOConfig, precision: Precision) -> float:
    """`warn_initial_ratio_deviation`, or its default: in fp32 a rollout and a fresh forward agree to
    ~1e-6; in 16 bits, shapes that differ between the rollout and the update round differently."""
    if cfg.warnings.initial_ratio_deviation is not None:
        return cfg.warnings.initial_ratio_deviation
    return 5e-2 if rounds_to_16_bits(cfg, precision) else 1e-3


def warnings_of(cfg: PPOConfig, figures: dict[str, float], first_length: float, iteration: int,
              previous_length: float | None = None) -> list[str]:
    found = []
    length = figures["rollout/response_length"]
    if previous_length is not None and length < (1 - cfg.warnings.length_collapse) * previous_length:
        found.append(f"mean response length collapsed from {previous_length:.1f} to {length:.1f} tokens in one "
                     "iteration: the policy is learning to stop early (check the value loss and the KL)")
    if figures["rollout/kl"] > cfg.evaluation.kl_budget:
        found.append(f"mean KL per sequence {figures['rollout/kl']:.2f} is over the budget of {cfg.evaluation.kl_budget}")
    drift = abs(figures["rollout/response_length"] - first_length) / max(first_length, 1e-6)
    if drift > cfg.warnings.length_drift:
        found.append(f"mean response length {figures['rollout/response_length']:.1f} drifted {drift:.0%} "
                     f"from {first_length:.1f}")
    if figures.get("rollout/filled_share", 0.0) > 0:
        found.append(f"dynamic sampling took its {cfg.dynamic_sampling.max_rounds} rounds and still filled "
                     f"{figures['rollout/filled_share']:.0%} of the batch with groups whose scores are all equal (no "
                     f"signal; {figures['rollout/filtered_share']:.0%} of the groups sampled were): raise "
                     "dynamic_sampling.max_rounds, or give the reward more spread")
    if figures["rollout/eos_rate"] < cfg.warnings.eos_rate:
        found.append(f"only {figures['rollout/eos_rate']:.0%} of responses end with EOS")
    if figures["train/ratio_max"] > cfg.warnings.ratio_max:
        found.append(f"policy ratio reached {figures['train/ratio_max']:.1f} (threshold {cfg.warnings.ratio_max})")
    threshold = initial_ratio_threshold(cfg, resolve_precision(cfg.precision))
    if figures["train/initial_ratio_deviation"] > threshold:
        found.append(f"before the first update the policy ratio was already {figures['train/initial_ratio_deviation']:.2g} "
                     f"from 1 (threshold {threshold:g}): rollout and training compute different policies (dropout "
                     "left on, or precision drift; try ppo.old_logprobs: recompute)")
    return [f"iteration {iteration}: {message}" for message in found]


def iteration_figures(trainer: PPOTrainer, episodes: Episodes, train: dict[str, float], timings: dict[str, float],
                      started: float) -> dict[str, float]:
    """What one iteration logs, this process's share (`over_processes` combines them); `started`:
    the iteration's start on the `time.perf_counter` clock."""
    batch, scores, kl, accelerator = episodes.batch, episodes.scores, episodes.kl, trainer.accelerator
    figures = {
        "rollout/score": scores.shown.mean().item(),
        "rollout/score_std": gathered(accelerator, scores.shown).std().item(),  # over all processes' scores
        "rollout/score_used": scores.used.mean().item(),
        "rollout/non_score_reward": (-episodes.reward_beta * kl).sum(1).mean().item(),
        "rollout/kl": kl.sum(1).mean().item(),
        "rollout/kl_coef": episodes.beta,
        "rollout/entropy": masked_mean(batch.entropy, batch.mask).item(),
        "rollout/response_length": batch.mask.sum(1).float().mean().item(),
        "rollout/eos_rate": batch.has_eos.float().mean().item(),
        **{f"train/{k}": v for k, v in train.items()},
        "train/learning_rate": trainer.scheduler.get_last_lr()[0],
        **{f"time/{k}": v for k, v in timings.items()},
    }
    if scores.raw is not None:
        figures["rollout/score_raw"] = scores.raw.mean().item()
    if episodes.returns is not None:
        figures["train/explained_variance"] = explained_variance(batch.values, episodes.returns, batch.mask)
    if trainer.reward_functions or trainer.cfg.reward.overlong:  # terms besides the reward model's
        figures |= term_figures(scores.terms, {f.term.name for f in trainer.reward_functions})
    if batch.engine_logprobs is not None:
        gap = (batch.logprobs - batch.engine_logprobs).abs() * batch.mask  # (B, T)
        figures |= {"rollout/vllm_logprob_gap": masked_mean(gap, batch.mask).item(),
                    "rollout/vllm_logprob_gap_max": gap.max().item()}
    if episodes.engine_weights is not None:
        weights = episodes.engine_weights[batch.mask.bool()]  # (tokens,)
        figures |= {"rollout/engine_importance_weight": weights.mean().item(),
                    "rollout/engine_importance_weight_std": weights.std().item() if len(weights) > 1 else 0.0,
                    "rollout/engine_importance_weight_capped": (weights >= trainer.cfg.vllm.importance_sampling_cap - 1e-6).float().mean().item()}
    elapsed = time.perf_counter() - started
    return figures | {"time/iteration": elapsed,
                      "time/tokens_per_second": batch.mask.sum().item() * accelerator.num_processes / elapsed}


def term_figures(terms: dict[str, torch.Tensor], functions: set[str]) -> dict[str, float]:
    """Each reward term's mean and std over the responses it scored; for a function, the share of
    responses it gave no reward (`_none`)."""
    figures = {}
    for name, values in terms.items():  # (B,) each, NaN where a function gave none
        given = values[~values.isnan()]
        figures[f"rollout/reward/{name}"] = given.mean().item() if len(given) else 0.0
        figures[f"rollout/reward/{name}_std"] = given.std().item() if len(given) > 1 else 0.0
        if name in functions:
            figures[f"rollout/reward/{name}_none"] = values.isnan().float().mean().item()
    return figures


def report_iteration(reporting: Reporting, cfg: PPOConfig, loop: LoopState, episodes: Episodes,
                     figures: dict[str, float]) -> None:
    """Warnings, figures, every episode, and now and then a few samples to read."""
    iteration, batch, messages, scores = episodes.iteration, episodes.batch, episodes.messages, episodes.scores
    previous_length = loop.history[-1]["rollout/response_length"] if loop.history else None
    for message in warnings_of(cfg, figures, loop.first_length, iteration, previous_length):
        reporting.warning(message)
    reporting.metrics(figures, iteration)
    # With reward functions or the overlong penalty each term is a column too (`reward/<name>`; NaN where a function gave none).
    terms = {f"reward/{name}": values.cpu().numpy() for name, values in scores.terms.items()} \
        if cfg.reward.functions or cfg.reward.overlong else {}
    reporting.rollouts(pd.DataFrame({"prompt_messages": [json.dumps(m) for m in messages], "response": batch.texts,
                                     "score": scores.shown.cpu().numpy(), **terms,
                                     "kl": episodes.kl.sum(1).cpu().numpy()}), iteration)
    if iteration % cfg.sample_every == 0 or iteration == cfg.num_iterations:
        shown = slice(0, cfg.num_logged_samples)
        reporting.samples(pd.DataFrame({"user": [last_user_message(m) for m in messages[shown]],
                                        "response": batch.texts[shown],
                                        "score": scores.shown[shown].cpu().numpy(),
                                        **{name: values[shown] for name, values in terms.items()}}), iteration)


def build_trainer(cfg: PPOConfig, inputs: PPOInputs, output_dir: Path) -> PPOTrainer:
    """This process's models, held as `cfg.launch` says (`stages.runtime.holding`), with their optimizer,
    schedule and sampler. Rank 0 keeps the single-process random stream; the others sample with their own."""
    accelerator = Accelerator()
    torch.manual_seed(cfg.seed)
    holding = holding_for(accelerator, cfg.launch, cfg.sharded_sampling, resolve_precision(cfg.precision).autocast_dtype,
                          cfg.offload_frozen)
    models = load_models(cfg, inputs.sft_location, inputs.reward_location, holding)
    if accelerator.process_index > 0:
        torch.manual_seed(cfg.seed + accelerator.process_index)
    actor_critic = holding.trained(ActorCritic(models))  # DDP or FSDP2 on several processes; as is on one
    # Built on the parameters as held (FSDP2 replaces them with shards), so its state is sharded too.
    optimizer = torch.optim.AdamW(models.trainable(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay, eps=1e-5,
                                  fused=True)  # one kernel per step instead of several per parameter
    scaler = torch.amp.GradScaler(accelerator.device.type, enabled=models.precision.autocast_dtype == torch.float16)
    total_steps = cfg.num_iterations * cfg.num_ppo_epochs * cfg.num_minibatches
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    return PPOTrainer(cfg, accelerator, models, actor_critic, optimizer, scheduler, scaler,
                      sampler_for(cfg, policy_sampler(models), cfg.seed, output_dir / "vllm.log",
                                  cfg.launch.engine == "ray"),
                      load_reward_functions(cfg.reward))


def resume(trainer: PPOTrainer, state_dir: Path, reporting: Reporting) -> LoopState:
    """The loop state of an earlier, interrupted attempt, its models and optimizer restored; its
    figures replayed, so this run's curves start at iteration 1, not at the resume point."""
    models = trainer.models
    loop = load_state(state_dir, models, trainer.optimizer, trainer.scheduler, trainer.scaler,
                      trainer.accelerator.process_index)
    if loop.normalization is not None:
        models.restore_normalization(loop.normalization.gain, loop.normalization.bias)
    trainer.sampler.sync(models.policy)
    reporting.warning(f"resumed from the full-state checkpoint after iteration {loop.iteration}")
    for past in loop.history:
        reporting.metrics({k: v for k, v in past.items() if k != "iteration"}, int(past["iteration"]))
    return loop


def save_state(trainer: PPOTrainer, state_dir: Path, loop: LoopState, ahead: SamplingAhead | None = None) -> None:
    """A full-state checkpoint of every process (collective), with the rollouts sampled ahead."""
    rank = trainer.accelerator.process_index
    save_state_everywhere(trainer, state_dir, loop, None if ahead is None else lambda staging: ahead.save(staging, rank))


def hand_off(trainer: PPOTrainer, loop: LoopState, held_out: HeldOut, inputs: PPOInputs, output_dir: Path,
             reporting: Reporting) -> PPOResult | None:
    """The final evaluation (every process: a sharded model needs them all), then on rank 0 the
    trained policy saved as a plain Hugging Face folder, and the stage's result."""
    cfg, models, holding = trainer.cfg, trainer.models, trainer.models.holding
    holding.check_weights_agree(trainer.actor_critic)
    trainer.optimizer.state.clear()  # the last full-state checkpoint holds it; the evaluation needs the memory
    held = held_as(models.policy, trainer.accelerator.num_processes)
    metrics, evaluation = evaluate(models, trainer.sampler, held_out, cfg.evaluation, cfg.sampling,
                                   function_judge(trainer))
    trained = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    saved, tags = saved_dtype_and_tags(cfg, inputs.sft_location, trained)
    # LoRA merged in float32: into bf16-held weights (`frozen_dtype`) a bf16 merge would round small updates away.
    checkpoint = output_dir / "checkpoint"
    holding.save_plain(models.policy, models.tokenizer, checkpoint, saved)
    if not trainer.accelerator.is_main_process:
        return None
    warn_over_kl_budget(metrics, cfg.evaluation.kl_budget, reporting)
    metrics["train/iterations"] = float(loop.iteration)
    if models.scorer is not None:
        metrics |= {"normalization/gain": models.scorer.gain, "normalization/bias": models.scorer.bias}
    return PPOResult(checkpoint, metrics, loop.history, evaluation, tags | held)


def train_ppo(cfg: PPOConfig, inputs: PPOInputs, output_dir: Path, reporting: Reporting = Reporting()) -> PPOResult | None:
    """Run PPO and evaluate against the SFT policy. Resumes from `output_dir/state` when a
    full-state checkpoint of an earlier, interrupted run is there. On several processes every
    one trains and evaluates (a sharded model needs them all); only the main one reports, saves and returns."""
    if cfg.reward.uses_model and inputs.reward_location is None:
        raise StageUserError("ppo: reward.terms has a reward-model term (a term without `function`), but no reward "
                             "checkpoint was given; run the reward stage, or make every term a function")
    if not cfg.reward.uses_model:  # a reward of functions alone: no reward model is loaded, whatever was passed
        inputs = replace(inputs, reward_location=None)
    cfg = with_micro_batches("ppo", cfg, Counts(ppo_eval_prompts=len(inputs.eval_prompts)), inputs.sft_location,
                             inputs.reward_location, reporting)
    trainer = build_trainer(cfg, inputs, output_dir)
    ahead = SamplingAhead(trainer.sampler, cfg.sampling, cfg.rollout.max_staleness) if cfg.rollout.max_staleness else None
    try:
        return _train(trainer, ahead, cfg, inputs, output_dir, reporting)
    finally:
        if ahead is not None:
            ahead.close()
        trainer.sampler.close()  # a vLLM server stopped however the stage ends


def _train(trainer: PPOTrainer, ahead: SamplingAhead | None, cfg: PPOConfig, inputs: PPOInputs, output_dir: Path,
           reporting: Reporting) -> PPOResult | None:
    """`train_ppo`'s loop and hand-off, on a built trainer (and its rollouts sampled ahead, if any)."""
    accelerator, models = trainer.accelerator, trainer.models
    # Before a resume or a reference refresh can change the reference: it is the SFT policy now.
    held_out = HeldOut.sample(models, inputs.eval_prompts, cfg.evaluation, cfg.sampling, accelerator.device,
                              tuple(cfg.reward.columns))
    state_dir = output_dir / "state"
    loop = LoopState(kl=KLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon))
    if (state_dir / "loop.json").exists():
        loop = resume(trainer, state_dir, reporting)
        if ahead is not None:
            ahead.resume(state_dir, accelerator.process_index, accelerator.device, version=loop.iteration)
    prompts = Prompts.of(inputs.prompts, cfg)

    while loop.iteration < cfg.num_iterations:
        iteration, started, timings = loop.iteration + 1, time.perf_counter(), {}
        if ahead is not None:
            sampled, sampling_figures = sample_ahead(trainer, ahead, loop, prompts, iteration, timings)
        elif cfg.dynamic_sampling is None:
            sampled, sampling_figures = sample_round(trainer, loop, prompts, loop.cursor, iteration, timings), {}
        else:
            sampled, sampling_figures = sample_until_full(trainer, loop, prompts, iteration, timings)
        batch, messages, scores = sampled.batch, sampled.messages, sampled.scores

        beta = loop.kl.value
        reward_beta, kl_loss_coef = (0.0, cfg.kl.loss_coef + beta) if cfg.kl_in_loss else (beta, cfg.kl.loss_coef)
        with timed(timings, "advantages"):
            kl = kl_estimate(batch.logprobs, batch.ref_logprobs, cfg.kl.estimator) * batch.mask  # (B, T)
            advantages, returns = advantages_and_returns(accelerator, batch, kl, scores, reward_beta, cfg)
            episodes = Episodes(iteration, batch, messages, scores, kl, beta, reward_beta, kl_loss_coef, advantages,
                                returns, engine_weights(batch, cfg), loss_mask(batch, cfg))

        with timed(timings, "train"):
            train = ppo_update(trainer, episodes)
        if ahead is not None:
            with timed(timings, "sampling_wait"):
                ahead.settle()  # the server takes new weights with nothing in flight
        with timed(timings, "weight_sync"):
            trainer.sampler.sync(models.policy)
        if ahead is not None:
            ahead.synced(iteration)

        figures = over_processes(accelerator, iteration_figures(trainer, episodes, train, timings, started)
                                 | sampling_figures)
        loop.kl.update(figures["rollout/kl"], cfg.rollout_batch_size)
        if cfg.ref_refresh_every and iteration % cfg.ref_refresh_every == 0:
            models.reference.load_state_dict(models.policy.state_dict())

        loop.first_length = loop.first_length or figures["rollout/response_length"]
        report_iteration(reporting, cfg, loop, episodes, figures)
        loop.iteration, loop.cursor = iteration, loop.cursor + prompts.per_iteration * sampled.rounds
        every = cfg.evaluation.every
        if every and iteration % every == 0 and iteration < cfg.num_iterations:
            figures |= evaluate_midway(models, trainer.sampler, held_out, cfg, iteration, reporting,
                                       function_judge(trainer))
        loop.history = loop.history + [{"iteration": iteration, **figures}]
        reporting.progress(iteration, cfg.num_iterations)
        if iteration % cfg.checkpoint_every == 0 or iteration == cfg.num_iterations:
            save_state(trainer, state_dir, loop, ahead)  # the last one too: if the upload fails, a rerun goes straight to evaluation

    return hand_off(trainer, loop, held_out, inputs, output_dir, reporting)
