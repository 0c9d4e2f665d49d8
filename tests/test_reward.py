"""The reward stage: the loss on a hand-worked pair, last-token scoring, normalisation, the gate,
and scoring with a tokenizer other than the policy's."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from schemas.validate import LengthBudget, load_validated
from stages.common.reporting import Reporting
from stages.reward import RewardGateError, RewardInputs, bradley_terry_loss, calibration, train_reward
from stages.rewards.scoring import (
    NORMALIZATION_KEY,
    RewardScorer,
    fit_normalization,
    init_reward_head,
    last_token_scores,
    load_reward_model,
)
from stages.runtime.models import load_tokenizer
from tests.helpers import resumes_past_torn_saves


def test_bradley_terry_loss_and_gradient_on_a_hand_worked_pair():
    r_c = torch.tensor([2.0], requires_grad=True)
    r_r = torch.tensor([1.0], requires_grad=True)
    loss = bradley_terry_loss(r_c, r_r)
    # -log sigmoid(1) = log(1 + e^-1) = 0.313262
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    loss.backward()
    # d/dr_c = -(1 - sigmoid(1)) = -0.268941; d/dr_r = +0.268941
    assert r_c.grad.item() == pytest.approx(-(1 - 1 / (1 + math.exp(-1))), abs=1e-6)
    assert r_r.grad.item() == pytest.approx(1 - 1 / (1 + math.exp(-1)), abs=1e-6)
    # A margin of 1 asks for more: -log sigmoid(0) = log 2.
    assert (bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([1.0])).item()
            == pytest.approx(math.log(2)))


def test_reward_head_initialisation_scale():
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=32, hidden_size=256, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=4, num_labels=1))
    torch.manual_seed(0)
    init_reward_head(model)
    assert model.score.weight.std().item() == pytest.approx(1 / math.sqrt(257), rel=0.1)


def _scorer(world, side="right"):
    tokenizer = load_tokenizer(str(world / "model"), padding_side=side)
    torch.manual_seed(0)
    return RewardScorer(load_reward_model(str(world / "model"), tokenizer), tokenizer)


@pytest.mark.parametrize("side", ["left", "right"])
def test_score_is_read_at_the_last_real_token_under_either_padding(world, side):
    scorer = _scorer(world, side)
    sequences = scorer.encode(["Describe the cat.", "Describe my dog. Please."],
                              ["The cat is warm.", "The dog is kind, warm and calm."])
    padded = scorer.tokenizer.pad({"input_ids": sequences})["input_ids"][0]
    assert (padded[0] if side == "left" else padded[-1]) == scorer.tokenizer.pad_token_id
    alone = torch.stack([scorer.raw_scores([seq])[0] for seq in sequences])  # (2,) no padding at all
    together = scorer.raw_scores(sequences)  # (2,) the shorter one padded
    assert torch.allclose(alone, together, atol=1e-5)
    # ...and it is the last token that counts: appending a token changes the score.
    assert not torch.isclose(scorer.raw_scores([sequences[0] + [sequences[0][-2]]])[0], alone[0], atol=1e-5)


def test_last_token_scores_matches_the_model_own_pooling_for_right_padding(world):
    scorer = _scorer(world)
    batch = scorer.tokenizer.pad({"input_ids": scorer.encode(["Hi", "Describe the cat."],
                                                             ["Hello.", "The cat is warm."])},
                                 return_tensors="pt")
    with torch.no_grad():
        ours = last_token_scores(scorer.model, batch["input_ids"], batch["attention_mask"])
        theirs = scorer.model(**batch).logits.squeeze(-1)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_normalisation_maps_references_to_mean_zero_std_one():
    raw = torch.tensor([1.0, 3.0, 5.0, 7.0])
    gain, bias = fit_normalization(raw)
    normalized = gain * raw + bias
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert normalized.std().item() == pytest.approx(1.0, abs=1e-6)


def test_calibration_buckets_by_margin():
    margins = torch.tensor([0.1, -0.2, 0.3, 2.0, 3.0, -4.0]).numpy()
    table = calibration(margins, margins > 0, buckets=2)
    assert table["pairs"].tolist() == [3, 3]
    assert table["accuracy"].tolist() == pytest.approx([2 / 3, 2 / 3])


def _pairs(world, name, tokenizer):
    return load_validated(str(world / f"{name}.jsonl"), "preference", tokenizer=tokenizer,
                          budget=LengthBudget(32, 64)).frame


def test_reward_stage_trains_normalises_and_saves(world, tiny_config, tmp_path):
    cfg = tiny_config.reward.model_copy(update={"max_steps": 20, "num_train_epochs": 1.0})
    location = str(world / "model")
    tokenizer = load_tokenizer(location)
    prompts = load_validated(str(world / "prompts_eval.jsonl"), "prompt", tokenizer=tokenizer).frame
    result = train_reward(cfg, RewardInputs(model_location=location, policy_location=location,
                                            train=_pairs(world, "preferences", tokenizer),
                                            evaluation=_pairs(world, "preferences_eval", tokenizer),
                                            normalization_prompts=prompts), tmp_path)
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_untrained"]
    config = json.loads((result.checkpoint / "config.json").read_text())
    assert config[NORMALIZATION_KEY]["gain"] == pytest.approx(result.metrics["normalization/gain"])
    assert (result.checkpoint / "model.safetensors").exists()

    scorer = RewardScorer.from_pretrained(result.checkpoint)
    assert scorer.gain == pytest.approx(result.metrics["normalization/gain"])
    evaluation = result.eval_scores
    messages = [json.loads(m) for m in evaluation["prompt_messages"]]
    again = scorer.score(messages, list(evaluation["chosen"]))
    assert torch.allclose(again, torch.tensor(evaluation["score_chosen"].values, dtype=torch.float32), atol=1e-4)


def test_quality_gate_fails_with_measured_and_required_figures(world, tiny_config, tmp_path):
    cfg = tiny_config.reward.model_copy(update={"max_steps": 1, "min_eval_accuracy": 0.999})
    location = str(world / "model")
    tokenizer = load_tokenizer(location)
    with pytest.raises(RewardGateError, match=r"accuracy 0\.\d{3} is below the required 0\.999") as caught:
        train_reward(cfg, RewardInputs(model_location=location, policy_location=location,
                                       train=_pairs(world, "preferences", tokenizer),
                                       evaluation=_pairs(world, "preferences_eval", tokenizer),
                                       normalization_prompts=None), tmp_path)
    assert "eval/accuracy" in caught.value.metrics
    assert not (tmp_path / "checkpoint").exists()


def test_scorer_retokenises_decoded_text_with_its_own_tokenizer(world, tmp_path):
    """A reward model whose tokenizer differs from the policy's (other ids, other chat template)
    scores the same text the same way however the policy tokenised it."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(world / "model" / "tokenizer.json"))
    backend.add_special_tokens(["<extra_0>", "<extra_1>"])  # shifts nothing, but new ids exist
    other = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                    chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                                  "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(other), hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2, num_labels=1,
                                                       pad_token_id=other.pad_token_id))
    folder = tmp_path / "rm"
    model.save_pretrained(folder)
    other.save_pretrained(folder)
    scorer = RewardScorer.from_pretrained(folder)
    policy_tokenizer = load_tokenizer(str(world / "model"))
    response_ids = policy_tokenizer("The cat is warm.", add_special_tokens=False)["input_ids"]
    decoded = policy_tokenizer.decode(response_ids)
    (encoded,) = scorer.encode([[{"role": "user", "content": "Describe the cat."}]], [decoded])
    assert scorer.tokenizer.decode(encoded) == "[user] Describe the cat.\n[assistant] The cat is warm.</s>"
    direct = scorer.score(["Describe the cat."], [decoded])
    assert torch.allclose(direct, scorer.raw_scores([encoded]))
    # A reply cut off at the length limit is scored as it is: no end token is appended to it.
    (cut,) = scorer.encode([[{"role": "user", "content": "Describe the cat."}]], [decoded], complete=[False])
    assert scorer.tokenizer.decode(cut) == "[user] Describe the cat.\n[assistant] The cat is warm."
    assert torch.allclose(scorer.score(["Describe the cat."], [decoded], complete=[False]), scorer.raw_scores([cut]))


