"""Stage 3: PPO fine-tuning of the SFT policy against the frozen, normalised reward model.

One iteration of `train_ppo` reads top to bottom (the steps are numbered in `_train`'s loop):

  1 sample     `samples_per_prompt` responses to each of a batch of prompts, and the passes PPO
               needs besides: old log-probs, values (GAE only), reference log-probs, under the
               models as they are now; then the scores: the reward model's (its normalisation
               fitted on the run's first round), Python reward functions', their weighted sum.
               With a distillation teacher, its marks on the sampled tokens. One round, or DAPO's
               dynamic sampling's rounds; the episodes from the run's source, chosen once (one turn
               per prompt, an environment's loop, or sampled ahead on the vLLM server)
  2 advantage  where the KL coefficient beta goes (`kl_weights`: the reward, or GRPO's loss term);
               the per-token KL to the reference; the estimator's advantages, from the table
               `stages.math.ppo_math.ESTIMATORS`:
               gae          r_t = -beta * KL_t, plus the score on the last response token;
                            GAE(gamma, lambda); returns = A + V; A whitened
               grpo         (score - group mean) / group std on every token; KL goes to the loss
               rloo         R = score - beta * sum KL; R minus the mean of the group's others
               reinforce++  discounted returns of r_t (score minus group mean for -baseline); whitened
               distill      r_t alone (discount 0, no baseline): with a teacher (`ppo.teacher`), every
                            estimator's r_t also holds w * (log p_teacher - log p_policy) on each token
  3 update     num_ppo_epochs x shuffled minibatches (micro-batches accumulate):
               loss = -L_clip [+ c1 L_V] - c2 H [+ c3 KL]; grad-norm clip; AdamW, warmup + linear decay
  4 sync       the policy's weights to the sampler (a vLLM server takes them with nothing in flight)
  5 control    the adaptive (or fixed) KL coefficient, fed the mean KL per sequence; optional
               reference refresh
  6 report     figures, warnings, episodes; every `evaluation.every` iterations and after the last
               one, held-out prompts: the policy against the SFT policy's responses; a full-state
               checkpoint every `checkpoint_every`

On several processes (`accelerate launch`) each samples and scores its share of the rollout
batch with its own seed; advantage whitening, the KL controller and the logged figures use
statistics over all processes (`stages.runtime.collectives`), and DDP or FSDP2 averages the
gradients, so one iteration does the work of the single-process iteration with the same
`rollout_batch_size`. Whether the processes hold whole models (DDP) or shards of them (FSDP2) is
`stages.runtime.holding`'s business: the loop below reads the same either way.

Where each step lives, in the order to read them (docs/architecture.md): sampling and the passes
`stages.rl.rollout`, the scores `stages.rl.scoring`, advantages `stages.rl.advantages` (the
equations `stages.math.ppo_math`), the update `stages.rl.update`; beside them the batch types
`stages.rl.batch`, the teacher `stages.rl.teacher`, the models and the critic `stages.rl.ppo_models`,
figures and warnings `stages.rl.ppo_report`, evaluations `stages.rl.evaluation`, full-state
checkpoints `stages.rl.ppo_state`; every `auto` resolved as the stage starts, `stages.resolved`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
from accelerate import Accelerator
from transformers import get_scheduler

from rlhf.sections.ppo import PPOConfig
from stages.common.errors import StageUserError
from stages.common.reporting import Reporting, timed
from stages.common.user_code import on_import_path
from stages.engines.vllm_server import sampler_for
from stages.envs.ahead import SampledAhead, Schedule
from stages.envs.episode import EpisodeSource
from stages.envs.loop import episode_source
from stages.envs.remote.served import served_environment
from stages.math.ppo_math import KLController
from stages.memory.phases import Counts
from stages.resolved import probed, resolved
from stages.rewards.functions import load_reward_functions
from stages.rewards.remote import remote_rewards
from stages.rl.advantages import estimate, kl_weights
from stages.rl.evaluation import HeldOut, evaluate, evaluate_midway, warn_over_kl_budget
from stages.rl.ppo_models import ActorCritic, load_models
from stages.rl.ppo_report import iteration_figures, report_iteration
from stages.rl.ppo_state import LoopState, complete_state, load_state, save_state_everywhere
from stages.rl.rollout import Prompts, Rollouts, policy_sampler
from stages.rl.scoring import Scoring
from stages.rl.teacher import check_teacher_given
from stages.rl.update import Learner, ppo_update
from stages.runtime.collectives import mean_over_processes, over_processes
from stages.runtime.holding import held_as, holding_for
from stages.runtime.models import resolve_precision, saved_dtype_and_tags


@dataclass(frozen=True, kw_only=True)
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
    teacher_location: str | None = None
    """The distillation teacher's folder (`ppo.teacher`, resolved by the caller); None without a teacher."""


