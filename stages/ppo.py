"""Stage 3: PPO fine-tuning of the SFT policy against the frozen, normalised reward model.

One iteration reads top to bottom in `train_ppo`:

    rollout   sample responses for a batch of prompts; keep log-probs, values, reference log-probs
    score     the reward model scores prompt + response text; EOS penalty; optional clipping
    rewards   r_t = -beta * KL_t, plus the score on the last response token
    advantage GAE(gamma, lambda); returns = A + V; A whitened
    update    num_ppo_epochs x shuffled minibatches (micro-batches accumulate):
              loss = -L_clip + c1 L_V - c2 H [+ c3 KL]; grad-norm clip; AdamW, warmup + linear decay
    control   adaptive (or fixed) KL coefficient; optional reference refresh

On several processes (`accelerate launch`, DDP) each samples and scores its share of the
rollout batch with its own seed; advantage whitening, the KL controller and the logged figures
use statistics over all processes, and DDP averages the gradients, so one iteration does the
work of the single-process iteration with the same `rollout_batch_size`.

The equations live in `stages.ppo_math`; this module holds models, batching and state.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, load_model, save_file, save_model
from transformers import DynamicCache, PreTrainedModel, get_scheduler

from rlhf.config import PPOConfig
from rlhf.evaluation import win_rate
from stages.errors import NonFiniteLossError
from stages.models import (Precision, device, disable_dropout, dtype_named, load_causal_lm, load_tokenizer,
                           position_ids_for, resolve_precision, save_trained, stop_token_ids)
from stages.ppo_math import (KLController, apply_eos_penalty, clipped_policy_loss, clipped_value_loss, entropy_of,
                             explained_variance, gae, is_end, kl_estimate, logprobs_of, masked_mean, masked_whiten,
                             response_mask, token_rewards, truncate_after_eos)
from stages.reward import RewardScorer, fit_normalization, load_reward_model


@dataclass
class PPOHooks:
    """How the stage reports while it runs; the flow forwards these to MLflow and Prefect logs."""

    metrics: Callable[[dict[str, float], int], None] = lambda metrics, iteration: None
    samples: Callable[[pd.DataFrame, int], None] = lambda table, iteration: None
    warning: Callable[[str], None] = lambda message: None
    rollouts: Callable[[pd.DataFrame, int], None] = lambda table, iteration: None
    """Every iteration's episodes (this process's share): prompt messages, response, normalised
    score, KL per sequence; for a caller that judges them with what the stage must not see
    (the demo world's gold function)."""


# --- models -----------------------------------------------------------------------------------


class ValueHead(torch.nn.Module):
    """V(s_t) = w . h_t + b on the last hidden state; small initial values so early advantages
    come from the rewards, not from noise. `detach_body`: the value loss trains the head only,
    never the policy's body it reads."""

    def __init__(self, hidden_size: int, detach_body: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        self.detach_body = detach_body
        torch.nn.init.normal_(self.linear.weight, std=1.0 / math.sqrt(hidden_size + 1))
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor, detach_body: bool = False) -> torch.Tensor:  # (B, T, H) -> (B, T)
        return self.linear(hidden.detach() if self.detach_body or detach_body else hidden).squeeze(-1)


@dataclass
class Models:
    policy: PreTrainedModel
    value_head: ValueHead | None
    critic: PreTrainedModel | None
    reference: PreTrainedModel | None
    """None when LoRA is on: the reference is the policy with its adapters disabled."""
    scorer: RewardScorer
    tokenizer: object
    precision: Precision
    stop_ids: list[int]
    """Token ids that end a response: the reply end, EOS, and any the generation config lists."""
    value_offset: float = 0.0
    """Added to the critic's head (no bias of its own on most families) by `normalize_critic`."""

    def trainable(self) -> list[torch.nn.Parameter]:
        modules = [self.policy, self.value_head, self.critic]
        return [p for m in modules if m is not None for p in m.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> None:
        for module in (self.policy, self.value_head, self.critic):
            if module is not None:
                module.train(mode)


def load_models(cfg: PPOConfig, sft_location: str, reward_location: str) -> Models:
    """Trained modules (policy, value head or critic) in float32 whatever the checkpoints' dtype;
    frozen ones (reference, reward model) in `cfg.frozen_dtype`; dropout off in all of them, so
    a rollout and the update that follows compute the same policy."""
    frozen = dtype_named(cfg.frozen_dtype)
    tokenizer = load_tokenizer(sft_location, padding_side="left", trust_remote_code=cfg.trust_remote_code)
    policy = load_causal_lm(sft_location, tokenizer, trust_remote_code=cfg.trust_remote_code)
    disable_dropout(policy)
    reference = None
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                                   target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
    else:
        reference = copy.deepcopy(policy).to(frozen).eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    value_head, critic = None, None
    if cfg.critic in ("shared", "detached"):
        value_head = ValueHead(policy.config.hidden_size, detach_body=cfg.critic == "detached")
    else:
        reward_tokenizer = load_tokenizer(reward_location, trust_remote_code=cfg.trust_remote_code)
        if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"ppo.critic = 'reward' needs the reward model at {reward_location} to share the policy's "
                             "tokenizer (the critic reads the policy's token ids); use ppo.critic = 'shared'")
        critic = load_reward_model(reward_location, tokenizer, trust_remote_code=cfg.trust_remote_code, fresh_head=False)
    scorer = RewardScorer.from_pretrained(reward_location, dtype=frozen, trust_remote_code=cfg.trust_remote_code)
    scorer.model.requires_grad_(False)
    models = Models(policy, value_head, critic, reference, scorer, tokenizer, resolve_precision(cfg.precision),
                    stop_token_ids(policy))
    run_on = device()
    for module in (policy, value_head, critic, reference):
        if module is not None:
            module.to(run_on)
    return models


@contextmanager
def reference_policy(models: Models) -> Iterator[PreTrainedModel]:
    """The frozen reference: its own copy, or the LoRA policy with adapters disabled."""
    if models.reference is not None:
        yield models.reference
    else:
        with models.policy.disable_adapter():
            yield models.policy


def forward_response(model: PreTrainedModel, queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor,
                     mask: torch.Tensor, want_hidden: bool, precision: Precision) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits that predict each response token, and the final hidden states at the same
    positions, from one pass over prompt + response. # -> (B, T, V), (B, T, H) | None"""
    input_ids = torch.cat([queries, responses], dim=1)  # (B, Tq + T)
    attention_mask = torch.cat([query_mask, mask.long()], dim=1)
    steps = responses.shape[1]
    with precision.autocast(input_ids.device):
        # Only the last T + 1 positions need the vocabulary projection: the logits at position p predict token p + 1.
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask),
                    output_hidden_states=want_hidden, use_cache=False, logits_to_keep=steps + 1)
    # Sliced here as well: a model that ignores `logits_to_keep` returns every position.
    logits = out.logits[:, -(steps + 1):-1]  # (B, T, V)
    hidden = out.hidden_states[-1][:, -(steps + 1):-1] if want_hidden else None  # (B, T, H)
    return logits, hidden


