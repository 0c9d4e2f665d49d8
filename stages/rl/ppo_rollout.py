"""PPO's rollout on a sampler: sample, then the passes PPO needs besides (old log-probs and values
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
from stages.common.tensors import entropy_of, is_end, logprobs_of, response_mask
from stages.engines.sampler import Generation, HFSampler, Sampler, Sampling
from stages.envs.episode import EpisodeGeneration, check_failed_share
from stages.envs.loop import EpisodeRunner
from stages.rl.batch import Rollout, concat
from stages.rl.ppo_models import Models, forward_response, policy_and_values, reference_policy

if TYPE_CHECKING:
    import pandas as pd

    from rlhf.config_common import SamplingConfig
    from rlhf.config_ppo import PPOConfig


def policy_sampler(models: Models) -> HFSampler:
    """The sampler of a PPO run's policy."""
    return HFSampler(model=models.policy, tokenizer=models.tokenizer, stop_ids=models.stop_ids,
                     precision=models.precision, holding=models.holding, compact=models.packs)


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
@dataclass(frozen=True)
class ReferenceResponses:
    """The frozen reference's answers: what the reward terms score of each, and whether it ended."""

    texts: list[str]
    complete: list[bool]
    episodes: list | None = None
    """Each prompt's `Episode`, where the answers are multi-turn."""


def reference_responses(models: Models, prompts: list[str], sampling: SamplingConfig, seed: int,
                        episodic: Episodic | None = None) -> ReferenceResponses:
    """The frozen reference's (the SFT policy's) responses to `prompts`, or with `episodic` its
    episodes, sampled from `seed` on a random stream of its own, `sampling.micro_batch_size` at a time
    (collective where the policy is sharded)."""
    texts, complete, episodes = [], [], []
    chunks = in_chunks(prompts, sampling)
    rows = [None] * len(chunks) if episodic is None else [c.rows for c in episodic.chunks(sampling)]
    with own_random_stream(models.policy.device), reference_policy(models) as reference:
        torch.manual_seed(seed)
        sampler = reference_sampler(models, reference)
        for chunk, records in zip(chunks, rows, strict=True):
            if records is not None:
                found = episodic.runner.run(sampler, records, sampling.temperature)
                episodes += found
                texts += [e.answer for e in found]
                complete += [e.status == "ok" for e in found]
                continue
            responses = sampler.generate(chunk, Sampling(sampling.response_length, sampling.temperature)).responses
            texts += models.tokenizer.batch_decode(responses, skip_special_tokens=True)
            complete += is_end(responses, models.stop_ids).any(dim=1).tolist()
    return ReferenceResponses(texts, complete, None if episodic is None else episodes)


def in_chunks(items: list, sampling: SamplingConfig) -> list[list]:
    """`items` in runs of `sampling.micro_batch_size` (one run when unset): what a process samples at once."""
    size = sampling.micro_batch_size or max(len(items), 1)
    return [items[start:start + size] for start in range(0, len(items), size)]


@dataclass(frozen=True)
class Episodic:
    """Multi-turn episodes instead of single responses: the environment's runner and each prompt's record."""

    runner: EpisodeRunner
    rows: list[dict]
    """Each prompt's record: `messages` and the declared columns (`reward.columns`), in the prompts' order."""

    def chunks(self, sampling: SamplingConfig) -> list[Episodic]:
        return [Episodic(self.runner, rows) for rows in in_chunks(self.rows, sampling)]


@torch.no_grad()
def rollout(models: Models, sampler: Sampler, prompts: list[str], sampling: SamplingConfig,
            timings: dict[str, float], sampled: list[Generation] | None = None,
            episodic: Episodic | None = None) -> Rollout:
    """Sample responses (or, `episodic`, multi-turn episodes), then the passes PPO needs besides: old
    log-probs and values (from the sampling pass when `models.reuse_sampling_pass` and the sampler gave
    them: never an engine's own, `engine_logprobs`, which are kept beside), and the reference's
    log-probs, under the models as they are now; `sampling.micro_batch_size` prompts at a time, the
    pieces then padded into one batch. `sampled`: the chunks' responses, sampled earlier
    (`stages.rl.sampling_ahead`)."""
    models.train(False)
    chunks = in_chunks(prompts, sampling)
    episodes = [None] * len(chunks) if episodic is None else episodic.chunks(sampling)
    batch = concat([_rollout_chunk(models, sampler, chunk, sampling, timings, earlier, rows)
                    for chunk, earlier, rows in zip(chunks, sampled or [None] * len(chunks), episodes, strict=True)],
                   models.tokenizer.pad_token_id)
    if episodic is not None:  # a template or environment that fails most episodes stops the run, saying why
        check_failed_share(batch.episodes, episodic.runner.settings.max_failed_share)
    return batch


