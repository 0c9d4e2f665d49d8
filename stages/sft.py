"""Stage 1: supervised fine-tuning on demonstrations, with TRL's `SFTTrainer`.

Plain Python: a frozen config, a base model location and validated data in; a checkpoint
folder and metrics out. The loss covers only the response tokens (and the EOS that ends
them); prompt tokens are masked by TRL's prompt-completion handling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pandas as pd
import torch
from transformers import PrinterCallback, TrainerCallback, set_seed
from trl import SFTConfig as TRLSFTConfig
from trl import SFTTrainer

from rlhf.config import SFTConfig
from stages.models import generate_greedy, load_causal_lm, load_tokenizer, save_checkpoint

MetricsSink = Callable[[dict[str, float], int], None]
"""Receives (metrics, step) while training; the flow forwards them to MLflow."""


@dataclass(frozen=True)
class SFTResult:
    checkpoint: Path
    """Hugging Face folder with safetensors weights, tokenizer and generation config."""
    metrics: dict[str, float]
    """Final figures: `eval/loss`, `eval/loss_untrained`, `train/loss`, `train/steps`."""
    samples: list[dict[str, str]] = field(default_factory=list)
    """Greedy answers to held-out prompts: {prompt, response, reference}."""


_UNLOGGED = ("epoch", "total_flos", "runtime", "per_second", "preparation_time")


class _ForwardLogs(TrainerCallback):
    """Sends the Trainer's logs to a sink, named as the pipeline names them (`train/loss`, `eval/loss`)."""

    def __init__(self, sink: MetricsSink):
        self.sink = sink

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = {}
        for key, value in (logs or {}).items():
            if not isinstance(value, (int, float)) or key.endswith(_UNLOGGED):
                continue
            if key.startswith("eval_"):
                metrics[f"eval/{key[5:]}"] = float(value)
            elif not key.startswith("train_"):  # the end-of-run summary repeats `train_*` aggregates
                metrics[f"train/{key}"] = float(value)
        if metrics:
            self.sink(metrics, state.global_step)


def _as_prompt_completion(frame: pd.DataFrame, eos_token: str) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "prompt": list(frame["prompt"]),
        "completion": [response + eos_token for response in frame["response"]],
    })


def build_trainer(
    cfg: SFTConfig,
    model_location: str,
    train: pd.DataFrame,
    evaluation: pd.DataFrame,
    output_dir: Path,
    sink: MetricsSink | None = None,
) -> SFTTrainer:
    """TRL's SFTTrainer set up from our config: completion-only loss, no checkpoints of its own."""
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(model_location, trust_remote_code=cfg.trust_remote_code)
    model = load_causal_lm(model_location, tokenizer, trust_remote_code=cfg.trust_remote_code)

    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    args = TRLSFTConfig(
        output_dir=str(output_dir / "trainer"),
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps or -1,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        warmup_steps=cfg.warmup_ratio,  # a float below 1 is a share of the total steps
        lr_scheduler_type=cfg.lr_scheduler_type,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        activation_checkpointing=cfg.gradient_checkpointing,
        max_length=cfg.max_length,
        completion_only_loss=True,
        packing=False,
        bf16=use_bf16,
        eval_strategy="steps",
        eval_steps=cfg.eval_steps,
        logging_steps=cfg.logging_steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataset_num_proc=None,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=_as_prompt_completion(train, tokenizer.eos_token),
        eval_dataset=_as_prompt_completion(evaluation, tokenizer.eos_token),
        processing_class=tokenizer,
        callbacks=[_ForwardLogs(sink)] if sink else None,
    )
    trainer.remove_callback(PrinterCallback)  # the sink, not stdout, receives the logs
    return trainer


def train_sft(
    cfg: SFTConfig,
    model_location: str,
    train: pd.DataFrame,
    evaluation: pd.DataFrame,
    output_dir: Path,
    sink: MetricsSink | None = None,
) -> SFTResult:
    """Fine-tune the causal LM at `model_location` on validated (prompt, response) records."""
    trainer = build_trainer(cfg, model_location, train, evaluation, output_dir, sink)
    tokenizer = trainer.processing_class
    untrained_loss = trainer.evaluate()["eval_loss"]
    if sink:
        sink({"eval/loss_untrained": untrained_loss}, 0)
    train_output = trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]

    model = trainer.model
    picks = evaluation.head(cfg.num_samples)
    answers = generate_greedy(model, tokenizer, list(picks["prompt"]), max_new_tokens=cfg.max_length - cfg.max_prompt_length)
    samples = [{"prompt": p, "response": a, "reference": r} for p, a, r in zip(picks["prompt"], answers, picks["response"])]

    checkpoint = save_checkpoint(model, tokenizer, output_dir / "checkpoint")
    metrics = {
        "eval/loss": float(eval_loss),
        "eval/loss_untrained": float(untrained_loss),
        "train/loss": float(train_output.training_loss),
        "train/steps": float(train_output.global_step),
    }
    return SFTResult(checkpoint=checkpoint, metrics=metrics, samples=samples)