def shared_values(models: Models, hidden: torch.Tensor, detach_body: bool = False) -> torch.Tensor:
    """Values from the policy's own final hidden states. # (B, T, H) -> (B, T)"""
    return models.value_head(hidden.to(models.value_head.linear.weight.dtype), detach_body)


def critic_values(models: Models, queries, query_mask, responses, mask) -> torch.Tensor:
    """Values from the separate critic's pass over prompt + response. # -> (B, T)"""
    _, hidden = forward_response(models.critic, queries, query_mask, responses, mask, want_hidden=True,
                                 precision=models.precision)
    return models.critic.score(hidden).squeeze(-1).float() + models.value_offset


def policy_and_values(models: Models, queries, query_mask, responses, mask,
                      freeze_policy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy logits and values for the response tokens; with the shared value head, one backbone
    pass (`freeze_policy`: the value loss does not reach the body). # (B, T, V), (B, T)"""
    logits, hidden = forward_response(models.policy, queries, query_mask, responses, mask,
                                      want_hidden=models.critic is None, precision=models.precision)
    if models.critic is None:
        return logits, shared_values(models, hidden, detach_body=freeze_policy)
    return logits, critic_values(models, queries, query_mask, responses, mask)


class ActorCritic(torch.nn.Module):
    """The trained modules (policy and value head, or policy and critic) as one module whose
    forward is `policy_and_values`, so a distributed engine wraps and synchronises them together."""

    def __init__(self, models: Models):
        super().__init__()
        self.policy, self.value_head, self.critic = models.policy, models.value_head, models.critic
        self.models = models

    def forward(self, queries, query_mask, responses, mask, freeze_policy=False) -> tuple[torch.Tensor, torch.Tensor]:
        return policy_and_values(self.models, queries, query_mask, responses, mask, freeze_policy)


# --- rollout ----------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One iteration's episodes; every tensor is (B, T) over response tokens unless noted."""

    queries: torch.Tensor  # (B, Tq) left-padded prompt ids
    query_mask: torch.Tensor  # (B, Tq)
    responses: torch.Tensor  # truncated after the first EOS, then padding
    mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor
    scores: torch.Tensor  # (B,) used in the reward: normalised, EOS-penalised, clipped
    normalized_scores: torch.Tensor  # (B,) the reward model's normalised scores
    raw_scores: torch.Tensor  # (B,) of the response as it is: a cut-off one is scored without an end token
    has_eos: torch.Tensor  # (B,) the response ended with an end token
    texts: list[str]
    prompts: list[str]


@dataclass
class Samples:
    """Sampled responses with what the sampling pass saw; (B, T) over response tokens unless noted."""

    queries: torch.Tensor  # (B, Tq) left-padded prompt ids
    query_mask: torch.Tensor  # (B, Tq)
    responses: torch.Tensor  # truncated after the first EOS, then padding
    logprobs: torch.Tensor  # log pi(token) under the temperature-scaled logits it was drawn from
    entropy: torch.Tensor
    hidden: torch.Tensor  # (B, T, H) final hidden states at the positions that predicted each token


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row from categorical `probs` by inverse-CDF sampling: one uniform number per
    row, where torch.multinomial draws one per vocabulary entry. # (B, V) -> (B, 1)"""
    cdf = probs.cumsum(dim=-1)  # (B, V)
    u = torch.rand(len(probs), 1, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]  # scaled: cdf[-1] may round below 1
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1)