@dataclass(kw_only=True, frozen=True)
class PPOResult:
    checkpoint: Path
    """The final policy as a plain Hugging Face folder (no value head, LoRA merged)."""
    metrics: dict[str, float]
    history: list[dict[str, float]]
    """Per-iteration figures, for curves and plots."""
    evaluation: pd.DataFrame
    """Held-out prompts with PPO and SFT responses, their scores and the KL of the PPO response."""
    tags: dict[str, str] = field(default_factory=dict)
    """Run tags: precision (`rlhf.trainable_dtype`, `rlhf.autocast_dtype`, `rlhf.checkpoint_dtype`) and
    `rlhf.held_as`, in episodes the tool-call convention read (`rlhf.tool_parser`), and where asked
    whether the passes were compiled (`rlhf.compile`)."""


def build_learner(cfg: PPOConfig, inputs: PPOInputs) -> Learner:
    """This process's models, held as `cfg.launch` says (`stages.runtime.holding`), with their optimizer,
    schedule and loss scaling. Rank 0 keeps the single-process random stream; the others sample with
    their own."""
    accelerator = Accelerator()
    torch.manual_seed(cfg.seed)
    autocast = resolve_precision(cfg.precision).autocast_dtype
    holding = holding_for(accelerator, cfg.launch, cfg.sharded_sampling, autocast, cfg.offload_frozen)
    models = load_models(cfg, inputs.sft_location, inputs.reward_location, holding, inputs.teacher_location)
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
    return Learner(cfg=cfg, accelerator=accelerator, models=models, actor_critic=actor_critic, optimizer=optimizer,
                   scheduler=scheduler, scaler=scaler)


def build_rollouts(learner: Learner, inputs: PPOInputs, output_dir: Path) -> Rollouts:
    """Where the run's episodes come from and what scores them: the sampler (`rollout_engine`), the
    episode source (one turn per prompt or the `environment`'s loop, sampled ahead on the vLLM server
    with `rollout.max_staleness`), the prompts' order, and the reward's terms."""
    cfg, models = learner.cfg, learner.models
    on_import_path(cfg.paths)  # the stage's `module:function`s: reward terms, environments, tool parsers
    sampler = sampler_for(cfg, policy_sampler(models), cfg.seed, output_dir / "vllm.log", cfg.launch.engine == "ray")
    source: EpisodeSource = episode_source(cfg.environment, models.tokenizer, inputs.sft_location, models.stop_ids,
                                           cfg.sampling.response_length, cfg.reward.sees_reasoning)
    scoring = Scoring(cfg=cfg, accelerator=learner.accelerator, models=models,
                      functions=load_reward_functions(cfg), remotes=remote_rewards(cfg.reward.remotes),
                      prompts_as_sampled=source.prompt_is_row)
    rollouts = Rollouts(cfg=cfg, accelerator=learner.accelerator, models=models, sampler=sampler, source=source,
                        scoring=scoring, prompts=Prompts.of(inputs.prompts, cfg))
    if cfg.rollout.max_staleness:  # the source's episodes sampled ahead, read as the source reads them
        rollouts.source = SampledAhead(sampler, source, cfg.sampling, cfg.rollout.max_staleness,
                                       Schedule(rollouts.records_of, cfg.num_iterations), cfg.rollout.partial)
    return rollouts


