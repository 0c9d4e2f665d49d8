"""LoRA adapters the same way in every stage: which layers they target in each model family
(`lora_targets`: all-linear, the output head by name), building them (`lora_config`, `with_lora`), keeping
and restoring their initial values (`keep_initial_adapters`, `restore_adapters`), and merging them into a
plain model (`merged`; `untied_head`: an adapted output head tied to the input embeddings, written as a
tensor of its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stages.runtime.models import CHECKPOINT_TENSOR, LoRATask, fill_in_place, reads_checkpoints

if TYPE_CHECKING:  # the modelling half of transformers takes seconds to import
    from peft import LoraConfig
    from transformers import PreTrainedModel

    from rlhf.sections.base import LoRAConfig


def lora_config(settings: LoRAConfig, task_type: LoRATask, model: torch.nn.Module) -> LoraConfig:
    """peft's `LoraConfig` for a stage's `lora` settings on `model`: every stage builds its adapters here, so
    they are the same kind everywhere (no dropout, no bias, scale alpha / r) on the same layers
    (`lora_targets`, resolved on this model). A new object per call: peft writes into the config it is
    given (`SEQ_CLS` adds the `score` head to `modules_to_save`)."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    modules = dict(model.named_modules())
    linears = [name for name, module in modules.items() if isinstance(module, (torch.nn.Linear, Conv1D))]
    own = model.get_output_embeddings() if task_type == "CAUSAL_LM" else next(
        (getattr(model, name) for name in ("score", "classifier")
         if isinstance(getattr(model, name, None), torch.nn.Module)),
        None)
    head = next((name for name, module in modules.items() if module is own), None) if own is not None else None
    adapt_head = task_type == "CAUSAL_LM" and getattr(settings, "output_layer", False)  # PPO's policy only
    targets = lora_targets(settings, linears, head, adapt_head)
    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, target_modules=targets,
                      lora_dropout=0.0, bias="none", task_type=task_type)


def lora_targets(settings: LoRAConfig, linears: list[str], head: str | None, adapt_head: bool) -> list[str]:
    """The module names a model's adapters go on, as peft matches them (a module whose name is, or ends
    with `.` and, one of these), from its linear layers' full names (`linears`) and its output head's
    name (`head`: a causal LM's output projection, a classifier's score head). `all-linear`: every
    linear layer but the head; else the names listed. The head is added when `adapt_head`. Given as
    the layers' last name parts (`q_proj`) where those pick out exactly the same layers, else whole."""
    if settings.target_modules == "all-linear":
        chosen = {name for name in linears if name != head}
    else:
        chosen = {name for name in linears if _matches_target(name, settings.target_modules)}
    if adapt_head and head is not None:
        chosen.add(head)
    short = sorted({name.rsplit(".", 1)[-1] for name in chosen})
    if {name for name in linears if _matches_target(name, short)} == chosen:
        return short
    return sorted(chosen)


def _matches_target(name: str, targets: list[str]) -> bool:
    return any(name == target or name.endswith(f".{target}") for target in targets)


def with_lora(model: PreTrainedModel, settings: LoRAConfig | None, task_type: LoRATask) -> torch.nn.Module:
    """`model` wrapped with fresh LoRA adapters as TRL's trainers wrap it when handed
    `lora_config(settings, task_type, model)` (its own weights frozen), or `model` itself when `settings`
    is None: the structure a sharded stage gathers its trained state into."""
    if settings is None:
        return model
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(settings, task_type, model))
    restore_adapters(model)
    return model


_INITIAL_ADAPTERS = "_rlhf_initial_adapters"


def keep_initial_adapters() -> None:
    """From now on in this process, every LoRA adapter peft initialises keeps a copy of its initial
    values on its layer. peft makes each adapter on the CPU, initialises it, then moves it to the device
    of the weights it adapts; under sharded loading that is the meta device, where the values are lost.
    `restore_adapters` puts them back on the first process, which sends them on: so a sharded run
    starts from the very adapters a one-process run draws. Set by `stages.launch.local` for sharded
    launches; adapters are small (r x width per adapted matrix)."""
    from peft.tuners.lora import LoraLayer

    if getattr(LoraLayer.reset_lora_parameters, "keeps_initial_values", False):
        return
    initialise = LoraLayer.reset_lora_parameters

    def initialise_and_keep(self, adapter_name, *args, **kwargs):
        initialise(self, adapter_name, *args, **kwargs)
        kept = self.__dict__.setdefault(_INITIAL_ADAPTERS, {})
        for i, parameter in enumerate(_adapter_parameters(self, adapter_name)):
            kept[adapter_name, i] = parameter.detach().clone()

    initialise_and_keep.keeps_initial_values = True
    LoraLayer.reset_lora_parameters = initialise_and_keep


