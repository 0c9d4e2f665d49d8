"""Where an iteration's episodes come from, and the passes PPO needs besides sampling.

`Rollouts` is the RL stage's sampling: a round of prompts (`round_picks`), their episodes from the
run's `EpisodeSource` (one turn per prompt, an environment's loop, or single turns sampled ahead on
the vLLM server: `stages.envs`), then `rollout`'s passes under the models as they are now (old
log-probs and values, unless the sampling pass gave them, the reference's log-probs, the teacher's
marks), then the scores (`stages.rl.scoring.Scoring`). DAPO's dynamic sampling takes rounds until
every group carries signal. `sync` hands the updated policy to the sampler.

PPO's iterations and every evaluation of a policy (`stages.rl.evaluation`, PPO's and DPO's) call
`rollout`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel

from stages.common.batches import Sequences, concat, rows_of
from stages.common.reporting import timed
from stages.common.tensors import entropy_of, logprobs_of
from stages.engines.sampler import HFSampler, Sampler, Sampling
from stages.envs.episode import Episode, EpisodeGeneration, EpisodeSource, SingleTurn, check_failed_share, in_chunks
from stages.envs.parsers import reasoning_parser
from stages.math.ppo_math import groups_with_signal
from stages.rewards.scoring import Scores
from stages.rl.batch import Rollout
from stages.rl.ppo_models import Models, policy_and_values, reference_policy
from stages.rl.ppo_state import LoopState
from stages.rl.scoring import Scoring
from stages.runtime.collectives import over_processes, sum_over_processes
from stages.runtime.forward import forward_response

if TYPE_CHECKING:
    import pandas as pd

    from rlhf.sections.base import SamplingConfig
    from rlhf.sections.ppo import PPOConfig


@dataclass(kw_only=True)
class Rollouts:
    """What an iteration's episodes come from and are scored by: the sampler, the episode source, the
    prompts in their order, and the `Scoring`. Built once per run (`stages.ppo.build_rollouts`)."""

    cfg: PPOConfig
    accelerator: Accelerator
    models: Models
    sampler: Sampler
    """What samples the policy: transformers' decode loop, or a vLLM server (`stages.engines`)."""
    source: EpisodeSource
    """Where the episodes come from: one turn per prompt, an environment's loop, or sampled ahead."""
    scoring: Scoring
    prompts: Prompts

    def sample(self, loop: LoopState, iteration: int, timings: dict[str, float]) -> tuple[Rollout, Scores]:
        """This process's share of the iteration's episodes, with their passes and scores: one round,
        or with `dynamic_sampling` rounds until the groups carry signal. Advances `loop.cursor` past
        the prompts it took. Phases timed into `timings`."""
        if self.cfg.dynamic_sampling is not None:
            rollout, scores, rounds = self.sample_until_full(loop, iteration, timings)
        else:
            (rollout, scores), rounds = self.round(loop, loop.cursor, iteration, timings), 1
        loop.cursor = loop.cursor + self.prompts.per_iteration * rounds
        return replace(rollout, figures=rollout.figures | self.source.figures), scores

    def round(self, loop: LoopState, cursor: int, iteration: int, timings: dict[str, float]) -> tuple[Rollout, Scores]:
        """One round: the prompts of `round_picks` from `cursor`, sampled, passed and scored. A run's
        first round fits the reward normalisation (`loop.normalization`) before it is scored.
        Collective, as are the reward functions."""
        rows = self.prompts.records(self.round_picks(cursor))
        rollout_ = rollout(self.models, self.sampler, self.source, rows, self.cfg.sampling, timings)
        rollout_ = self.with_sft_references(rollout_, rows, cursor, timings)  # what `choice` judges compare with
        return self.scoring.score(rollout_, loop, iteration, timings)

    def sample_until_full(self, loop: LoopState, iteration: int,
                          timings: dict[str, float]) -> tuple[Rollout, Scores, int]:
        """DAPO's dynamic sampling: rounds until every process holds its share of groups whose scores
        differ (`groups_with_signal`), at most `dynamic_sampling.max_rounds`; the batch is those groups,
        in the order sampled, filled up with groups without signal where the rounds ran out. Every
        process takes the same number of rounds (collective). Figures: the share of sampled groups
        dropped, the rounds taken, the share of the batch filled without signal."""
        cfg, accelerator = self.cfg, self.accelerator
        size, groups = cfg.samples_per_prompt, self.prompts.per_iteration // accelerator.num_processes
        rounds: list[tuple[Rollout, Scores]] = []
        while len(rounds) < cfg.dynamic_sampling.max_rounds:
            spent = {}
            rounds.append(self.round(loop, loop.cursor + len(rounds) * self.prompts.per_iteration, iteration, spent))
            for phase, seconds in spent.items():
                timings[phase] = timings.get(phase, 0.0) + seconds
            signal = torch.cat([groups_with_signal(scores.reward, size) for _, scores in rounds])  # (G * rounds,)
            full = torch.tensor(float(signal.sum() >= groups), device=accelerator.device)
            if sum_over_processes(accelerator, full).item() == accelerator.num_processes:
                break
        order = torch.cat([signal.nonzero().flatten(), (~signal).nonzero().flatten()])[:groups].tolist()
        rows = [group * size + j for group in order for j in range(size)]
        figures = {"rollout/filtered_share": 1.0 - signal.float().mean().item(), "rollout/sampling_rounds": len(rounds),
                   "rollout/filled_share": max(groups - int(signal.sum()), 0) / groups}
        if self.scoring.remotes:
            figures["remote/retries"] = sum(r.figures["remote/retries"] for r, _ in rounds)
        pad_id = self.models.tokenizer.pad_token_id
        kept = rows_of(concat([r for r, _ in rounds], pad_id), rows)
        scores = rows_of(concat([s for _, s in rounds], pad_id), rows)
        return replace(kept, figures=figures), scores, len(rounds)

    def round_picks(self, cursor: int) -> list[int]:
        """This process's share of the next `prompts.per_iteration` prompts from `cursor`, each repeated
        `samples_per_prompt` times (a prompt's group on consecutive rows): indices into `prompts`."""
        cfg, accelerator, prompts = self.cfg, self.accelerator, self.prompts
        local = prompts.per_iteration // accelerator.num_processes
        picks = prompt_batch(cfg.seed, len(prompts.texts), cursor, prompts.per_iteration)
        return [i for i in picks[accelerator.process_index * local:][:local] for _ in range(cfg.samples_per_prompt)]

    def records_of(self, iteration: int) -> list[dict]:
        """This process's prompt records of `iteration` (from 1) where every iteration takes one round
        (no dynamic sampling): what a source that samples ahead asks for before the iteration runs."""
        return self.prompts.records(self.round_picks((iteration - 1) * self.prompts.per_iteration))

    def with_sft_references(self, rollout_: Rollout, rows: list[dict], cursor: int,
                            timings: dict[str, float]) -> Rollout:
        """`rollout_` with each episode's `reference`, what `choice` judges compare it with: the SFT
        policy's answer to its group's prompt (`rows`, the prompts' records, in groups of
        `samples_per_prompt`), one per group, sampled from the run's seed and the round's `cursor` (so
        a resumed run asks the same). As it is without such a judge."""
        cfg = self.cfg
        if not cfg.reward.pairwise:
            return rollout_
        size = cfg.samples_per_prompt
        with timed(timings, "sft_reference"):
            sft = reference_episodes(self.models, self.source.now(), rows[::size], cfg.sampling,
                                     cfg.seed * 1_000_003 + cursor)
        episodes = [replace(e, reference=sft[i // size].answer) for i, e in enumerate(rollout_.episodes)]
        return replace(rollout_, episodes=episodes)

    def sync(self, iteration: int, timings: dict[str, float]) -> None:
        """The updated policy's weights to the sampler (a vLLM server takes them with nothing in flight:
        what the source sampled ahead is settled first, and then sampled by this version)."""
        self.source.settle(timings)
        with timed(timings, "weight_sync"):
            self.sampler.sync(self.models.policy, iteration)

    def close(self) -> None:
        """What the source holds in flight dropped, and a vLLM server stopped: however the stage ends."""
        self.source.close()
        self.sampler.close()


def policy_sampler(models: Models) -> HFSampler:
    """The sampler of a PPO run's policy."""
    return HFSampler(model=models.policy, tokenizer=models.tokenizer, stop_ids=models.stop_ids,
                     precision=models.precision, holding=models.holding, compact=models.packs,
                     compiler=models.compiler)


def single_turn(models: Models) -> SingleTurn:
    """One response per prompt from the policy's tokenizer and end tokens, its reasoning read in the
    family's convention: a rollout without an environment (DPO's evaluation, benchmarks)."""
    return SingleTurn(models.tokenizer, models.stop_ids, reasoning_parser(models.tokenizer))


def reference_sampler(models: Models, reference: PreTrainedModel) -> HFSampler:
    """A sampler of the frozen reference (`reference_policy(models)`), held as the policy is."""
    return HFSampler(model=reference, tokenizer=models.tokenizer, stop_ids=models.stop_ids, precision=models.precision,
                     holding=models.holding, compact=models.packs)


@contextmanager
def own_random_stream(device: torch.device):
    """A block whose seeding and sampling leave the caller's random stream (CPU, and the GPU's) as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        yield


@torch.no_grad()
def reference_episodes(models: Models, source: EpisodeSource, rows: list[dict], sampling: SamplingConfig,
                       seed: int) -> list[Episode]:
    """The frozen reference's (the SFT policy's) episodes of `rows` (`source`), sampled from `seed` on
    a random stream of its own, `sampling.micro_batch_size` at a time (collective where the policy is
    sharded)."""
    episodes = []
    with own_random_stream(models.policy.device), reference_policy(models) as reference:
        torch.manual_seed(seed)
        sampler = reference_sampler(models, reference)
        for chunk in in_chunks(rows, sampling.micro_batch_size):
            episodes += source.generation(sampler, chunk, Sampling(sampling.response_length, sampling.temperature),
                                          models.policy.device, {}).episodes
    return episodes


@torch.no_grad()
def rollout(models: Models, sampler: Sampler, source: EpisodeSource, rows: list[dict], sampling: SamplingConfig,
            timings: dict[str, float]) -> Rollout:
    """Sample the episodes of `rows` (each prompt's record: `prompt`, `messages`, declared columns)
    from `source`, then the passes PPO needs besides (`passes`), under the models as they are now;
    `sampling.micro_batch_size` prompts at a time, the pieces then padded into one batch. A source that
    fails too many episodes stops the run, saying why."""
    models.train(False)
    chunks = []
    for chunk in in_chunks(rows, sampling.micro_batch_size):
        sampled = source.generation(sampler, chunk, Sampling(sampling.response_length, sampling.temperature),
                                    models.policy.device, timings)
        chunks.append(passes(models, sampled, chunk, sampling.temperature, timings))
    batch = concat(chunks, models.tokenizer.pad_token_id)
    check_failed_share(batch.episodes, source.max_failed_share)
    return batch


def _gave_what_the_update_needs(models: Models, sampled: EpisodeGeneration) -> bool:
    """Whether the sampling pass holds the old log-probs and, for a critic on the policy's body, its hidden states."""
    return sampled.logprobs is not None and (sampled.hidden is not None or not models.critic.reads_policy_hidden)


def largest_deviation(accelerator: Accelerator | None, sampled: torch.Tensor, recomputed: torch.Tensor,
                      trainable: torch.Tensor) -> float:
    """The largest |sampled - recomputed| log-prob on the model's own tokens, over every process
    (collective on several; None: this process alone). # (B, R) each -> float"""
    worst = (sampled - recomputed).abs().masked_fill(trainable == 0, 0.0).max().item()
    return worst if accelerator is None else over_processes(accelerator, {"deviation_max": worst})["deviation_max"]


def passes(models: Models, sampled: EpisodeGeneration, rows: list[dict], temperature: float,
           timings: dict[str, float]) -> Rollout:
    """The passes after sampling, timed under `forward`: `values` (the critic on the sampling pass's
    outputs, where `models.old_logprobs` takes the sampler's log-probs: never an engine's own,
    `engine_logprobs`, which are kept beside) or `policy_forward` (the policy's log-probs, with the
    values), `reference`, and the teacher's marks (`teacher`). They run over all of an episode's
    tokens (tool results are context); their figures are kept on the model's own tokens (`trainable`)."""
    sequences = Sequences(sampled.queries, sampled.query_mask, sampled.responses, sampled.mask, sampled.restarts)
    trainable = sampled.trainable
    if sampled.computed_tokens is not None:  # the decode loop's, where it counts them
        fed = sampled.query_mask.sum() + (sampled.mask.sum(dim=1) - 1).clamp(min=0).sum()  # a last token is never fed
        models.counts.add("generate", float(fed), sampled.computed_tokens)

    def deviation() -> float:  # `auto`'s one comparison: the sampler's log-probs against the update's pass
        # Uncounted: a resumed run checks again, and its figures are the uninterrupted run's (time/ aside).
        with timed(timings, "old_logprobs_check"):
            logits, _ = forward_response(models.policy, sequences, replace(models.passes("check"), counts=None))
        recomputed = logprobs_of(logits, sampled.responses, temperature)
        return largest_deviation(models.holding.accelerator, sampled.logprobs, recomputed, trainable)

    with timed(timings, "forward"):
        if models.old_logprobs.reuse(_gave_what_the_update_needs(models, sampled), deviation):
            logprobs, entropy = sampled.logprobs, sampled.entropy
            with timed(timings, "values"):
                values = models.critic.values(sampled.hidden, sequences, models.passes("values"))
        else:
            with timed(timings, "policy_forward"):
                logits, values = policy_and_values(models, sequences, phase="policy_forward")
                logprobs, entropy = logprobs_of(logits, sampled.responses, temperature), entropy_of(logits, temperature)
        with timed(timings, "reference"), reference_policy(models) as reference:
            ref_logits, _ = forward_response(reference, sequences, models.passes("reference"))
            ref_logprobs = logprobs_of(ref_logits, sampled.responses, temperature)
        teacher = models.teacher.marks(sequences, trainable, temperature, models.passes("teacher"), timings)
    logprobs = logprobs * trainable
    engine_logprobs = logprobs if sampled.engine_logprobs is None else sampled.engine_logprobs * trainable
    episodes = sampled.episodes
    ended = torch.tensor([e.status == "ok" for e in episodes], device=sampled.responses.device)  # (B,)
    return Rollout(**sequences._asdict(), trainable=trainable, turn_rewards=sampled.turn_rewards, logprobs=logprobs,
                   ref_logprobs=ref_logprobs * trainable, values=values * trainable, entropy=entropy,
                   engine_logprobs=engine_logprobs, teacher=teacher, has_eos=ended, episodes=episodes,
                   messages=[row["messages"] for row in rows])


@dataclass(frozen=True)
class Prompts:
    """The prompts PPO samples, as each use of them needs them."""

    texts: list[str]
    messages: list[list[dict]]
    columns: list[dict]
    """Each prompt's declared extra columns (`reward.columns`): the reward functions' inputs."""
    per_iteration: int
    """Prompts per sampling round, over all processes: `rollout_batch_size / samples_per_prompt`."""

    def records(self, picks: list[int]) -> list[dict]:
        """These prompts as episodes' records: the rendered `prompt`, its `messages` and the declared columns."""
        return [{"prompt": self.texts[i], "messages": self.messages[i], **self.columns[i]} for i in picks]

    @classmethod
    def of(cls, frame: pd.DataFrame, cfg: PPOConfig) -> Prompts:
        return cls(list(frame["prompt"]), [json.loads(m) for m in frame["prompt_messages"]],
                   frame[list(cfg.reward.columns)].to_dict("records"), cfg.rollout_batch_size // cfg.samples_per_prompt)


def prompt_batch(order_seed: int, n_prompts: int, cursor: int, size: int) -> list[int]:
    """Indices of the next `size` prompts from a seeded shuffle that is redrawn for every pass."""
    picks = []
    while len(picks) < size:
        pass_number, position = divmod(cursor, n_prompts)
        order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(order_seed + pass_number))
        take = min(size - len(picks), n_prompts - position)
        picks += order[position:position + take].tolist()
        cursor += take
    return picks