def _sampled(models: Models, sampler: Sampler, prompts: list[str], sampling: SamplingConfig,
             episodic: Episodic | None) -> Generation:
    """The chunk's responses, or its episodes (`EpisodeGeneration`)."""
    if episodic is None:
        return sampler.generate(prompts, Sampling(sampling.response_length, sampling.temperature))
    return episodic.runner.generation(sampler, episodic.rows, sampling.temperature, models.policy.device)


def _gave_what_the_update_needs(models: Models, sampled: Generation) -> bool:
    """Whether the sampling pass holds the old log-probs and, for a critic on the policy's body, its hidden states."""
    wants_hidden = models.critic is not None and models.critic.reads_policy_hidden
    return sampled.logprobs is not None and (sampled.hidden is not None or not wants_hidden)


def _rollout_chunk(models: Models, sampler: Sampler, prompts: list[str], sampling: SamplingConfig,
                   timings: dict[str, float], sampled: Generation | None = None,
                   episodic: Episodic | None = None) -> Rollout:
    """Phases timed: `generate` (unless `sampled` earlier); `forward`, the passes after it: `values`
    (the critic on the sampling pass's outputs) or `policy_forward` (the policy's log-probs, with the
    values), and `reference`. In an episode the passes run over all its tokens (tool results are
    context) and its figures are kept on the model's own tokens (`trainable`)."""
    temperature = sampling.temperature
    if sampled is None:
        with timed(timings, "generate"):
            sampled = _sampled(models, sampler, prompts, sampling, episodic)
    queries, query_mask, responses = sampled.queries, sampled.query_mask, sampled.responses
    marks = response_marks(models, sampled)
    mask, trainable = marks.mask, marks.trainable
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
    engine_logprobs = None if sampled.engine_logprobs is None else sampled.engine_logprobs * trainable
    return Rollout(queries=queries, query_mask=query_mask, responses=responses, mask=mask,
                   logprobs=logprobs * trainable, ref_logprobs=ref_logprobs * trainable,
                   values=None if values is None else values * trainable, entropy=entropy, has_eos=marks.has_eos,
                   texts=marks.texts, prompts=prompts, engine_logprobs=engine_logprobs, trainable=trainable,
                   turn_rewards=marks.turn_rewards, episodes=marks.episodes)


@dataclass(frozen=True, kw_only=True)
class ResponseMarks:
    """What marks a chunk's responses for the passes and the scores: the one place where a single
    response and a multi-turn episode differ."""

    mask: torch.Tensor  # (B, T) every real token after the prompt: what the passes attend to
    trainable: torch.Tensor  # (B, T) the model's own tokens (a single response's every real token)
    turn_rewards: torch.Tensor  # (B, T) each turn's reward on its last token (0 for a single response)
    has_eos: torch.Tensor  # (B,) it ended: an end token, or an episode whose model answered
    texts: list[str]  # what the reward terms score: the response, or the episode's answer
    episodes: list | None  # each row's `Episode`; None for single responses


def response_marks(models: Models, sampled: Generation) -> ResponseMarks:
    """The marks of sampled single responses (cut at the first end token) or of episodes (`EpisodeGeneration`)."""
    if isinstance(sampled, EpisodeGeneration):
        ended = torch.tensor([e.status == "ok" for e in sampled.episodes], device=sampled.responses.device)
        return ResponseMarks(mask=sampled.mask, trainable=sampled.trainable, turn_rewards=sampled.turn_rewards,
                             has_eos=ended, texts=[e.answer for e in sampled.episodes], episodes=sampled.episodes)
    mask = response_mask(sampled.responses, models.stop_ids)
    return ResponseMarks(mask=mask, trainable=mask, turn_rewards=torch.zeros_like(mask),
                         has_eos=is_end(sampled.responses, models.stop_ids).any(dim=1),
                         texts=models.tokenizer.batch_decode(sampled.responses, skip_special_tokens=True),
                         episodes=None)


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
        """These prompts as an environment's records: `messages` and the declared columns."""
        return [{"messages": self.messages[i], **self.columns[i]} for i in picks]

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
