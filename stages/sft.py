"""Stage 1: supervised fine-tuning on demonstrations, with TRL's `SFTTrainer`.

Plain Python: a frozen config, a base model location and validated data in; a checkpoint
folder and metrics out. The loss covers only the response tokens and the EOS that ends them:
records are encoded with `encode_replies` and handed to TRL with a completion mask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pandas as pd
from accelerate import PartialState
from transformers import PreTrainedTokenizerBase, PrinterCallback, set_seed
from trl import SFTConfig as TRLSFTConfig
from trl import SFTTrainer

from rlhf.config import SFTConfig
from schemas.adapters import last_user_message
from stages.common.reporting import Reporting
from stages.engines.sampler import HFSampler, Sampling
from stages.runtime.lora import lora_config
from stages.runtime.models import encode_replies, load_causal_lm, load_tokenizer, saved_dtype_and_tags, stop_token_ids
from stages.runtime.training import (
    ForwardLogs,
    last_trainer_checkpoint,
    prepare_sharding,
    trained_as_held,
    trainer_arguments,
    untrained_evaluation,
)


@dataclass(frozen=True)
class SFTInputs:
    model_location: str
    """The base causal LM: a local folder or a hub name."""
    train: pd.DataFrame
    """Validated (prompt, response) records."""
    evaluation: pd.DataFrame
    """Held-out records of the same contract."""


@dataclass(frozen=True)
class SFTResult:
    checkpoint: Path
    """Hugging Face folder with safetensors weights, tokenizer and generation config."""
    metrics: dict[str, float]
    """Final figures: `eval/loss`, `eval/loss_untrained`, `train/loss`, `train/steps`."""
    samples: list[dict[str, str]] = field(default_factory=list)
    """Greedy answers to held-out prompts: {prompt, response, reference}."""
    tags: dict[str, str] = field(default_factory=dict)
    """Run tags: precision (`rlhf.trainable_dtype`, `rlhf.autocast_dtype`, `rlhf.checkpoint_dtype`) and
    `rlhf.held_as`."""


def _encoded(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    prompt_ids, reply_ids = encode_replies(tokenizer, list(frame["prompt"]), list(frame["response"]))
    return datasets.Dataset.from_dict({
        "input_ids": [p + r for p, r in zip(prompt_ids, reply_ids, strict=True)],
        "completion_mask": [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, reply_ids, strict=True)],
    })


def build_trainer(cfg: SFTConfig, inputs: SFTInputs, output_dir: Path,
                  reporting: Reporting = Reporting()) -> SFTTrainer:
    """TRL's SFTTrainer set up from our config: completion-only loss, no checkpoints of its own.
    The model keeps the dropout its config sets: regularisation for supervised learning, as TRL does.
    With `cfg.lora`, TRL wraps it with LoRA adapters (peft) and trains those alone."""
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(inputs.model_location, trust_remote_code=cfg.trust_remote_code,
                               chat_template=cfg.chat_template)
    model = load_causal_lm(inputs.model_location, tokenizer, trust_remote_code=cfg.trust_remote_code)
    args = TRLSFTConfig(**trainer_arguments(cfg, output_dir), completion_only_loss=True, packing=False)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=_encoded(inputs.train, tokenizer),
        eval_dataset=_encoded(inputs.evaluation, tokenizer),
        processing_class=tokenizer,
        callbacks=[ForwardLogs(reporting)],
        peft_config=None if cfg.lora is None else lora_config(cfg.lora, "CAUSAL_LM", model),
    )
    trainer.remove_callback(PrinterCallback)  # `reporting`, not stdout, receives the logs
    prepare_sharding(trainer)
    return trainer


def train_sft(cfg: SFTConfig, inputs: SFTInputs, output_dir: Path,
              reporting: Reporting = Reporting()) -> SFTResult | None:
    """Fine-tune the base causal LM (or, with `cfg.lora`, LoRA adapters on it, merged into the saved
    checkpoint) on validated (prompt, response) records. On several processes every one trains, samples
    and takes part in saving (a sharded model needs them all); only the main one writes and returns."""
    trainer = build_trainer(cfg, inputs, output_dir, reporting)
    tokenizer = trainer.processing_class
    train_output = trainer.train(resume_from_checkpoint=last_trainer_checkpoint(output_dir))
    untrained_loss = untrained_evaluation(trainer)["eval_loss"]
    reporting.metrics({"eval/loss_untrained": untrained_loss}, 0)
    eval_loss = trainer.evaluate()["eval_loss"]
    model, holding, updated, held = trained_as_held(trainer, cfg.launch)

    picks = inputs.evaluation.head(cfg.num_samples)
    answers = []
    if len(picks):  # on every process: a sharded model needs them all
        greedy = Sampling(cfg.max_length - cfg.max_prompt_length, temperature=None, logprobs=False)
        sampler = HFSampler(model=model, tokenizer=tokenizer, stop_ids=stop_token_ids(model), holding=holding)
        answers = tokenizer.batch_decode(sampler.generate(list(picks["prompt"]), greedy).responses,
                                         skip_special_tokens=True)
    users = [last_user_message(json.loads(m)) for m in picks["prompt_messages"]]
    samples = [{"user": u, "response": a, "reference": r}
               for u, a, r in zip(users, answers, picks["response"], strict=True)]

    saved, tags = saved_dtype_and_tags(cfg, inputs.model_location, updated)
    checkpoint = output_dir / "checkpoint"
    holding.save_plain(model, tokenizer, checkpoint, saved)  # LoRA merged; sharded: a tensor at a time
    if not PartialState().is_main_process:
        return None
    metrics = {
        "eval/loss": float(eval_loss),
        "eval/loss_untrained": float(untrained_loss),
        "train/loss": float(train_output.training_loss),
        "train/steps": float(train_output.global_step),
    }
    return SFTResult(checkpoint=checkpoint, metrics=metrics, samples=samples, tags=tags | held)
