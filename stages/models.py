"""Loading and saving models the same way in every stage.

One place decides how a checkpoint is read (safetensors only, remote code only when asked),
how the tokenizer pads, and which special-token ids the model config carries, so no two
stages can disagree about them silently.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:  # the modelling half of transformers takes seconds to import; a flow that only validates data never needs it
    from transformers import PreTrainedModel


def load_tokenizer(location: str, *, padding_side: str = "left", trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer at `location`, padding on `padding_side`, with a pad token distinct from EOS.

    A tokenizer without a pad token gets `<pad>` added (the model's embeddings are resized
    to match in `load_causal_lm`): reusing EOS as padding would hide every real EOS from
    the loss and from the end-of-response mask.
    """
    tokenizer = AutoTokenizer.from_pretrained(location, padding_side=padding_side, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer at {location} has no EOS token; responses could never end")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def load_causal_lm(location: str, tokenizer: PreTrainedTokenizerBase, *, trust_remote_code: bool = False) -> PreTrainedModel:
    """A causal LM from safetensors weights, its embeddings and special-token ids matching `tokenizer`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(location, use_safetensors=True, trust_remote_code=trust_remote_code)
    fit_to_tokenizer(model, tokenizer)
    return model


def fit_to_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Grow the embeddings to cover tokens the tokenizer added (e.g. `<pad>`) and write the
    tokenizer's pad/bos/eos ids into the model and generation configs."""
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    configs = [model.config] + ([model.generation_config] if getattr(model, "generation_config", None) else [])
    for config in configs:
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """A plain Hugging Face folder: safetensors weights, config, generation config, tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, so left padding does not shift them. # (B, T) -> (B, T)"""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int,
             temperature: float | None = None, num_return_sequences: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids, their attention mask, and the new tokens: greedy when `temperature`
    is None, else sampled from the full temperature-scaled distribution (no top-k or top-p).
    # -> (B, Tq), (B, Tq), (B * num_return_sequences, T)"""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                      padding_side="left").to(model.device)
    sampling = {"do_sample": False} if temperature is None else {
        "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(**batch, **sampling, max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # (B, Tq + T)
    return batch["input_ids"], batch["attention_mask"], out[:, batch["input_ids"].shape[1]:]


def generate_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of rendered prompts, decoded without special tokens."""
    if not prompts:
        return []
    was_training = model.training
    model.eval()
    _, _, new_tokens = generate(model, tokenizer, prompts, max_new_tokens)
    model.train(was_training)
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


def encode_replies(tokenizer: PreTrainedTokenizerBase, prompts: list[str], replies: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of rendered prompts and of replies closed by EOS, the way every stage sees them.

    No special tokens are added implicitly: the chat template already placed BOS and the role
    markers. A prompt is encoded on its own, so its ids are exactly what generation starts from.
    """
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    reply_ids = [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(replies), add_special_tokens=False)["input_ids"]]
    return prompt_ids, reply_ids


def set_determinism(deterministic: bool, num_threads: int | None) -> None:
    """Deterministic kernels and a fixed CPU thread count: the conditions under which the same
    config, seed and data give identical results (on CPU; see README, Guarantees)."""
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