@torch.inference_mode()
def sample(model: PreTrainedModel, tokenizer, prompts: list[str], cfg: PPOConfig, precision: Precision,
           stop_ids: list[int]) -> Samples:
    """Sample up to `response_length` tokens per prompt from the full temperature-scaled
    distribution, one KV-cached step at a time, keeping each token's log-prob, the entropy and
    the final hidden state of the step that produced it: the rollout then needs no second
    policy pass for old log-probs and (shared-body) values. Stops early once every row has an end token."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                      padding_side="left").to(model.device)
    queries, query_mask = batch["input_ids"], batch["attention_mask"]  # (B, Tq)
    attention_mask, positions = query_mask, position_ids_for(query_mask)
    step_ids, cache = queries, DynamicCache()
    tokens, logprobs, entropy, hidden = [], [], [], []
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=model.device)
    with precision.autocast(model.device):
        for _ in range(cfg.response_length):
            out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
            logits = out.logits[:, -1:].float()  # (B, 1, V)
            token = draw(torch.softmax(logits[:, -1] / cfg.temperature, dim=-1))  # (B, 1)
            tokens.append(token)
            logprobs.append(logprobs_of(logits, token, cfg.temperature))
            entropy.append(entropy_of(logits, cfg.temperature))
            hidden.append(out.hidden_states[-1][:, -1:])
            finished |= is_end(token.squeeze(1), stop_ids)
            if finished.all():
                break
            step_ids, positions = token, positions[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
    responses = truncate_after_eos(torch.cat(tokens, dim=1), stop_ids, tokenizer.pad_token_id)
    return Samples(queries, query_mask, responses, torch.cat(logprobs, dim=1), torch.cat(entropy, dim=1),
                   torch.cat(hidden, dim=1))


def reuse_sampling_pass(cfg: PPOConfig, precision: Precision) -> bool:
    """Whether old log-probs (and shared-body values) come from the sampling pass: in fp32 they
    equal a fresh forward up to float rounding; under autocast the KV-cached steps drift
    further from the full-sequence pass the update uses, so a second forward is taken."""
    if cfg.old_logprobs == "auto":
        return precision.autocast_dtype is None
    return cfg.old_logprobs == "sampling"


def score_fields(raw: torch.Tensor, has_eos: torch.Tensor, scorer: RewardScorer, cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """Normalised scores, and the scores the reward uses: normalised, a cut-off response given
    `missing_eos_score` (when set), clipped to `score_clip` (when set). # (B,), (B,) -> (B,) each"""
    normalized = scorer.normalize(raw)
    scores = apply_eos_penalty(normalized, has_eos, cfg.missing_eos_score)
    if cfg.score_clip is not None:
        scores = scores.clamp(-cfg.score_clip, cfg.score_clip)
    return {"normalized_scores": normalized, "scores": scores}


@torch.inference_mode()
def rollout(models: Models, prompts: list[str], prompt_messages: list, cfg: PPOConfig, timings: dict) -> Rollout:
    tokenizer = models.tokenizer
    models.train(False)
    start = time.perf_counter()
    sampled = sample(models.policy, tokenizer, prompts, cfg, models.precision, models.stop_ids)
    queries, query_mask, responses = sampled.queries, sampled.query_mask, sampled.responses
    timings["generate"] = time.perf_counter() - start

    start = time.perf_counter()
    mask = response_mask(responses, models.stop_ids)
    if reuse_sampling_pass(cfg, models.precision):
        logprobs, entropy = sampled.logprobs, sampled.entropy
        if models.critic is None:
            values = shared_values(models, sampled.hidden)
        else:  # only the critic needs a pass; the policy's figures are the sampling pass's
            values = critic_values(models, queries, query_mask, responses, mask)
    else:
        logits, values = policy_and_values(models, queries, query_mask, responses, mask)
        logprobs, entropy = logprobs_of(logits, responses, cfg.temperature), entropy_of(logits, cfg.temperature)
    with reference_policy(models) as reference:
        ref_logits, _ = forward_response(reference, queries, query_mask, responses, mask, want_hidden=False,
                                         precision=models.precision)
    ref_logprobs = logprobs_of(ref_logits, responses, cfg.temperature)

    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    has_eos = is_end(responses, models.stop_ids).any(dim=1)
    raw = models.scorer.score(prompt_messages, texts, normalized=False, complete=has_eos.tolist()).to(queries.device)
    timings["score"] = time.perf_counter() - start
    return Rollout(queries, query_mask, responses, mask, logprobs * mask, ref_logprobs * mask, values * mask,
                   entropy, raw_scores=raw, has_eos=has_eos, texts=texts, prompts=prompts,
                   **score_fields(raw, has_eos, models.scorer, cfg))


# --- update -----------------------------------------------------------------------------------


MAX_FIGURES = ("_max", "initial_ratio_deviation")
"""Figures summarised by their largest value (over minibatches and processes), not their mean."""


@dataclass
class UpdateStats:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **figures: float) -> None:
        for key, value in figures.items():
            self.values.setdefault(key, []).append(float(value))

    def means(self) -> dict[str, float]:
        return {key: (max(v) if key.endswith(MAX_FIGURES) else float(np.mean(v))) for key, v in self.values.items()}


