"""PPO's rollout on a sampler: sample episodes (`stages.envs.episode.EpisodeSource`: one turn per
prompt, or an environment's loop), then the passes PPO needs besides (old log-probs and values
unless the sampling pass gave them, and the reference's log-probs). PPO's iterations and every
evaluation of a policy (`stages.rl.evaluation`, PPO's and DPO's) call `rollout`. Which prompts an
iteration samples: `Prompts`, `prompt_batch`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from stages.common.reporting import timed
from stages.common.tensors import entropy_of, log_probs, logprobs_of, picked, top_bins
from stages.engines.sampler import Generation, HFSampler, Sampler, Sampling
from stages.envs.episode import Episode, EpisodeGeneration, EpisodeSource, SingleTurn, check_failed_share
from stages.rl.batch import Rollout, concat
from stages.rl.ppo_models import Models, forward_response, policy_and_values, reference_policy

if TYPE_CHECKING:
    import pandas as pd

    from rlhf.config_common import SamplingConfig
    from rlhf.config_ppo import PPOConfig


def policy_sampler(models: Models) -> HFSampler:
    """The sampler of a PPO run's policy."""
    return HFSampler(model=models.policy, tokenizer=models.tokenizer, stop_ids=models.stop_ids,
                     precision=models.precision, holding=models.holding, compact=models.packs,
                     compiler=models.compiler)


def single_turn(models: Models) -> SingleTurn:
    """One response per prompt from the policy's tokenizer and end tokens: a rollout without an environment."""
    return SingleTurn(models.tokenizer, models.stop_ids)


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
        for chunk in in_chunks(rows, sampling):
            episodes += source.generation(sampler, chunk, Sampling(sampling.response_length, sampling.temperature),
                                          models.policy.device).episodes
    return episodes


def in_chunks(items: list, sampling: SamplingConfig) -> list[list]:
    """`items` in runs of `sampling.micro_batch_size` (one run when unset): what a process samples at once."""
    size = sampling.micro_batch_size or max(len(items), 1)
    return [items[start:start + size] for start in range(0, len(items), size)]


@torch.no_grad()
def rollout(models: Models, sampler: Sampler, source: EpisodeSource, rows: list[dict], sampling: SamplingConfig,
            timings: dict[str, float], sampled: list[EpisodeGeneration] | None = None) -> Rollout:
    """Sample the episodes of `rows` (each prompt's record: `prompt`, `messages`, declared columns)
    from `source` (a single turn, or an environment's loop), then the passes PPO needs besides: old
    log-probs and values (from the sampling pass when `models.reuse_sampling_pass` and the sampler gave
    them: never an engine's own, `engine_logprobs`, which are kept beside), and the reference's
    log-probs, under the models as they are now; `sampling.micro_batch_size` prompts at a time, the
    pieces then padded into one batch. `sampled`: the chunks' episodes, sampled earlier
    (`stages.rl.sampling_ahead`). A source that fails too many episodes stops the run, saying why."""
    models.train(False)
    chunks = in_chunks(rows, sampling)
    batch = concat([_rollout_chunk(models, sampler, source, chunk, sampling, timings, earlier)
                    for chunk, earlier in zip(chunks, sampled or [None] * len(chunks), strict=True)],
                   models.tokenizer.pad_token_id)
    check_failed_share(batch.episodes, source.max_failed_share)
    return batch


def _gave_what_the_update_needs(models: Models, sampled: Generation) -> bool:
    """Whether the sampling pass holds the old log-probs and, for a critic on the policy's body, its hidden states."""
    wants_hidden = models.critic is not None and models.critic.reads_policy_hidden
    return sampled.logprobs is not None and (sampled.hidden is not None or not wants_hidden)


def _rollout_chunk(models: Models, sampler: Sampler, source: EpisodeSource, rows: list[dict],
                   sampling: SamplingConfig, timings: dict[str, float],
                   sampled: EpisodeGeneration | None = None) -> Rollout:
    """Phases timed: `generate` (unless `sampled` earlier); `forward`, the passes after it: `values`
    (the critic on the sampling pass's outputs) or `policy_forward` (the policy's log-probs, with the
    values), and `reference`. The passes run over all of an episode's tokens (tool results are
    context) and its figures are kept on the model's own tokens (`trainable`). With a distillation
    teacher, its log-probs too (`teacher`)."""
    temperature = sampling.temperature
    if sampled is None:
        with timed(timings, "generate"):
            sampled = source.generation(sampler, rows, Sampling(sampling.response_length, temperature),
                                        models.policy.device)
    queries, query_mask, responses = sampled.queries, sampled.query_mask, sampled.responses
    mask, trainable = sampled.mask, sampled.trainable
    if sampled.computed_tokens is not None:  # the decode loop's, where it counts them
        fed = query_mask.sum() + (mask.sum(dim=1) - 1).clamp(min=0).sum()  # a response's last token is never fed
        models.counts.add("generate", float(fed), sampled.computed_tokens)

    with timed(timings, "forward"):
        if models.reuse_sampling_pass and _gave_what_the_update_needs(models, sampled):
            logprobs, entropy = sampled.logprobs, sampled.entropy
            with timed(timings, "values"):
                values = None if models.critic is None else models.critic.values(
                    sampled.hidden, queries, query_mask, responses, mask, models.passes("values"))
        else:
            with timed(timings, "policy_forward"):
                logits, values = policy_and_values(models, queries, query_mask, responses, mask,
                                                   phase="policy_forward")
                logprobs, entropy = logprobs_of(logits, responses, temperature), entropy_of(logits, temperature)
        with timed(timings, "reference"), reference_policy(models) as reference:
            ref_logits, _ = forward_response(reference, queries, query_mask, responses, mask, want_hidden=False,
                                             passes=models.passes("reference"))
            ref_logprobs = logprobs_of(ref_logits, responses, temperature)
        teacher_logprobs = teacher_top = teacher_bins = None
        if models.teacher is not None:
            with timed(timings, "teacher"):
                teacher_logits, _ = forward_response(models.teacher, queries, query_mask, responses, mask,
                                                     want_hidden=False, passes=models.passes("teacher"))
                teacher_logps = log_probs(teacher_logits, temperature)  # (B, T, V), normalised once for both
                teacher_logprobs = picked(teacher_logps, responses) * trainable
                if models.teacher_top_k:  # the loss's k + 1 bins at every position (B, T, k), (B, T, k + 1)
                    teacher_top, teacher_bins = top_bins(teacher_logps, models.teacher_top_k)
    engine_logprobs = None if sampled.engine_logprobs is None else sampled.engine_logprobs * trainable
    episodes = sampled.episodes
    ended = torch.tensor([e.status == "ok" for e in episodes], device=responses.device)  # (B,)
    return Rollout(queries=queries, query_mask=query_mask, responses=responses, mask=mask,
                   logprobs=logprobs * trainable, ref_logprobs=ref_logprobs * trainable,
                   teacher_logprobs=teacher_logprobs, teacher_top=teacher_top, teacher_bins=teacher_bins,
                   values=None if values is None else values * trainable, entropy=entropy, has_eos=ended,
                   texts=[e.answer for e in episodes], prompts=[row["prompt"] for row in rows],
                   engine_logprobs=engine_logprobs, trainable=trainable, turn_rewards=sampled.turn_rewards,
                   episodes=episodes)


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
