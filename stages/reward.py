"""Stage 2: a Bradley-Terry reward model on preference pairs, with TRL's `RewardTrainer`.

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)  [+ c * mean((r_c + r_r)^2)]

r is a sequence-classification model with one output, read at the last real token of
prompt + reply + EOS. After training, a gain and bias are fitted so that the SFT policy's own
responses to held-out prompts score mean 0 and standard deviation 1; they travel in the
checkpoint's config and `RewardScorer` applies them wherever the model scores."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import torch
from accelerate import PartialState
from accelerate.utils import is_peft_model
from transformers import (
    PreTrainedTokenizerBase,
    PrinterCallback,
    set_seed,
)
from trl import RewardConfig as TRLRewardConfig
from trl import RewardTrainer

from rlhf.config import RewardConfig
from stages.common.errors import RewardGateError
from stages.common.reporting import Reporting
from stages.common.tensors import is_end
from stages.engines.sampler import HFSampler, Sampling
from stages.engines.vllm_server import sampler_for
from stages.memory.phases import Counts
from stages.resolved import resolved
from stages.rewards.scoring import (
    NORMALIZATION_KEY,
    RewardScorer,
    fit_normalization,
    load_reward_model,
)
from stages.runtime.holding import Holding
from stages.runtime.lora import lora_config
from stages.runtime.models import (
    encode_pairs,
    load_causal_lm,
    load_tokenizer,
    saved_dtype_and_tags,
    stop_token_ids,
)
from stages.runtime.training import (
    ForwardLogs,
    count_padding,
    last_trainer_checkpoint,
    prepare_sharding,
    trained_as_held,
    trainer_arguments,
    untrained_evaluation,
)

"""Model-config entry holding {"gain": g, "bias": b}: normalised score = g * raw + b."""


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """-log sigmoid(r_c - r_r - m), averaged over pairs. # (B,), (B,), (B,) or scalar -> ()"""
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected - margin).mean()