@dataclass(frozen=True)
class MicroBatch:
    """Some rows of a rollout, without the columns that are padding in all of them."""

    queries: torch.Tensor  # (b, tq)
    query_mask: torch.Tensor
    responses: torch.Tensor  # (b, t)
    mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def micro_batch(batch: Rollout, advantages: torch.Tensor, returns: torch.Tensor, rows: torch.Tensor) -> MicroBatch:
    """The rows' tensors, dropping leading prompt columns and trailing response columns that no
    row uses: the rollout is padded for its longest prompt and response, a micro-batch need not be.
    Position ids count real tokens, so dropping all-padding columns changes no position."""
    query_mask, mask = batch.query_mask[rows], batch.mask[rows]
    first = int(query_mask.any(dim=0).long().argmax())  # first prompt column with a real token
    end = int(mask.any(dim=0).nonzero().max()) + 1  # past the last response column with a real token

    def responses_of(x: torch.Tensor) -> torch.Tensor:
        return x[rows][:, :end]

    return MicroBatch(batch.queries[rows][:, first:], query_mask[:, first:], responses_of(batch.responses),
                      mask[:, :end], responses_of(batch.logprobs), responses_of(batch.ref_logprobs),
                      responses_of(batch.values), responses_of(advantages), responses_of(returns))


