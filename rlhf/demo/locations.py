"""What a config needs to know of the embedded demo world, without importing the world itself
(its builder, and the gold function no stage may read): its settings and the `demo:` locations."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict


class DemoWorldConfig(BaseModel):
    """Sizes and knobs of the demo world; the seed makes it reproducible."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    seed: int = 0
    """Seeds every random choice: data, tokenizer corpus order and model initialisation."""
    task: Literal["describe", "tools", "code"] = "describe"
    """`describe` a subject; `tools`: with the adjectives a `preferences` tool tells; `code`: write f(x) (tested)."""
    n_sft: int = 2000
    """SFT demonstrations for training."""
    n_sft_eval: int = 200
    """Held-out SFT demonstrations."""
    n_pairs: int = 4000
    """Preference pairs for reward-model training."""
    n_pairs_eval: int = 400
    """Held-out preference pairs."""
    n_prompts: int = 512
    """Prompts for PPO rollouts."""
    n_prompts_eval: int = 64
    """Held-out prompts for evaluation."""
    label_temperature: float = 0.5
    """Bradley-Terry temperature of the labelling coin: P(a > b) = sigmoid((g_a - g_b) / T)."""
    off_subject_rate: float = 0.1
    """Share of demonstrations that (wrongly) talk about another subject."""
    tool_call_rate: float = 0.5
    """`task: tools`: share of demonstrations that call the tool before answering (the others guess)."""
    correct_rate: float = 0.5
    """`task: code`: share of demonstrations whose function is the one asked for (the others are off by one part)."""
    vocab_size: int = 512
    """Byte-level BPE vocabulary size."""
    hidden_size: int = 64
    """Width of the tiny Llama model."""
    intermediate_size: int = 192
    """MLP width of the tiny Llama model."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (and key/value heads)."""
    max_position_embeddings: int = 128
    """Context length."""

    def fingerprint(self) -> str:
        """Digest of the config and of the world builder's source (and its tool's): a new world whenever
        either changes."""
        source = b"".join(Path(__file__).with_name(name).read_bytes() for name in ("world.py", "tools.py", "code.py"))
        payload = json.dumps(self.model_dump(), sort_keys=True).encode() + source
        return hashlib.sha256(payload).hexdigest()[:16]


DEMO_SCHEME = "demo:"
DEMO_ARTIFACTS = ("model", "sft", "sft_eval", "preferences", "preferences_eval", "prompts", "prompts_eval")


def resolve_location(location: str, world_dir: Path | None) -> str:
    """`demo:sft` -> `<world>/sft.jsonl`, `demo:model` -> `<world>/model`; anything else unchanged."""
    if not location.startswith(DEMO_SCHEME):
        return location
    name = location[len(DEMO_SCHEME):]
    if name not in DEMO_ARTIFACTS:
        raise ValueError(f"unknown demo artifact {location!r}; known: {', '.join(DEMO_ARTIFACTS)}")
    if world_dir is None:
        raise ValueError(f"{location!r} needs the demo world, which this config does not build")
    return str(Path(world_dir) / (name if name == "model" else f"{name}.jsonl"))
