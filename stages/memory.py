"""Will it fit? The memory a stage needs on each process, predicted from the models' configs alone.

Each model is built from its `config.json` on the meta device (the real shapes, no weights read:
a 70B config plans in seconds). For every stage the plan walks the phases the stage's code goes
through and takes the largest:

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
                 reads it from the checkpoint, casts it and sends it and the others receive it

The per-token activation figures were read off what autograd saves for a HF Llama layer
(`torch.autograd.graph.saved_tensors_hooks`): float32 4 x (8h + 2kv + 4i) bytes, bf16 autocast
32h + 4kv + 8i bytes (h hidden, kv the key/value width, i the MLP width); docs/scaling.md has how
the plan compares with measurement. The plan is a prediction, not an allocator trace: it leaves
out allocator fragmentation and transient buffers smaller than a layer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

from rlhf.config import (DPOConfig, LaunchConfig, LoRAConfig, PipelineConfig, PolicyLoRAConfig, PPOConfig,
                         RewardConfig, SFTConfig, StageName, TrainedStage)

GIB = 1024 ** 3
ADAM_BYTES = 8
"""AdamW's two float32 moments per trained parameter."""
LOGIT_COPIES = 4
"""Float32 copies of the logits alive around a loss: the logits, their log-softmax (saved), its
gradient, and one transient (an entropy or a float cast)."""
RUNTIME_GIB = 0.75
"""Per process, besides tensors: the libraries, the CUDA context, allocator slack."""
FSDP_CONFIG = "configs/accelerate/fsdp.yaml"

SCORING_BATCH = 64
"""Sequences the reward model scores in one pass (`stages.reward.RewardScorer.raw_scores`)."""


# --- model shapes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a model, read off its config built on the meta device."""

    location: str
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    """Key/value heads x head size: the width of each of a layer's K and V."""
    vocab: int
    layer_parameters: int
    """Parameters of one decoder layer (the largest)."""
    outside_layers: int
    """Parameters outside the decoder layers: embeddings, final norm, output head (FSDP2's root unit)."""
    head_parameters: int
    """Parameters of the output projection that are its own (0 when tied to the input embeddings)."""
    linears: tuple[tuple[str, int, int], ...] = field(repr=False)
    """(module name, in features, out features) of every Linear layer, for counting adapters."""
    head_name: str | None = None
    """Module name of the causal LM's output projection (`lm_head`)."""

    def lora_parameters(self, lora: LoRAConfig, classifier: bool = False) -> int:
        """Adapter parameters peft adds: r x (in + out) for every Linear layer `lora` puts adapters on
        (`stages.models.lora_targets`; the output head with PPO's `output_layer`), in the causal LM or,
        with `classifier`, in the reward model on the same body (its score head trains whole: counted apart)."""
        from stages.models import lora_targets

        targets = lora_targets(lora, [name for name, _, _ in self.linears], self.head_name,
                               adapt_head=getattr(lora, "output_layer", False) and not classifier)
        return sum(lora.r * (fan_in + fan_out) for name, fan_in, fan_out in self.linears
                   if any(name == target or name.endswith(f".{target}") for target in targets))


@functools.lru_cache(maxsize=32)
def model_shape(location: str, trust_remote_code: bool = False) -> ModelShape:
    """The causal LM at `location` (hub id or folder), from its config alone, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.holding import decoder_layers

    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    parameters = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    head_size = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    intermediate = (getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None)
                    or getattr(text, "n_inner", None) or 4 * hidden)
    from transformers.pytorch_utils import Conv1D

    linears = tuple((name, *_fans(module)) for name, module in model.named_modules()
                    if isinstance(module, (torch.nn.Linear, Conv1D)))
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    own_head = 0 if head is None or head.weight is embedding else head.weight.numel()
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    return ModelShape(location, parameters, len(layers), hidden, intermediate, kv_heads * head_size,
                      model.get_input_embeddings().num_embeddings,
                      max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                      sum(p.numel() for p in model.parameters() if id(p) not in in_layers), own_head, linears, head_name)


def _fans(module) -> tuple[int, int]:
    """(in, out) features of a Linear, or of GPT-2's Conv1D (weight stored as (in, out))."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.nf


def reward_shape(policy_like: ModelShape) -> ModelShape:
    """The same body with a one-output score head instead of the vocabulary projection."""
    head = policy_like.head_parameters
    return replace(policy_like, parameters=policy_like.parameters - head + policy_like.hidden, vocab=1,
                   outside_layers=policy_like.outside_layers - head + policy_like.hidden, head_parameters=0,
                   linears=tuple(l for l in policy_like.linears if l[0] != "lm_head"))


