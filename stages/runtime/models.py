"""Loading and saving models the same way in every stage.

One place decides how a checkpoint is read (safetensors only, remote code only when asked, in
the dtype the stage asks for, not the one it was saved in), how the tokenizer pads, which
token closes a reply, which special-token ids the model and generation configs carry, how
dropout is switched off, and in which dtype a checkpoint is written, so no two stages can
disagree about them silently."""

from __future__ import annotations

import hashlib
import json
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stages.common.errors import ChatTemplateError

# the modelling half of transformers takes seconds to import; a flow that only validates data never needs it
if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlhf.sections.base import StageSettings


def load_tokenizer(location: str, *, padding_side: str = "left", trust_remote_code: bool = False,
                   chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer at `location`, padding on `padding_side`, with a pad token distinct from EOS
    and a chat template: `chat_template` (a Jinja string or a .jinja file) when given, else its own.

    A tokenizer without a pad token gets `<pad>` added (the model's embeddings are resized
    to match in `load_causal_lm`): reusing EOS as padding would hide every real EOS from
    the loss and from the end-of-response mask. A tokenizer with neither a template nor a
    configured one is refused: every prompt is rendered with it, and guessing a format would
    train the model on text it will never be prompted with.
    """
    tokenizer = AutoTokenizer.from_pretrained(location, padding_side=padding_side, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer at {location} has no EOS token; responses could never end")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    if not tokenizer.chat_template:
        raise ChatTemplateError(
            f"the tokenizer at {location} has no chat template; set the stage's `chat_template` in the config "
            "(a Jinja template string, or the path of a .jinja file) so prompts are rendered the way the model "
            "will be prompted")
    return tokenizer


def read_chat_template(template: str) -> str:
    """A chat template given in the config: the contents of a `.jinja` file, or the template itself."""
    if template.endswith(".jinja"):
        path = Path(template)
        if not path.is_file():
            raise ChatTemplateError(f"chat template file {template} not found")
        return path.read_text()
    return template


_REPLY_ENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reply_end_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that closes an assistant reply: the special token the chat template writes right
    after the reply's text (`<|im_end|>` in ChatML, `<|eot_id|>` in Llama 3, `</s>` in Llama 2),
    else the tokenizer's EOS. SFT learns to emit it, and generation stops at it."""
    if tokenizer not in _REPLY_ENDS:
        from jinja2 import TemplateError

        marker = "Zq7xReplyEndMarker"
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hello"}, {"role": "assistant", "content": marker}], tokenize=False)
        except TemplateError:  # a template that cannot render a plain exchange has no reply end to read
            rendered = ""
        after = rendered[rendered.index(marker) + len(marker):].lstrip() if marker in rendered else ""
        following = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
        special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        _REPLY_ENDS[tokenizer] = following[0] if following and following[0] in special else tokenizer.eos_token_id
    return _REPLY_ENDS[tokenizer]


def stop_token_ids(model: PreTrainedModel) -> list[int]:
    """Every token id that ends a response (set by `fit_to_tokenizer`): generation stops at the
    first of them, and a response is complete when it holds one."""
    ids = model.generation_config.eos_token_id
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def checkpoint_dtype(location: str, *, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype a checkpoint's weights were saved in, as its config states (float32 when unstated)."""
    from transformers import AutoConfig

    dtype = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code).dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_causal_lm(location: str, tokenizer: PreTrainedTokenizerBase, *, dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """A causal LM from safetensors weights in `dtype` (float32 unless asked: a trained model's
    weights and optimizer states must not be bf16, whatever the checkpoint was saved in), its
    embeddings and special-token ids matching `tokenizer`."""
    from transformers import AutoModelForCausalLM

    model = load_pretrained(AutoModelForCausalLM, location, dtype=dtype, trust_remote_code=trust_remote_code)
    fit_to_tokenizer(model, tokenizer)
    return model


def sharded_loading() -> bool:
    """Whether this process loads models for a sharded launch (`stages.launch.local` switches FSDP's
    `cpu_ram_efficient_loading` on): every process then builds each model on the meta device, and
    the first sends the others their shards, reading the checkpoint a tensor at a time as it goes
    (`stages.runtime.holding.Sharded`)."""
    import os

    return (os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
            and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() == "true"
            and torch.distributed.is_initialized())


def reads_checkpoints() -> bool:
    """Whether this process reads model weights: every process, but under sharded loading only the first."""
    return not sharded_loading() or torch.distributed.get_rank() == 0


CHECKPOINT_TENSOR = "_rlhf_checkpoint_tensor"
"""Attribute of a meta parameter (or buffer) that the first process will read, when it is sent: the
(safetensors file, key) it comes from."""


def load_pretrained(auto_class, location: str, *, dtype: torch.dtype, trust_remote_code: bool = False, **config):
    """`auto_class.from_pretrained` from safetensors in `dtype`. Under sharded loading, the same model
    with no bytes of weights on any process: built from its config with every parameter on the meta
    device (buffers real: rotary frequencies are not sent) and the checkpoint's generation config. On
    the first process each such parameter names the checkpoint tensor it will be read from when it is
    sent (`read_checkpoint_tensor`), and the parameters the checkpoint lacks (a fresh score head) are
    real, initialised as `from_pretrained` initialises them. A checkpoint whose tensors transformers
    renames or converts on loading is read whole on the first process instead, as `from_pretrained` reads it."""
    if not sharded_loading():
        return auto_class.from_pretrained(location, use_safetensors=True, dtype=dtype,
                                          trust_remote_code=trust_remote_code, **config)
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig

    model_config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code, **config)
    with init_empty_weights(include_buffers=False), unfilled_memory():  # each parameter made on the CPU, then moved
        model = auto_class.from_config(model_config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # as `from_pretrained` ties them (the meta parameters are created untied)
    if getattr(model, "generation_config", None) is not None:
        try:
            model.generation_config = GenerationConfig.from_pretrained(location)
        except OSError:  # none saved: the one built from the model config, as `from_pretrained` keeps
            pass
    if reads_checkpoints() and not _point_at_checkpoint(model, auto_class, location, dtype, trust_remote_code, config):
        return auto_class.from_pretrained(location, use_safetensors=True, dtype=dtype,
                                          trust_remote_code=trust_remote_code, **config)
    return model


def _checkpoint_files(location: str) -> dict[str, str]:
    """Each tensor of the safetensors checkpoint at `location` (a folder, or a hub id as
    `from_pretrained` resolves it) -> the local file holding it."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    def local(name: str) -> str | None:
        return cached_file(location, name, _raise_exceptions_for_missing_entries=False)

    index = local("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = {name: local(name) for name in set(weight_map.values())}
        return {key: files[name] for key, name in weight_map.items()}
    single = local("model.safetensors")
    if single is None:
        raise FileNotFoundError(f"no safetensors weights at {location} (model.safetensors or its index)")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _point_at_checkpoint(model, auto_class, location: str, dtype: torch.dtype, trust_remote_code: bool,
                         config: dict) -> bool:
    """Mark each meta parameter of `model` (just built on the meta device) with the checkpoint tensor it
    is read from, and initialise those the checkpoint lacks as `from_pretrained` does (transformers'
    own initialisation, so a fresh head draws the same random numbers). Names are matched as
    transformers renames them. False, marking nothing, where transformers converts a tensor's values
    on loading, or would load other tensors than these names say: what only `from_pretrained` knows."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    files = _checkpoint_files(location)
    # Checkpoint names as transformers renames them on loading (legacy names such as GPT-NeoX's
    # `embed_out`, the base-model prefix); a tensor it converts (fused, split) only it can load.
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    names: dict[str, str] = {}
    for key in files:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if converted is not None:
            return False
        names[name] = key

    def stored(name: str) -> str | None:
        return names.get(name)

    aliases: dict[int, list[str]] = {}  # tied parameters: one tensor, several names
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    found = {key: next((stored(n) for n in names if stored(n)), None) for key, names in aliases.items()}
    _, info = auto_class.from_pretrained(location, use_safetensors=True, dtype=dtype, device_map={"": "meta"},
                                         output_loading_info=True, trust_remote_code=trust_remote_code, **config)
    lacking = {key for key, where in found.items()
               if where is None and isinstance(tensors[key], torch.nn.Parameter)}
    if {n for key in lacking for n in aliases[key]} - set(info["missing_keys"]):
        return False  # transformers finds these under other names
    if any(set(aliases[key]) <= set(info["missing_keys"]) for key, where in found.items() if where):
        return False  # transformers finds these elsewhere, or not at all
    for key, where in found.items():
        tensor = tensors[key]
        if where is None:
            continue
        if tensor.is_meta:
            setattr(tensor, CHECKPOINT_TENSOR, (files[where], where))
            tensor._is_hf_initialized = True  # noqa: SLF001 - transformers' own mark: initialisation skips it
        else:  # a persistent buffer, real from construction: the checkpoint's values
            with torch.no_grad():
                tensor.copy_(read_checkpoint_tensor(files[where], where))
    if lacking:
        with unfilled_memory():  # initialised next, as `from_pretrained` initialises what it did not load
            for key in lacking:
                parameter = tensors[key]
                fill_in_place(parameter, torch.empty_like(parameter, device="cpu"))
        for module in model.modules():  # a module the meta build marked as initialised is initialised again
            if any(id(p) in lacking for p in module.parameters(recurse=False)):
                module._is_hf_initialized = False
        model.initialize_weights()
    return True


def fill_in_place(parameter: torch.nn.Parameter, value: torch.Tensor) -> None:
    """A meta `parameter` made real with `value`, the same object (every module holding it, a tied
    twin included, sees it)."""
    torch.utils.swap_tensors(parameter, torch.nn.Parameter(value, parameter.requires_grad))


def read_checkpoint_tensor(file: str, key: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint, read into this process's memory (the only copy)."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return f.get_tensor(key)


def materialise(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor marked with its checkpoint tensor (`load_pretrained`), read; any other tensor as it is."""
    if tensor.is_meta and hasattr(tensor, CHECKPOINT_TENSOR):
        return read_checkpoint_tensor(*getattr(tensor, CHECKPOINT_TENSOR)).to(tensor.dtype)
    return tensor


@contextmanager
def unfilled_memory():
    """New tensors left as they are allocated while inside. Deterministic mode has torch fill every new
    tensor (`torch.empty` included) with NaN (`torch.utils.deterministic.fill_uninitialized_memory`),
    which writes, and so makes resident, every page of storage meant never to be read or written:
    a meta build's passing CPU tensors, placeholder storage. Only for such storage."""
    import torch.utils.deterministic

    before = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = before


def fit_to_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Grow the embeddings to cover tokens the tokenizer added (e.g. `<pad>`), write the
    tokenizer's pad/bos/eos ids into the model config, and make the generation config stop at
    every end token: the reply end, the tokenizer's EOS and any the checkpoint's generation
    config already lists (Llama 3 lists several)."""
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        if reads_checkpoints():  # under sharded loading, the embeddings (one tensor, or two untied) read to be resized
            weights = {id(e.weight): e.weight for e in (model.get_input_embeddings(), model.get_output_embeddings())
                       if e is not None and e.weight.is_meta}
            for weight in weights.values():
                fill_in_place(weight, materialise(weight))
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        listed = generation.eos_token_id
        listed = [] if listed is None else list(listed) if isinstance(listed, (list, tuple)) else [listed]
        stops = [reply_end_id(tokenizer), tokenizer.eos_token_id]
        stops = list(dict.fromkeys(stops + listed))
        # a lone id stays an int, as hub configs write it
        generation.eos_token_id = stops if len(stops) > 1 else stops[0]
        generation.pad_token_id = tokenizer.pad_token_id
        generation.bos_token_id = tokenizer.bos_token_id


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off in every form a transformers model uses: `nn.Dropout` modules, and the float
    probabilities that attention and decoder layers copy from their config at construction and
    pass to functional dropout in train mode (Llama/Qwen/Mistral `attention_dropout`, OPT's
    `dropout` and `layerdrop`). The config itself is left as the checkpoint wrote it."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "drop" in name.lower() and isinstance(value, float):
                setattr(module, name, 0.0)


LoRATask = Literal["CAUSAL_LM", "SEQ_CLS"]
"""What a LoRA-wrapped model is: a causal LM (SFT, DPO, PPO's policy) or a one-output sequence
classifier (the reward model), whose `score` head peft then trains whole beside the adapters."""


@dataclass(frozen=True)
class Precision:
    """How a stage computes: the dtype its optimizer updates, and the dtype autocast runs in."""

    name: str
    """`fp32`, `bf16-mixed` or `fp16-mixed`."""
    autocast_dtype: torch.dtype | None
    """None: no autocast, everything in float32 (trained weights and optimizer states are float32 in every case)."""

    def autocast(self, on: torch.device):
        return nullcontext() if self.autocast_dtype is None else torch.autocast(on.type, dtype=self.autocast_dtype)


def precision_tags(precision: Precision, trained: list[torch.nn.Parameter], saved: torch.dtype) -> dict[str, str]:
    """What every stage run is tagged with: the dtype(s) its optimizer actually updated (read from
    the trained parameters, not assumed), the autocast dtype, and the saved checkpoint's dtype."""
    updated = sorted({_dtype_name(p.dtype) for p in trained})
    return {"rlhf.trainable_dtype": ",".join(updated),
            "rlhf.autocast_dtype": ("none" if precision.autocast_dtype is None
                                    else _dtype_name(precision.autocast_dtype)),
            "rlhf.checkpoint_dtype": _dtype_name(saved)}


def resolve_precision(setting: str) -> Precision:
    """`auto` is bf16-mixed on a CUDA GPU with bf16 support and fp32 elsewhere."""
    if setting == "auto":
        setting = "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if setting == "fp16-mixed" and not torch.cuda.is_available():
        raise ValueError("precision fp16-mixed needs a CUDA GPU (its loss scaling is a GPU technique); "
                         "use fp32 or bf16-mixed on the CPU")
    return Precision(setting, {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[setting])


def frozen_dtype_of(setting: str, precision: Precision) -> torch.dtype:
    """A stage's `frozen_dtype` as it holds its frozen weights: `auto` is bf16 where the stage computes in
    bf16 (`precision: auto` on a GPU that has it), float32 where it computes in float32."""
    if setting == "auto":
        return torch.bfloat16 if precision.autocast_dtype == torch.bfloat16 else torch.float32
    return dtype_named(setting)


def rounds_to_16_bits(cfg, precision: Precision) -> bool:
    """Whether the policy's passes compute in 16 bits: under autocast, or as a LoRA policy whose own
    weights are held in bf16 (`frozen_dtype`), whatever the precision."""
    return precision.autocast_dtype is not None or (
        cfg.lora is not None and frozen_dtype_of(cfg.frozen_dtype, precision) != torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_named(name: str) -> torch.dtype:
    """`float32`, `bfloat16` or `float16` as a torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def output_dtype(setting: str, base_location: str, *, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype a stage saves its checkpoint in: `base` keeps its starting checkpoint's."""
    if setting == "base":
        return checkpoint_dtype(base_location, trust_remote_code=trust_remote_code)
    return dtype_named(setting)


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path,
                    dtype: torch.dtype | None = None) -> Path:
    """A plain Hugging Face folder: safetensors weights in `dtype` (the model's own when None),
    config stating that dtype, generation config, tokenizer. The model itself is not cast."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in model.state_dict().items()}
    model.save_pretrained(folder, safe_serialization=True, state_dict=state)
    return finish_checkpoint(folder, tokenizer, dtype)


def finish_checkpoint(folder: Path, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype) -> Path:
    """A saved model's folder completed: its config stating the dtype its weights were written in (not
    the one it was trained in), and the tokenizer."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = _dtype_name(dtype)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(folder)
    return folder


def saved_dtype_and_tags(cfg: StageSettings, base_location: str, trained: list[torch.nn.Parameter]
                         ) -> tuple[torch.dtype, dict[str, str]]:
    """The dtype a stage's final checkpoint is written in (`checkpoint_dtype`), and the run's precision tags."""
    saved = output_dtype(cfg.checkpoint_dtype, base_location, trust_remote_code=cfg.trust_remote_code)
    return saved, precision_tags(resolve_precision(cfg.precision), trained, saved)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, so left padding does not shift them. # (B, T) -> (B, T)"""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def left_padded(tokenizer: PreTrainedTokenizerBase, prompts: list[str], on: torch.device):
    """Rendered prompts as one batch padded on the left, where generation continues them.
    # -> {"input_ids": (B, Tq), "attention_mask": (B, Tq)}"""
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                     padding_side="left").to(on)


def left_padded_ids(prompts: list[list[int]], pad_id: int, on: torch.device) -> dict[str, torch.Tensor]:
    """Prompts given as token ids as one batch padded on the left, as `left_padded` pads rendered ones.
    # -> {"input_ids": (B, Tq), "attention_mask": (B, Tq)}"""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], dtype=torch.long)
    return {"input_ids": input_ids.to(on), "attention_mask": mask.to(on)}


def encode_replies(tokenizer: PreTrainedTokenizerBase, prompts: list[str], replies: list[str],
                   complete: list[bool] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of rendered prompts and of replies closed by the reply-end token, the way every
    stage sees them; a reply marked not `complete` (cut off at the length limit) is left open.

    No special tokens are added implicitly: the chat template already placed BOS and the role
    markers. A prompt is encoded on its own, so its ids are exactly what generation starts from.
    """
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return prompt_ids, encode_reply_ids(tokenizer, replies, complete)


def encode_reply_ids(tokenizer: PreTrainedTokenizerBase, replies: list[str], complete: list[bool] | None = None
                     ) -> list[list[int]]:
    """Replies' ids as `encode_replies` makes them: closed by the reply-end token unless marked not `complete`."""
    if not replies:
        return []
    end = [reply_end_id(tokenizer)]
    complete = [True] * len(replies) if complete is None else complete
    return [ids + end if closed else ids
            for ids, closed in zip(tokenizer(list(replies), add_special_tokens=False)["input_ids"], complete,
                                   strict=True)]


def encode_pairs(tokenizer: PreTrainedTokenizerBase, prompts: list[str], chosen: list[str],
                 rejected: list[str]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Preference pairs as `encode_replies` encodes them: prompt ids, chosen ids, rejected ids
    (each reply closed by the reply-end token). The reward and DPO stages train on these."""
    prompt_ids, chosen_ids = encode_replies(tokenizer, prompts, chosen)
    _, rejected_ids = encode_replies(tokenizer, prompts, rejected)
    return prompt_ids, chosen_ids, rejected_ids


def set_determinism(deterministic: bool, num_threads: int | None) -> None:
    """Deterministic kernels and a fixed CPU thread count: the conditions under which the same
    config, seed and data give identical results (on CPU; see docs/reproducibility.md)."""
    import os

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """sha256 of what decides how a fast tokenizer renders and splits text (its full backend
    definition, added tokens included, and its chat template); None for a slow tokenizer.
    Two tokenizers loaded from different folders with the same content share it."""
    if tokenizer not in _TOKENIZER_DIGESTS:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        _TOKENIZER_DIGESTS[tokenizer] = None if backend is None else hashlib.sha256(
            (backend.to_str() + "\0" + str(tokenizer.chat_template)).encode()).hexdigest()
    return _TOKENIZER_DIGESTS[tokenizer]


def folder_digest(folder: Path) -> str:
    """sha256 over a folder's relative file names and bytes: the identity of a checkpoint."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()
