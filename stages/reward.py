"""Stage 2: a Bradley-Terry reward model on preference pairs, with TRL's `RewardTrainer`.

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)  [+ c * mean((r_c + r_r)^2)]

r is a sequence-classification model with one output, read at the last real token of
prompt + reply + EOS. After training, a gain and bias are fitted so that the SFT policy's own
responses to held-out prompts score mean 0 and standard deviation 1; they travel in the
checkpoint's config and `RewardScorer` applies them wherever the model scores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import torch
from accelerate import PartialState
from accelerate.utils import is_peft_model
from transformers import (AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase,
                          PrinterCallback, set_seed)
from trl import RewardConfig as TRLRewardConfig
from trl import RewardTrainer

from rlhf.config import RewardConfig
from schemas.validate import render_prompt
from stages.errors import RewardGateError
from stages.memory import SCORING_BATCH, Counts, with_micro_batches
from stages.holding import Holding
from stages.models import (device, disable_dropout, encode_pairs, encode_replies, fit_to_tokenizer, load_causal_lm,
                           load_pretrained, load_tokenizer, lora_config, position_ids_for, saved_dtype_and_tags,
                           stop_token_ids)
from stages.ppo_math import is_end, last_token_index
from stages.reporting import Reporting
from stages.rollout import HFSampler, Sampling
from stages.vllm_rollout import sampler_for
from stages.training import (ForwardLogs, last_trainer_checkpoint, prepare_sharding, trained_as_held, trainer_arguments,
                             untrained_evaluation)

NORMALIZATION_KEY = "rlhf_reward_normalization"
"""Model-config entry holding {"gain": g, "bias": b}: normalised score = g * raw + b."""


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """-log sigmoid(r_c - r_r - m), averaged over pairs. # (B,), (B,), (B,) or scalar -> ()"""
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected - margin).mean()


def init_reward_head(model: PreTrainedModel) -> None:
    """Score head ~ N(0, 1/sqrt(d + 1)) with zero bias, so initial rewards have unit scale."""
    head = model.score
    torch.nn.init.normal_(head.weight, mean=0.0, std=1.0 / math.sqrt(model.config.hidden_size + 1))
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)


def load_reward_model(location: str, tokenizer: PreTrainedTokenizerBase, *, dtype: torch.dtype = torch.float32,
                      trust_remote_code: bool = False, fresh_head: bool = True) -> PreTrainedModel:
    """A one-output sequence classifier in `dtype` from a causal-LM (or reward) checkpoint, dropout
    off: the two replies of a pair must be scored by the same function (TRL's default too)."""
    model = load_pretrained(AutoModelForSequenceClassification, location, dtype=dtype,
                            trust_remote_code=trust_remote_code, num_labels=1)
    fit_to_tokenizer(model, tokenizer)
    if fresh_head:
        init_reward_head(model)
    disable_dropout(model)
    return model


