"""SFT, reward and DPO with `lora`: TRL's trainers train LoRA adapters (peft) on frozen weights,
and the stages hand over a plain Hugging Face checkpoint with the adapters merged.

What is checked, on the tiny world: only the adapters train (r * (in + out) parameters per
targeted Linear; for the reward model the score head too), the trainer's own weights stay as
loaded, the saved checkpoint has no adapter files or keys and differs from its start only in the
targeted weights, each by a matrix of rank at most r (a merged adapter), and the stage learned.
DPO's reference is the policy with its adapters disabled, not a second model. An SFT run killed
after its first trainer checkpoint resumes from the adapters it saved. Each stage on two FSDP2
processes gathers its adapters into the same plain checkpoint as one process.

Every stage starts from the demo base model (DPO too: the mechanics are the same as from an SFT
checkpoint, and no SFT run is needed first).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

from rlhf.sections.base import LaunchConfig, LoRAConfig
from stages import dpo, reward, sft
from stages.common.reporting import Reporting
from stages.launch.call import Determinism, call_stage
from stages.runtime.models import load_tokenizer
from tests.helpers import close, dataset

LORA = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"])
"""Every Linear of the demo model's decoder layers (width 64, MLP 192), so `in != out` for some."""
TARGETS = tuple(LORA.target_modules)


@pytest.fixture(scope="module")
def inputs(world, tokenizer):
    """Every stage's inputs on the tiny world, each starting from the demo base model."""
    base = str(world / "model")
    pairs, pairs_eval = dataset(world, tokenizer, "preferences"), dataset(world, tokenizer, "preferences_eval")
    prompts_eval = dataset(world, tokenizer, "prompts_eval")
    return {"sft": sft.SFTInputs(base, dataset(world, tokenizer, "sft"), dataset(world, tokenizer, "sft_eval")),
            "reward": reward.RewardInputs(model_location=base, policy_location=base, train=pairs,
                                          evaluation=pairs_eval, normalization_prompts=prompts_eval),
            "dpo": dpo.DPOInputs(base, pairs, pairs_eval, prompts_eval)}


def _config(tiny_config, stage: str, **update):
    return getattr(tiny_config, stage).model_copy(update={"lora": LORA} | update)


def _targeted(name: str) -> bool:
    """Whether a plain model's parameter belongs to a Linear that gets adapters."""
    module = name.rsplit(".", 1)[0]
    return any(module == t or module.endswith("." + t) for t in TARGETS)


def _expected_adapters(location: str) -> int:
    """r * (in + out) for each Linear the adapters target, counted on the plain model."""
    plain = AutoModelForCausalLM.from_pretrained(location, use_safetensors=True)
    return sum(LORA.r * (m.in_features + m.out_features) for name, m in plain.named_modules()
               if isinstance(m, torch.nn.Linear) and _targeted(name + ".weight"))


