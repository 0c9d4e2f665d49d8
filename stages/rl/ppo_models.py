"""The models PPO holds and the passes it takes through them.

The policy (with LoRA adapters or not), its frozen reference, the reward model that scores, the
distillation teacher (`stages.rl.teacher`), and, for GAE, the critic: a value head on the policy's
own body (`SharedValueHead`), a separate model started from the reward model (`RewardCritic`), or
LoRA adapters and a value head on the reward model the scorer holds (`RewardLoRACritic`: one copy
of the reward model instead of two). Every critic answers `values(...)`, its value loss and its
figure the same way, so the rollout, the update and the report never ask which one they have; the
critic-free estimators (GRPO, RLOO, REINFORCE++, distillation) hold `NoCritic`, whose values are 0
and which adds no loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from rlhf.sections.base import LoRAConfig
from rlhf.sections.ppo import CriticConfig, PPOConfig
from stages.common.batches import Sequences
from stages.common.errors import StageUserError
from stages.math.ppo_math import clipped_value_loss, explained_variance
from stages.rewards.scoring import RewardScorer, load_reward_model, shares_tokenizer
from stages.rl.old_logprobs import OldLogprobs
from stages.rl.teacher import NoTeacher, Teacher, teacher_for
from stages.runtime.compiling import LEAST_COMPILE_S, Compiler, probe_compile
from stages.runtime.forward import forward_response, last_hidden, padding_free_refusal
from stages.runtime.holding import Holding, Replicated
from stages.runtime.lora import copied, lora_config, restore_adapters, with_lora
from stages.runtime.models import (
    Precision,
    disable_dropout,
    frozen_dtype_of,
    load_causal_lm,
    load_tokenizer,
    resolve_precision,
    stop_token_ids,
)
from stages.runtime.packing import Passes, TokenCounts

# --- critics ------------------------------------------------------------------------------------


class ValueFunction(torch.nn.Module):
    """What every critic that learns shares: its value loss in the update and its figure."""

    learns = True

    def with_value_loss(self, loss: torch.Tensor, values: torch.Tensor, micro, settings: CriticConfig,
                        num_tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """`loss` plus c1 x the clipped value loss of `values` (B, T) against the micro-batch's returns,
        over the minibatch's `num_tokens`; its figures."""
        value_loss, value_clipped = clipped_value_loss(values, micro.values, micro.returns, micro.counted,
                                                       settings.clip_range_value, num_tokens)
        return loss + settings.vf_coef * value_loss, {"value_loss": value_loss.item(),
                                                       "value_clip_fraction": value_clipped.item()}

    def figures(self, batch) -> dict[str, float]:
        """How much of the returns' variance the rollout's values explain."""
        return {"train/explained_variance": explained_variance(batch.values, batch.returns, batch.trainable)}


