"""What each stage holds on each process, phase by phase, and so its peak: `plan_trainer_stage`
(SFT, reward, DPO through TRL's trainers) and `plan_ppo`, for a `Target` (a `Device`, the data's
`Counts`, the process count).

Each phase adds to what the models already hold (`Held`):

    resident     the models each process holds: trained ones as float32 weights, gradients and
                 AdamW's two moments (16 B per parameter), or frozen weights plus small float32
                 adapters (LoRA); frozen models in their dtype; FSDP2 divides all of it by the
                 process count, and each sharded model keeps its root unit (embeddings, output
                 head) gathered after its first forward
    training     + gradients, DDP's gradient buckets, autocast's bf16 weight copies, the saved
                 activations of one micro-batch (every decoder layer's, or only its input under
                 gradient checkpointing, plus one layer recomputed) and its logits
    sampling     + the KV cache of every sequence sampled at once and, sharded, the gathered policy
    forwards     + the logits of the passes without gradients (PPO's old and reference log-probs)
    hand-off     what a process holds after training: the evaluation's or normalisation's models
                 and samples; sharded, the layers and tensors gathered one at a time to sample and save
    loading      sharded: every model's shards and one whole tensor in flight, as the first process
                 reads it from the checkpoint, casts it and sends it and the others receive it"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from rlhf.config import DPOConfig, RewardConfig, SFTConfig
from rlhf.sections.base import LoRAConfig, StageName, TrainedStage
from rlhf.sections.ppo import PPOConfig
from stages.memory.shapes import (
    ADAM_BYTES,
    GIB,
    RUNTIME_GIB,
    ModelShape,
    _bytes_of,
    forward_without_gradients,
    kv_cache,
    largest_tensor,
    reward_shape,
    training_activations,
)

# --- the parts of a plan --------------------------------------------------------------------------

SCORING_BATCH = 64
"""Sequences the reward model scores in one pass (`stages.rewards.scoring.RewardScorer.raw_scores`)."""


@dataclass(frozen=True)
class Device:
    """Where the stages run: the memory of one GPU, or this machine's RAM (shared by its processes)."""

    kind: Literal["cuda", "cpu"]
    memory: float
    """Bytes."""

    def fits(self, plan: StagePlan, share: float = 1.0, on_node: int | None = None) -> bool:
        """Whether `plan` needs at most `share` of this memory (on CPU a node's processes share it:
        `on_node` of them, by default all of the stage's)."""
        need = plan.peak * ((on_node or plan.processes) if self.kind == "cpu" else 1)
        return need <= share * self.memory

    def describe(self) -> str:
        return (f"one GPU of {self.memory / GIB:.1f} GiB" if self.kind == "cuda"
                else f"this machine's {self.memory / GIB:.1f} GiB of RAM (shared by a stage's processes)")


def this_device() -> Device:
    """The GPU the stages will use (the first), or this machine's RAM."""
    import torch

    if torch.cuda.is_available():
        return Device("cuda", float(torch.cuda.get_device_properties(0).total_memory))
    return Device("cpu", float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))