def _adapter_parameters(layer, adapter_name: str) -> list[torch.nn.Parameter]:
    """The parameters of one adapter of a LoRA layer (A and B, of a linear or an embedding)."""
    found = []
    for container in (layer.lora_A, layer.lora_B, layer.lora_embedding_A, layer.lora_embedding_B):
        if adapter_name in container:
            item = container[adapter_name]
            found.extend(item.parameters() if isinstance(item, torch.nn.Module) else [item])
    return found


def restore_adapters(model: torch.nn.Module) -> None:
    """On the process that reads checkpoints, every LoRA adapter peft left on the meta device given back
    the values it was initialised with (`keep_initial_adapters`), rounded as peft rounds them. Elsewhere nothing."""
    from peft.tuners.lora import LoraLayer

    if not reads_checkpoints():
        return
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        kept = layer.__dict__.get(_INITIAL_ADAPTERS, {})
        for adapter_name in list(layer.lora_A) + list(layer.lora_embedding_A):
            for i, parameter in enumerate(_adapter_parameters(layer, adapter_name)):
                if parameter.is_meta and (adapter_name, i) in kept:
                    # As peft moved it: into the dtype of the weights it adapts, then back into its own
                    # (peft's `autocast_adapter_dtype` keeps adapters of bf16 weights in float32).
                    value = kept.pop((adapter_name, i)).to(layer.get_base_layer().weight.dtype).to(parameter.dtype)
                    fill_in_place(parameter, value)


def copied(module: torch.nn.Module) -> torch.nn.Module:
    """`copy.deepcopy(module)`, its meta parameters still marked with the checkpoint tensors they are
    read from (`load_pretrained`; deepcopy keeps no tensor attributes)."""
    import copy

    twin = copy.deepcopy(module)
    for mine, its in zip(module.state_dict(keep_vars=True).values(), twin.state_dict(keep_vars=True).values(),
                         strict=True):
        if hasattr(mine, CHECKPOINT_TENSOR):
            setattr(its, CHECKPOINT_TENSOR, getattr(mine, CHECKPOINT_TENSOR))
    return twin


def merged(model: torch.nn.Module) -> PreTrainedModel:
    """A plain transformers model: a peft model's adapters folded into the weights they adapt and
    the wrappers removed (`merge_and_unload`; a `score` head trained beside them takes the
    original's place), in place; any other model as it is. An output head with adapters that is
    tied to the input embeddings is untied first (`untied_head`), so its merge
    leaves the embeddings as they are."""
    from accelerate.utils import is_peft_model


    if not is_peft_model(model):
        return model
    if untied_head(model) is not None:
        head = model.get_base_model().get_output_embeddings()
        head.base_layer.weight = torch.nn.Parameter(head.base_layer.weight.detach().clone(), requires_grad=False)
        model.get_base_model().config.tie_word_embeddings = False
    return model.merge_and_unload()


def untied_head(module: torch.nn.Module, untie: bool = False) -> tuple[str, torch.nn.Module] | None:
    """(plain name, layer) of `module`'s output head when a hand-off writes it as its own tensor,
    though the model ties it to its input embeddings: when it carries LoRA adapters (merged, it is no
    longer the embeddings; written once as the embeddings, the adapters would be lost) or with `untie`."""
    from accelerate.utils import is_peft_model
    from peft.tuners.lora import LoraLayer

    plain = module.get_base_model() if is_peft_model(module) else module
    head, embeddings = plain.get_output_embeddings(), plain.get_input_embeddings()
    if head is None or embeddings is None:
        return None
    weight = head.base_layer.weight if isinstance(head, LoraLayer) else head.weight
    if weight is not embeddings.weight or not (untie or isinstance(head, LoraLayer)):
        return None
    return next(name for name, m in plain.named_modules() if m is head), head