def _base_name(name: str) -> str:
    """A peft parameter's name in the plain model: `base_model.model.` and `.base_layer` dropped."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_only_the_adapters_train_and_the_trainers_own_weights_stay(stage, tiny_config, inputs, world, tmp_path):
    cfg = _config(tiny_config, stage, max_steps=3, eval_steps=100)
    build = {"sft": sft.build_trainer, "reward": reward.build_trainer, "dpo": dpo.build_trainer}[stage]
    trainer = build(cfg, inputs[stage], tmp_path)
    model = trainer.model
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    adapters = {n: p for n, p in trainable.items() if ".lora_A." in n or ".lora_B." in n}
    expected = _expected_adapters(str(world / "model"))
    # Per layer: 4 attention projections x 4 x (64 + 64) + 3 MLP projections x 4 x (64 + 192); 2 layers.
    assert sum(p.numel() for p in adapters.values()) == expected == 2 * (4 * 4 * 128 + 3 * 4 * 256)
    head = {n: p for n, p in trainable.items() if n not in adapters}
    if stage == "reward":  # peft's SEQ_CLS trains a copy of the one-output score head whole
        assert list(head) == ["base_model.model.score.modules_to_save.default.weight"]
        assert head[list(head)[0]].shape == (1, 64)
    else:
        assert head == {}
    # Frozen: every weight of the model itself (for the reward model, its original score head too).
    plain = AutoModelForCausalLM.from_pretrained(str(world / "model"), use_safetensors=True)
    own = {n for n, _ in plain.named_parameters() if not n.startswith("lm_head.")} | (
        {"score.weight"} if stage == "reward" else set())
    assert {_base_name(n) for n in frozen} == own

    trainer.train()
    after = dict(model.named_parameters())
    for name, before in frozen.items():
        assert torch.equal(after[name].detach(), before), name  # the model's own weights, as loaded
    for name, before in trainable.items():
        if ".lora_A." not in name:  # lora_B starts at zero; it and the score head must have moved
            assert not torch.equal(after[name].detach(), before), name
    if stage == "dpo":
        assert trainer.ref_model is None  # the reference is this model with its adapters disabled


def _merged_only_where_targeted(start: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> int:
    """Every weight the checkpoint shares with its start is unchanged, except the targeted ones,
    which each moved by a matrix of rank at most r (a merged adapter); returns how many moved."""
    moved = 0
    for name in saved.keys() & start.keys():
        delta = saved[name].float() - start[name].float()
        if not _targeted(name):
            assert torch.equal(saved[name], start[name]), name
            continue
        assert delta.abs().max() > 0, name
        assert torch.linalg.matrix_rank(delta).item() <= LORA.r, name
        moved += 1
    return moved


def _assert_plain(checkpoint: Path) -> dict[str, torch.Tensor]:
    files = {p.name for p in checkpoint.iterdir()}
    assert "model.safetensors" in files and not any(name.startswith("adapter_") for name in files)
    state = load_file(checkpoint / "model.safetensors")
    assert not any("lora" in key or "base_layer" in key or "modules_to_save" in key for key in state)
    return state


def test_sft_with_lora_learns_and_hands_over_a_plain_merged_checkpoint(tiny_config, inputs, world, tmp_path):
    cfg = _config(tiny_config, "sft", max_steps=12, learning_rate=1e-2)
    result = sft.train_sft(cfg, inputs["sft"], tmp_path)
    # The demo base model is untrained and its embeddings (the tied output layer too) stay frozen: adapters
    # alone lower its loss less than full fine-tuning does (6.14 -> 5.62 measured, 1.9 fully fine-tuned).
    assert result.metrics["eval/loss"] < 0.95 * result.metrics["eval/loss_untrained"]
    assert result.tags["rlhf.trainable_dtype"] == "float32"  # read off the adapters
    saved = _assert_plain(result.checkpoint)
    start = load_file(world / "model" / "model.safetensors")
    assert _merged_only_where_targeted(start, saved) == 14  # 7 projections in both layers
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert all(s["response"] for s in result.samples)


def test_reward_with_lora_trains_adapters_and_head_and_saves_a_plain_normalised_model(tiny_config, inputs, world,
                                                                                       tmp_path):
    cfg = _config(tiny_config, "reward", max_steps=12, learning_rate=1e-2)
    result = reward.train_reward(cfg, inputs["reward"], tmp_path)
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_untrained"]
    saved = _assert_plain(result.checkpoint)
    start = load_file(world / "model" / "model.safetensors")
    assert _merged_only_where_targeted(start, saved) == 14
    set_seed(cfg.seed)  # the stage's fresh head, drawn again
    fresh = reward.load_reward_model(str(world / "model"), load_tokenizer(str(world / "model"))).score.weight
    assert saved["score.weight"].shape == fresh.shape == (1, 64)
    assert not torch.equal(saved["score.weight"], fresh.detach())  # the head trained beside the adapters

    model = AutoModelForSequenceClassification.from_pretrained(result.checkpoint, use_safetensors=True)
    assert model.config.num_labels == 1
    scorer = reward.RewardScorer.from_pretrained(result.checkpoint)
    assert scorer.gain == pytest.approx(result.metrics["normalization/gain"])  # the normalisation in config.json
    evaluation = result.eval_scores
    again = scorer.score([json.loads(m) for m in evaluation["prompt_messages"]], list(evaluation["chosen"]))
    assert torch.allclose(again, torch.tensor(evaluation["score_chosen"].values, dtype=torch.float32), atol=1e-4)


def test_dpo_with_lora_takes_the_adapter_disabled_policy_as_its_reference(tiny_config, inputs, world, tmp_path):
    cfg = _config(tiny_config, "dpo", max_steps=8, learning_rate=1e-2)
    trainer = dpo.build_trainer(cfg, inputs["dpo"], tmp_path / "trainer")
    assert trainer.ref_model is None  # no second copy of the model
    trainer.train()
    base = str(world / "model")
    tokenizer = load_tokenizer(base)
    batch = tokenizer(["<s>Describe the cat.", "Describe my dog. Please."], return_tensors="pt", padding=True)
    reference = AutoModelForCausalLM.from_pretrained(base, use_safetensors=True).eval()
    policy = trainer.model.eval()
    with torch.no_grad():
        expected = reference(**batch).logits
        with policy.disable_adapter():
            disabled = policy(**batch).logits
        trained = policy(**batch).logits
    assert torch.allclose(disabled, expected, atol=1e-5)  # adapters off: the starting model
    assert not torch.allclose(trained, expected, atol=1e-3)  # adapters on: the trained policy

    result = dpo.train_dpo(cfg, inputs["dpo"], tmp_path / "stage")
    metrics = result.metrics
    assert metrics["eval/loss_untrained"] == pytest.approx(math.log(2), abs=1e-3)  # policy == reference at the start
    assert metrics["eval/loss"] < metrics["eval/loss_untrained"]
    assert metrics["eval/kl"] > 0
    saved = _assert_plain(result.checkpoint)
    assert _merged_only_where_targeted(load_file(world / "model" / "model.safetensors"), saved) == 14


def test_sft_with_lora_resumes_from_its_adapter_checkpoint(tiny_config, inputs, tmp_path):
    cfg = _config(tiny_config, "sft", max_steps=8, checkpoint_every=4, learning_rate=1e-2)
    whole = sft.train_sft(cfg, inputs["sft"], tmp_path / "whole")

    def crash_at_step_6(metrics, step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sft.train_sft(cfg, inputs["sft"], tmp_path / "cut", Reporting(metrics=crash_at_step_6))
    kept = tmp_path / "cut" / "trainer" / "checkpoint-4"
    assert (kept / "adapter_model.safetensors").is_file() and not (kept / "model.safetensors").exists()
    steps = []
    resumed = sft.train_sft(cfg, inputs["sft"], tmp_path / "cut",
                            Reporting(metrics=lambda metrics, step: steps.append((step, metrics))))
    assert min(s for s, m in steps if "train/loss" in m) > 4  # picked up after step 4
    assert resumed.metrics["eval/loss"] == pytest.approx(whole.metrics["eval/loss"], rel=1e-5)
    assert load_file(resumed.checkpoint / "model.safetensors").keys() == load_file(
        whole.checkpoint / "model.safetensors").keys()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_lora_sharded_matches_one_process(stage, tiny_config, inputs, world, tmp_path):
    """Two FSDP2 processes train the adapters as one process does, at the same global batch, and
    gather them (into `blank()` wrapped as the trainer wrapped it) into the same plain checkpoint."""

    train = {"sft": sft.train_sft, "reward": reward.train_reward, "dpo": dpo.train_dpo}[stage]
    one_cfg = _config(tiny_config, stage, max_steps=6, batch_size=16, learning_rate=1e-2)
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": LaunchConfig(
        num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml")})
    run = lambda cfg, folder: call_stage(train, cfg, inputs[stage], folder, Reporting(),  # noqa: E731
                                         Determinism(num_threads=2))
    one, two = run(one_cfg, tmp_path / "one"), run(two_cfg, tmp_path / "two")
    assert (one.tags["rlhf.held_as"], two.tags["rlhf.held_as"]) == ("one process", "fsdp2 x 2")
    for key in ("train/loss", "eval/loss", "eval/loss_untrained"):
        assert close(two.metrics[key], one.metrics[key]), (key, one.metrics[key], two.metrics[key])
    assert two.metrics["eval/loss"] < two.metrics["eval/loss_untrained"]
    saved = _assert_plain(two.checkpoint)
    assert _merged_only_where_targeted(load_file(world / "model" / "model.safetensors"), saved) == 14
    alone = load_file(one.checkpoint / "model.safetensors")
    assert saved.keys() == alone.keys()
    assert all(torch.allclose(saved[k], alone[k], atol=1e-4) for k in saved)
