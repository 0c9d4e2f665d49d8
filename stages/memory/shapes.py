"""What the memory plan counts with: each model's shape read off its `config.json` on the meta
device (the real shapes, no weights read: a 70B config in seconds), the device a stage runs on, and the
bytes of a layer's saved activations, a forward without gradients and a KV cache.

The per-token activation figures were read off what autograd saves for a HF Llama layer
(`torch.autograd.graph.saved_tensors_hooks`): float32 4 x (8h + 2kv + 4i) bytes, bf16 autocast
32h + 4kv + 8i bytes (h hidden, kv the key/value width, i the MLP width); docs/scaling.md has how
the plan compares with measurement."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from rlhf.sections.base import LoRAConfig

GIB = 1024 ** 3
ADAM_BYTES = 8
LOGIT_COPIES = 4
RUNTIME_GIB = 0.75


# --- model shapes -------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
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
        (`stages.runtime.lora.lora_targets`; the output head with PPO's `output_layer`), in the causal LM or,
        with `classifier`, in the reward model on the same body (its score head trains whole: counted apart)."""
        from stages.runtime.lora import lora_targets

        targets = lora_targets(lora, [name for name, _, _ in self.linears], self.head_name,
                               adapt_head=getattr(lora, "output_layer", False) and not classifier)
        return sum(lora.r * (fan_in + fan_out) for name, fan_in, fan_out in self.linears
                   if any(name == target or name.endswith(f".{target}") for target in targets))


@functools.lru_cache(maxsize=32)
def model_shape(location: str, trust_remote_code: bool = False) -> ModelShape:
    """The causal LM at `location` (hub id or folder), from its config alone, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.runtime.holding import decoder_layers

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
    return ModelShape(location=location, parameters=parameters, layers=len(layers), hidden=hidden,
                      intermediate=intermediate, kv_width=kv_heads * head_size,
                      vocab=model.get_input_embeddings().num_embeddings,
                      layer_parameters=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                      outside_layers=sum(p.numel() for p in model.parameters() if id(p) not in in_layers),
                      head_parameters=own_head, linears=linears, head_name=head_name)


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
                   linears=tuple(linear for linear in policy_like.linears if linear[0] != "lm_head"))


# --- activations and caches -------------------------------------------------------------------------


def _bytes_of(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


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


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the model's largest tensor: the embeddings (or output head), or a layer's MLP matrix."""
    return max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden)
