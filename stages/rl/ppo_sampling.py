"""Where an iteration's episodes come from, chosen once per run (`sampling_for`): one sampling round,
DAPO's dynamic sampling (rounds until every group carries signal), or a round the vLLM server
sampled ahead while earlier iterations trained (`stages.rl.sampling_ahead`). A round samples a
batch of prompts (`round_picks`), runs the passes PPO needs (`stages.rl.ppo_rollout.rollout`) and
scores the responses (`stages.rl.ppo_scores`). `sync_weights` hands the updated policy to the sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from stages.common.reporting import timed
from stages.envs.episode import EpisodeGeneration, single_turn_batch
from stages.math.ppo_math import groups_with_signal
from stages.rewards.scoring import concat_scores
from stages.rl.batch import Sampled, concat, rows_of
from stages.rl.ppo_rollout import Prompts, in_chunks, prompt_batch, rollout
from stages.rl.ppo_scores import (
    fitted_normalization,
    function_terms,
    raw_scores,
    remote_terms,
    scores_of,
    with_sft_references,
)
from stages.rl.ppo_state import LoopState
from stages.rl.sampling_ahead import SamplingAhead
from stages.rl.update import Learner
from stages.runtime.collectives import sum_over_processes

Sample = Callable[[int, dict[str, float]], Sampled]
"""`sample(iteration, timings)`: the iteration's `Sampled`, with the sampling's own figures; phases
timed into `timings`."""


def sampling_for(learner: Learner, loop: LoopState, prompts: Prompts, ahead: SamplingAhead | None) -> Sample:
    """How this run samples: sampled ahead on the server (`rollout.max_staleness`), in rounds until
    the groups carry signal (`dynamic_sampling`), or one round per iteration."""
    if ahead is not None:
        return lambda iteration, timings: sample_ahead(learner, ahead, loop, prompts, iteration, timings)
    if learner.cfg.dynamic_sampling is not None:
        return lambda iteration, timings: sample_until_full(learner, loop, prompts, iteration, timings)
    return lambda iteration, timings: sample_round(learner, loop, prompts, loop.cursor, iteration, timings)


def sync_weights(learner: Learner, ahead: SamplingAhead | None, iteration: int, timings: dict[str, float]) -> None:
    """The updated policy's weights to the sampler (a vLLM server takes them with nothing in flight:
    what was sampled ahead is settled first, and then sampled by this version)."""
    if ahead is not None:
        with timed(timings, "sampling_wait"):
            ahead.settle()
    with timed(timings, "weight_sync"):
        learner.sampler.sync(learner.models.policy)
    if ahead is not None:
        ahead.synced(iteration)


def round_picks(learner: Learner, prompts: Prompts, cursor: int) -> list[int]:
    """This process's share of the next `prompts.per_iteration` prompts from `cursor`, each repeated
    `samples_per_prompt` times (a prompt's group on consecutive rows): indices into `prompts`."""
    cfg, accelerator = learner.cfg, learner.accelerator
    local = prompts.per_iteration // accelerator.num_processes
    picks = prompt_batch(cfg.seed, len(prompts.texts), cursor, prompts.per_iteration)
    return [i for i in picks[accelerator.process_index * local:][:local] for _ in range(cfg.samples_per_prompt)]


def sample_round(learner: Learner, loop: LoopState, prompts: Prompts, cursor: int, iteration: int,
                 timings: dict[str, float], sampled: list[EpisodeGeneration] | None = None) -> Sampled:
    """One round: the prompts of `round_picks`, sampled (unless `sampled` earlier, by `SamplingAhead`)
    and scored. A run's first round fits the reward normalisation (`loop.normalization`) before it
    is scored. Collective, as are the reward functions."""
    cfg, models = learner.cfg, learner.models
    picks = round_picks(learner, prompts, cursor)
    messages = [prompts.messages[i] for i in picks]
    rows = prompts.records(picks)
    batch = rollout(models, learner.sampler, learner.episode_source, rows, cfg.sampling, timings, sampled)
    raw = None if models.scorer is None else raw_scores(models.scorer, batch, messages, timings,
                                                         single_turn=not learner.episode_source.multi_turn)
    if raw is not None and loop.normalization is None:  # the run's first round: the reward's scale
        loop.normalization, batch = fitted_normalization(learner, raw, batch)
    functions = function_terms(learner, messages, batch.episodes, iteration, timings)
    batch = with_sft_references(learner, batch, rows, cursor, timings)  # what `choice` judges compare with
    remote, retries = remote_terms(learner, messages, batch.episodes, iteration, timings)
    return Sampled(batch=batch, messages=messages, scores=scores_of(raw, batch, models.scorer, cfg, functions, remote),
                   figures={"remote/retries": retries} if remote else {})


def sample_until_full(learner: Learner, loop: LoopState, prompts: Prompts, iteration: int,
                      timings: dict[str, float]) -> Sampled:
    """DAPO's dynamic sampling: rounds of `sample_round` until every process holds its share of
    groups whose scores differ (`groups_with_signal`), at most `dynamic_sampling.max_rounds`; the
    batch is those groups, in the order sampled, filled up with groups without signal where the
    rounds ran out. Every process takes the same number of rounds (collective). Figures: the
    share of sampled groups dropped, the rounds taken, the share of the batch filled without signal."""
    cfg, accelerator = learner.cfg, learner.accelerator
    size, groups = cfg.samples_per_prompt, prompts.per_iteration // accelerator.num_processes
    rounds: list[Sampled] = []
    while len(rounds) < cfg.dynamic_sampling.max_rounds:
        spent = {}
        rounds.append(sample_round(learner, loop, prompts, loop.cursor + len(rounds) * prompts.per_iteration,
                                   iteration, spent))
        for phase, seconds in spent.items():
            timings[phase] = timings.get(phase, 0.0) + seconds
        signal = torch.cat([groups_with_signal(r.scores.reward, size) for r in rounds])  # (G * rounds,)
        full = torch.tensor(float(signal.sum() >= groups), device=accelerator.device)
        if sum_over_processes(accelerator, full).item() == accelerator.num_processes:
            break
    order = torch.cat([signal.nonzero().flatten(), (~signal).nonzero().flatten()])[:groups].tolist()
    rows = [group * size + j for group in order for j in range(size)]
    batch = rows_of(concat([r.batch for r in rounds], learner.models.tokenizer.pad_token_id), rows)
    messages = [m for r in rounds for m in r.messages]
    figures = {"rollout/filtered_share": 1.0 - signal.float().mean().item(), "rollout/sampling_rounds": len(rounds),
               "rollout/filled_share": max(groups - int(signal.sum()), 0) / groups}
    if learner.remote_rewards:
        figures["remote/retries"] = sum(r.figures["remote/retries"] for r in rounds)
    return Sampled(batch=batch, messages=[messages[i] for i in rows],
                   scores=concat_scores([r.scores for r in rounds]).rows(rows), rounds=len(rounds), figures=figures)


def sample_ahead(learner: Learner, ahead: SamplingAhead, loop: LoopState, prompts: Prompts, iteration: int,
                 timings: dict[str, float]) -> Sampled:
    """This iteration's round, sampled earlier on the server (`stages.rl.sampling_ahead`), after
    submitting the next iterations' (so the server samples them while this one trains), then scored
    under the models as they are now. Timed: `rollout_wait`, this iteration's wait for its rollout;
    `generate`, the server's seconds on it, spent beside earlier work."""
    per_iteration = prompts.per_iteration

    def texts_of(k: int) -> list[str]:  # every iteration takes one round: no dynamic sampling here
        return [prompts.texts[i] for i in round_picks(learner, prompts, loop.cursor + (k - iteration) * per_iteration)]

    ahead.fill(iteration, learner.cfg.num_iterations, texts_of)
    with timed(timings, "rollout_wait"):
        earlier = ahead.take(iteration)
    timings["generate"] = earlier.seconds
    # single-turn only (episodes step their environment between turns, which the server cannot do ahead)
    chunks = in_chunks(prompts.records(round_picks(learner, prompts, loop.cursor)), learner.cfg.sampling)
    models = learner.models
    episodes = [single_turn_batch(generation, rows, models.tokenizer, models.stop_ids)
                for generation, rows in zip(earlier.generations, chunks, strict=True)]
    sampled = sample_round(learner, loop, prompts, loop.cursor, iteration, timings, episodes)
    return replace(sampled, figures=sampled.figures | {"rollout/staleness": float(iteration - 1 - earlier.version)})
