"""How a stage's processes hold its models: whole on each (`Replicated`: one process, or DDP)
or split between them (`Sharded`: FSDP2, `torch.distributed.fsdp.fully_shard`). PPO holds all its
models so; the TRL-driven stages (whose trainer shards the trained model) read and save it so after
training (`stages.runtime.training.trained_as_held`).

Every place where the two differ is a method here, so `train_ppo`'s rollout and update read the
same either way:

    place_trained(module)      on this device, or sharded as soon as loaded (a unit per decoder layer)
    trained(actor_critic)      DDP-wrap policy and critic together, or as is (sharded when placed)
    frozen(model)              as is, or sharded (reference, reward model)
    accumulating(module, last) DDP skips the all-reduce before the last micro-batch; FSDP2
                               reduce-scatters every micro-batch (gradients stay sharded)
    clip_grad_norm(...)        the norm over the whole model, whichever process holds which part
    release(*modules)          nothing, or every gathered unit back in its shards (FSDP2 keeps a root unit
                               gathered after a forward: its parameters then copies, not what is stepped)
    sampling(policy)           `gather: whole`: the whole policy gathered once for the rollout;
                               `per_layer`: each layer gathered at every decode step
    all_finished(finished)     sharded processes take every decode step together
    save_plain(model, ...)     the trained model as a plain Hugging Face folder: written by rank 0,
                               or gathered and written a tensor at a time (`save_streamed`)
    save / load                the full-state checkpoint: safetensors from rank 0, or
                               `torch.distributed.checkpoint`, one shard per process

Collectives: on several processes, every method that says so must be called by every process.
Passes without gradients run under `torch.no_grad`, never `torch.inference_mode`: FSDP2 gathers
parameters into tensors it keeps, and tensors made in inference mode cannot be trained afterwards.
accelerate's FSDP plugin ignores FSDP on CPU (it falls back to DDP); PPO drives `fully_shard`
itself, on the device mesh of all processes (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from accelerate import Accelerator, PartialState

if TYPE_CHECKING:
    from rlhf.sections.base import LaunchConfig

from stages.runtime.collectives import check_weights_agree
from stages.runtime.lora import merged, untied_head
from stages.runtime.models import device

Gather = Literal["whole", "per_layer"]


def decoder_layers(model: torch.nn.Module, required: bool = True) -> list[torch.nn.Module]:
    """The model's repeated blocks, by the class names transformers lists in `_no_split_modules`
    (`LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...); found through peft wrappers too. A module
    without any (a value head) has none; where they are `required`, that is an error."""
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or [])}
    # By the class hierarchy: a sharded layer's class is FSDP2's subclass of its own (`FSDPLlamaDecoderLayer`).
    layers = [module for module in model.modules() if any(c.__name__ in names for c in type(module).__mro__)]
    if required and not layers:
        raise ValueError(f"{type(model).__name__} names no decoder-layer class (`_no_split_modules`): FSDP2 has no "
                         "per-layer units to shard it into")
    return layers


@dataclass
class Replicated:
    """Every process holds whole models: one process, or DDP (through accelerate) on several.
    Without an accelerator: this process alone (evaluations, tests)."""

    accelerator: Accelerator | None = None

    def place_trained(self, module: torch.nn.Module) -> None:
        module.to(device())

    def trained(self, module: torch.nn.Module) -> torch.nn.Module:
        return module if self.accelerator is None else self.accelerator.prepare(module)  # DDP on several processes

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(device())

    def accumulating(self, module: torch.nn.Module, last: bool):
        return nullcontext() if last or self.accelerator is None else self.accelerator.no_sync(module)

    def clip_grad_norm(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm).item()

    def release(self, *modules: torch.nn.Module) -> None:
        return None  # whole models: their parameters are always the ones the optimizer steps

    @contextmanager
    def sampling(self, policy: torch.nn.Module) -> Iterator[None]:
        yield

    def all_finished(self, finished: torch.Tensor) -> bool:
        return bool(finished.all())

    def most(self, value: int) -> int:
        return value

    def check_weights_agree(self, module: torch.nn.Module) -> None:
        check_weights_agree(self.accelerator, module)

    def save_plain(self, model: torch.nn.Module, tokenizer, folder: Path, dtype: torch.dtype) -> None:
        """The main process saves `model` (a transformers model, maybe with LoRA adapters) as the plain
        model it stands for, in `dtype`: adapters merged in float32 (in place), as `Sharded.save_plain` merges."""
        from stages.runtime.models import save_checkpoint

        if self.accelerator is None or self.accelerator.is_main_process:
            save_checkpoint(merged(model.float()), tokenizer, folder, dtype)

    def save(self, folder: Path, modules: dict[str, torch.nn.Module], optimizer) -> None:
        """Rank 0 writes each module's weights and the optimizer state (the same on every process)."""
        from safetensors.torch import save_model

        if self.accelerator.is_main_process:
            for name, module in modules.items():
                save_model(module, str(folder / f"{name}.safetensors"))
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, folder: Path, modules: dict[str, torch.nn.Module], optimizer) -> None:
        from safetensors.torch import load_model

        for name, module in modules.items():
            load_model(module, str(folder / f"{name}.safetensors"))
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))


@dataclass(kw_only=True)
class Sharded:
    """FSDP2: each process holds 1/N of every model's parameters (and of the trained ones'
    gradients and optimizer state); a unit per decoder layer, gathered for its forward and
    backward only. Trained modules keep float32 parameters; under bf16 autocast the units compute
    in bf16 and reduce gradients in float32."""

    accelerator: Accelerator | PartialState
    """The processes (only which one is the first, how many, and their device are read)."""
    gather: Gather = "whole"
    """How sampling reads the policy: gathered whole once per rollout, or layer by layer at each decode step."""
    autocast_dtype: torch.dtype | None = None
    offload_trained: bool = False
    """Every model's shards in host memory, the trained ones' gradients and optimizer state too (the
    accelerate config's `fsdp_offload_params`): each unit copied to the device when gathered, the
    optimizer stepping on the CPU (FSDP2's `CPUOffloadPolicy`)."""
    offload_frozen: bool = False
    """The frozen models' shards in host memory, each unit copied to the device when gathered (`ppo.offload_frozen`)."""

    def __post_init__(self):
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.accelerator.device.type, (self.accelerator.num_processes,))

    def _mp_policy(self, trained: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if trained and self.autocast_dtype is not None:
            return MixedPrecisionPolicy(param_dtype=self.autocast_dtype, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()  # as held: float32 (or a frozen model's dtype)

    def _shard(self, model: torch.nn.Module, trained: bool, forward_method: str | None = None) -> None:
        """A unit per decoder layer (if it has any), then the rest of `model` as one unit; with
        `forward_method`, that method gathers the unit as `forward` does (a critic's `values`).
        Parameters already sharded stay in the unit that holds them: a `reward-lora` critic's
        adapters are sharded with the reward model they sit in."""
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, register_fsdp_forward_method
        from torch.distributed.tensor import DTensor

        unit = {"mesh": self.mesh, "mp_policy": self._mp_policy(trained)}
        offload = self.offload_trained or (self.offload_frozen and not trained)
        if offload:
            unit["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        held = {p for p in model.parameters() if isinstance(p, DTensor)}
        # Every process built the model on the meta device, but for what the first one computed itself
        # (a fresh head, resized embeddings, adapters): what it sends, tensor by tensor, once sharded.
        sent = dict(model.state_dict(keep_vars=True)) if self.accelerator.is_main_process else {}
        for layer in decoder_layers(model, required=forward_method is None):
            fully_shard(layer, reshard_after_forward=True, **unit)
        fully_shard(model, reshard_after_forward=False, ignored_params=held or None, **unit)
        receive_from_rank0(model, sent, skip=held)
        if offload:  # received on the device (the collectives' own); FSDP2 keeps offloaded shards on the CPU
            model._apply(lambda t: t.cpu() if isinstance(t, DTensor) else t)
        if forward_method is not None:
            register_fsdp_forward_method(model, forward_method)

    def place_trained(self, module: torch.nn.Module) -> None:
        """Shard a trained module (the policy, or a critic: gathered for `values` too) in place, as
        soon as it is built (its tensors read and sent one at a time: `receive_from_rank0`).
        The optimizer must be built after this, on the sharded parameters."""
        self._shard(module, trained=True, forward_method="values" if hasattr(module, "values") else None)

    def trained(self, module: torch.nn.Module) -> torch.nn.Module:
        """The `ActorCritic` as is: its policy and critic were sharded when placed."""
        return module

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """The reference is sharded like the policy. A reward model is read by its score head
        after its body's forward, so its body is the unit and the tiny head stays whole; adapters
        on the body (a `reward-lora` critic's, trained) are sharded with it, once."""
        head = getattr(model, "score", None)
        if head is None:
            self._shard(model, trained=False)
            return model
        broadcast_from_rank0(head)
        self._shard(model.base_model, trained=False)  # `last_token_scores` calls the body, then the head
        return model

    def accumulating(self, module: torch.nn.Module, last: bool):
        return nullcontext()  # reduce-scatter every micro-batch: gradients stay sharded

    def clip_grad_norm(self, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)  # over every shard (a DTensor reduction)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()

    def release(self, *modules: torch.nn.Module) -> None:
        """Put every gathered unit of `modules` back in its shards. FSDP2 keeps a root unit gathered after
        a forward (for the backward it expects); after a pass outside the update (the rollout's, the
        scorer's) the module's parameters are then the gathered copies, which the optimizer never steps
        and whose gradients FSDP2 moves to the shards: listed for clipping they count none, and an
        in-place change to them is lost at the next reshard. Before either, the units are released."""
        for module in modules:
            for unit in _units(module):
                unit.reshard()

    @contextmanager
    def sampling(self, policy: torch.nn.Module) -> Iterator[None]:
        """`whole`: gather every unit of the policy once, keep it gathered for all decode steps,
        and free it after; `per_layer`: FSDP2's own gathering at each step's forward."""
        if self.gather == "per_layer":
            yield
            return
        units = _units(policy)
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(unit is not policy, recurse=False)  # as `_shard` set them

    def all_finished(self, finished: torch.Tensor) -> bool:
        """Whether every process's rows have ended (collective): the per-layer gathers of a decode
        step need every process, so none may stop before the others."""
        done = finished.all().to(torch.int32).reshape(1)
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
        return bool(done.item())

    def most(self, value: int) -> int:
        """The largest of every process's `value` (collective): what they must agree on before a
        sampling call they all take part in (a round's token budget; 0: no process has an episode left)."""
        most = torch.tensor([value], dtype=torch.int64, device=device())
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most.item())

    def check_weights_agree(self, module: torch.nn.Module) -> None:
        """One copy of each parameter, split between the processes: nothing can disagree."""

    def save_plain(self, model: torch.nn.Module, tokenizer, folder: Path, dtype: torch.dtype) -> None:
        """`save_streamed`: gathered and written a tensor at a time, never whole anywhere (collective).
        Released first: a root unit an evaluation's pass left gathered holds copies in the passes' dtype."""
        self.release(model)
        save_streamed(model, tokenizer, folder, SaveFormat(dtype), self.accelerator.is_main_process)

    def save(self, folder: Path, modules: dict[str, torch.nn.Module], optimizer) -> None:
        """Each process writes its shards of every module and of the optimizer state
        (`torch.distributed.checkpoint`; collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(modules, optimizer), checkpoint_id=str(folder / "sharded"))

    def load(self, folder: Path, modules: dict[str, torch.nn.Module], optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = self._state(modules, optimizer)
        dcp.load(state, checkpoint_id=str(folder / "sharded"))
        for name, module in modules.items():
            set_model_state_dict(module, state[name])
        set_optimizer_state_dict(_Together(modules), optimizer, state["optimizer"])

    @staticmethod
    def _state(modules: dict[str, torch.nn.Module], optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {name: get_model_state_dict(module) for name, module in modules.items()}
        return state | {"optimizer": get_optimizer_state_dict(_Together(modules), optimizer)}


class _Together(torch.nn.Module):
    """The saved modules as one, so the optimizer's parameters are named the same on save and load."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


TAG_HELD_AS = "rlhf.held_as"
"""Run tag: how the trained model was held, read off its parameters (`fsdp2 x N`, `ddp x N`, `one process`)."""


def held_as(module: torch.nn.Module, num_processes: int) -> dict[str, str]:
    """`TAG_HELD_AS` for a trained module as it is held now: sharded parameters are DTensors."""
    if any(hasattr(p, "full_tensor") for p in module.parameters()):
        return {TAG_HELD_AS: f"fsdp2 x {num_processes}"}
    return {TAG_HELD_AS: f"ddp x {num_processes}" if num_processes > 1 else "one process"}


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """A small module kept whole on every process (a score head), on this process's device with rank
    0's values (collective); built on the meta device, rank 0 reads it from its checkpoint first
    (`models.materialise`) and the others give it storage to receive into."""
    from stages.runtime.models import fill_in_place, materialise

    for parameter in module.parameters():
        if parameter.is_meta and torch.distributed.get_rank() == 0:
            fill_in_place(parameter, materialise(parameter))
    if any(t.is_meta for t in module.parameters()):
        module.to_empty(device=device())
    module.to(device())
    for tensor in [*module.parameters(), *module.buffers()]:
        torch.distributed.broadcast(tensor.data, src=0)


def receive_from_rank0(model: torch.nn.Module, sent: dict[str, torch.Tensor], skip: set = frozenset()) -> None:
    """Fill a just-sharded `model`'s shards from rank 0, one tensor at a time (collective): `sent` is
    what rank 0 held of it before sharding (empty on the other processes), each tensor real or on the
    meta device marked with the checkpoint tensor it is read from (`models.load_pretrained`). Rank 0
    reads (or takes) each in turn, casts it to the shard's dtype and broadcasts it; every process keeps
    its own part. So no process ever holds more than one whole tensor of the model. Parameters in
    `skip`, sharded earlier with another model, are left as they are."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from stages.runtime.models import materialise, unfilled_memory

    # Storage for the shards (tied parameters stay one); what is real stays: buffers (rotary frequencies,
    # computed at construction) and parameters sharded with another model.
    with unfilled_memory():  # written next, by what is received
        model._apply(lambda t: torch.empty_like(t, device=device()) if t.is_meta else t)
    done = {id(p) for p in skip}
    for name, local in model.state_dict(keep_vars=True).items():
        if id(local) in done:
            continue
        done.add(id(local))
        if sent:
            whole = materialise(sent[name])
            if whole.is_meta:
                raise ValueError(f"{name} of {type(model).__name__} is neither in its checkpoint nor initialised "
                                 "on the first process: nothing to send")
            whole = whole.detach().to(device(), local.dtype)
        else:
            with unfilled_memory():
                whole = torch.empty(local.shape, dtype=local.dtype, device=device())
        torch.distributed.broadcast(whole, src=0)
        with torch.no_grad():
            if isinstance(local, DTensor):
                shape, offset = compute_local_shape_and_global_offset(whole.shape, local.device_mesh, local.placements)
                local.to_local().copy_(whole[tuple(slice(o, o + n) for n, o in zip(shape, offset, strict=True))])
            else:
                local.copy_(whole)
        del whole


SHARD_BYTES = 5 * 1024 ** 3
"""Largest safetensors file a streamed hand-off writes (above it: several files and an index, as
`save_pretrained` writes them; the hub's models are mostly split at 5 GB, transformers 5's default is
50 GB). Memory does not depend on it: tensors are written as they are gathered."""


@dataclass(frozen=True)
class SaveFormat:
    """How `save_streamed` writes a model's tensors."""

    dtype: torch.dtype
    """What its floating-point tensors are written in."""
    shard_bytes: int = SHARD_BYTES
    """The largest file written: above it, several files and an index."""
    untie: bool = False
    """Write a tied output head as its own tensor all the same (`untied_head`)."""


def plain_tensors(module: torch.nn.Module, untie: bool = False) -> list[tuple[str, torch.Size, torch.dtype,
                                                                              Callable[[], torch.Tensor]]]:
    """(name, shape, dtype, gather) for every parameter and persistent buffer of `module` (tied ones once),
    named as in the plain transformers model; `gather()` gives the whole tensor (collective when
    sharded: every process calls it, in order). A peft model's LoRA adapters are merged into the
    weights they adapt (in float32: W + scale x B A), and a trained copy (`modules_to_save`) takes the
    original's place. An output head tied to the input embeddings comes as a tensor of its own,
    last, where `untied_head` says so."""
    from peft.tuners.lora import LoraLayer

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()

    def merged_weight(layer, weight: torch.Tensor) -> Callable[[], torch.Tensor]:
        def gather() -> torch.Tensor:
            value = whole(weight).float()
            for adapter in layer.active_adapters:
                delta = whole(layer.lora_B[adapter].weight).float() @ whole(layer.lora_A[adapter].weight).float()
                value = value + (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]
            return value
        return gather

    lora = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    persistent = [(f"{prefix}.{name}" if prefix else name, buffer) for prefix, m in module.named_modules()
                  for name, buffer in m.named_buffers(recurse=False) if name not in m._non_persistent_buffers_set]
    entries = []
    for name, tensor in [*module.named_parameters(), *persistent]:
        if ".lora_" in name or ".original_module." in name:
            continue  # merged into the base weight / replaced by the trained copy
        owner, _, leaf = name.rpartition(".")
        plain = name.removeprefix("base_model.model.")
        plain = plain.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        layer = lora.get(owner.removesuffix(".base_layer")) if owner.endswith(".base_layer") else None
        if layer is not None and set(layer.lora_embedding_A):
            raise ValueError(f"{owner}: LoRA on embeddings is not merged by the streamed hand-off")
        gather = merged_weight(layer, tensor) if layer is not None and leaf == "weight" else \
            (lambda t=tensor: whole(t))
        entries.append((plain, tensor.shape, tensor.dtype, gather))
    head = untied_head(module, untie)
    if head is not None:
        name, layer = head
        weight = layer.base_layer.weight if isinstance(layer, LoraLayer) else layer.weight
        gather = merged_weight(layer, weight) if isinstance(layer, LoraLayer) else (lambda t=weight: whole(t))
        entries.append((f"{name}.weight", weight.shape, weight.dtype, gather))
    return entries


def save_streamed(module: torch.nn.Module, tokenizer, folder: Path, form: SaveFormat, main: bool) -> Path:
    """`module` (a transformers model, sharded or not, maybe with LoRA adapters) saved as the plain
    model it stands for, its floating-point tensors in `form.dtype`: safetensors files of at most
    `form.shard_bytes` and, above one, an index, as `save_pretrained` writes them; its config, generation
    config and `tokenizer` beside (collective; `main`, rank 0, writes). Each file's header is written
    first, from the shapes, then each tensor's bytes as it is gathered: no process holds more than one
    tensor of the model at a time. A tied output head is written untied (its own tensor, the config
    saying `tie_word_embeddings: false`) where `untied_head(module, form.untie)` says so."""
    from accelerate.utils import is_peft_model
    from torch.distributed.fsdp import FSDPModule

    from stages.runtime.models import finish_checkpoint

    entries = [(name, shape, form.dtype if kind.is_floating_point else kind, gather)
               for name, shape, kind, gather in plain_tensors(module, form.untie)]
    files: list[list[tuple]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry[1].numel() * entry[2].itemsize
        if files[-1] and size + nbytes > form.shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    if main:
        plain = module.get_base_model() if is_peft_model(module) else module
        folder.mkdir(parents=True, exist_ok=True)
        plain.config.architectures = [next(c.__name__ for c in type(plain).__mro__ if not issubclass(c, FSDPModule))]
        plain.config.save_pretrained(folder)
        if untied_head(module, form.untie) is not None:  # the model in memory stays tied
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}, indent=2) + "\n")
        if getattr(plain, "generation_config", None) is not None:
            plain.generation_config.save_pretrained(folder)
    for file, members in zip(names, files, strict=True):
        with open(folder / file, "wb") if main else nullcontext() as out:
            if main:
                out.write(_safetensors_header([(name, shape, kind) for name, shape, kind, _ in members]))
            for _, _, kind, gather in members:
                tensor = gather()  # every process gathers, in the same order
                if main:
                    out.write(tensor.to("cpu", kind).contiguous().view(torch.uint8).numpy().data)
    if main and len(files) > 1:
        weight_map = {name: file for file, members in zip(names, files, strict=True) for name, *_ in members}
        total = sum(shape.numel() * kind.itemsize for _, shape, kind, _ in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return finish_checkpoint(folder, tokenizer, form.dtype) if main else folder


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def _safetensors_header(entries: list[tuple[str, torch.Size, torch.dtype]]) -> bytes:
    """The head of a safetensors file whose tensors follow in `entries`' order, back to back: the
    length of the JSON header (8 bytes, little-endian), then the header, padded to 8 bytes."""
    import struct

    header, offset = {}, 0
    for name, shape, kind in entries:
        end = offset + shape.numel() * kind.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[kind], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


Holding = Replicated | Sharded


def holding_for(accelerator: Accelerator, launch: LaunchConfig, gather: Gather, autocast_dtype: torch.dtype | None,
                offload_frozen: bool = False) -> Holding:
    """`Sharded` when the stage's launch shards (FSDP2) and runs on several processes (offloading as
    its accelerate config and `offload_frozen` say), else `Replicated`."""
    if gather not in ("whole", "per_layer"):
        raise ValueError(f"sharded_sampling {gather!r} must be resolved first (stages.memory.plan.with_micro_batches)")
    if launch.sharded and accelerator.num_processes > 1:
        return Sharded(accelerator=accelerator, gather=gather, autocast_dtype=autocast_dtype,
                       offload_trained=launch.offload_params, offload_frozen=offload_frozen)
    return Replicated(accelerator)