def ppo_update(actor_critic: torch.nn.Module, accelerator: Accelerator, batch: Rollout, advantages: torch.Tensor,
               returns: torch.Tensor, cfg: PPOConfig, optimizer: torch.optim.Optimizer, scheduler,
               scaler: torch.amp.GradScaler, iteration: int) -> dict[str, float]:
    """num_ppo_epochs passes of shuffled minibatches over this process's rollout, one optimizer step each.
    `initial_ratio_deviation`, max |ratio - 1| over the first minibatch before any step, checks that
    the update computes the policy the rollout sampled from (dropout off, same precision)."""
    actor_critic.train(True)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    policy_parameters = list(accelerator.unwrap_model(actor_critic).policy.parameters())
    in_policy = {id(p) for p in policy_parameters}
    critic_parameters = [p for p in trained if id(p) not in in_policy]  # the value head or the critic model
    n = len(batch.responses)
    stats = UpdateStats()
    for epoch in range(cfg.num_ppo_epochs):
        for index, minibatch in enumerate(torch.randperm(n).split(n // cfg.num_minibatches)):
            figures = accumulate_gradients(actor_critic, accelerator, batch, advantages, returns,
                                           minibatch.to(batch.responses.device), cfg, scaler, iteration)
            deviation = figures.pop("ratio_deviation_max")
            if epoch == 0 and index == 0:
                stats.add(initial_ratio_deviation=deviation)
            if iteration <= cfg.freeze_policy_iterations:  # no step at all: Adam's moments and step count stay fresh
                for parameter in policy_parameters:
                    parameter.grad = None
            scaler.unscale_(optimizer)  # clipping reads true gradient norms (no-op without fp16 loss scaling)
            # Each model clipped on its own: a large value-loss gradient must not shrink the policy's step.
            grad_norm = torch.nn.utils.clip_grad_norm_(policy_parameters, cfg.max_grad_norm)
            critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic_parameters, cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stats.add(**figures, grad_norm=grad_norm.item(), critic_grad_norm=critic_grad_norm.item())
    return stats.means()


def accumulate_gradients(actor_critic: torch.nn.Module, accelerator: Accelerator, batch: Rollout,
                         advantages: torch.Tensor, returns: torch.Tensor, rows: torch.Tensor, cfg: PPOConfig,
                         scaler: torch.amp.GradScaler, iteration: int) -> dict[str, float]:
    """Gradients of one minibatch (these `rows` of this process's rollout), accumulated over its
    micro-batches and averaged over processes by DDP at the last one.

    Every loss term is a mean over the minibatch's tokens on all processes together: each
    micro-batch's masked sum is divided by N / P, with N those tokens and P the process count,
    because DDP divides the summed gradients by P. The gradient is then the same for every
    `micro_batch_size` and process count (tested to 1e-5). Returned figures are this process's
    sums on the same scale, so their mean over processes is the minibatch's token mean."""
    num_tokens = batch.mask[rows].sum()
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(num_tokens)
    num_tokens = num_tokens.clamp(min=1.0) / accelerator.num_processes
    micro_batches = rows.split(cfg.micro_batch_size or len(rows))
    totals: dict[str, float] = {}
    for position, micro_rows in enumerate(micro_batches):
        last = position == len(micro_batches) - 1
        with nullcontext() if last else accelerator.no_sync(actor_critic):
            figures = _micro_batch_step(actor_critic, micro_batch(batch, advantages, returns, micro_rows), cfg,
                                        num_tokens, scaler, iteration)
        for key, value in figures.items():
            totals[key] = max(totals.get(key, 0.0), value) if key.endswith(MAX_FIGURES) else totals.get(key, 0.0) + value
    return totals


def _micro_batch_step(actor_critic: torch.nn.Module, micro: MicroBatch, cfg: PPOConfig, num_tokens: torch.Tensor,
                      scaler: torch.amp.GradScaler, iteration: int) -> dict[str, float]:
    """Forward and backward of one micro-batch: its masked loss sums over the minibatch's `num_tokens`."""
    mask = micro.mask
    # Critic warm-up: the policy terms stay in the graph at weight 0 (every parameter gets a
    # gradient, as DDP needs); `ppo_update` then drops the policy's gradients before the step.
    warming_up = iteration <= cfg.freeze_policy_iterations
    logits, values = actor_critic(micro.queries, micro.query_mask, micro.responses, mask, warming_up)
    logprobs = logprobs_of(logits, micro.responses, cfg.temperature)
    policy = clipped_policy_loss(logprobs, micro.logprobs, micro.advantages, mask, cfg.clip_range, num_tokens)
    value_loss, value_clipped = clipped_value_loss(values, micro.values, micro.returns, mask, cfg.clip_range_value,
                                                   num_tokens)
    # Without an entropy bonus the entropy is a statistic only: no graph through the softmax.
    entropy = masked_mean(entropy_of(logits if cfg.entropy_coef else logits.detach(), cfg.temperature), mask,
                          num_tokens=num_tokens)
    policy_terms = policy.loss - cfg.entropy_coef * entropy
    if cfg.kl_loss_coef > 0:
        policy_terms = policy_terms + cfg.kl_loss_coef * masked_mean(kl_estimate(logprobs, micro.ref_logprobs, "k3"),
                                                                     mask, num_tokens=num_tokens)
    loss = (0.0 if warming_up else 1.0) * policy_terms + cfg.vf_coef * value_loss
    if not torch.isfinite(loss):
        raise NonFiniteLossError(f"non-finite PPO loss ({loss.item()}) at iteration {iteration}; "
                                 "the last full-state checkpoint is kept")
    scaler.scale(loss).backward()
    ratio = policy.ratio.detach()
    return dict(policy_loss=policy.loss.item(), value_loss=value_loss.item(), entropy=entropy.item(),
                clip_fraction=policy.clip_fraction.item(), value_clip_fraction=value_clipped.item(),
                approx_kl=policy.approx_kl.item(),
                ratio_mean=masked_mean(ratio, mask, num_tokens=num_tokens).item(),
                ratio_max=(ratio * mask).max().item(), ratio_deviation_max=((ratio - 1).abs() * mask).max().item())


# --- full-state checkpoints -------------------------------------------------------------------


@dataclass
class LoopState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    iteration: int = 0
    """Iterations completed."""
    cursor: int = 0
    """Prompts consumed so far (the order is a seeded shuffle per pass over the prompts)."""
    kl: dict = field(default_factory=dict)
    normalization: dict[str, float] | None = None
    """The reward normalisation PPO scores with ({"gain", "bias"}), once fixed at iteration 1."""
    first_length: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)


def _rng_key(name: str, rank: int) -> str:
    return name if rank == 0 else f"{name}_rank{rank}"


def rng_states(accelerator: Accelerator) -> dict[str, torch.Tensor]:
    """Every process's random-number generator states, collected on all of them (collective)."""
    own = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        own["cuda"] = torch.cuda.get_rng_state()
    everyone = [own]
    if accelerator.num_processes > 1:
        everyone = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(everyone, own)
    return {_rng_key(name, rank): state for rank, states in enumerate(everyone) for name, state in states.items()}


def save_state(folder: Path, models: Models, optimizer, scheduler, scaler, loop: LoopState,
               rng: dict[str, torch.Tensor]) -> Path:
    """Write a full-state checkpoint atomically (staging folder, then rename); keeps only the newest.
    On several processes the main one writes it: weights and optimizer state are the same on all,
    `rng` holds each process's generators."""
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_model(models.policy, str(staging / "policy.safetensors"))
    for name in ("value_head", "critic", "reference"):
        module = getattr(models, name)
        if module is not None:
            save_model(module, str(staging / f"{name}.safetensors"))
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    torch.save(scheduler.state_dict(), staging / "scheduler.pt")
    torch.save(scaler.state_dict(), staging / "scaler.pt")
    save_file(rng, str(staging / "rng.safetensors"))
    (staging / "loop.json").write_text(json.dumps(loop.__dict__))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def load_state(folder: Path, models: Models, optimizer, scheduler, scaler, rank: int = 0) -> LoopState:
    """Restore a full-state checkpoint, with process `rank`'s random generators. Tensors come from
    safetensors; optimizer and scheduler state load with `weights_only=True`, which refuses
    arbitrary pickled objects."""
    load_model(models.policy, str(folder / "policy.safetensors"))
    for name in ("value_head", "critic", "reference"):
        module = getattr(models, name)
        if module is not None:
            load_model(module, str(folder / f"{name}.safetensors"))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    scaler.load_state_dict(torch.load(folder / "scaler.pt", weights_only=True))
    rng = load_file(str(folder / "rng.safetensors"))
    if _rng_key("torch", rank) not in rng:
        raise ValueError(f"the full-state checkpoint in {folder} was written by fewer processes than this run has; "
                         "resume with the same launch.num_processes")
    torch.set_rng_state(rng[_rng_key("torch", rank)])
    if _rng_key("cuda", rank) in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng[_rng_key("cuda", rank)])
    return LoopState(**json.loads((folder / "loop.json").read_text()))


# --- evaluation -------------------------------------------------------------------------------


