"""How every stage loads and saves models: float32 training whatever the checkpoint's dtype, the
saved dtype as stated, dropout off in every form, reply ends and stop tokens from the tokenizer's
own conventions, and log-probs that do not trust `logits_to_keep`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

from stages.runtime.models import (
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
    output_dtype,
    precision_tags,
    reply_end_id,
    resolve_precision,
    save_checkpoint,
    stop_token_ids,
)


@pytest.fixture
def bf16_checkpoint(tmp_path, world):
    """The demo model's tokenizer beside a small Llama saved in bfloat16, as most hub checkpoints are."""
    tokenizer = load_tokenizer(str(world / "model"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    folder = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _saved_dtypes(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {f.get_slice(name).get_dtype() for name in f.keys()}


def test_a_bf16_checkpoint_trains_in_float32_and_is_saved_back_in_bf16(bf16_checkpoint, tmp_path):
    tokenizer = load_tokenizer(str(bf16_checkpoint))
    model = load_causal_lm(str(bf16_checkpoint), tokenizer)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    saved = output_dtype("base", str(bf16_checkpoint))
    assert saved == torch.bfloat16 and output_dtype("float32", str(bf16_checkpoint)) == torch.float32
    out = save_checkpoint(model, tokenizer, tmp_path / "out", saved)
    assert _saved_dtypes(out) == {"BF16"} and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # saving does not cast the model
    out32 = save_checkpoint(model, tokenizer, tmp_path / "out32", torch.float32)
    assert _saved_dtypes(out32) == {"F32"} and json.loads((out32 / "config.json").read_text())["dtype"] == "float32"


def test_one_small_adamw_step_moves_float32_weights_where_bf16_would_round_it_away(bf16_checkpoint):
    """Why trained weights are float32: at lr 1e-5 most bf16 weights cannot move at all."""
    tokenizer = load_tokenizer(str(bf16_checkpoint))
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_causal_lm(str(bf16_checkpoint), tokenizer, dtype=dtype)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.tensor([[1, 5, 6, 7, 8]])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        changed = sum((p.detach() != b).sum().item() for p, b in zip(model.parameters(), before, strict=True))
        moved[dtype] = changed / sum(b.numel() for b in before)
    assert moved[torch.float32] > 0.95 and moved[torch.bfloat16] < 0.5, moved


def test_precision_settings_and_tags():
    assert resolve_precision("fp32").autocast_dtype is None
    assert resolve_precision("bf16-mixed").autocast_dtype == torch.bfloat16
    assert resolve_precision("auto").name == ("bf16-mixed" if torch.cuda.is_available() else "fp32")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16-mixed needs a CUDA GPU"):
            resolve_precision("fp16-mixed")
    trained = [torch.nn.Parameter(torch.zeros(2))]
    assert precision_tags(resolve_precision("bf16-mixed"), trained, torch.bfloat16) == {
        "rlhf.trainable_dtype": "float32", "rlhf.autocast_dtype": "bfloat16", "rlhf.checkpoint_dtype": "bfloat16"}


def test_dropout_is_off_in_modules_and_in_config_probabilities():
    """OPT passes `config.dropout` and `attention_dropout` to functional dropout and skips layers
    with `layerdrop`: zeroing `nn.Dropout` modules alone leaves all three on in train mode."""
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=50, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                     num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=64,
                                     dropout=0.3, attention_dropout=0.3, layerdrop=0.5))
    ids = torch.tensor([[2, 5, 6, 7, 8, 9]])
    model.eval()
    expected = model(input_ids=ids).logits
    model.train()
    assert not torch.allclose(model(input_ids=ids).logits, expected)
    disable_dropout(model)
    for _ in range(3):
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)
    assert model.config.dropout == 0.3  # the saved config keeps the user's settings


def test_reply_end_comes_from_the_chat_template(tokenizer, world):
    from transformers import AutoTokenizer

    assert reply_end_id(tokenizer) == tokenizer.eos_token_id  # the demo template closes replies with EOS
    chatml = AutoTokenizer.from_pretrained(str(world / "model"))
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert reply_end_id(chatml) == chatml.convert_tokens_to_ids("<|im_end|>") != chatml.eos_token_id


