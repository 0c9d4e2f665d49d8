"""The SFT stage: completion-only loss, real learning on a tiny config, a hub-shaped checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from schemas.validate import LengthBudget, load_validated
from stages.common.reporting import Reporting
from stages.sft import SFTInputs, build_trainer, train_sft
from tests.helpers import resumes_past_torn_saves


def _data(world, cfg, tokenizer, name):
    budget = LengthBudget(cfg.max_prompt_length, cfg.max_length)
    return load_validated(str(world / f"{name}.jsonl"), "sft", tokenizer=tokenizer, budget=budget).frame


def test_loss_covers_the_response_and_eos_only(world, tiny_config, tokenizer, tmp_path):
    cfg = tiny_config.sft
    train = _data(world, cfg, tokenizer, "sft")
    trainer = build_trainer(cfg, SFTInputs(str(world / "model"), train, train.head(4)), tmp_path)
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    n_prompt = len(tokenizer(train.iloc[0]["prompt"], add_special_tokens=False)["input_ids"])
    n_reply = len(tokenizer(train.iloc[0]["response"], add_special_tokens=False)["input_ids"]) + 1  # + EOS
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert ids[n_prompt + n_reply - 1] == tokenizer.eos_token_id
    assert labels[:n_prompt] == [-100] * n_prompt  # prompt masked
    assert labels[n_prompt:n_prompt + n_reply] == ids[n_prompt:n_prompt + n_reply]  # response and EOS learned
    assert all(label == -100 for label in labels[n_prompt + n_reply:])  # padding masked


def test_sft_learns_the_demo_task_and_saves_a_loadable_checkpoint(world, tiny_config, tokenizer, tmp_path):
    cfg = tiny_config.sft.model_copy(update={"max_steps": 30, "learning_rate": 3e-3})
    logged = []
    result = train_sft(cfg, SFTInputs(str(world / "model"), _data(world, cfg, tokenizer, "sft"),
                                      _data(world, cfg, tokenizer, "sft_eval")), tmp_path,
                       Reporting(metrics=lambda m, s: logged.append((s, m))))
    assert result.metrics["eval/loss"] < 0.6 * result.metrics["eval/loss_untrained"]
    assert result.metrics["train/steps"] == 30
    assert any("train/loss" in m for _, m in logged) and any("eval/loss" in m for _, m in logged)
    assert len(result.samples) == cfg.num_samples and all(s["response"] for s in result.samples)

    files = {p.name for p in result.checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    reloaded = AutoTokenizer.from_pretrained(result.checkpoint)
    assert reloaded.chat_template == tokenizer.chat_template
    assert (json.loads((result.checkpoint / "generation_config.json").read_text())["eos_token_id"]
            == tokenizer.eos_token_id)
    assert model.config.pad_token_id == tokenizer.pad_token_id


@pytest.fixture
def foreign_model(tmp_path, world):
    """A local GPT-2-style model whose tokenizer has no pad token and no chat template:
    the shape of many hub checkpoints, standing in for one here (no network)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(world / "model" / "tokenizer.json"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    folder = tmp_path / "gpt2-tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_any_local_causal_lm_works_in_place_of_the_demo_model(foreign_model, world, tiny_config, tmp_path):
    from stages.common.errors import ChatTemplateError
    from stages.runtime.models import load_tokenizer

    with pytest.raises(ChatTemplateError, match="no chat template; set the stage's `chat_template`"):
        load_tokenizer(str(foreign_model))
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer = load_tokenizer(str(foreign_model), chat_template=str(template))
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    cfg = tiny_config.sft.model_copy(update={"max_steps": 2, "model": str(foreign_model),
                                             "chat_template": str(template)})
    train = _data(world, cfg, tokenizer, "sft")
    assert (train.iloc[0]["prompt"]
            == "user: " + json.loads(train.iloc[0]["prompt_messages"])[0]["content"] + "\nassistant: ")
    result = train_sft(cfg, SFTInputs(str(foreign_model), train, train.head(4)), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)  # grew by the added pad token
    assert torch.isfinite(torch.tensor(result.metrics["eval/loss"]))
    assert load_tokenizer(str(result.checkpoint)).chat_template == template.read_text()  # carried to later stages


def test_interrupted_sft_resumes_from_its_trainer_checkpoint(world, tiny_config, tokenizer, tmp_path):
    cfg = tiny_config.sft.model_copy(update={"max_steps": 8, "checkpoint_every": 4, "logging_steps": 2})
    inputs = SFTInputs(str(world / "model"), _data(world, cfg, tokenizer, "sft"),
                       _data(world, cfg, tokenizer, "sft_eval"))
    whole = train_sft(cfg, inputs, tmp_path / "whole")

    def crash_at_step_6(metrics, step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sft(cfg, inputs, tmp_path / "cut", Reporting(metrics=crash_at_step_6))
    assert (tmp_path / "cut" / "trainer" / "checkpoint-4").is_dir()
    # and killed again, at each point of its save at step 8: each resumes from checkpoint-4
    swept, resumed, steps = resumes_past_torn_saves(
        lambda reporting: train_sft(cfg, inputs, tmp_path / "cut", reporting),
        tmp_path / "cut", tmp_path / "whole", done=4, torn=8)
    assert len(swept) >= 10, swept
    assert min(s for s, m in steps if "train/loss" in m) > 4  # training picked up after step 4
    assert resumed.metrics["eval/loss"] == pytest.approx(whole.metrics["eval/loss"], rel=1e-5)