def start_or_resume(learner: Learner, rollouts: Rollouts, state_dir: Path, reporting: Reporting) -> LoopState:
    """A fresh loop state, or an interrupted attempt's from `state_dir`: its models and optimizer
    restored, the sampler synced to them, what the source held in flight (rollouts sampled ahead)
    restored, and its figures replayed, so this run's curves start at iteration 1, not at the resume point."""
    cfg, accelerator, models = learner.cfg, learner.accelerator, learner.models
    found, passed = complete_state(state_dir)
    if passed is not None:
        reporting.warning(f"the full-state checkpoint was passed over: {passed}; "
                          + (f"resuming from {found.name}" if found else "starting over"))
    if found is None:
        return LoopState(kl=KLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon))
    loop = load_state(found, models, learner.optimizer, learner.scheduler, learner.scaler, accelerator.process_index)
    if loop.normalization is not None:
        models.restore_normalization(loop.normalization.gain, loop.normalization.bias)
    rollouts.sampler.sync(models.policy, loop.iteration)
    rollouts.source.resume(found, accelerator.process_index, accelerator.device, version=loop.iteration)
    reporting.warning(f"resumed from the full-state checkpoint after iteration {loop.iteration}")
    for past in loop.history:
        reporting.metrics({k: v for k, v in past.items() if k != "iteration"}, int(past["iteration"]))
    return loop


def save_state(learner: Learner, rollouts: Rollouts, state_dir: Path, loop: LoopState) -> None:
    """A full-state checkpoint of every process (collective), with what the source holds in flight."""
    rank = learner.accelerator.process_index
    save_state_everywhere(learner, state_dir, loop, lambda staging: rollouts.source.save(staging, rank))


def final_evaluation(learner: Learner, rollouts: Rollouts, held_out: HeldOut,
                     reporting: Reporting) -> tuple[dict[str, float], pd.DataFrame]:
    """The final evaluation, on every process (a sharded model needs them all)."""
    cfg, models = learner.cfg, learner.models
    models.holding.check_weights_agree(learner.actor_critic)
    learner.optimizer.state.clear()  # the last full-state checkpoint holds it; the evaluation needs the memory
    metrics, evaluation = evaluate(models, rollouts.sampler, held_out, cfg.evaluation, cfg.sampling,
                                   rollouts.scoring.term_judge())
    if learner.accelerator.is_main_process:
        warn_over_kl_budget(metrics, cfg.evaluation.kl_budget, reporting)
    if models.scorer is not None:
        metrics |= {"normalization/gain": models.scorer.gain, "normalization/bias": models.scorer.bias}
    return metrics, evaluation


def save_policy(learner: Learner, sft_location: str, output_dir: Path) -> tuple[Path, dict[str, str]]:
    """The trained policy saved as a plain Hugging Face folder (every process takes part), and the
    run's tags of how it was held and computed."""
    cfg, models = learner.cfg, learner.models
    held = held_as(models.policy, learner.accelerator.num_processes)
    saved, tags = saved_dtype_and_tags(cfg, sft_location, learner.trained_parameters())
    # LoRA merged in float32: into bf16-held weights (`frozen_dtype`) a bf16 merge would round small updates away.
    checkpoint = output_dir / "checkpoint"
    models.holding.save_plain(models.policy, models.tokenizer, checkpoint, saved)
    return checkpoint, tags | held | compile_tags(cfg, models) | models.old_logprobs.tags()


def compile_tags(cfg: PPOConfig, models) -> dict[str, str]:
    """`rlhf.compile`: whether the passes were compiled and why (`auto`'s probe), where `ppo.compile` was asked."""
    return {} if cfg.compile is False else {"rlhf.compile": models.compiler.reason}