@torch.inference_mode()
def evaluate(models: Models, eval_prompts: pd.DataFrame, cfg: PPOConfig) -> tuple[dict[str, float], pd.DataFrame]:
    """PPO policy against the SFT reference on held-out prompts, `eval_samples_per_prompt` each:
    reward-model scores of both, the win rate with its standard error, and KL(PPO || SFT) on the
    PPO responses.

    Common random numbers: the SFT baseline is sampled first, from `eval_seed` alone, so every PPO
    run from the same SFT checkpoint and prompts (whatever its training seed or settings) is judged
    against the same baseline responses; the policy's own samples come from `eval_seed + 1`."""
    models.train(False)
    repeat = cfg.eval_samples_per_prompt
    prompts = [p for p in eval_prompts["prompt"] for _ in range(repeat)]
    messages = [json.loads(m) for m in eval_prompts["prompt_messages"] for _ in range(repeat)]
    torch.manual_seed(cfg.eval_seed)
    with reference_policy(models) as reference:
        sft_responses = sample(reference, models.tokenizer, prompts, cfg, models.precision, models.stop_ids).responses
    sft_texts = models.tokenizer.batch_decode(sft_responses, skip_special_tokens=True)
    sft_complete = is_end(sft_responses, models.stop_ids).any(dim=1).tolist()
    sft_scores = models.scorer.score(messages, sft_texts, complete=sft_complete)
    torch.manual_seed(cfg.eval_seed + 1)
    ppo = rollout(models, prompts, messages, cfg, {})
    kl = (kl_estimate(ppo.logprobs, ppo.ref_logprobs) * ppo.mask).sum(1)
    table = pd.DataFrame({"prompt": prompts, "prompt_messages": [json.dumps(m) for m in messages],
                          "ppo_response": ppo.texts, "sft_response": sft_texts,
                          "ppo_score": ppo.normalized_scores.cpu().numpy(), "sft_score": sft_scores.numpy(),
                          "kl": kl.cpu().numpy()})
    wins, wins_se = win_rate(list(table["ppo_score"]), list(table["sft_score"]), prompts)
    metrics = {"eval/score": table["ppo_score"].mean(), "eval/score_sft": table["sft_score"].mean(),
               "eval/kl": table["kl"].mean(), "eval/response_length": ppo.mask.sum(1).float().mean().item(),
               "eval/eos_rate": ppo.has_eos.float().mean().item(), "eval/win_rate_rm": wins,
               "eval/win_rate_rm_se": wins_se}
    return {k: float(v) for k, v in metrics.items()}, table


# --- the stage --------------------------------------------------------------------------------


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
    """Precision tags for the run: `rlhf.trainable_dtype`, `rlhf.autocast_dtype`, `rlhf.checkpoint_dtype`."""


def initial_ratio_threshold(cfg: PPOConfig, precision: Precision) -> float:
    """`warn_initial_ratio_deviation`, or its default: in fp32 a rollout and a fresh forward agree to
    ~1e-6; under autocast, shapes that differ between the rollout and the update round differently."""
    if cfg.warn_initial_ratio_deviation is not None:
        return cfg.warn_initial_ratio_deviation
    return 1e-3 if precision.autocast_dtype is None else 5e-2


def _warnings(cfg: PPOConfig, figures: dict[str, float], first_length: float, iteration: int,
              previous_length: float | None = None) -> list[str]:
    found = []
    length = figures["rollout/response_length"]
    if previous_length is not None and length < (1 - cfg.warn_length_collapse) * previous_length:
        found.append(f"mean response length collapsed from {previous_length:.1f} to {length:.1f} tokens in one "
                     "iteration: the policy is learning to stop early (check the value loss and the KL)")
    if figures["rollout/kl"] > cfg.kl_budget:
        found.append(f"mean KL per sequence {figures['rollout/kl']:.2f} is over the budget of {cfg.kl_budget}")
    drift = abs(figures["rollout/response_length"] - first_length) / max(first_length, 1e-6)
    if drift > cfg.warn_length_drift:
        found.append(f"mean response length {figures['rollout/response_length']:.1f} drifted {drift:.0%} "
                     f"from {first_length:.1f}")
    if figures["rollout/eos_rate"] < cfg.warn_eos_rate:
        found.append(f"only {figures['rollout/eos_rate']:.0%} of responses end with EOS")
    if figures["train/ratio_max"] > cfg.warn_ratio_max:
        found.append(f"policy ratio reached {figures['train/ratio_max']:.1f} (threshold {cfg.warn_ratio_max})")
    threshold = initial_ratio_threshold(cfg, resolve_precision(cfg.precision))
    if figures["train/initial_ratio_deviation"] > threshold:
        found.append(f"before the first update the policy ratio was already {figures['train/initial_ratio_deviation']:.2g} "
                     f"from 1 (threshold {threshold:g}): rollout and training compute different policies (dropout "
                     "left on, or precision drift; try ppo.old_logprobs: recompute)")
    return [f"iteration {iteration}: {message}" for message in found]