def _pairs(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    prompt_ids, chosen_ids, rejected_ids = encode_pairs(tokenizer, list(frame["prompt"]), list(frame["chosen"]),
                                                        list(frame["rejected"]))
    columns: dict[str, list] = {"chosen_ids": [p + c for p, c in zip(prompt_ids, chosen_ids, strict=True)],
                                "rejected_ids": [p + r for p, r in zip(prompt_ids, rejected_ids, strict=True)]}
    if "margin" in frame.columns:
        columns["margin"] = [float(m) for m in frame["margin"]]
    return datasets.Dataset.from_dict(columns)


def calibration(margins: np.ndarray, correct: np.ndarray, buckets: int) -> pd.DataFrame:
    """Accuracy by |score margin| bucket (equal counts): a calibrated model is surer where it is right."""
    order = np.argsort(np.abs(margins), kind="stable")
    rows = []
    for i, idx in enumerate(np.array_split(order, buckets)):
        if len(idx):
            rows.append({"bucket": i, "margin_low": float(np.abs(margins[idx]).min()),
                         "margin_high": float(np.abs(margins[idx]).max()), "pairs": len(idx),
                         "accuracy": float(correct[idx].mean())})
    return pd.DataFrame(rows)


@torch.no_grad()
def sample_references(cfg: RewardConfig, policy_location: str, prompts: list[str],
                      holding: Holding, log: Path) -> list[tuple[int, str, bool]]:
    """(prompt index, response, complete): `cfg.normalization_samples` responses per prompt sampled at
    temperature 1 from the policy at `policy_location` (seeded with `cfg.seed`), up to the reply
    length `cfg` allows, `cfg.normalization_micro_batch_size` sequences at a time (None: all at once);
    the policy held as `holding` holds a frozen model (sharded: read by the first process, split
    between all, and sampled by every one, layer by layer, with the same seed, so every process draws
    the same responses); with `rollout_engine: vllm` on a vLLM server instead (its log in `log`).
    `complete` is False for a response cut off without an end token."""
    tokenizer = load_tokenizer(policy_location, trust_remote_code=cfg.trust_remote_code)
    policy = holding.frozen(load_causal_lm(policy_location, tokenizer, trust_remote_code=cfg.trust_remote_code).eval())
    torch.manual_seed(cfg.seed)
    per_prompt = cfg.normalization_samples
    repeated = [p for p in prompts for _ in range(per_prompt)]  # a prompt's samples on consecutive rows
    stop_ids = stop_token_ids(policy)
    sampler = sampler_for(cfg, HFSampler(model=policy, tokenizer=tokenizer, stop_ids=stop_ids,
                                         holding=holding), cfg.seed, log,
                          cfg.launch.engine == "ray")
    sampling = Sampling(cfg.max_length - cfg.max_prompt_length, temperature=1.0, logprobs=False)
    size = cfg.normalization_micro_batch_size or max(len(repeated), 1)
    texts, complete = [], []
    try:
        for start in range(0, len(repeated), size):
            responses = sampler.generate(repeated[start:start + size], sampling).responses  # (b, T)
            texts += tokenizer.batch_decode(responses, skip_special_tokens=True)
            complete += is_end(responses, stop_ids).any(dim=1).tolist()
    finally:
        sampler.close()
    return [(i // per_prompt, text, bool(done)) for i, (text, done) in enumerate(zip(texts, complete, strict=True))]


@dataclass(kw_only=True, frozen=True)
class RewardInputs:
    model_location: str
    """Where the reward model starts: the SFT checkpoint, or a model named in the config."""
    policy_location: str
    """The SFT policy whose own responses set the score normalisation."""
    train: pd.DataFrame
    """Validated preference pairs."""
    evaluation: pd.DataFrame
    """Held-out pairs of the same contract."""
    normalization_prompts: pd.DataFrame
    """Validated prompts the policy answers for the normalisation."""


@dataclass(kw_only=True, frozen=True)
class RewardResult:
    checkpoint: Path | None
    """Hugging Face folder (safetensors, tokenizer, normalisation in config.json); None if the gate failed."""
    metrics: dict[str, float]
    """`eval/accuracy`, `eval/loss`, `eval/margin`, `eval/accuracy_untrained`, `normalization/*`."""
    eval_scores: pd.DataFrame
    """Held-out pairs with normalised `score_chosen` and `score_rejected`."""
    calibration: pd.DataFrame
    """Accuracy by margin bucket."""
    tags: dict[str, str] = field(default_factory=dict)
    """Run tags: precision (`rlhf.trainable_dtype`, `rlhf.autocast_dtype`, `rlhf.checkpoint_dtype`) and
    `rlhf.held_as`."""


def build_trainer(cfg: RewardConfig, inputs: RewardInputs, output_dir: Path,
                  reporting: Reporting = Reporting()) -> RewardTrainer:
    """TRL's RewardTrainer from our config, on a freshly headed one-output classifier. With
    `cfg.lora`, TRL wraps it with LoRA adapters (peft, `SEQ_CLS`): the adapters and a trained copy
    of the score head train, the body's own weights stay frozen."""
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(inputs.model_location, padding_side="right", trust_remote_code=cfg.trust_remote_code,
                               chat_template=cfg.chat_template)
    model = load_reward_model(inputs.model_location, tokenizer, trust_remote_code=cfg.trust_remote_code)
    args = TRLRewardConfig(**trainer_arguments(cfg, output_dir),
                           center_rewards_coefficient=cfg.center_rewards_coefficient,
                           disable_dropout=True)
    logs = ForwardLogs(reporting)
    trainer = RewardTrainer(model=model, args=args, train_dataset=_pairs(inputs.train, tokenizer),
                            eval_dataset=_pairs(inputs.evaluation, tokenizer), processing_class=tokenizer,
                            callbacks=[logs],
                            peft_config=None if cfg.lora is None else lora_config(cfg.lora, "SEQ_CLS", model))
    trainer.remove_callback(PrinterCallback)
    count_padding(trainer, logs)
    prepare_sharding(trainer)
    return trainer


def train_reward(cfg: RewardConfig, inputs: RewardInputs, output_dir: Path,
                 reporting: Reporting = Reporting()) -> RewardResult | None:
    """Train on validated pairs (with `cfg.lora`, LoRA adapters and the score head, merged into the
    saved checkpoint), evaluate on held-out pairs, normalise against the SFT policy, and save, unless
    held-out accuracy is below `cfg.min_eval_accuracy` (then `RewardGateError`, with the figures).
    On several processes every one trains, scores, samples and takes part in saving (a sharded model
    needs them all); only the main one writes and returns."""
    model_location, evaluation = inputs.model_location, inputs.evaluation
    prompts = inputs.normalization_prompts
    cfg = resolved("reward", cfg, Counts(reward_normalization_prompts=None if prompts is None else len(prompts)),
                   (inputs.policy_location, model_location), reporting)
    trainer = build_trainer(cfg, inputs, output_dir, reporting)
    tokenizer = trainer.processing_class
    train_output = trainer.train(resume_from_checkpoint=last_trainer_checkpoint(output_dir, reporting))
    untrained, final = untrained_evaluation(trainer), trainer.evaluate()
    model, holding, updated, held = trained_as_held(trainer, cfg.launch)
    main = PartialState().is_main_process

    # On every process (a sharded model needs them all); a LoRA model's adapters and score head count, unmerged.
    plain = model.get_base_model() if is_peft_model(model) else model
    scorer = RewardScorer(plain, tokenizer)
    messages = [json.loads(m) for m in evaluation["prompt_messages"]]
    chosen = scorer.score(messages, list(evaluation["chosen"]), normalized=False)
    rejected = scorer.score(messages, list(evaluation["rejected"]), normalized=False)
    margins = (chosen - rejected).numpy()
    accuracy = float((margins > 0).mean())
    metrics = {
        "eval/accuracy": accuracy,
        "eval/loss": float(final["eval_loss"]),
        "eval/margin": float(margins.mean()),
        "eval/accuracy_untrained": float(untrained["eval_accuracy"]),
        "eval/loss_untrained": float(untrained["eval_loss"]),
        "train/loss": float(train_output.training_loss),
        "train/steps": float(train_output.global_step),
    }
    if accuracy < cfg.min_eval_accuracy:
        if not main:
            return None
        raise RewardGateError(f"reward model held-out accuracy {accuracy:.3f} is below the required "
                              f"{cfg.min_eval_accuracy:.3f} (reward.min_eval_accuracy); the pipeline stops before PPO",
                              metrics)

    normalization_prompts = inputs.normalization_prompts
    prompts = list(normalization_prompts["prompt"])
    references = sample_references(cfg, inputs.policy_location, prompts, holding, output_dir / "vllm.log")
    reference_messages = [json.loads(normalization_prompts["prompt_messages"].iloc[i]) for i, _, _ in references]
    reference_scores = scorer.score(reference_messages, [text for _, text, _ in references], normalized=False,
                                    complete=[done for _, _, done in references])
    gain, bias = fit_normalization(reference_scores)
    metrics |= {"normalization/gain": gain, "normalization/bias": bias,
                "normalization/reference_mean_raw": reference_scores.mean().item(),
                "normalization/reference_std_raw": reference_scores.std().item()}

    setattr(plain.config, NORMALIZATION_KEY, {"gain": gain, "bias": bias})
    saved, tags = saved_dtype_and_tags(cfg, model_location, updated)
    checkpoint = output_dir / "checkpoint"
    holding.save_plain(model, tokenizer, checkpoint, saved)  # LoRA merged; sharded: a tensor at a time
    if not main:
        return None
    scores = evaluation.assign(score_chosen=(gain * chosen + bias).numpy(),
                               score_rejected=(gain * rejected + bias).numpy())
    return RewardResult(checkpoint=checkpoint, metrics=metrics, eval_scores=scores,
                        calibration=calibration(margins, margins > 0, cfg.calibration_buckets),
                        tags=tags | held)
