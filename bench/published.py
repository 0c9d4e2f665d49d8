"""The shapes of models people align, as their published `config.json` files state them, for
planning memory without the hub (`rlhf plan` reads only a model's config; no weights are needed).

    folder = write_config(tmp_path / "llama-3-8b", "Llama-3-8B")   # a folder `rlhf plan` can read
"""

from __future__ import annotations

import json
from pathlib import Path

_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 8192, "bos_token_id": 128000, "eos_token_id": 128001,
           "vocab_size": 128256, "tie_word_embeddings": False, "num_key_value_heads": 8}

PUBLISHED: dict[str, dict] = {
    "Qwen2.5-0.5B": _QWEN2 | {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                              "tie_word_embeddings": True},
    "Qwen2.5-1.5B": _QWEN2 | {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                              "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                              "tie_word_embeddings": True},
    "Qwen2.5-7B": _QWEN2 | {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                            "tie_word_embeddings": False},
    "Llama-3-8B": _LLAMA3 | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                             "num_attention_heads": 32},
    "Qwen2.5-14B": _QWEN2 | {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                             "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                             "tie_word_embeddings": False},
    "Llama-3-70B": _LLAMA3 | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                              "num_attention_heads": 64},
}
"""Published configs (the fields that set the shapes), by model name."""

PUBLISHED_PARAMETERS = {"Qwen2.5-0.5B": 0.494e9, "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-7B": 7.62e9, "Llama-3-8B": 8.03e9,
                        "Qwen2.5-14B": 14.7e9, "Llama-3-70B": 70.6e9}
"""Parameter counts the model cards state, to check the shapes against."""


def write_config(folder: Path, name: str) -> Path:
    """A folder holding `name`'s config.json (bfloat16 weights, as published), and nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(PUBLISHED[name] | {"torch_dtype": "bfloat16"}, indent=2))
    return folder