def over_processes(accelerator: Accelerator, figures: dict[str, float]) -> dict[str, float]:
    """Each figure averaged over processes; `MAX_FIGURES` take the largest (collective)."""
    if accelerator.num_processes == 1:
        return figures
    keys = sorted(figures)
    values = torch.tensor([figures[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    summed, largest = values.clone(), values.clone()
    torch.distributed.all_reduce(summed)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return {k: (largest[i] if k.endswith(MAX_FIGURES) else summed[i] / accelerator.num_processes).item()
            for i, k in enumerate(keys)}


def check_weights_agree(accelerator: Accelerator, module: torch.nn.Module) -> None:
    """Fail loudly if the processes' trained weights differ: gradients were not synchronised (collective)."""
    if accelerator.num_processes == 1:
        return
    total = torch.stack([p.detach().double().sum() for p in module.parameters() if p.requires_grad]).sum()
    low, high = total.clone(), total.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    if (high - low).abs() > 1e-6 * high.abs().clamp(min=1.0):
        raise RuntimeError(f"the {accelerator.num_processes} processes ended with different weights "
                           f"(parameter sums {low.item():.9g} .. {high.item():.9g}): gradients were not synchronised")


def whiten_over_processes(accelerator: Accelerator, x: torch.Tensor, mask: torch.Tensor,
                          shift_mean: bool = True) -> torch.Tensor:
    """`masked_whiten` with mean and variance over every process's entries, as one process holding
    the whole rollout batch would take them (collective). # (B, T) -> (B, T)"""
    if accelerator.num_processes == 1:
        return masked_whiten(x, mask, shift_mean)
    sums = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()  # (3,)
    torch.distributed.all_reduce(sums)
    total, squares, n = sums
    mean = total / n
    var = (squares / n - mean ** 2) * n / (n - 1).clamp(min=1.0)
    return masked_whiten(x, mask, shift_mean, moments=(mean.to(x.dtype), var.to(x.dtype)))


def first_normalization(accelerator: Accelerator, scorer: RewardScorer, batch: Rollout,
                        cfg: PPOConfig) -> dict[str, float]:
    """The reward normalisation PPO keeps for the whole run: refitted on the first iteration's raw
    scores over all processes (so scores start at mean 0, std 1 under PPO's own temperature,
    response length and prompts, where the reward stage sampled with its own), or the reward
    checkpoint's own when `refit_normalization` is off (collective). Cut-off responses count too:
    `missing_eos_score` is a score on this same scale."""
    if not cfg.refit_normalization:
        return {"gain": scorer.gain, "bias": scorer.bias}
    gain, bias = fit_normalization(accelerator.gather(batch.raw_scores.float()))
    return {"gain": gain, "bias": bias}


@torch.no_grad()
def normalize_critic(models: Models, gain: float, bias: float, values: torch.Tensor) -> torch.Tensor:
    """Put the reward-model critic on the normalised score scale: its head's parameters times
    `gain` plus a constant `bias`, the map the scorer applies to raw scores; returns this
    iteration's values (computed before the fit) mapped the same way. # (B, T) -> (B, T)"""
    for parameter in models.critic.score.parameters():
        parameter.mul_(gain)
    models.value_offset = bias
    return gain * values + bias


def _prompt_batch(order_seed: int, n_prompts: int, cursor: int, size: int) -> list[int]:
    """Indices of the next `size` prompts from a seeded shuffle that is redrawn for every pass."""
    picks = []
    while len(picks) < size:
        pass_number, position = divmod(cursor, n_prompts)
        order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(order_seed + pass_number))
        take = min(size - len(picks), n_prompts - position)
        picks += order[position:position + take].tolist()
        cursor += take
    return picks


def train_ppo(
    cfg: PPOConfig,
    sft_location: str,
    reward_location: str,
    prompts: pd.DataFrame,
    eval_prompts: pd.DataFrame,
    output_dir: Path,
    hooks: PPOHooks = PPOHooks(),
) -> PPOResult | None:
    """Run PPO and evaluate against the SFT policy. Resumes from `output_dir/state` when a
    full-state checkpoint of an earlier, interrupted run is there. On several processes every
    one trains; only the main one reports, evaluates, saves and returns."""
    accelerator = Accelerator()
    rank = accelerator.process_index
    torch.manual_seed(cfg.seed)
    models = load_models(cfg, sft_location, reward_location)
    if rank > 0:  # its own sampling noise; rank 0 keeps the single-process stream
        torch.manual_seed(cfg.seed + rank)
    optimizer = torch.optim.AdamW(models.trainable(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay, eps=1e-5,
                                  fused=True)  # one kernel per step instead of several per parameter
    # Loss scaling for fp16 autocast only; disabled, it passes losses and steps through unchanged.
    scaler = torch.amp.GradScaler(accelerator.device.type, enabled=models.precision.autocast_dtype == torch.float16)
    actor_critic = accelerator.prepare(ActorCritic(models))  # DDP on several processes; as is on one
    total_steps = cfg.num_iterations * cfg.num_ppo_epochs * cfg.num_minibatches
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    kl_control = KLController(cfg.init_kl_coef, cfg.target_kl, cfg.kl_horizon)
    state_dir = output_dir / "state"
    loop = LoopState()
    if (state_dir / "loop.json").exists():
        loop = load_state(state_dir, models, optimizer, scheduler, scaler, rank)
        kl_control = KLController(**loop.kl)
        if loop.normalization is not None:
            models.scorer.gain, models.scorer.bias = loop.normalization["gain"], loop.normalization["bias"]
            if cfg.normalize_critic and models.critic is not None:  # the saved head is already scaled
                models.value_offset = loop.normalization["bias"]
        hooks.warning(f"resumed from the full-state checkpoint after iteration {loop.iteration}")
        for past in loop.history:  # so this run's curves start at iteration 1, not at the resume point
            hooks.metrics({k: v for k, v in past.items() if k != "iteration"}, int(past["iteration"]))
    prompt_texts = list(prompts["prompt"])
    prompt_messages = [json.loads(m) for m in prompts["prompt_messages"]]

    while loop.iteration < cfg.num_iterations:
        iteration = loop.iteration + 1
        started, timings = time.perf_counter(), {}
        local = cfg.rollout_batch_size // accelerator.num_processes
        picks = _prompt_batch(cfg.seed, len(prompt_texts), loop.cursor, cfg.rollout_batch_size)[rank * local:][:local]
        messages = [prompt_messages[i] for i in picks]
        batch = rollout(models, [prompt_texts[i] for i in picks], messages, cfg, timings)
        if loop.normalization is None:
            loop.normalization = first_normalization(accelerator, models.scorer, batch, cfg)
            models.scorer.gain, models.scorer.bias = loop.normalization["gain"], loop.normalization["bias"]
            batch = dataclasses.replace(batch, **score_fields(batch.raw_scores, batch.has_eos, models.scorer, cfg))
            if cfg.normalize_critic and models.critic is not None:
                values = normalize_critic(models, **loop.normalization, values=batch.values)
                batch = dataclasses.replace(batch, values=values)

        kl = kl_estimate(batch.logprobs, batch.ref_logprobs, cfg.kl_estimator) * batch.mask  # (B, T)
        rewards = token_rewards(batch.scores, kl, kl_control.value, batch.mask)
        if cfg.whiten_rewards:
            rewards = whiten_over_processes(accelerator, rewards, batch.mask, shift_mean=False)
        advantages, returns = gae(rewards, batch.values, batch.mask, cfg.gamma, cfg.lam)
        advantages = whiten_over_processes(accelerator, advantages, batch.mask)

        start = time.perf_counter()
        train = ppo_update(actor_critic, accelerator, batch, advantages, returns, cfg, optimizer, scheduler, scaler,
                           iteration)
        timings["train"] = time.perf_counter() - start

        kl_per_sequence = kl.sum(1).mean().item()
        figures = {
            "rollout/score": batch.normalized_scores.mean().item(),
            "rollout/score_std": accelerator.gather(batch.normalized_scores).std().item(),  # over all processes' scores
            "rollout/score_raw": batch.raw_scores.mean().item(),
            "rollout/score_used": batch.scores.mean().item(),
            "rollout/non_score_reward": (-kl_control.value * kl).sum(1).mean().item(),
            "rollout/kl": kl_per_sequence,
            "rollout/kl_coef": kl_control.value,
            "rollout/entropy": masked_mean(batch.entropy, batch.mask).item(),
            "rollout/response_length": batch.mask.sum(1).float().mean().item(),
            "rollout/eos_rate": batch.has_eos.float().mean().item(),
            **{f"train/{k}": v for k, v in train.items()},
            "train/explained_variance": explained_variance(batch.values, returns, batch.mask),
            "train/learning_rate": scheduler.get_last_lr()[0],
            **{f"time/{k}": v for k, v in timings.items()},
        }
        elapsed = time.perf_counter() - started
        figures["time/iteration"] = elapsed
        figures["time/tokens_per_second"] = batch.mask.sum().item() * accelerator.num_processes / elapsed
        figures = over_processes(accelerator, figures)
        kl_control.update(figures["rollout/kl"], cfg.rollout_batch_size)
        if cfg.ref_refresh_every and iteration % cfg.ref_refresh_every == 0 and models.reference is not None:
            models.reference.load_state_dict(models.policy.state_dict())

        loop.first_length = loop.first_length or figures["rollout/response_length"]
        previous_length = loop.history[-1]["rollout/response_length"] if loop.history else None
        for message in _warnings(cfg, figures, loop.first_length, iteration, previous_length):
            hooks.warning(message)
        hooks.metrics(figures, iteration)
        hooks.rollouts(pd.DataFrame({"prompt_messages": [json.dumps(m) for m in messages], "response": batch.texts,
                                     "score": batch.normalized_scores.cpu().numpy(),
                                     "kl": kl.sum(1).cpu().numpy()}), iteration)
        if iteration % cfg.sample_every == 0 or iteration == cfg.num_iterations:
            shown = slice(0, cfg.num_logged_samples)
            hooks.samples(pd.DataFrame({"prompt": batch.prompts[shown], "response": batch.texts[shown],
                                        "score": batch.scores[shown].cpu().numpy()}), iteration)
        loop.iteration, loop.cursor = iteration, loop.cursor + cfg.rollout_batch_size
        loop.kl, loop.history = kl_control.state_dict(), loop.history + [{"iteration": iteration, **figures}]
        if iteration % cfg.checkpoint_every == 0 or iteration == cfg.num_iterations:
            # The last one too: if the upload fails, a rerun goes straight to evaluation.
            rng = rng_states(accelerator)
            if accelerator.is_main_process:
                save_state(state_dir, models, optimizer, scheduler, scaler, loop, rng)
            accelerator.wait_for_everyone()  # no process runs on (or stops) before the state is written

    check_weights_agree(accelerator, actor_critic)
    if not accelerator.is_main_process:
        return None
    metrics, evaluation = evaluate(models, eval_prompts, cfg)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    policy = models.policy.merge_and_unload() if cfg.lora is not None else models.policy
    checkpoint, tags = save_trained(policy, models.tokenizer, output_dir / "checkpoint", cfg, sft_location, trained)
    metrics |= {"train/iterations": float(loop.iteration), "normalization/gain": models.scorer.gain,
                "normalization/bias": models.scorer.bias}
    return PPOResult(checkpoint, metrics, loop.history, evaluation, tags)