def test_generation_stops_at_the_reply_end_the_eos_and_every_id_the_checkpoint_lists(bf16_checkpoint):
    tokenizer = load_tokenizer(str(bf16_checkpoint))
    config = json.loads((bf16_checkpoint / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, 7]  # as Llama 3 lists <|eot_id|>, <|end_of_text|>, ...
    (bf16_checkpoint / "generation_config.json").write_text(json.dumps(config))
    model = load_causal_lm(str(bf16_checkpoint), tokenizer)
    assert stop_token_ids(model) == [tokenizer.eos_token_id, 7]


def test_log_probs_do_not_trust_logits_to_keep(tiny_config, trained):
    """A model that ignores `logits_to_keep` returns every position's logits; the response's
    log-probs must still be read at the response positions."""
    from stages.common.batches import Sequences
    from stages.rl.ppo_models import load_models
    from stages.runtime.forward import forward_response

    models = load_models(tiny_config.ppo, trained["sft"], trained["reward"])

    class IgnoresLogitsToKeep(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, logits_to_keep=None, **inputs):
            return self.model(**inputs)

    queries = models.tokenizer(["<s><|user|>Describe the cat.<|assistant|>"], return_tensors="pt",
                               add_special_tokens=False)
    responses = models.tokenizer(["The cat is warm.</s>"], return_tensors="pt", add_special_tokens=False)
    sequences = Sequences(queries["input_ids"], queries["attention_mask"], responses["input_ids"],
                          responses["attention_mask"].float())
    with torch.no_grad():
        kept, kept_hidden = forward_response(models.policy, sequences, models.passes("test"), want_hidden=True)
        full, full_hidden = forward_response(IgnoresLogitsToKeep(models.policy), sequences, models.passes("test"),
                                             want_hidden=True)
    assert full.shape == kept.shape == (1, responses["input_ids"].shape[1], len(models.tokenizer))
    torch.testing.assert_close(full, kept)
    torch.testing.assert_close(full_hidden, kept_hidden)


@pytest.mark.parametrize("task", ["CAUSAL_LM", "SEQ_CLS"])
@pytest.mark.parametrize("family, targets", [("llama", ["q_proj", "v_proj"]), ("qwen2", ["q_proj", "v_proj"]),
                                             ("gpt2", ["c_attn"])])
def test_streamed_hand_off_is_the_merged_model(tmp_path, family, targets, task):
    """`holding.save_streamed` (the sharded stages' hand-off, here on one process): several files and an
    index above the size limit, LoRA adapters merged and a trained score head in place, a plain folder
    `from_pretrained` reads back equal to `merge_and_unload` of the same model."""
    from rlhf.sections.base import LoRAConfig
    from stages.rewards.scoring import load_reward_model
    from stages.runtime.holding import SaveFormat, save_streamed
    from stages.runtime.lora import merged, with_lora
    from stages.runtime.models import load_causal_lm, load_tokenizer
    from tests.model_families import build_family

    location = str(build_family(family, tmp_path))
    tokenizer = load_tokenizer(location, chat_template="{{ messages }}")
    torch.manual_seed(0)
    base = load_causal_lm(location, tokenizer) if task == "CAUSAL_LM" else load_reward_model(location, tokenizer)
    model = with_lora(base, LoRAConfig(r=4, target_modules=targets), task)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p))  # adapters that change the weights, a head unlike the original
    total = sum(p.numel() for p in merged(copy.deepcopy(model)).parameters())
    save_streamed(model, tokenizer, tmp_path / "streamed", SaveFormat(torch.float32, shard_bytes=4 * total // 3),
                  main=True)
    assert len(list((tmp_path / "streamed").glob("model-*-of-*.safetensors"))) >= 2
    assert (tmp_path / "streamed" / "model.safetensors.index.json").is_file()

    auto = AutoModelForCausalLM if task == "CAUSAL_LM" else AutoModelForSequenceClassification
    read = auto.from_pretrained(tmp_path / "streamed", use_safetensors=True)
    expected = merged(model).state_dict()
    assert set(read.state_dict()) == set(expected)
    for name, tensor in read.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    save_streamed(model, tokenizer, tmp_path / "bf16", SaveFormat(torch.bfloat16), main=True)  # one file, 16 bits
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), expected[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("streamed", [True, False])
def test_a_tied_output_head_with_adapters_is_handed_off_untied(tmp_path, streamed):
    """Qwen2 ties its output head to its input embeddings. With LoRA on the head, the merged head is
    no longer the embeddings: both hand-offs (streamed, and `merged` + `save_checkpoint`) write it as
    its own tensor, untied, and leave the embeddings as they were. Written once as the embeddings,
    the head's adapters were lost (logits 5.0 off on a tiny tied Llama)."""
    from rlhf.sections.base import LoRAConfig
    from stages.runtime.holding import SaveFormat, save_streamed
    from stages.runtime.lora import merged, with_lora
    from stages.runtime.models import load_causal_lm, load_tokenizer, save_checkpoint
    from tests.model_families import build_family

    location = str(build_family("qwen2", tmp_path))
    tokenizer = load_tokenizer(location)
    torch.manual_seed(0)
    model = with_lora(load_causal_lm(location, tokenizer), LoRAConfig(r=4, target_modules=["q_proj", "lm_head"]),
                      "CAUSAL_LM").eval()
    embeddings = model.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p))
    ids = torch.tensor([[3, 17, 42, 9, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    if streamed:
        save_streamed(model, tokenizer, tmp_path / "out", SaveFormat(torch.float32), main=True)
    else:
        save_checkpoint(merged(model), tokenizer, tmp_path / "out", torch.float32)
    read = AutoModelForCausalLM.from_pretrained(tmp_path / "out", use_safetensors=True).eval()
    assert read.config.tie_word_embeddings is False
    assert read.get_output_embeddings().weight is not read.get_input_embeddings().weight
    torch.testing.assert_close(read.get_input_embeddings().weight, embeddings, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(read(input_ids=ids).logits, want, rtol=0, atol=1e-4)


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_process_that_does_not_read_the_checkpoint_holds_no_weights_even_in_deterministic_mode(tmp_path,
                                                                                                  monkeypatch):
    """Sharded loading: the model built from its config on the meta device stays virtual. Deterministic
    mode fills every new tensor with NaN, the passing CPU tensors of a meta build included, which once
    made it resident: a whole model on every process."""
    from stages.runtime import models

    LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                vocab_size=32000).save_pretrained(tmp_path)
    monkeypatch.setattr(models, "sharded_loading", lambda: True)
    monkeypatch.setattr(models, "reads_checkpoints", lambda: False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        before = _resident_bytes()
        model = models.load_pretrained(AutoModelForCausalLM, str(tmp_path), dtype=torch.float32)
        grown = _resident_bytes() - before
    finally:
        torch.use_deterministic_algorithms(deterministic)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters()) and weights > 400 * 2**20
    assert grown < 0.1 * weights, f"{grown / 2**20:.0f} MiB resident for {weights / 2**20:.0f} MiB of weights"


def test_the_reading_process_of_a_sharded_load_makes_what_one_process_loads(tmp_path, monkeypatch):
    """Sharded loading on the first process: every weight stays on the meta device, marked with the
    checkpoint tensor it is read from when sent (a bf16 checkpoint cast to float32 a tensor at a time);
    what the checkpoint lacks (a fresh score head) and LoRA adapters are made there exactly as one
    process makes them: the same values, the same random numbers drawn."""
    from peft.tuners.lora import LoraLayer

    from rlhf.sections.base import LoRAConfig
    from stages.runtime import lora, models

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256)).to(torch.bfloat16).save_pretrained(
        tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()  # split, as hub checkpoints are

    def build():
        torch.manual_seed(1)
        model = models.load_pretrained(AutoModelForSequenceClassification, str(tmp_path), dtype=torch.float32,
                                       num_labels=1)
        return lora.with_lora(model, LoRAConfig(r=4), "SEQ_CLS"), torch.randn(4)

    (one, after_one) = build()
    monkeypatch.setattr(LoraLayer, "reset_lora_parameters", LoraLayer.reset_lora_parameters)  # restored after
    monkeypatch.setattr(models, "sharded_loading", lambda: True)
    monkeypatch.setattr(models, "reads_checkpoints", lambda: True)
    monkeypatch.setattr(lora, "reads_checkpoints", lambda: True)
    lora.keep_initial_adapters()
    (sharded, after_sharded) = build()
    assert torch.equal(after_sharded, after_one)  # the same random numbers drawn
    ones, shardeds = dict(one.named_parameters()), dict(sharded.named_parameters())
    assert ones.keys() == shardeds.keys()
    read = {name for name, p in shardeds.items() if p.is_meta}
    assert read and all(models.CHECKPOINT_TENSOR in vars(shardeds[name]) for name in read)
    assert not any("lora" in name or "score" in name for name in read)  # made on this process
    for name, parameter in shardeds.items():
        value = models.materialise(parameter)
        assert value.dtype == ones[name].dtype == torch.float32, name
        torch.testing.assert_close(value, ones[name], rtol=0, atol=0, msg=name)
