"""PPO's rollout on a sampler: sample, then the passes PPO needs besides (old log-probs and values
unless the sampling pass gave them, and the reference's log-probs). PPO's iterations and every
evaluation of a policy (`stages.rl.evaluation`, PPO's and DPO's) call `rollout`. Which prompts an
iteration samples: `Prompts`, `prompt_batch`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from stages.common.reporting import timed
from stages.common.tensors import entropy_of, is_end, logprobs_of, response_mask
from stages.engines.sampler import Generation, HFSampler, Sampler, Sampling
from stages.rl.batch import Rollout, concat
from stages.rl.ppo_models import Models, forward_response, policy_and_values, reference_policy

if TYPE_CHECKING:
    import pandas as pd

    from rlhf.config_common import SamplingConfig
    from rlhf.config_ppo import PPOConfig


def policy_sampler(models: Models) -> HFSampler:
    """The sampler of a PPO run's policy."""
    return HFSampler(model=models.policy, tokenizer=models.tokenizer, stop_ids=models.stop_ids,
                     precision=models.precision, holding=models.holding)


def reference_sampler(models: Models, reference: PreTrainedModel) -> HFSampler:
    """A sampler of the frozen reference (`reference_policy(models)`), held as the policy is."""
    return HFSampler(model=reference, tokenizer=models.tokenizer, stop_ids=models.stop_ids, precision=models.precision,
                     holding=models.holding)


def in_chunks(items: list, sampling: SamplingConfig) -> list[list]:
    """`items` in runs of `sampling.micro_batch_size` (one run when unset): what a process samples at once."""
    size = sampling.micro_batch_size or max(len(items), 1)
    return [items[start:start + size] for start in range(0, len(items), size)]


@torch.no_grad()
def rollout(models: Models, sampler: Sampler, prompts: list[str], sampling: SamplingConfig,
            timings: dict[str, float], sampled: list[Generation] | None = None) -> Rollout:
    """Sample responses, then the passes PPO needs besides: old log-probs and values (from the
    sampling pass when `models.reuse_sampling_pass` and the sampler gave them: never an engine's own,
    `engine_logprobs`, which are kept beside), and the reference's log-probs, under the models as
    they are now; `sampling.micro_batch_size` prompts at a time, the pieces then padded into one
    batch. `sampled`: the chunks' responses, sampled earlier (`stages.rl.sampling_ahead`)."""
    models.train(False)
    chunks = in_chunks(prompts, sampling)
    return concat([_rollout_chunk(models, sampler, chunk, sampling, timings, earlier)
                   for chunk, earlier in zip(chunks, sampled or [None] * len(chunks), strict=True)],
                  models.tokenizer.pad_token_id)


def _gave_what_the_update_needs(models: Models, sampled: Generation) -> bool:
    """Whether the sampling pass holds the old log-probs and, for a critic on the policy's body, its hidden states."""
    wants_hidden = models.critic is not None and models.critic.reads_policy_hidden
    return sampled.logprobs is not None and (sampled.hidden is not None or not wants_hidden)


def _rollout_chunk(models: Models, sampler: Sampler, prompts: list[str], sampling: SamplingConfig,
                   timings: dict[str, float], sampled: Generation | None = None) -> Rollout:
    """Phases timed: `generate` (unless `sampled` earlier); `forward`, the passes after it: `values`
    (the critic on the sampling pass's outputs) or `policy_forward` (the policy's log-probs, with the
    values), and `reference`."""
    temperature = sampling.temperature
    if sampled is None:
        with timed(timings, "generate"):
            sampled = sampler.generate(prompts, Sampling(sampling.response_length, temperature))
    queries, query_mask, responses = sampled.queries, sampled.query_mask, sampled.responses

    with timed(timings, "forward"):
        mask = response_mask(responses, models.stop_ids)
        if models.reuse_sampling_pass and _gave_what_the_update_needs(models, sampled):
            logprobs, entropy = sampled.logprobs, sampled.entropy
            with timed(timings, "values"):
                values = None if models.critic is None else models.critic.values(
                    sampled.hidden, queries, query_mask, responses, mask, models.precision)
        else:
            with timed(timings, "policy_forward"):
                logits, values = policy_and_values(models, queries, query_mask, responses, mask)
                logprobs, entropy = logprobs_of(logits, responses, temperature), entropy_of(logits, temperature)
        with timed(timings, "reference"), reference_policy(models) as reference:
            ref_logits, _ = forward_response(reference, queries, query_mask, responses, mask, want_hidden=False,
                                             precision=models.precision)
            ref_logprobs = logprobs_of(ref_logits, responses, temperature)
    engine_logprobs = None if sampled.engine_logprobs is None else sampled.engine_logprobs * mask
    return Rollout(queries=queries, query_mask=query_mask, responses=responses, mask=mask,
                   logprobs=logprobs * mask, ref_logprobs=ref_logprobs * mask,
                   values=None if values is None else values * mask, entropy=entropy,
                   has_eos=is_end(responses, models.stop_ids).any(dim=1),
                   texts=models.tokenizer.batch_decode(responses, skip_special_tokens=True), prompts=prompts,
                   engine_logprobs=engine_logprobs)


@dataclass(frozen=True)
class Prompts:
    """The prompts PPO samples, as each use of them needs them."""

    texts: list[str]
    messages: list[list[dict]]
    columns: list[dict]
    """Each prompt's declared extra columns (`reward.columns`): the reward functions' inputs."""
    per_iteration: int
    """Prompts per sampling round, over all processes: `rollout_batch_size / samples_per_prompt`."""

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
