"""Every stage on checkpoints of real model families, not only the demo's Llama.

Each family (tests/model_families.py) is a tiny model built from config, saved in bfloat16, with
a tokenizer that follows that family's conventions: SentencePiece with BOS (Mistral), ChatML
whose turn ends before the EOS (Qwen2), several EOS ids (Llama 3), no pad token and no chat
template with learned positions and config dropout (GPT-2), config dropout (OPT), partial rotary
(Pythia). Each goes through SFT -> reward -> PPO at smoke size, and the test checks what a user
relies on: float32 training of bf16 weights, a policy ratio of exactly 1 before the first PPO
update (dropout off in every form), weights that move, replies that end where the family ends
them, checkpoints that reload with the Auto classes in the base dtype, and a final policy that
generates through `transformers.pipeline`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from schemas.validate import LengthBudget, load_validated
from tests.model_families import CHATML_TEMPLATE, FAMILIES, build_family


def _budget(folder) -> LengthBudget:
    """Token budgets inside the model's context (GPT-2's learned positions stop at 128); Llama 3's
    template writes a dated system header into every prompt, so prompts get up to 128 tokens."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    limit = min(getattr(config, "max_position_embeddings", None) or config.n_positions, 192)
    return LengthBudget(limit - 64, limit)


def _changed_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Share of the elements of tensors present in both that changed."""
    common = [name for name in before if name in after and before[name].shape == after[name].shape]
    changed = sum((before[n].float() != after[n].float()).sum().item() for n in common)
    return changed / sum(before[n].numel() for n in common)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_runs_sft_reward_ppo(name, world, tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from rlhf.config import with_overrides
    from stages.common.reporting import Reporting
    from stages.ppo import PPOInputs, train_ppo
    from stages.reward import RewardInputs, train_reward
    from stages.runtime.models import load_causal_lm, load_tokenizer, reply_end_id, stop_token_ids
    from stages.sft import SFTInputs, train_sft

    family = FAMILIES[name]
    base = build_family(name, tmp_path)
    template = None if family.has_chat_template else CHATML_TEMPLATE
    tokenizer = load_tokenizer(str(base), chat_template=template)
    budget = _budget(base)
    assert reply_end_id(tokenizer) == tokenizer.convert_tokens_to_ids(family.reply_end_token)

    def data(file, kind):
        return load_validated(str(world / f"{file}.jsonl"), kind, tokenizer=tokenizer, budget=budget).frame

    common = {"max_prompt_length": budget.max_prompt_length, "max_length": budget.max_length, "precision": "fp32",
              "max_steps": 4, "chat_template": template}
    sft = train_sft(tiny_config.sft.model_copy(update={**common, "model": str(base), "learning_rate": 1e-3}),
                    SFTInputs(str(base), data("sft", "sft"), data("sft_eval", "sft")), tmp_path / "sft")
    reward = train_reward(tiny_config.reward.model_copy(update=common),
                          RewardInputs(model_location=str(sft.checkpoint), policy_location=str(sft.checkpoint),
                                       train=data("preferences", "preference"),
                                       evaluation=data("preferences_eval", "preference"),
                                       normalization_prompts=data("prompts_eval", "prompt")),
                          tmp_path / "reward")
    ppo_cfg = with_overrides(tiny_config.ppo, {"max_prompt_length": budget.max_prompt_length,
                                               "sampling.response_length": 8, "num_iterations": 2, "precision": "fp32"})
    warnings = []
    ppo = train_ppo(ppo_cfg, PPOInputs(sft_location=str(sft.checkpoint), reward_location=str(reward.checkpoint),
                                       prompts=data("prompts", "prompt"), eval_prompts=data("prompts_eval", "prompt")),
                    tmp_path / "ppo",
                    Reporting(warning=warnings.append))

    # bf16 in, float32 trained, bf16 out
    for result in (sft, reward, ppo):
        assert {k: v for k, v in result.tags.items() if k != "rlhf.old_logprobs"} == {
            "rlhf.trainable_dtype": "float32", "rlhf.autocast_dtype": "none", "rlhf.checkpoint_dtype": "bfloat16",
            "rlhf.held_as": "one process"}
        assert json.loads((result.checkpoint / "config.json").read_text())["dtype"] == "bfloat16"
    # fp32 passes: the first batch's sampled log-probs agreed with a forward, so the run took them
    assert ppo.tags["rlhf.old_logprobs"].startswith("sampling (auto: the first batch's sampled log-probs were at"), \
        ppo.tags
    # dropout off everywhere: the update starts from the policy the rollout sampled
    deviations = [row["train/initial_ratio_deviation"] for row in ppo.history]
    assert max(deviations) <= 1e-5, deviations
    assert not any("before the first update" in w for w in warnings), warnings
    # training moved the weights (as saved, in bf16)
    base_weights = load_file(str(base / "model.safetensors"))
    sft_weights = load_file(str(sft.checkpoint / "model.safetensors"))
    assert _changed_share(base_weights, sft_weights) > 0.3
    assert _changed_share(sft_weights, load_file(str(ppo.checkpoint / "model.safetensors"))) > 0.1
    assert reward.metrics["train/steps"] == 4
    # replies end where the family ends them; generation stops at every end id
    trained_tokenizer = load_tokenizer(str(sft.checkpoint))
    assert trained_tokenizer.chat_template == (template or tokenizer.chat_template)
    policy = load_causal_lm(str(ppo.checkpoint), trained_tokenizer)
    assert stop_token_ids(policy) == list(family.expected_stop_ids(trained_tokenizer))
    # every checkpoint reloads with the Auto classes, in the dtype it was saved in
    for folder, auto in ((sft.checkpoint, AutoModelForCausalLM),
                         (reward.checkpoint, AutoModelForSequenceClassification),
                         (ppo.checkpoint, AutoModelForCausalLM)):
        assert auto.from_pretrained(folder, dtype="auto").dtype == torch.bfloat16
        assert AutoTokenizer.from_pretrained(folder).chat_template
    generator = pipeline("text-generation", model=str(ppo.checkpoint))
    out = generator([{"role": "user", "content": "Describe the cat."}], max_new_tokens=6, do_sample=False)
    assert out[0]["generated_text"][-1]["role"] == "assistant"


def test_a_model_without_a_chat_template_is_refused_before_anything_trains(world, tmp_path):
    from flows.pipeline import check_inputs
    from rlhf.config import load_config

    base = build_family("gpt2", tmp_path)
    cfg = load_config("configs/tiny.yaml", {"sft.model": str(base)})
    (report,) = check_inputs.fn(cfg, ["sft", "reward", "ppo"], str(world))
    assert report.startswith(f"sft stage: the tokenizer at {base} has no chat template; "
                             "set the stage's `chat_template`")
    budgets = {f"{stage}.max_prompt_length": 48 for stage in ("sft", "reward", "ppo")}
    budgets |= {"sft.max_length": 96, "reward.max_length": 96}  # GPT-2's BPE spells ChatML's markers in several tokens
    given = load_config("configs/tiny.yaml", {"sft.model": str(base), "sft.chat_template": CHATML_TEMPLATE, **budgets})
    assert check_inputs.fn(given, ["sft", "reward", "ppo"], str(world)) == []


@pytest.mark.parametrize("name", list(FAMILIES))
def test_sharded_loading_reads_every_family_a_tensor_at_a_time(name, tmp_path, monkeypatch):
    """The first process of a sharded launch builds each family's causal LM and classifier on the meta
    device, every weight marked with the checkpoint tensor it reads (names renamed as transformers
    renames them: GPT-NeoX's `embed_out` is `lm_head`); read back, each is the `from_pretrained` weight."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages.runtime import models

    folder = str(build_family(name, tmp_path))
    for auto, extra in ((AutoModelForCausalLM, {}), (AutoModelForSequenceClassification, {"num_labels": 1})):
        whole = auto.from_pretrained(folder, dtype=torch.float32, **extra).state_dict()
        with monkeypatch.context() as patch:
            patch.setattr(models, "sharded_loading", lambda: True)
            patch.setattr(models, "reads_checkpoints", lambda: True)
            model = models.load_pretrained(auto, folder, dtype=torch.float32, **extra)
        fresh = {"score.weight"} if extra else set()  # a classifier's head is new, made on this process
        for key, tensor in model.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.nn.Parameter) and key not in fresh:
                assert tensor.is_meta, (auto.__name__, key)  # not read while loading
            if key not in fresh:
                assert torch.equal(models.materialise(tensor), whole[key]), (auto.__name__, key)