def _autocast(section: TrainedStage, device: Device) -> str | None:
    """The autocast dtype a stage computes in on `device` (`precision: auto` is bf16 on a GPU)."""
    precision = section.precision
    if precision == "auto":
        precision = "bf16-mixed" if device.kind == "cuda" else "fp32"
    return {"fp32": None, "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[precision]


@dataclass(frozen=True)
class Layout:
    """How a stage's processes hold and compute its models."""

    processes: int
    """How many processes run the stage."""
    sharded: bool
    """FSDP2: each model divided between the processes (else whole on each: DDP, or one process)."""
    autocast: str | None
    """The dtype the stage computes in under autocast (None: float32)."""
    frozen: str = "float32"
    """The dtype its frozen weights are held in (`frozen_dtype`, `auto` resolved as the stage does)."""

    @classmethod
    def of(cls, section: TrainedStage, target: Target) -> Layout:
        """`section`'s launch on `target`, whose process count overrides the launch's."""
        n = target.processes or section.launch.num_processes
        sharded = section.launch.accelerate_settings().get("distributed_type") == "FSDP" and n > 1
        autocast = _autocast(section, target.device)
        frozen = getattr(section, "frozen_dtype", "float32")  # SFT and reward freeze nothing
        if frozen == "auto":  # as `stages.runtime.models.frozen_dtype_of`
            frozen = "bfloat16" if autocast == "bfloat16" else "float32"
        return cls(n, sharded, autocast, frozen)

    @property
    def sharding(self) -> int:
        """Processes each model is divided between (1: whole on each)."""
        return self.processes if self.sharded else 1

    @property
    def compute(self) -> int:
        """Bytes of a value the stage computes (2 under autocast)."""
        return 2 if self.autocast else 4


@dataclass(kw_only=True, frozen=True)
class Held:
    """One model as a process holds it."""

    name: str
    parameters: int
    """All of its parameters (not divided between processes)."""
    trained: int
    """Parameters the optimizer updates (all, or the adapters and any whole head)."""
    weights: float
    """Bytes of this process's share of its weights (frozen and trained)."""
    gradients: float
    optimizer: float
    gathered: float
    """Bytes FSDP2 keeps gathered besides the shard: the root unit after its first forward."""
    how: str
    """`trained`, `LoRA r=8 (bfloat16 frozen)`, `frozen bfloat16`, ..."""
    host: float = 0.0
    """Bytes of this process's share held in host memory instead (offloaded: weights, and a trained
    model's gradients and optimizer state); the device then holds only what is gathered."""


@dataclass(kw_only=True, frozen=True)
class StagePlan:
    """One stage's predicted memory per process, and whether it fits."""

    stage: str
    processes: int
    sharded: bool
    held: list[Held]
    phases: dict[str, dict[str, float]]
    """Each phase's bytes on top of the resident models, by item (`activations`, `kv_cache`, ...)."""
    notes: list[str] = field(default_factory=list)
    alone: frozenset[str] = frozenset()
    """Phases that come before the resident models exist (`loading`): their items are all they hold."""
    after_training: frozenset[str] = frozenset({"hand-off"})
    """Phases after the optimizer's state is dropped (the stages drop it once training is over)."""

    @property
    def resident(self) -> float:
        return sum(h.weights + h.optimizer + h.gathered for h in self.held) + RUNTIME_GIB * GIB

    def phase_total(self, phase: str) -> float:
        base = RUNTIME_GIB * GIB if phase in self.alone else self.resident
        if phase in self.after_training:
            base -= sum(h.optimizer for h in self.held)
        return base + sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak(self) -> float:
        """Predicted peak bytes on one process."""
        return self.phase_total(self.peak_phase)

    def state_bytes(self) -> float:
        """Model-and-optimizer state: weights, gradients and optimizer moments of every model held."""
        return sum(h.weights + h.gradients + h.optimizer for h in self.held)


# --- holding models ------------------------------------------------------------------------------------


def _frozen(name: str, shape: ModelShape, dtype: str, sharding: int) -> Held:
    """A frozen model held in `dtype` by one of `sharding` processes (`sharding` 1: whole)."""
    gathered = shape.outside_layers * _bytes_of(dtype) if sharding > 1 else 0.0
    return Held(name=name, parameters=shape.parameters, trained=0,
                weights=shape.parameters * _bytes_of(dtype) / sharding, gradients=0.0, optimizer=0.0,
                gathered=gathered,
                how=f"frozen {dtype}")


def _trained(name: str, shape: ModelShape, lora: LoRAConfig | None, frozen_dtype: str, layout: Layout,
             head_trains: bool = False) -> Held:
    """A trained model as one of `layout.sharding` processes holds it: whole in float32, or with `lora` its
    adapters (and with `head_trains` a score head) in float32 on weights held in `frozen_dtype`."""
    sharding = layout.sharding
    if lora is None:
        trained_params, how = shape.parameters, "trained float32"
        weights, gathered_dtype = 4 * shape.parameters, layout.compute
    else:
        trained_params = shape.lora_parameters(lora, classifier=head_trains) + (shape.hidden if head_trains else 0)
        how = f"LoRA r={lora.r} on {frozen_dtype} weights"
        weights = shape.parameters * _bytes_of(frozen_dtype) + 4 * trained_params
        gathered_dtype = _bytes_of(frozen_dtype)
    gathered = shape.outside_layers * gathered_dtype if sharding > 1 else 0.0
    return Held(name=name, parameters=shape.parameters, trained=trained_params, weights=weights / sharding,
                gradients=4 * trained_params / sharding,
                optimizer=ADAM_BYTES * trained_params / sharding, gathered=gathered, how=how)


def _offloaded(held: Held) -> Held:
    """`held` with its shards in host memory (FSDP2's `CPUOffloadPolicy`): each unit is copied to the
    device when gathered (counted with the gathered layers), gradients go back to the host as they are
    reduced, and the optimizer steps there."""
    return replace(held, weights=0.0, gradients=0.0, optimizer=0.0, host=held.weights + held.gradients + held.optimizer,
                   how=f"{held.how}, offloaded")


def _training_extras(trained: Iterable[Held], layout: Layout, largest_layer: float) -> dict[str, float]:
    """What training adds to the resident models besides activations: gradients; under DDP its
    buckets (one more copy of the gradients); without sharding, autocast's cached bf16 copies of
    the trained weights; sharded, the layers gathered for forward and backward."""
    trained = list(trained)
    extras = {"gradients": sum(h.gradients for h in trained)}
    if layout.processes > 1 and not layout.sharded:
        extras["ddp_buckets"] = extras["gradients"]
    if layout.autocast and not layout.sharded:
        extras["autocast_weight_copies"] = sum(2 * h.trained for h in trained)
    if layout.sharded:
        extras["gathered_layers"] = 2 * largest_layer  # the layer computing and the next one, prefetched
    return extras


def sharded_hand_off(model: ModelShape, compute: int) -> dict[str, float]:
    """What a sharded stage adds to hand its model off, besides sampling's cache: sampling gathers two
    layers at a time (the one computing and the next), saving gathers one tensor at a time, merged in
    float32 (`stages.runtime.holding.save_streamed`)."""
    return {"gathered": max(2 * model.layer_parameters * compute, 4 * largest_tensor(model))}


def loading(shards: float, model: ModelShape, device_kind: str) -> dict[str, float]:
    """A process while a sharded stage loads its models: the shards of every model loaded so far and one
    whole tensor in flight (`stages.runtime.holding.receive_from_rank0`): on the CPU as the first process reads
    it (float32 at most) and casts it, on a GPU as it is sent in the shard's dtype (float32 at most).
    No process ever holds a whole model."""
    return {"shards": shards, "tensor_in_flight": (8 if device_kind == "cpu" else 4) * largest_tensor(model)}


# --- the stages --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """Sequences some phases sample all at once, counted from the data when it is known."""

    ppo_eval_prompts: int | None = None
    dpo_eval_prompts: int | None = None
    reward_normalization_prompts: int | None = None


@dataclass(frozen=True)
class Target:
    """What a plan is for: the device each process runs on, the data's counts, and how many processes."""

    device: Device
    """The memory each process has (`this_device`, or the one `rlhf plan` is told of)."""
    counts: Counts = Counts()
    """The prompt sets some phases sample all at once."""
    processes: int | None = None
    """The stage's processes; None: its `launch.num_processes`."""


def _count(known: int | None, fallback: int, what: str, notes: list[str]) -> int:
    if known is None:
        notes.append(f"{what}: not counted (data not read); planned as {fallback}")
        return fallback
    return known


def plan_trainer_stage(stage: StageName, section: SFTConfig | RewardConfig | DPOConfig, policy: ModelShape,
                       model: ModelShape, target: Target) -> StagePlan:
    """SFT, reward or DPO: a TRL trainer on `batch_size` examples of `max_length` tokens per process
    (pairs: chosen and rejected in one batch), then the main process's samples or evaluation."""
    layout, device = Layout.of(section, target), target.device
    sharded, sharding, autocast, compute = layout.sharded, layout.sharding, layout.autocast, layout.compute
    notes: list[str] = []
    frozen = layout.frozen  # under LoRA adapters (DPO's; SFT and reward freeze nothing)
    trained = _trained("reward model" if stage == "reward" else "policy", model, section.lora, frozen, layout,
                       head_trains=stage == "reward")
    held = [trained]
    if stage == "dpo" and section.lora is None:  # the reference: a frozen copy (LoRA: the adapters disabled)
        held.append(_frozen("reference", model, "float32", sharding))
    sequences = section.batch_size * (2 if stage in ("reward", "dpo") else 1)
    logits_positions = 0 if stage == "reward" else section.max_length
    largest_layer = model.layer_parameters * compute
    training = _training_extras([trained], layout, largest_layer) | {
        "activations": training_activations(model, sequences, section.max_length, logits_positions, autocast,
                                            section.gradient_checkpointing)}
    if stage == "dpo" and section.lora is None:
        training["reference_forward"] = forward_without_gradients(model, sequences, section.max_length,
                                                                  section.max_length, autocast)
    phases = {"training": training}
    # After training every process holds the model as it trained it; sharded, it samples, scores and
    # saves it layer by layer and tensor by tensor (`stages.runtime.holding`), never gathering it whole.
    streamed = sharded_hand_off(model, compute) if sharded else {}
    if stage == "sft":
        phases["hand-off"] = streamed | {"samples": kv_cache(model, section.num_samples, section.max_length, autocast)}
    elif stage == "reward":
        prompts = _count(target.counts.reward_normalization_prompts, 64, "reward.normalization_prompts", notes)
        sequences = prompts * section.normalization_samples
        sequences = min(sequences, section.normalization_micro_batch_size or sequences)
        phases["hand-off"] = streamed | {
            "normalization_policy": 4 * policy.parameters / sharding,
            "normalization_samples": kv_cache(policy, sequences, section.max_length, None),
            "normalization_forward": forward_without_gradients(policy, 1, section.max_length, 1, None)}
    else:
        prompts = _count(target.counts.dpo_eval_prompts, 64, "dpo.evaluation.prompts", notes)
        evaluated = prompts * section.evaluation.samples_per_prompt
        sequences = min(evaluated, section.sampling.micro_batch_size or evaluated)
        length = section.max_prompt_length + section.sampling.response_length
        reference = model.parameters * _bytes_of(layout.frozen)
        phases["hand-off"] = streamed | {
            "evaluation_reference": reference / sharding,
            "evaluation_samples": kv_cache(model, sequences, length, autocast),
            "evaluation_forwards": forward_without_gradients(model, sequences, length,
                                                             section.sampling.response_length + 1,
                                                             autocast)}
    alone, received = frozenset(), 0.0
    if sharded and device.kind == "cuda" and section.launch.offload_params:  # on the CPU, host memory is the device's
        # Every model: the trained one, DPO's reference, and the frozen ones the
        # hand-off holds (`stages.runtime.holding.Sharded`), in host memory; each received on the device first.
        received = max(h.weights for h in held)
        held = [_offloaded(h) for h in held]
        phases["training"].pop("gradients")  # back to the host as each unit's are reduced
        frozen_later = sum(phases["hand-off"].pop(k, 0.0) for k in ("evaluation_reference", "normalization_policy"))
        notes.append(f"offloaded (fsdp_offload_params): {(sum(h.host for h in held) + frozen_later) / GIB:.2f} GiB "
                     "per process in host memory")
    if section.gradient_accumulation_steps == 1 and "gradients" in training:  # offloaded: on the host
        # The trainer drops its gradients after each step (`zero_grad` sets them to None), and backward frees
        # each layer's activations as it makes that layer's gradients: the two peak apart, the larger counts.
        # Measured on an H100 (0.36B SFT and reward): the peak was the state and gradients, plus 0.1-0.7 GiB.
        training["activations"] = max(training["activations"], training.pop("gradients"))
        notes.append("gradients and activations peak apart (no accumulation): the larger is counted")
    if sharded:
        phases["loading"] = loading(sum(h.weights for h in held) + received, model, device.kind)
        alone = frozenset({"loading"})
    return StagePlan(stage=stage, processes=layout.processes, sharded=sharded, held=held, phases=phases, notes=notes,
                     alone=alone)


@dataclass(frozen=True)
class PPOShapes:
    """The models a PPO run holds, by their shapes."""

    policy: ModelShape
    """The policy's: its reference's too, and a `policy` critic's body."""
    reward: ModelShape | None
    """The reward model's where the reward uses one (and a `reward` critic's body); None: no reward model."""
    frozen: dict[str, ModelShape] = field(default_factory=dict)
    """By name, the frozen models besides the reference whose logits each rollout takes: the distillation `teacher`."""

    @classmethod
    def of(cls, section: PPOConfig, shapes: dict[str, ModelShape]) -> PPOShapes:
        """The models `section` holds, from `shapes` by name; one not in `shapes` (unread) as large as the policy."""
        policy = shapes["policy"]
        reward = reward_shape(shapes.get("reward", policy)) if section.reward.uses_model else None
        frozen = {"teacher": shapes.get("teacher", policy)} if section.teacher else {}
        return cls(policy, reward, frozen)


def _ppo_models(section: PPOConfig, models: PPOShapes, layout: Layout) -> tuple[list[Held], list[str]]:
    """The models a PPO run holds, the policy first, and notes on them."""
    notes: list[str] = []
    policy, reward, frozen, sharding = models.policy, models.reward, layout.frozen, layout.sharding
    held = [_trained("policy", policy, section.lora, frozen, layout)]
    if section.lora is None:
        held.append(_frozen("reference", policy, frozen, sharding))
    critic_kind = section.critic.kind if section.uses_critic else None
    if critic_kind == "reward-lora":
        held.append(_trained("reward model + critic", reward, section.critic.lora, frozen, layout, head_trains=True))
    elif reward is not None:
        held.append(_frozen("reward model", reward, frozen, sharding))
    else:
        notes.append("no reward model: the reward is its other terms alone (functions, remote ones, a teacher's)")
    # Frozen like the reference, offloaded with it.
    held += [_frozen(name, shape, frozen, sharding) for name, shape in models.frozen.items()]
    if critic_kind in ("reward", "policy"):
        held.append(_trained("critic", reward_shape(policy) if critic_kind == "policy" else reward, None, frozen,
                             layout))
    elif critic_kind in ("shared", "detached"):
        notes.append("critic: a value head on the policy's body (hidden + 1 parameters)")
    return held, notes


def plan_ppo(section: PPOConfig, models: PPOShapes, target: Target) -> StagePlan:
    """PPO as `stages.ppo.train_ppo` holds and runs it: policy (with LoRA: its frozen weights are the
    reference), reference, reward model (None: a reward of functions alone), critic, the frozen models
    whose logits the rollout takes (a distillation teacher); sampling, the rollout's forwards, the
    update's micro-batches, the evaluations."""
    layout, device = Layout.of(section, target), target.device
    n, sharded, autocast, compute = layout.processes, layout.sharded, layout.autocast, layout.compute
    held, notes = _ppo_models(section, models, layout)
    policy, reward, pol = models.policy, models.reward, held[0]
    critic_kind = section.critic.kind if section.uses_critic else None
    critic_model = reward_shape(policy) if critic_kind == "policy" else reward

    length = section.max_prompt_length + section.response_tokens
    local = section.rollout_batch_size // n
    micro = section.micro_batch_size or section.rollout_batch_size // (section.num_minibatches * n)
    trained = [h for h in held if h.trained]
    largest_layer = max(policy.layer_parameters, (reward or policy).layer_parameters) * compute
    update = _training_extras(trained, layout, largest_layer) | {
        "policy_activations": training_activations(policy, micro, length, section.response_tokens + 1,
                                                   autocast, section.gradient_checkpointing)}
    if critic_kind in ("reward", "reward-lora", "policy"):
        update["critic_activations"] = training_activations(critic_model, micro, length, 0, autocast,
                                                            section.gradient_checkpointing)
    gathered_policy = {"gathered_policy": policy.parameters * compute} if sharded and \
        section.sharded_sampling == "whole" else {}
    eval_prompts = _count(target.counts.ppo_eval_prompts, section.rollout_batch_size // section.samples_per_prompt,
                          "ppo.evaluation.prompts", notes)
    evaluated = eval_prompts * section.evaluation.samples_per_prompt  # every process evaluates every held-out prompt
    at_once = section.sampling.micro_batch_size or max(local, evaluated)
    rolled, judged = min(local, at_once), min(evaluated, at_once)
    scored = min(rolled, SCORING_BATCH)
    forwards = {"logits": forward_without_gradients(policy, rolled, length, section.response_tokens + 1, autocast)}
    if reward is not None:
        forwards["scoring"] = forward_without_gradients(reward, scored, length, 0, autocast)
    for name, shape in models.frozen.items():  # their logits beside the policy's, which the rollout still holds
        forwards[f"{name}_logits"] = forward_without_gradients(shape, rolled, length, section.response_tokens + 1,
                                                               autocast)
    phases = {
        "sampling": gathered_policy | {"kv_cache": kv_cache(policy, rolled, length, autocast)},
        "rollout_forwards": forwards,
        "update": update,
        "evaluation": gathered_policy | {
            "kv_cache": kv_cache(policy, judged, length, autocast),
            "logits": forward_without_gradients(policy, judged, length, section.response_tokens + 1,
                                                autocast)},
    }
    alone = frozenset()
    if sharded:
        phases["hand-off"] = sharded_hand_off(policy, compute)  # saved a tensor at a time
    received = 0.0
    if sharded and device.kind == "cuda" and (section.launch.offload_params or section.offload_frozen):
        # In host memory: every model (the accelerate config's `fsdp_offload_params`) or the frozen ones,
        # held as `stages.runtime.holding.Sharded.frozen` holds them (a `reward-lora` critic's body and adapters);
        # each received on the device first.
        offloaded = [h for h in held if section.launch.offload_params or (h is not pol and h.name != "critic")]
        received = max((h.weights for h in offloaded), default=0.0)
        held = [_offloaded(h) if any(h is o for o in offloaded) else h for h in held]
        if section.launch.offload_params:
            phases["update"].pop("gradients")  # back to the host as each unit's are reduced
        notes.append(f"offloaded ({'fsdp_offload_params' if section.launch.offload_params else 'offload_frozen'}): "
                     f"{sum(h.host for h in held) / GIB:.2f} GiB per process in host memory")
    if sharded:
        phases["loading"] = loading(sum(h.weights for h in held) + received, policy, device.kind)
        alone = frozenset({"loading"})
    return StagePlan(stage="ppo", processes=n, sharded=sharded, held=held, phases=phases, notes=notes, alone=alone)