def test_interrupted_reward_training_resumes_from_its_trainer_checkpoint(world, tiny_config, tmp_path):
    cfg = tiny_config.reward.model_copy(update={"max_steps": 8, "checkpoint_every": 4, "logging_steps": 2,
                                                "eval_steps": 100})
    location = str(world / "model")
    tokenizer = load_tokenizer(location)
    prompts = load_validated(str(world / "prompts_eval.jsonl"), "prompt", tokenizer=tokenizer).frame
    inputs = RewardInputs(model_location=location, policy_location=location,
                          train=_pairs(world, "preferences", tokenizer),
                          evaluation=_pairs(world, "preferences_eval", tokenizer), normalization_prompts=prompts)
    whole = train_reward(cfg, inputs, tmp_path / "whole")

    def crash_at_step_6(metrics, step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_reward(cfg, inputs, tmp_path / "cut", Reporting(metrics=crash_at_step_6))
    assert (tmp_path / "cut" / "trainer" / "checkpoint-4").is_dir()
    # and killed again, at each point of its save at step 8: each resumes from checkpoint-4
    swept, resumed, steps = resumes_past_torn_saves(
        lambda reporting: train_reward(cfg, inputs, tmp_path / "cut", reporting),
        tmp_path / "cut", tmp_path / "whole", done=4, torn=8)
    assert len(swept) >= 10, swept
    assert min(s for s, m in steps if "train/loss" in m) > 4  # training picked up after step 4
    assert resumed.metrics["eval/loss"] == pytest.approx(whole.metrics["eval/loss"], rel=1e-5)
