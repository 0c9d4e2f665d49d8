"""The embedded demo world: deterministic, hub-shaped, and with a gold function that means what it says."""

from __future__ import annotations

import hashlib
import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.demo.locations import DemoWorldConfig, resolve_location
from rlhf.demo.world import CHAT_TEMPLATE, build_records, build_world, gold_prefers, gold_score

# The describe world as it was before the tools task existed (issue 62): its records' and its chat
# template's digests. Its tokenizer and weights were compared byte for byte then; these keep the data.
DESCRIBE_RECORDS = {
    "default": "1b3daeab6200b32e634bbfbde4463fd9e911c1e5dfd43ea169c43caceab6ed33",
    "tiny": "50970b7e394ebbdd2b4a6ab62917389876273188e0f1a4529393fc6501f6cf46",
}
DESCRIBE_TEMPLATE = "15cdb4ee5beb3ed46b705fe9bc851861d0b35d7663da8ecb21362442c2437e06"


def test_gold_score_on_hand_worked_cases():
    prompt = "Describe the cat."
    assert gold_score(prompt, "The cat is warm and kind.") == 3.0  # 2 pleasant + right subject
    assert gold_score(prompt, "The cat is warm, warm and warm.") == 2.0  # repeats count once
    assert gold_score(prompt, "The dog is warm.") == 0.0  # pleasant, but about another subject
    assert gold_score(prompt, "The cat is cold, rude and blue.") == -1.0
    long = "The cat is " + " ".join(["big"] * 10) + "."  # 13 words: 3 over budget
    assert gold_score(prompt, long) == 1.0 - 1.5
    assert gold_prefers(prompt, "The cat is warm.", "The cat is cold.") == 1.0
    assert gold_prefers(prompt, "The cat is big.", "The cat is red.") == 0.5


def test_records_are_deterministic_and_splits_disjoint():
    cfg = DemoWorldConfig(n_sft=50, n_sft_eval=10, n_pairs=50, n_pairs_eval=10, n_prompts=20, n_prompts_eval=10)
    a, b = build_records(cfg), build_records(cfg)
    assert a == b
    assert build_records(cfg.model_copy(update={"seed": 1})) != a
    train_prompts = {r["prompt"] for r in a["prompts"]}
    assert not train_prompts & {r["prompt"] for r in a["prompts_eval"]}


def test_the_default_world_is_the_describe_world_unchanged():
    tiny = DemoWorldConfig(n_sft=64, n_sft_eval=16, n_pairs=64, n_pairs_eval=16, n_prompts=16, n_prompts_eval=8)
    for name, cfg in (("default", DemoWorldConfig()), ("tiny", tiny)):
        assert cfg.task == "describe"
        digest = hashlib.sha256(json.dumps(build_records(cfg), sort_keys=True).encode()).hexdigest()
        assert digest == DESCRIBE_RECORDS[name], name
    assert hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest() == DESCRIBE_TEMPLATE


def test_labels_are_noisy_but_mostly_agree_with_gold():
    records = build_records(DemoWorldConfig(n_pairs=2000, n_pairs_eval=0))
    agree = [gold_prefers(r["prompt"], r["chosen"], r["rejected"]) for r in records["preferences"]]
    share = sum(agree) / len(agree)
    assert 0.75 < share < 0.97, share  # realistic label noise, not a copy of the gold function


def test_world_is_saved_as_ordinary_hugging_face_folders(world, tiny_config):
    assert build_world(world.parent, tiny_config.demo) == world  # built once, then reused
    tokenizer = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", use_safetensors=True)
    ids = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert len(ids) == 3 and None not in ids
    assert tokenizer.padding_side == "left"
    assert model.config.pad_token_id == tokenizer.pad_token_id and model.config.eos_token_id == tokenizer.eos_token_id
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the cat."}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<s><|user|>Describe the cat.<|assistant|>"
    assert (world / "model" / "model.safetensors").exists()
    first = json.loads((world / "sft.jsonl").read_text().splitlines()[0])
    assert set(first) == {"prompt", "response"}


def test_same_seed_gives_identical_weights(tmp_path, tiny_config):
    a = build_world(tmp_path / "a", tiny_config.demo)
    b = build_world(tmp_path / "b", tiny_config.demo)
    assert (a / "model" / "model.safetensors").read_bytes() == (b / "model" / "model.safetensors").read_bytes()
    assert (a / "model" / "tokenizer.json").read_bytes() == (b / "model" / "tokenizer.json").read_bytes()


def test_demo_locations_resolve_into_the_world(tmp_path):
    assert resolve_location("demo:model", tmp_path) == str(tmp_path / "model")
    assert resolve_location("demo:preferences_eval", tmp_path) == str(tmp_path / "preferences_eval.jsonl")
    assert resolve_location("gpt2", tmp_path) == "gpt2"