def test_sharded_loading_resizes_embeddings_as_one_process(tmp_path, monkeypatch):
    """Llama 3 has no pad token, so its embeddings grow by one (`<pad>`), the new rows drawn from the
    old ones' mean and covariance. The first process of a sharded launch reads the embeddings (input
    and output, untied) before resizing them: the same rows, the same random numbers drawn after."""
    from stages.runtime import models

    folder = str(build_family("llama3", tmp_path))
    tokenizer = models.load_tokenizer(folder)

    def load():
        torch.manual_seed(3)
        return models.load_causal_lm(folder, tokenizer), torch.randn(4)

    one, after_one = load()
    monkeypatch.setattr(models, "sharded_loading", lambda: True)
    monkeypatch.setattr(models, "reads_checkpoints", lambda: True)
    sharded, after_sharded = load()
    from transformers import AutoConfig

    assert one.get_input_embeddings().num_embeddings == len(tokenizer) > AutoConfig.from_pretrained(folder).vocab_size
    for mine, theirs in ((sharded.get_input_embeddings(), one.get_input_embeddings()),
                         (sharded.get_output_embeddings(), one.get_output_embeddings())):
        assert not mine.weight.is_meta and torch.equal(mine.weight, theirs.weight)
    assert sharded.model.layers[0].self_attn.q_proj.weight.is_meta  # the rest is read when sent
    assert torch.equal(after_sharded, after_one)