def train_ppo(cfg: PPOConfig, inputs: PPOInputs, output_dir: Path,
              reporting: Reporting = Reporting()) -> PPOResult | None:
    """Run PPO and evaluate against the SFT policy. Resumes from `output_dir/state` when a
    full-state checkpoint of an earlier, interrupted run is there. On several processes every
    one trains and evaluates (a sharded model needs them all); only the main one reports, saves and returns."""
    if cfg.reward.uses_model and inputs.reward_location is None:
        raise StageUserError("ppo: reward.terms has a reward-model term (a term without `function`), but no reward "
                             "checkpoint was given; run the reward stage, or make every term a function")
    check_teacher_given(cfg, inputs.teacher_location)
    if not cfg.reward.uses_model:  # a reward of functions alone: no reward model is loaded, whatever was passed
        inputs = replace(inputs, reward_location=None)
    cfg = resolved("ppo", cfg, Counts(ppo_eval_prompts=len(inputs.eval_prompts)),
                   (inputs.sft_location, inputs.reward_location), reporting)  # every `auto`, here and only here
    learner = build_learner(cfg, inputs)
    reporting.params(probed(cfg, learner.models))
    rollouts = build_rollouts(learner, inputs, output_dir)
    servers = [*rollouts.scoring.remotes, *served_environment(cfg.environment)]
    for warning in filter(None, (server.exposed_token() for server in servers)):
        reporting.warning(warning)
    try:
        return _train(learner, rollouts, inputs, output_dir, reporting)
    finally:
        rollouts.close()  # what was sampled ahead dropped, a vLLM server stopped, however the stage ends


def _train(learner: Learner, rollouts: Rollouts, inputs: PPOInputs, output_dir: Path,
           reporting: Reporting) -> PPOResult | None:
    """`train_ppo`'s loop and hand-off, on a built learner and its rollouts."""
    cfg, accelerator, models = learner.cfg, learner.accelerator, learner.models
    # Before a resume or a reference refresh can change the reference: it is the SFT policy now.
    held_out = HeldOut.sample(models, inputs.eval_prompts, cfg.evaluation, cfg.sampling, rollouts.source.now(),
                              tuple(cfg.reward.columns))
    state_dir = output_dir / "state"
    loop = start_or_resume(learner, rollouts, state_dir, reporting)

    while loop.iteration < cfg.num_iterations:
        iteration, started, timings = loop.iteration + 1, time.perf_counter(), {}
        models.counts.reset()  # this iteration's passes only, not the evaluations' between
        # 1. sample this process's share of the episodes, with the passes PPO needs, and score them
        rollout, scores = rollouts.sample(loop, iteration, timings)
        # 2. advantage: the KL to the reference, weighted where `kl_weights` puts beta
        with timed(timings, "advantages"):
            batch = estimate(accelerator, cfg, models.teacher, rollout, scores, kl_weights(cfg, beta=loop.kl.value))
        # 3. update: epochs of minibatches, one optimizer step each
        with timed(timings, "train"):
            train = ppo_update(learner, batch, iteration)
        # 4. sync the sampler to the updated policy
        rollouts.sync(iteration, timings)
        figures = over_processes(accelerator, iteration_figures(learner, rollouts, batch, train, timings, started)
                                 | rollout.figures)  # this iteration's, over every process
        # 5. control: the KL coefficient, fed the mean KL per sequence over every process
        kl_per_sequence = mean_over_processes(accelerator, batch.sequence_kl.mean().item())
        loop.kl.update(kl_per_sequence, cfg.rollout_batch_size)
        if cfg.ref_refresh_every and iteration % cfg.ref_refresh_every == 0:
            models.reference.load_state_dict(models.policy.state_dict())
        # 6. report; evaluate now and then; checkpoint the full state
        loop.first_length = loop.first_length or figures["rollout/response_length"]
        report_iteration(reporting, rollouts, loop, batch, figures, iteration)
        loop.iteration = iteration
        if cfg.evaluation.every and iteration % cfg.evaluation.every == 0 and iteration < cfg.num_iterations:
            figures |= evaluate_midway(rollouts, held_out, iteration, reporting)
        loop.history = loop.history + [{"iteration": iteration, **figures}]
        reporting.progress(iteration, cfg.num_iterations)
        if iteration % cfg.checkpoint_every == 0 or iteration == cfg.num_iterations:
            save_state(learner, rollouts, state_dir, loop)  # the last one too: if the upload fails, a rerun evaluates

    # Hand-off: the final evaluation and the saved policy (every process), the result (the main one)
    metrics, evaluation = final_evaluation(learner, rollouts, held_out, reporting)
    checkpoint, tags = save_policy(learner, inputs.sft_location, output_dir)
    if not accelerator.is_main_process:
        return None
    metrics["train/iterations"] = float(loop.iteration)
    return PPOResult(checkpoint=checkpoint, metrics=metrics, history=loop.history, evaluation=evaluation,
                     tags=tags | rollouts.source.tags)