# --- the parts of a plan --------------------------------------------------------------------------


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Device:
    """Where the stages run: the memory of one GPU, or this machine's RAM (shared by its processes)."""

    kind: Literal["cuda", "cpu"]
    memory: float
    """Bytes."""

    def fits(self, plan: StagePlan, share: float = 1.0) -> bool:
        """Whether `plan` needs at most `share` of this memory (on CPU the processes of one stage share it)."""
        need = plan.peak * (plan.processes if self.kind == "cpu" else 1)
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


# --- activations and caches -------------------------------------------------------------------------


def _bytes_of(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _autocast(section: TrainedStage, device: Device) -> str | None:
    """The autocast dtype a stage computes in on `device` (`precision: auto` is bf16 on a GPU)."""
    precision = section.precision
    if precision == "auto":
        precision = "bf16-mixed" if device.kind == "cuda" else "fp32"
    return {"fp32": None, "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[precision]


def layer_activation_bytes(shape: ModelShape, autocast: str | None) -> float:
    """Bytes autograd saves per token in one decoder layer (read off a HF Llama layer)."""
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    return 4 * (8 * h + 2 * kv + 4 * i) if autocast is None else 32 * h + 4 * kv + 8 * i


def training_activations(shape: ModelShape, sequences: int, length: int, logits_positions: int,
                         autocast: str | None, checkpointing: bool) -> float:
    """Saved activations of one forward with gradients over `sequences` x `length` tokens, and the
    logits of `logits_positions` positions per sequence (all of them for SFT, the response for PPO)."""
    tokens = sequences * length
    per_layer = layer_activation_bytes(shape, autocast) * tokens
    layers = (shape.layers * 4 * shape.hidden * tokens + per_layer) if checkpointing else shape.layers * per_layer
    outside = 3 * 4 * shape.hidden * tokens
    logits = LOGIT_COPIES * 4 * shape.vocab * sequences * logits_positions
    return layers + outside + logits


def forward_without_gradients(shape: ModelShape, sequences: int, length: int, logits_positions: int,
                              autocast: str | None) -> float:
    """A pass without gradients: one layer's working set at a time, and the float32 logits with their log-softmax."""
    working = (6 * shape.hidden + 2 * shape.intermediate) * (2 if autocast else 4) * sequences * length
    return working + 2 * 4 * shape.vocab * sequences * logits_positions


def kv_cache(shape: ModelShape, sequences: int, length: int, autocast: str | None) -> float:
    """Keys and values of every layer for `sequences` sampled at once, up to `length` tokens, plus
    each decode step's float32 logits and the hidden states PPO keeps per sampled token."""
    width = 2 if autocast else 4
    return (2 * shape.layers * shape.kv_width * length * sequences * width
            + 3 * 4 * shape.vocab * sequences + shape.hidden * length * sequences * width)


# --- holding models ------------------------------------------------------------------------------------


def _frozen(name: str, shape: ModelShape, dtype: str, sharding: int) -> Held:
    """A frozen model held in `dtype` by one of `sharding` processes (`sharding` 1: whole)."""
    gathered = shape.outside_layers * _bytes_of(dtype) if sharding > 1 else 0.0
    return Held(name, shape.parameters, 0, shape.parameters * _bytes_of(dtype) / sharding, 0.0, 0.0, gathered,
                f"frozen {dtype}")


def _trained(name: str, shape: ModelShape, lora: LoRAConfig | None, frozen_dtype: str, sharding: int,
             compute_bytes: int, head_trains: bool = False) -> Held:
    """A trained model as one of `sharding` processes holds it: whole in float32, or with `lora` its
    adapters (and with `head_trains` a score head) in float32 on weights held in `frozen_dtype`."""
    if lora is None:
        trained_params, how = shape.parameters, "trained float32"
        weights, gathered_dtype = 4 * shape.parameters, compute_bytes
    else:
        trained_params = shape.lora_parameters(lora, classifier=head_trains) + (shape.hidden if head_trains else 0)
        how = f"LoRA r={lora.r} on {frozen_dtype} weights"
        weights = shape.parameters * _bytes_of(frozen_dtype) + 4 * trained_params
        gathered_dtype = _bytes_of(frozen_dtype)
    gathered = shape.outside_layers * gathered_dtype if sharding > 1 else 0.0
    return Held(name, shape.parameters, trained_params, weights / sharding, 4 * trained_params / sharding,
                ADAM_BYTES * trained_params / sharding, gathered, how)


def _engine(launch: LaunchConfig, processes: int | None) -> tuple[int, bool]:
    """(processes, sharded) for the stage's launch, with `processes` overriding its count."""
    n = processes or launch.num_processes
    return n, launch.engine().get("distributed_type") == "FSDP" and n > 1


def _offloaded(held: Held) -> Held:
    """`held` with its shards in host memory (FSDP2's `CPUOffloadPolicy`): each unit is copied to the
    device when gathered (counted with the gathered layers), gradients go back to the host as they are
    reduced, and the optimizer steps there."""
    return replace(held, weights=0.0, gradients=0.0, optimizer=0.0, host=held.weights + held.gradients + held.optimizer,
                   how=f"{held.how}, offloaded")


def _training_extras(trained: Iterable[Held], processes: int, sharded: bool, autocast: str | None,
                     largest_layer: float) -> dict[str, float]:
    """What training adds to the resident models besides activations: gradients; under DDP its
    buckets (one more copy of the gradients); without sharding, autocast's cached bf16 copies of
    the trained weights; sharded, the layers gathered for forward and backward."""
    trained = list(trained)
    extras = {"gradients": sum(h.gradients for h in trained)}
    if processes > 1 and not sharded:
        extras["ddp_buckets"] = extras["gradients"]
    if autocast and not sharded:
        extras["autocast_weight_copies"] = sum(2 * h.trained for h in trained)
    if sharded:
        extras["gathered_layers"] = 2 * largest_layer  # the layer computing and the next one, prefetched
    return extras


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the model's largest tensor: the embeddings (or output head), or a layer's MLP matrix."""
    return max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden)


def sharded_hand_off(model: ModelShape, compute: int) -> dict[str, float]:
    """What a sharded stage adds to hand its model off, besides sampling's cache: sampling gathers two
    layers at a time (the one computing and the next), saving gathers one tensor at a time, merged in
    float32 (`stages.holding.save_streamed`)."""
    return {"gathered": max(2 * model.layer_parameters * compute, 4 * largest_tensor(model))}


def loading(shards: float, model: ModelShape, device_kind: str) -> dict[str, float]:
    """A process while a sharded stage loads its models: the shards of every model loaded so far and one
    whole tensor in flight (`stages.holding.receive_from_rank0`): on the CPU as the first process reads
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


def _count(known: int | None, fallback: int, what: str, notes: list[str]) -> int:
    if known is None:
        notes.append(f"{what}: not counted (data not read); planned as {fallback}")
        return fallback
    return known


def plan_trainer_stage(stage: StageName, section: SFTConfig | RewardConfig | DPOConfig, policy: ModelShape,
                       model: ModelShape, device: Device, counts: Counts, processes: int | None = None) -> StagePlan:
    """SFT, reward or DPO: a TRL trainer on `batch_size` examples of `max_length` tokens per process
    (pairs: chosen and rejected in one batch), then the main process's samples or evaluation."""
    n, sharded = _engine(section.launch, processes)
    autocast = _autocast(section, device)
    compute = 2 if autocast else 4
    sharding = n if sharded else 1
    notes: list[str] = []
    frozen = section.frozen_dtype if stage == "dpo" else "float32"  # under LoRA adapters
    trained = _trained("reward model" if stage == "reward" else "policy", model, section.lora, frozen, sharding, compute,
                       head_trains=stage == "reward")
    held = [trained]
    if stage == "dpo" and section.lora is None:  # the reference: a frozen copy (LoRA: the adapters disabled)
        held.append(_frozen("reference", model, "float32", sharding))
    sequences = section.batch_size * (2 if stage in ("reward", "dpo") else 1)
    logits_positions = 0 if stage == "reward" else section.max_length
    largest_layer = model.layer_parameters * compute
    training = _training_extras([trained], n, sharded, autocast, largest_layer) | {
        "activations": training_activations(model, sequences, section.max_length, logits_positions, autocast,
                                            section.gradient_checkpointing)}
    if stage == "dpo" and section.lora is None:
        training["reference_forward"] = forward_without_gradients(model, sequences, section.max_length,
                                                                  section.max_length, autocast)
    phases = {"training": training}
    # After training every process holds the model as it trained it; sharded, it samples, scores and
    # saves it layer by layer and tensor by tensor (`stages.holding`), never gathering it whole.
    streamed = sharded_hand_off(model, compute) if sharded else {}
    if stage == "sft":
        phases["hand-off"] = streamed | {"samples": kv_cache(model, section.num_samples, section.max_length, autocast)}
    elif stage == "reward":
        prompts = _count(counts.reward_normalization_prompts, 64, "reward.normalization_prompts", notes)
        sequences = prompts * section.normalization_samples
        sequences = min(sequences, section.normalization_micro_batch_size or sequences)
        phases["hand-off"] = streamed | {
            "normalization_policy": 4 * policy.parameters / sharding,
            "normalization_samples": kv_cache(policy, sequences, section.max_length, None),
            "normalization_forward": forward_without_gradients(policy, 1, section.max_length, 1, None)}
    else:
        prompts = _count(counts.dpo_eval_prompts, 64, "dpo.evaluation.prompts", notes)
        evaluated = prompts * section.evaluation.samples_per_prompt
        sequences = min(evaluated, section.sampling.micro_batch_size or evaluated)
        length = section.max_prompt_length + section.sampling.response_length
        reference = model.parameters * _bytes_of(section.frozen_dtype)
        phases["hand-off"] = streamed | {
            "evaluation_reference": reference / sharding,
            "evaluation_samples": kv_cache(model, sequences, length, autocast),
            "evaluation_forwards": forward_without_gradients(model, sequences, length, section.sampling.response_length + 1,
                                                             autocast)}
    alone, received = frozenset(), 0.0
    if sharded and device.kind == "cuda" and section.launch.offload_params:  # on the CPU, host memory is the device's
        # Every model: the trained one, DPO's reference, and the frozen ones the
        # hand-off holds (`stages.holding.Sharded`), in host memory; each received on the device first.
        received = max(h.weights for h in held)
        held = [_offloaded(h) for h in held]
        phases["training"].pop("gradients")  # back to the host as each unit's are reduced
        frozen_later = sum(phases["hand-off"].pop(k, 0.0) for k in ("evaluation_reference", "normalization_policy"))
        notes.append(f"offloaded (fsdp_offload_params): {(sum(h.host for h in held) + frozen_later) / GIB:.2f} GiB "
                     "per process in host memory")
    if sharded:
        phases["loading"] = loading(sum(h.weights for h in held) + received, model, device.kind)
        alone = frozenset({"loading"})
    return StagePlan(stage, n, sharded, held, phases, notes, alone)


def plan_ppo(section: PPOConfig, policy: ModelShape, reward: ModelShape | None, device: Device, counts: Counts,
             processes: int | None = None) -> StagePlan:
    """PPO as `stages.ppo.train_ppo` holds and runs it: policy (with LoRA: its frozen weights are the
    reference), reference, reward model (None: a reward of functions alone), critic; sampling, the
    rollout's forwards, the update's micro-batches, the evaluations."""
    n, sharded = _engine(section.launch, processes)
    autocast = _autocast(section, device)
    compute = 2 if autocast else 4
    sharding = n if sharded else 1
    notes: list[str] = []
    frozen = section.frozen_dtype
    pol = _trained("policy", policy, section.lora, frozen, sharding, compute)
    held = [pol]
    if section.lora is None:
        held.append(_frozen("reference", policy, frozen, sharding))
    critic_kind = section.critic.kind if section.uses_critic else None
    if critic_kind == "reward-lora":
        held.append(_trained("reward model + critic", reward, section.critic.lora, frozen, sharding, compute,
                             head_trains=True))
    elif reward is not None:
        held.append(_frozen("reward model", reward, frozen, sharding))
    else:
        notes.append("no reward model: the reward is Python functions alone")
    critic_model = reward_shape(policy) if critic_kind == "policy" else reward
    if critic_kind in ("reward", "policy"):
        held.append(_trained("critic", critic_model, None, frozen, sharding, compute))
    elif critic_kind in ("shared", "detached"):
        notes.append("critic: a value head on the policy's body (hidden + 1 parameters)")

    length = section.max_prompt_length + section.sampling.response_length
    local = section.rollout_batch_size // n
    micro = section.micro_batch_size or section.rollout_batch_size // (section.num_minibatches * n)
    trained = [h for h in held if h.trained]
    largest_layer = max(policy.layer_parameters, (reward or policy).layer_parameters) * compute
    update = _training_extras(trained, n, sharded, autocast, largest_layer) | {
        "policy_activations": training_activations(policy, micro, length, section.sampling.response_length + 1, autocast,
                                                   section.gradient_checkpointing)}
    if critic_kind in ("reward", "reward-lora", "policy"):
        update["critic_activations"] = training_activations(critic_model, micro, length, 0, autocast,
                                                            section.gradient_checkpointing)
    gathered_policy = {"gathered_policy": policy.parameters * compute} if sharded and \
        section.sharded_sampling == "whole" else {}
    eval_prompts = _count(counts.ppo_eval_prompts, section.rollout_batch_size // section.samples_per_prompt,
                          "ppo.evaluation.prompts", notes)
    evaluated = eval_prompts * section.evaluation.samples_per_prompt  # every process evaluates every held-out prompt
    at_once = section.sampling.micro_batch_size or max(local, evaluated)
    rolled, judged = min(local, at_once), min(evaluated, at_once)
    scored = min(rolled, SCORING_BATCH)
    phases = {
        "sampling": gathered_policy | {"kv_cache": kv_cache(policy, rolled, length, autocast)},
        "rollout_forwards": {"logits": forward_without_gradients(policy, rolled, length, section.sampling.response_length + 1,
                                                                 autocast)} | (
            {"scoring": forward_without_gradients(reward, scored, length, 0, autocast)} if reward is not None else {}),
        "update": update,
        "evaluation": gathered_policy | {
            "kv_cache": kv_cache(policy, judged, length, autocast),
            "logits": forward_without_gradients(policy, judged, length, section.sampling.response_length + 1, autocast)},
    }
    alone = frozenset()
    if sharded:
        phases["hand-off"] = sharded_hand_off(policy, compute)  # saved a tensor at a time
    received = 0.0
    if sharded and device.kind == "cuda" and (section.launch.offload_params or section.offload_frozen):
        # In host memory: every model (the accelerate config's `fsdp_offload_params`) or the frozen ones,
        # held as `stages.holding.Sharded.frozen` holds them (a `reward-lora` critic's body and adapters);
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
    return StagePlan("ppo", n, sharded, held, phases, notes, alone)


def plan_stage(cfg: PipelineConfig, stage: StageName, shapes: dict[str, ModelShape], device: Device,
               counts: Counts = Counts(), processes: int | None = None, section=None) -> StagePlan:
    """`stage`'s plan with `section` (default: the config's) and the models in `shapes`
    (`policy`, and `reward` where the reward model is its own)."""
    section = section or getattr(cfg, stage)
    if auto_fields(stage, section, counts, processes):
        section = resolve_micro_batches(stage, section, shapes, device, counts, processes)
    policy = shapes["policy"]
    if stage == "ppo":
        reward = reward_shape(shapes.get("reward", policy)) if section.reward.uses_model else None
        return plan_ppo(section, policy, reward, device, counts, processes)
    model = reward_shape(shapes.get("reward", policy)) if stage == "reward" else policy
    return plan_trainer_stage(stage, section, policy, model, device, counts, processes)


# --- micro-batches chosen for the device ------------------------------------------------------------------------

AUTO_MARGIN = 0.9
"""An `auto` micro-batch is the largest whose plan needs at most this share of the device's memory:
the rest for what the plan leaves out (allocator fragmentation, small transient buffers)."""


def _halvings(total: int) -> list[int]:
    """The powers of two below `total`, largest first: micro-batch sizes to try after all at once."""
    sizes, size = [], 1
    while size < total:
        sizes.append(size)
        size *= 2
    return sizes[::-1]


def auto_fields(stage: StageName, section, counts: Counts, processes: int | None = None) -> list[tuple[str, list]]:
    """(dotted field, candidate values, most memory first) for each of the stage's memory settings set
    to `auto`: PPO's `sharded_sampling`, then the micro-batch sizes, whose first candidate, None, is
    all at once (what a config without micro-batches does)."""
    fields = []
    n = processes or section.launch.num_processes
    if stage == "ppo" and section.sharded_sampling == "auto":  # first: the faster way, where it fits
        fields.append(("sharded_sampling", ["whole", "per_layer"]))
    if stage == "ppo" and section.sampling.micro_batch_size == "auto":
        evaluated = (counts.ppo_eval_prompts or 64) * section.evaluation.samples_per_prompt
        fields.append(("sampling.micro_batch_size", [None, *_halvings(max(section.rollout_batch_size // n, evaluated))]))
    if stage == "ppo" and section.micro_batch_size == "auto":
        minibatch = section.rollout_batch_size // (section.num_minibatches * n)
        fields.append(("micro_batch_size", [None, *(d for d in range(minibatch - 1, 0, -1) if minibatch % d == 0)]))
    if stage == "dpo" and section.sampling.micro_batch_size == "auto":
        evaluated = (counts.dpo_eval_prompts or 64) * section.evaluation.samples_per_prompt
        fields.append(("sampling.micro_batch_size", [None, *_halvings(evaluated)]))
    if stage == "reward" and section.normalization_micro_batch_size == "auto":
        sequences = (counts.reward_normalization_prompts or 64) * section.normalization_samples
        fields.append(("normalization_micro_batch_size", [None, *_halvings(sequences)]))
    return fields


def resolve_micro_batches(stage: StageName, section, shapes: dict[str, ModelShape], device: Device, counts: Counts,
                          processes: int | None = None):
    """`section` with every `auto` micro-batch size resolved: each the largest of its candidates
    (`auto_fields`) whose plan fits `device` with `AUTO_MARGIN`, the others at their smallest while
    it is chosen, in `auto_fields`' order; the smallest where none fits (the plan then says so).
    Explicit sizes are kept as they are."""
    from rlhf.config import with_overrides

    fields = auto_fields(stage, section, counts, processes)
    if not fields:
        return section
    section = with_overrides(section, {name: candidates[-1] for name, candidates in fields})
    for name, candidates in fields:
        for value in candidates[:-1]:
            trial = with_overrides(section, {name: value})
            if device.fits(plan_stage(None, stage, shapes, device, counts, processes, trial), AUTO_MARGIN):
                section = trial
                break
    return section


def resolved_values(stage: StageName, section, resolved) -> dict[str, int | str | None]:
    """What `resolve_micro_batches` chose, by the names in the section (`sampling.micro_batch_size`)."""
    return {name: functools.reduce(getattr, name.split("."), resolved)
            for name, _ in auto_fields(stage, section, Counts(), section.launch.num_processes)}


def with_micro_batches(stage: StageName, section, counts: Counts, policy_location: str,
                       reward_location: str | None = None, reporting=None):
    """What a stage calls first: `section` with its `auto` micro-batch sizes resolved on the device
    present (`this_device`) from its models' configs (the policy, and the reward model where the
    stage has one) and its data's counts; each process resolves the same. The chosen sizes go to
    `reporting.params` as `auto.<field>`. A section without `auto` is returned as it is."""
    if not auto_fields(stage, section, counts):
        return section
    shapes = {"policy": model_shape(policy_location, section.trust_remote_code)}
    if reward_location is not None:
        shapes["reward"] = model_shape(reward_location, section.trust_remote_code)
    resolved = resolve_micro_batches(stage, section, shapes, this_device(), counts)
    if reporting is not None:
        reporting.params({f"auto.{name}": value for name, value in resolved_values(stage, section, resolved).items()})
    return resolved


# --- what would make it fit ---------------------------------------------------------------------------------


def knobs(stage: StageName, section: TrainedStage) -> list[tuple[str, dict]]:
    """Settings that cut a stage's memory without changing what it computes much, cheapest first:
    (what to write in the config, the section fields it sets)."""
    found: list[tuple[str, dict]] = []
    if stage == "ppo":
        minibatch = section.rollout_batch_size // (section.num_minibatches * section.launch.num_processes)
        micro = section.micro_batch_size or minibatch
        if section.sampling.micro_batch_size is None or section.sampling.micro_batch_size > micro:
            # As many sequences without gradients at once as the update takes with them.
            found.append((f"ppo.sampling.micro_batch_size: {micro}",
                          {"sampling": section.sampling.model_copy(update={"micro_batch_size": micro})}))
        if micro > 1:
            found.append((f"{stage}.micro_batch_size: 1", {"micro_batch_size": 1}))
    elif section.batch_size > 1:
        found.append((f"{stage}.batch_size: 1 with gradient_accumulation_steps: "
                      f"{section.batch_size * section.gradient_accumulation_steps}",
                      {"batch_size": 1, "gradient_accumulation_steps": section.batch_size *
                       section.gradient_accumulation_steps}))
    if not section.gradient_checkpointing:
        found.append((f"{stage}.gradient_checkpointing: true", {"gradient_checkpointing": True}))
    if stage == "dpo" and (section.sampling.micro_batch_size or 2) > 1:
        found.append(("dpo.sampling.micro_batch_size: 1",
                      {"sampling": section.sampling.model_copy(update={"micro_batch_size": 1})}))
    if stage in ("ppo", "dpo") and section.frozen_dtype == "float32":
        found.append((f"{stage}.frozen_dtype: bfloat16", {"frozen_dtype": "bfloat16"}))
    if stage == "ppo" and not section.offload_frozen:  # acts only when sharded, on a GPU
        found.append(("ppo.offload_frozen: true", {"offload_frozen": True}))
    if stage == "ppo" and section.sharded_sampling == "whole":  # acts only when sharded: see `sharding_over`
        found.append(("ppo.sharded_sampling: per_layer", {"sharded_sampling": "per_layer"}))
    if stage == "ppo" and section.uses_critic and section.critic.kind == "reward":
        found.append(("ppo.critic.kind: reward-lora", {"critic": section.critic.model_copy(update={"kind": "reward-lora"})}))
    if section.lora is None:
        found.append((f"{stage}.lora: {{}}", {"lora": PolicyLoRAConfig() if stage == "ppo" else LoRAConfig()}))
    return found


def sharding_over(n: int) -> tuple[str, dict]:
    return (f"shard over {n} processes (launch: {{num_processes: {n}, accelerate_config: {FSDP_CONFIG}}})",
            {"launch": LaunchConfig(num_processes=n, accelerate_config=FSDP_CONFIG)})


def what_fits(section: TrainedStage, stage: StageName, shapes: dict[str, ModelShape], device: Device,
              counts: Counts, max_processes: int = 64, most: int = 5) -> list[str]:
    """Ways to bring the stage under `device`'s memory, cheapest first: the fewest knobs (sharding
    counts as one, at the fewest processes that fit), and at each count the knobs in `knobs`' order;
    at most `most` ways, from the smallest count that has any and the next."""
    import itertools

    options = knobs(stage, section)
    shardings = [sharding_over(n) for n in (2, 4, 8, 16, 32, 64) if n <= max_processes]

    def fits(chosen) -> bool:
        updates = {k: v for _, fields in chosen for k, v in fields.items()}
        changed = section.model_copy(update=updates)
        return device.fits(plan_stage(None, stage, shapes, device, counts, section=changed))

    found: list[tuple[frozenset[str], int, str]] = []  # (knobs, processes, the way as written)

    def add(chosen, processes: int) -> None:
        names = frozenset(name for name, _ in chosen)
        if not any(earlier <= names and n <= processes for earlier, n, _ in found):  # not a cheaper way plus more
            found.append((names, processes, ", ".join(name for name, _ in chosen)))

    first = None
    for size in range(1, len(options) + 2):
        if first is not None and size > first + 1:
            break
        for chosen in itertools.combinations(options, size):
            if fits(chosen):
                add(chosen, 1)
        for chosen in itertools.combinations(options, size - 1):
            for n, sharding in zip((2, 4, 8, 16, 32, 64), shardings):
                if fits(chosen + (sharding,)):
                    add(chosen + (sharding,), n)
                    break
        if found and first is None:
            first = size
    return [way for _, _, way in found[:most]]


# --- the whole config ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    device: Device
    stages: dict[str, StagePlan]
    verdicts: dict[str, bool]
    fixes: dict[str, list[str]]
    micro_batches: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Per stage, the `auto` micro-batch sizes resolved for this device (None: all at once)."""

    def message(self, stage: str) -> str:
        """Why a stage does not fit, and what would make it fit."""
        plan = self.stages[stage]
        need = plan.peak * (plan.processes if self.device.kind == "cpu" else 1)
        text = (f"{stage}: predicted peak {plan.peak / GIB:.1f} GiB per process ({plan.peak_phase})"
                + (f", {need / GIB:.1f} GiB for its {plan.processes} processes" if need != plan.peak else "")
                + f", over {self.device.describe()}")
        ways = self.fixes.get(stage) or []
        if ways:
            text += "; it would fit with: " + " | ".join(ways)
        else:
            text += "; no combination of LoRA, bf16 frozen models, gradient checkpointing, micro-batches and " \
                    "sharding over up to 64 processes makes it fit"
        return text


def model_shapes(cfg: PipelineConfig, resolve=lambda location: location) -> dict[str, ModelShape]:
    """The policy's shape (`sft.model`) and, when the config names one, the reward model's."""
    shapes = {"policy": model_shape(resolve(cfg.sft.model), cfg.sft.trust_remote_code)}
    if cfg.reward.model:
        shapes["reward"] = model_shape(resolve(cfg.reward.model), cfg.reward.trust_remote_code)
    return shapes


def plan(cfg: PipelineConfig, stages: list[str], shapes: dict[str, ModelShape], device: Device,
         counts: Counts = Counts(), processes: int | None = None) -> Plan:
    """Every stage's plan on `device`, whether it fits, and for those that do not, what would."""
    sections = {stage: resolve_micro_batches(stage, getattr(cfg, stage), shapes, device, counts, processes)
                for stage in stages}
    plans = {stage: plan_stage(cfg, stage, shapes, device, counts, processes, sections[stage]) for stage in stages}
    verdicts = {stage: device.fits(p) for stage, p in plans.items()}
    fixes = {stage: what_fits(sections[stage], stage, shapes, device, counts)
             for stage, ok in verdicts.items() if not ok}
    chosen = {stage: resolved_values(stage, getattr(cfg, stage), sections[stage]) for stage in stages}
    return Plan(device, plans, verdicts, fixes, {stage: values for stage, values in chosen.items() if values})


def _count_text(n: int) -> str:
    return next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                if n >= scale or scale == 1)


def plan_table(result: Plan) -> str:
    """The plan as Markdown: per stage, the models held and each part of the peak, in GiB per process."""
    lines = [f"Device: {result.device.describe()}", ""]
    for stage, p in result.stages.items():
        verdict = "fits" if result.verdicts[stage] else "DOES NOT FIT"
        engine = f"FSDP2 over {p.processes}" if p.sharded else (f"DDP x {p.processes}" if p.processes > 1
                                                                else "one process")
        lines += [f"### {stage} ({engine}): peak {p.peak / GIB:.2f} GiB per process in {p.peak_phase}: {verdict}",
                  "", "| model | parameters | held as | weights (GiB) | gradients | optimizer | gathered |",
                  "|---|---|---|---|---|---|---|"]
        for h in p.held:
            lines.append(f"| {h.name} | {_count_text(h.parameters)} ({_count_text(h.trained)} trained) | {h.how} | {h.weights / GIB:.2f} | "
                         f"{h.gradients / GIB:.2f} | {h.optimizer / GIB:.2f} | {h.gathered / GIB:.2f} |")
        lines += ["", "| phase | on top of the resident models (GiB) | total |", "|---|---|---|"]
        for phase, items in p.phases.items():
            parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in items.items())
            lines.append(f"| {phase} | {parts} | {p.phase_total(phase) / GIB:.2f} |")
        lines += ["", f"Resident (models, optimizer, runtime {RUNTIME_GIB} GiB): {p.resident / GIB:.2f} GiB"]
        if result.micro_batches.get(stage):
            chosen = ", ".join(f"{stage}.{name} {'all at once' if value is None else value}"
                               for name, value in result.micro_batches[stage].items())
            lines.append(f"- micro-batches chosen for this device (`auto`): {chosen}")
        lines += [f"- {note}" for note in p.notes]
        if not result.verdicts[stage]:
            lines.append(f"- {result.message(stage)}")
        lines.append("")
    return "\n".join(lines)


def plan_json(result: Plan) -> dict:
    """The plan as plain data (`rlhf plan --json`)."""
    return {"device": {"kind": result.device.kind, "memory_gib": result.device.memory / GIB},
            "stages": {stage: {
                "processes": p.processes, "sharded": p.sharded, "fits": result.verdicts[stage],
                "predicted_peak_gib": p.peak / GIB, "peak_phase": p.peak_phase,
                "state_gib": p.state_bytes() / GIB, "resident_gib": p.resident / GIB,
                "models": [{"name": h.name, "parameters": h.parameters, "trained_parameters": h.trained,
                            "held_as": h.how, "weights_gib": h.weights / GIB, "gradients_gib": h.gradients / GIB,
                            "optimizer_gib": h.optimizer / GIB, "gathered_gib": h.gathered / GIB,
                            "host_gib": h.host / GIB} for h in p.held],
                "phases": {phase: {k: v / GIB for k, v in items.items()} | {"total": p.phase_total(phase) / GIB}
                           for phase, items in p.phases.items()},
                "notes": p.notes, "fixes": result.fixes.get(stage, []),
                "micro_batches": result.micro_batches.get(stage, {})}
                for stage, p in result.stages.items()}}


# --- what a stage measured ----------------------------------------------------------------------------------


def _peak_rss() -> float | None:
    """This process's peak resident memory in bytes since the last reset (Linux's VmHWM)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextmanager
def measured_peak() -> Iterator[dict[str, float]]:
    """The block's peak memory, set in the yielded dict when it ends: `memory/peak_rss_gib`, this
    process's resident memory (its high-water mark reset at the start through /proc/self/clear_refs,
    where Linux allows it; `memory/start_rss_gib` what it was then: libraries and the process's own),
    and on a GPU `memory/peak_allocated_gib`, torch's peak allocated bytes."""
    import torch

    figures: dict[str, float] = {}
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pass
    if (start := _peak_rss()) is not None:
        figures["memory/start_rss_gib"] = start / GIB
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        yield figures
    finally:
        if (rss := _peak_rss()) is not None:
            figures["memory/peak_rss_gib"] = rss / GIB
        if torch.cuda.is_available():
            figures["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB


def with_figures(result, figures: dict[str, float]):
    """A stage's result (a `*Result` dataclass with `metrics`) with `figures` added to its metrics;
    anything else (None on the other processes) is returned as it is."""
    if not isinstance(getattr(result, "metrics", None), dict):
        return result
    return replace(result, metrics=result.metrics | figures)
