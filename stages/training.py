"""What the TRL-based stages share: Trainer arguments from our config, and metric forwarding."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from rlhf.config import TrainingConfig
from stages.models import resolve_precision
from stages.reporting import Reporting

_UNLOGGED = ("epoch", "total_flos", "runtime", "per_second", "preparation_time")


class ForwardLogs(TrainerCallback):
    """Sends the Trainer's logs to `reporting.metrics`, named as the pipeline names them (`train/loss`,
    `eval/loss`), and its step count to `reporting.progress`."""

    def __init__(self, reporting: Reporting):
        self.reporting = reporting

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
            self.reporting.metrics(metrics, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.reporting.progress(state.global_step, state.max_steps)


def untrained_evaluation(trainer) -> dict[str, float]:
    """The evaluation `eval_on_start` ran before the first step (the trainer state keeps it across resumes)."""
    return next(entry for entry in trainer.state.log_history if entry.get("step") == 0 and "eval_loss" in entry)


def last_trainer_checkpoint(output_dir: Path) -> str | None:
    """The newest `checkpoint-N` folder an interrupted earlier attempt left, if any."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = output_dir / "trainer"
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def trainer_arguments(cfg: TrainingConfig, output_dir: Path) -> dict:
    """Keyword arguments shared by TRL's SFTConfig and RewardConfig."""
    autocast_dtype = resolve_precision(cfg.precision).autocast_dtype
    return dict(
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
        # Autocast only: the model is handed over in float32, so weights and AdamW states stay float32.
        bf16=autocast_dtype == torch.bfloat16,
        fp16=autocast_dtype == torch.float16,
        eval_strategy="steps",
        eval_steps=cfg.eval_steps,
        # The untrained model's figures, taken inside `train()`: a `trainer.evaluate()` before it
        # leaves the model unwrapped, so on several processes DDP never synchronises the gradients.
        eval_on_start=True,
        logging_steps=cfg.logging_steps,
        save_strategy="steps",
        save_steps=cfg.checkpoint_every,
        save_total_limit=1,
        report_to="none",
        disable_tqdm=True,
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_pin_memory=torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every parameter takes part in each step; saves a graph walk
    )