class NoCritic:
    """The critic-free estimators' stand-in (GRPO, RLOO, REINFORCE++, distillation): no value function
    learns, so V = 0 on every token (their baselines come from the scores), with no value loss, no
    parameters and no figures."""

    learns = False
    reads_policy_hidden = False

    def values(self, policy_hidden, sequences: Sequences, passes: Passes, detach_body: bool = False
               ) -> torch.Tensor:  # -> (B, T)
        return torch.zeros_like(sequences.mask)

    def adopt_normalization(self, gain: float, bias: float, values: torch.Tensor) -> torch.Tensor:
        return values

    def restore_normalization(self, gain: float, bias: float) -> None:
        return None

    def with_value_loss(self, loss: torch.Tensor, values: torch.Tensor, micro, settings: CriticConfig | None,
                        num_tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return loss, {}

    def figures(self, batch) -> dict[str, float]:
        return {}


class SharedValueHead(ValueFunction):
    """V(s_t) = w . h_t + b on the policy's final hidden states: no model of its own. Small
    initial values, so early advantages come from the rewards, not from noise. `detach_body`:
    the value loss trains the head only, never the policy's body it reads."""

    reads_policy_hidden = True

    def __init__(self, hidden_size: int, detach_body: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        self.detach_body = detach_body
        torch.nn.init.normal_(self.linear.weight, std=1.0 / math.sqrt(hidden_size + 1))
        torch.nn.init.zeros_(self.linear.bias)

    def values(self, policy_hidden: torch.Tensor, sequences: Sequences, passes: Passes,
               detach_body: bool = False) -> torch.Tensor:  # (B, T, H) -> (B, T)
        hidden = policy_hidden.to(self.linear.weight.dtype)
        return self.linear(hidden.detach() if self.detach_body or detach_body else hidden).squeeze(-1)

    def adopt_normalization(self, gain: float, bias: float, values: torch.Tensor) -> torch.Tensor:
        """A fresh head has no score scale to adopt. # (B, T) -> (B, T)"""
        return values

    def restore_normalization(self, gain: float, bias: float) -> None:
        return None


class ScoreHeadCritic(ValueFunction):
    """A critic read off a reward model's score head at every response position, plus a constant
    `offset` (most families' score heads have no bias): `RewardCritic` and `RewardLoRACritic`, each
    giving `head` and `values`. With `rescale`, the reward normalisation PPO fits on its first
    rollouts is applied to the head too (parameters x gain, bias as the offset), so its first
    values are on the scale of the scores."""

    reads_policy_hidden = False

    def __init__(self, rescale: bool):
        super().__init__()
        self.rescale = rescale
        self.offset = 0.0
        """Added to the head's output."""

    @torch.no_grad()
    def adopt_normalization(self, gain: float, bias: float, values: torch.Tensor) -> torch.Tensor:
        """Put the head on the normalised score scale (the map the scorer applies to raw scores);
        returns `values` (computed before the fit) mapped the same way. # (B, T) -> (B, T)"""
        if not self.rescale:
            return values
        for parameter in self.head.parameters():
            parameter.mul_(gain)
        self.offset = bias
        return gain * values + bias

    def restore_normalization(self, gain: float, bias: float) -> None:
        """On resume: the saved head is already scaled; only the offset lives outside it."""
        if self.rescale:
            self.offset = bias


class RewardCritic(ScoreHeadCritic):
    """A separate critic started from the reward model (as InstructGPT and TRL do), all of it
    trained: its own pass over prompt + response, its score head read at every response position."""

    def __init__(self, model: PreTrainedModel, rescale: bool):
        super().__init__(rescale)
        self.model = model

    @property
    def head(self) -> torch.nn.Module:
        return self.model.score

    def values(self, policy_hidden, sequences: Sequences, passes: Passes, detach_body: bool = False
               ) -> torch.Tensor:  # -> (B, T)
        hidden = last_hidden(self.model.base_model, sequences, passes)
        return self.head(hidden).squeeze(-1).float() + self.offset


class RewardLoRACritic(ScoreHeadCritic):
    """A critic on the scorer's own reward model: LoRA adapters (float32) on its frozen weights
    (held in `frozen_dtype`), and a float32 value head of its own, a copy of the score head. One
    copy of the reward model where `RewardCritic` holds two; the scorer switches the adapters off
    whenever it scores (`RewardScorer.raw_scores`), so scores stay the reward model's own.

    Its registered modules are what it trains, the head and the adapter layers, so DDP, the
    optimizer and full-state checkpoints see exactly those; the body is placed (and, sharded,
    split into units, the adapters with it) as the scorer's model. Adapters start as a no-op
    (peft's B = 0), so the first values are the reward model's score at every position."""

    def __init__(self, scorer: RewardScorer, settings: LoRAConfig, rescale: bool):
        from peft.functional import cast_adapter_dtype, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        super().__init__(rescale)
        model = scorer.model
        # Injected into the scorer's model, not wrapped (no PeftModel: the score head is not copied into
        # `modules_to_save`, the value head below is the critic's own).
        inject_adapter_in_model(lora_config(settings, "SEQ_CLS", model), model)
        cast_adapter_dtype(model, "default")  # float32: peft gave them the dtype of the weights they adapt
        restore_adapters(model)
        self.scorer = scorer
        """Not a module of this one: the reward model is the scorer's, frozen but for these adapters."""
        self.head = copied(model.score).float().requires_grad_(True)
        self.adapters = torch.nn.ModuleList(
            getattr(layer, name) for layer in model.modules() if isinstance(layer, BaseTunerLayer)
            for name in layer.adapter_layer_names if len(getattr(layer, name, ())))

    def values(self, policy_hidden, sequences: Sequences, passes: Passes, detach_body: bool = False
               ) -> torch.Tensor:  # -> (B, T)
        hidden = last_hidden(self.scorer.model.base_model, sequences, passes)
        return self.head(hidden.float()).squeeze(-1) + self.offset


Critic = SharedValueHead | RewardCritic | RewardLoRACritic | NoCritic


# --- the models of a run -------------------------------------------------------------------------


@dataclass(kw_only=True)
class Models:
    """The models a run holds, placed as `holding` says, and how its passes over them compute."""

    policy: PreTrainedModel
    critic: Critic = field(default_factory=NoCritic)
    """The value function GAE learns; `NoCritic` for the critic-free advantage estimators."""
    reference: PreTrainedModel | None
    """None when LoRA is on: the reference is the policy with its adapters disabled (`reference_policy`)."""
    scorer: RewardScorer | None
    """None where no reward model takes part (DPO's evaluation; PPO whose reward is functions alone)."""
    teacher: Teacher | NoTeacher = field(default_factory=NoTeacher)
    """The distillation teacher (`ppo.teacher`), frozen and held as the reference is; `NoTeacher` without one."""
    tokenizer: object
    precision: Precision
    stop_ids: list[int]
    """Token ids that end a response: the reply end, EOS, and any the generation config lists."""
    holding: Holding = field(default_factory=Replicated)
    """How the processes hold the models: whole on each (one process, DDP) or sharded (FSDP2)."""
    old_logprobs: OldLogprobs = field(default_factory=OldLogprobs)
    """Whether old log-probs (and shared-body values) come from the sampling pass or a second forward
    (`ppo.old_logprobs`; `auto` decided on the run's first batch)."""
    padding_free: bool | str = False
    """The passes over prompt + response packed (`ppo.padding_free`; False where the models cannot take it)."""
    counts: TokenCounts = field(default_factory=TokenCounts)
    """Real and computed positions of every pass, by phase, since the last report."""
    compiler: Compiler = field(default_factory=Compiler)
    """The passes over prompt + response compiled (`ppo.compile`), or run as they are."""

    @property
    def packs(self) -> bool:
        """Whether passes may be packed and ended rows leave the decode loop (`padding_free` true or auto)."""
        return self.padding_free is not False

    def passes(self, phase: str) -> Passes:
        """How a pass of `phase` (`update`, `reference`, ...) computes, counted under that name."""
        return Passes(precision=self.precision, padding_free=self.padding_free, pad_id=self.tokenizer.pad_token_id,
                      counts=self.counts, phase=phase, compiler=self.compiler)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for m in self.trained_modules() for p in m.parameters() if p.requires_grad]

    def trained_modules(self) -> list[torch.nn.Module]:
        return [self.policy, self.critic] if self.critic.learns else [self.policy]

    def train(self, mode: bool = True) -> None:
        for module in self.trained_modules():
            module.train(mode)

    def adopt_normalization(self, gain: float, bias: float, values: torch.Tensor) -> torch.Tensor:
        """The scorer, and the critic if it takes it, on the normalised scale; `values` mapped alike
        (only with a reward model: nothing else is normalised)."""
        self.scorer.gain, self.scorer.bias = gain, bias
        self.holding.release(*self.trained_modules())  # a critic's head is scaled in place: in its shards
        return self.critic.adopt_normalization(gain, bias, values)

    def restore_normalization(self, gain: float, bias: float) -> None:
        """On resume: the scorer's map, and the critic's offset (its saved head is already scaled)."""
        self.scorer.gain, self.scorer.bias = gain, bias
        self.critic.restore_normalization(gain, bias)


def build_policy(cfg: PPOConfig, sft_location: str, tokenizer) -> PreTrainedModel:
    """The policy as PPO trains it, on the CPU: the SFT checkpoint in float32, dropout off; with
    `cfg.lora`, float32 LoRA adapters on its own weights, which are the reference and so are held
    in `cfg.frozen_dtype`."""
    dtype = torch.float32 if cfg.lora is None else frozen_dtype_of(cfg.frozen_dtype, resolve_precision(cfg.precision))
    policy = load_causal_lm(sft_location, tokenizer, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    disable_dropout(policy)
    # peft casts the adapters of bf16 weights to float32 (`autocast_adapter_dtype`).
    return with_lora(policy, cfg.lora, "CAUSAL_LM")


def build_critic(cfg: PPOConfig, policy: PreTrainedModel, tokenizer, scorer: RewardScorer | None,
                 reward_location: str | None, sft_location: str) -> Critic:
    """GAE's critic as `cfg.critic.kind` asks; `NoCritic` for the critic-free estimators. The critics on
    the reward model read the policy's token ids, so that model must share the policy's tokenizer."""
    if not cfg.uses_critic:
        return NoCritic()
    critic = cfg.critic
    if critic.kind in ("shared", "detached"):
        return SharedValueHead(policy.config.hidden_size, detach_body=critic.kind == "detached")
    if critic.kind == "policy":  # the SFT checkpoint's body, a fresh value head (nothing to normalise to)
        return RewardCritic(load_reward_model(sft_location, tokenizer, trust_remote_code=cfg.trust_remote_code,
                                              fresh_head=True), rescale=False)
    if scorer is None:  # the config refuses this; a direct caller without a reward model gets the reason
        raise ValueError(f"ppo.critic.kind = {critic.kind!r} starts from the reward model, and there is none")
    if scorer.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"ppo.critic.kind = {critic.kind!r} needs the reward model at {reward_location} to share "
                         "the policy's tokenizer (the critic reads the policy's token ids); use "
                         "ppo.critic.kind = 'shared'")
    if critic.kind == "reward-lora":
        return RewardLoRACritic(scorer, critic.lora, rescale=critic.normalize)
    return RewardCritic(load_reward_model(reward_location, tokenizer, trust_remote_code=cfg.trust_remote_code,
                                          fresh_head=False), rescale=critic.normalize)


def load_models(cfg: PPOConfig, sft_location: str, reward_location: str | None,
                holding: Holding | None = None, teacher_location: str | None = None) -> Models:
    """Trained weights (policy, critic, adapters) in float32 whatever the checkpoints' dtype; frozen
    ones (reference, reward model, a LoRA policy's own) in `cfg.frozen_dtype`; dropout off in all of
    them, so a rollout and the update that follows compute the same policy. No reward model where
    `reward_location` is None (a reward of functions alone); a distillation teacher from
    `teacher_location` where `cfg.teacher` is set. `holding` (default: whole, on this process) places
    them: the frozen ones at once, the trained ones when `holding.trained` wraps them."""
    holding = holding or Replicated()
    frozen = frozen_dtype_of(cfg.frozen_dtype, resolve_precision(cfg.precision))
    tokenizer = load_tokenizer(sft_location, padding_side="left", trust_remote_code=cfg.trust_remote_code)
    policy = build_policy(cfg, sft_location, tokenizer)
    padding_free = packing_setting(cfg.padding_free, [(policy, False)])  # probed whole, before any sharding
    keeps_chains_apart(cfg, [(policy, False)])
    reference = None
    if cfg.lora is None:
        reference = holding.frozen(copied(policy).to(frozen).eval().requires_grad_(False))
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    holding.place_trained(policy)  # sharded: split now, its tensors read and sent one at a time
    # Placed once the critic is built: `reward-lora` puts its adapters on this very model, placed with it.
    scorer = None
    if reward_location is not None:
        scorer = RewardScorer.from_pretrained(reward_location, dtype=frozen, trust_remote_code=cfg.trust_remote_code,
                                              place=lambda model: model)
        scorer.model.requires_grad_(False)
    critic = build_critic(cfg, policy, tokenizer, scorer, reward_location, sft_location)
    padding_free = packing_setting(padding_free, critic_bodies(critic))
    keeps_chains_apart(cfg, critic_bodies(critic))
    if scorer is not None:  # packed where its body takes it; the policy's ids read as sampled where they mean the same
        scorer.padding_free = packing_setting(padding_free, [(scorer.model.base_model, True)])
        scorer.policy_tokens = shares_tokenizer(scorer.tokenizer, tokenizer)
        scorer.model = holding.frozen(scorer.model)
    if critic.learns:
        holding.place_trained(critic)
    precision = resolve_precision(cfg.precision)
    counts = TokenCounts()
    if scorer is not None:
        scorer.counts = counts
    passes = Passes(precision=precision, padding_free=padding_free, pad_id=tokenizer.pad_token_id)
    teacher = teacher_for(cfg, teacher_location, tokenizer, holding)
    return Models(policy=policy, critic=critic, reference=reference, scorer=scorer, teacher=teacher,
                  tokenizer=tokenizer, precision=precision, stop_ids=stop_token_ids(policy), holding=holding,
                  old_logprobs=OldLogprobs(cfg.old_logprobs),
                  padding_free=padding_free, counts=counts, compiler=compiler_for(cfg, policy, passes))


def compiler_for(cfg: PPOConfig, policy: PreTrainedModel, passes: Passes) -> Compiler:
    """`ppo.compile` as this run takes it: on, off, or (`auto`) what `probe_compile` finds for the
    policy's forward and backward at the update's micro-batch shape (random tokens), over the
    update's policy passes in the run. A sharded launch runs eager under `auto` (`true` is refused
    by the config)."""
    if cfg.compile is not True and (cfg.compile is False or cfg.launch.sharded):
        return Compiler(enabled=False, reason="off" if cfg.compile is False else "off (auto: a sharded launch)")
    on = next(policy.parameters()).device
    static_shapes = on.type == "cuda"  # CUDA graphs and tuned kernels are per shape; a CPU's graphs take any length
    if cfg.compile is True:
        return Compiler(enabled=True, static_shapes=static_shapes, cuda_graphs=static_shapes, reason="on")
    minibatch = cfg.rollout_batch_size // (cfg.num_minibatches * cfg.launch.num_processes)
    rows = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else minibatch
    width = cfg.max_prompt_length + cfg.response_tokens
    vocab = policy.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (rows, width), generator=generator).to(on)
    query_mask = torch.ones(rows, cfg.max_prompt_length, dtype=torch.long, device=on)
    mask = torch.ones(rows, cfg.response_tokens, device=on)

    def run_pass(model) -> torch.Tensor:  # forward and backward of the policy, eager or compiled
        logits = model(input_ids=ids, attention_mask=torch.cat([query_mask, mask.long()], dim=1),
                       use_cache=False, logits_to_keep=cfg.response_tokens + 1).logits
        logits.float().logsumexp(-1).mean().backward()
        policy.zero_grad(set_to_none=True)
        return logits.detach()

    with passes.precision.autocast(on):
        passes_in_run = cfg.num_iterations * cfg.num_ppo_epochs * cfg.num_minibatches * (minibatch // rows)
        enabled, reason = probe_compile(run_pass, policy, passes_in_run, LEAST_COMPILE_S,
                                        1e-4 if passes.precision.autocast_dtype is None else 3e-2, static_shapes)
    return Compiler(enabled=enabled, static_shapes=static_shapes, cuda_graphs=static_shapes, reason=reason)


def critic_bodies(critic: Critic) -> list[tuple[PreTrainedModel, bool]]:
    """The models a critic runs passes of its own through (none for the shared value head), as
    `packing_setting` probes them: (model, a body without a head)."""
    if isinstance(critic, RewardCritic):
        return [(critic.model.base_model, True)]
    if isinstance(critic, RewardLoRACritic):
        return [(critic.scorer.model.base_model, True)]
    return []


def packing_setting(setting: bool | str, models: list[tuple[PreTrainedModel, bool]]) -> bool | str:
    """`ppo.padding_free` as these models can take it: refused with the reason where asked for
    (True) and a model's probe fails (`padding_free_refusal`); `auto` then runs padded (False)."""
    if setting is False:
        return False
    for model, base in models:
        reason = padding_free_refusal(model, base)
        if reason is not None and setting is True:
            raise ValueError(f"ppo.padding_free: {reason}; set it to auto (padded where refused) or false")
        if reason is not None:
            return False
    return setting


def keeps_chains_apart(cfg: PPOConfig, models: list[tuple[PreTrainedModel, bool]]) -> None:
    """Refuse an agent program (`environment.agent`) on a model whose attention does not keep packed
    sequences apart (`padding_free_refusal`): a rewritten history trains as a later chain of its
    episode's row, kept apart only by restarting positions (`Sequences.restarts`)."""
    if cfg.environment is None or cfg.environment.agent is None:
        return
    for model, base in models:
        reason = padding_free_refusal(model, base)
        if reason is not None:
            raise StageUserError(f"environment.agent: {reason}. An agent's rewritten history trains as a chain of "
                                 "its episode kept apart by restarting positions, which this model cannot do")


@contextmanager
def reference_policy(models: Models) -> Iterator[PreTrainedModel]:
    """The frozen reference: its own copy, or the LoRA policy with adapters disabled."""
    if models.reference is not None:
        yield models.reference
    else:
        with models.policy.disable_adapter():
            yield models.policy


def policy_and_values(models: Models, sequences: Sequences, freeze_policy: bool = False,
                      phase: str = "update") -> tuple[torch.Tensor, torch.Tensor]:
    """Policy logits and values for the response tokens (0 without a critic); with the shared
    value head, one backbone pass (`freeze_policy`: the value loss does not reach the body). Its
    passes are counted under `phase`. # (B, T, V), (B, T)"""
    critic, passes = models.critic, models.passes(phase)
    logits, hidden = forward_response(models.policy, sequences, passes, want_hidden=critic.reads_policy_hidden)
    return logits, critic.values(hidden, sequences, passes, detach_body=freeze_policy)


class ActorCritic(torch.nn.Module):
    """The trained modules (policy and critic) as one module whose forward is `policy_and_values`,
    so a distributed engine wraps and synchronises them together."""

    def __init__(self, models: Models):
        super().__init__()
        self.policy, self.critic = models.policy, models.critic
        self.models = models

    def forward(self, queries, query_mask, responses, mask, restarts, freeze_policy=False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors of `Sequences` one by one: what DDP and FSDP2 hand a module's forward."""
        return policy_and_values(self.models, Sequences(queries, query_mask, responses, mask, restarts), freeze_policy)