def _pairs(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    prompt_ids, chosen_ids, rejected_ids = encode_pairs(tokenizer, list(frame["prompt"]), list(frame["chosen"]),
                                                        list(frame["rejected"]))
    columns: dict[str, list] = {"chosen_ids": [p + c for p, c in zip(prompt_ids, chosen_ids)],
                                "rejected_ids": [p + r for p, r in zip(prompt_ids, rejected_ids)]}
    if "margin" in frame.columns:
        columns["margin"] = [float(m) for m in frame["margin"]]
    return datasets.Dataset.from_dict(columns)


class RewardScorer:
    """Scores (prompt, response) texts with a reward checkpoint, on the normalised scale.

    Prompts are conversations ([{role, content}, ...]) or plain user texts; they are rendered
    with this model's own chat template, so the policy may use a different tokenizer.

        scorer = RewardScorer.from_pretrained("path/to/checkpoint")
        scorer.score([[{"role": "user", "content": "Describe the cat."}]], ["The cat is warm."])
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, gain: float = 1.0, bias: float = 0.0):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model, self.tokenizer, self.gain, self.bias = model.eval(), tokenizer, gain, bias
        self._own_adapters = {id(m) for m in model.modules() if isinstance(m, BaseTunerLayer)}
        """Adapter layers the reward model came with (a LoRA reward model not yet merged): part of it, always on."""

    @classmethod
    def from_pretrained(cls, location: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                        place=None) -> RewardScorer:
        """`place(model)` puts the model where it runs (PPO's holding may shard it); default: this device."""
        tokenizer = load_tokenizer(str(location), trust_remote_code=trust_remote_code)
        model = load_reward_model(str(location), tokenizer, dtype=dtype, trust_remote_code=trust_remote_code,
                                  fresh_head=False)
        norm = getattr(model.config, NORMALIZATION_KEY, None) or {"gain": 1.0, "bias": 0.0}
        return cls(place(model) if place else model.to(device()), tokenizer, norm["gain"], norm["bias"])

    def encode(self, prompts: list, responses: list[str], complete: list[bool] | None = None) -> list[list[int]]:
        """Prompt + response ids; a response marked not `complete` gets no reply-end token, so a
        reply cut off at the length limit is scored as the unfinished text it is."""
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        rendered = [render_prompt(messages, self.tokenizer) for messages in conversations]
        prompt_ids, reply_ids = encode_replies(self.tokenizer, rendered, list(responses), complete)
        return [p + r for p, r in zip(prompt_ids, reply_ids, strict=True)]

    @torch.no_grad()
    def raw_scores(self, sequences: list[list[int]], batch_size: int = SCORING_BATCH) -> torch.Tensor:
        """Model outputs at the last real token of each id sequence, from the reward model as it was
        trained: any adapters on it are off while it scores. # -> (N,)"""
        scores = []
        with self.adapters_off():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start:start + batch_size]
                batch = self.tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(self.model.device)
                scores.append(last_token_scores(self.model, batch["input_ids"], batch["attention_mask"]).float().cpu())
        return torch.cat(scores) if scores else torch.empty(0)

    @contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The model without the LoRA adapters put on it after the scorer took it (PPO's `critic:
        reward-lora` trains some on this very model), each one as it was afterwards, trainable or not.
        A no-op without such adapters."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters
                  and id(m) not in self._own_adapters]
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}  # peft's switch sets requires_grad
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)
            for parameter in self.model.parameters():
                parameter.requires_grad_(id(parameter) in trainable)

    def score(self, prompts: list, responses: list[str], normalized: bool = True,
              complete: list[bool] | None = None) -> torch.Tensor:
        """Scores of (prompt, response) texts; `complete[i]` False: response i was cut off (default: all complete)."""
        raw = self.raw_scores(self.encode(prompts, responses, complete))
        return self.normalize(raw) if normalized else raw

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw model outputs on the normalised scale: gain * raw + bias."""
        return self.gain * raw + self.bias


def last_token_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head read at each row's last attended token, for left or right padding.

    Position ids count real tokens only, so a left-padded row gets the same positions as the
    unpadded sequence. # (B, T), (B, T) -> (B,)
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids_for(attention_mask)).last_hidden_state
    last = last_token_index(attention_mask)  # (B,) the rightmost real token
    return model.score(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1)


def fit_normalization(reference_scores: torch.Tensor) -> tuple[float, float]:
    """Gain and bias that map the reference scores to mean 0 and standard deviation 1."""
    mean, std = reference_scores.mean().item(), reference_scores.std().item()
    gain = 1.0 / max(std, 1e-6)
    return gain, -mean * gain


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
    sampler = sampler_for(cfg, HFSampler(policy, tokenizer, stop_ids, holding=holding), cfg.seed, log)
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
    return [(i // per_prompt, text, bool(done)) for i, (text, done) in enumerate(zip(texts, complete))]


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    """Run tags: precision (`rlhf.trainable_dtype`, `rlhf.autocast_dtype`, `rlhf.checkpoint_dtype`) and `rlhf.held_as`."""


def build_trainer(cfg: RewardConfig, inputs: RewardInputs, output_dir: Path,
                  reporting: Reporting = Reporting()) -> RewardTrainer:
    """TRL's RewardTrainer from our config, on a freshly headed one-output classifier. With
    `cfg.lora`, TRL wraps it with LoRA adapters (peft, `SEQ_CLS`): the adapters and a trained copy
    of the score head train, the body's own weights stay frozen."""
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(inputs.model_location, padding_side="right", trust_remote_code=cfg.trust_remote_code,
                               chat_template=cfg.chat_template)
    model = load_reward_model(inputs.model_location, tokenizer, trust_remote_code=cfg.trust_remote_code)
    args = TRLRewardConfig(**trainer_arguments(cfg, output_dir), center_rewards_coefficient=cfg.center_rewards_coefficient,
                           disable_dropout=True)
    trainer = RewardTrainer(model=model, args=args, train_dataset=_pairs(inputs.train, tokenizer),
                            eval_dataset=_pairs(inputs.evaluation, tokenizer), processing_class=tokenizer,
                            callbacks=[ForwardLogs(reporting)],
                            peft_config=None if cfg.lora is None else lora_config(cfg.lora, "SEQ_CLS", model))
    trainer.remove_callback(PrinterCallback)
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
    cfg = with_micro_batches("reward", cfg, Counts(reward_normalization_prompts=None if prompts is None else len(prompts)),
                             inputs.policy_location, model_location, reporting)
    trainer = build_trainer(cfg, inputs, output_dir, reporting)
    tokenizer = trainer.processing_class
    train_output = trainer.train(resume_from_checkpoint=last_trainer_checkpoint(output_dir))
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
    scores = evaluation.assign(score_chosen=(gain * chosen + bias).numpy(), score_rejected=(gain * rejected + bias).numpy())
    return RewardResult(checkpoint, metrics, scores, calibration(margins, margins > 0, cfg.calibration_buckets),
                        tags | held)
