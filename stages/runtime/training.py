"""What the TRL-based stages share: Trainer arguments from our config, and metric forwarding."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import TrainerCallback

from rlhf.sections.base import LaunchConfig, TrainingConfig
from stages.common.reporting import Reporting
from stages.runtime.holding import Holding, Sharded, held_as, holding_for
from stages.runtime.lora import restore_adapters
from stages.runtime.models import resolve_precision
from stages.runtime.packing import TokenCounts

_UNLOGGED = ("epoch", "total_flos", "runtime", "per_second", "preparation_time")


class ForwardLogs(TrainerCallback):
    """Sends the Trainer's logs to `reporting.metrics`, named as the pipeline names them (`train/loss`,
    `eval/loss`), with the padding share of the batches since the last log (`perf/padding_share/train`,
    where `count_padding` counts them), and its step count to `reporting.progress`."""

    def __init__(self, reporting: Reporting):
        self.reporting = reporting
        self.counts = TokenCounts()

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
            metrics |= self.counts.shares()
            self.reporting.metrics(metrics, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.reporting.progress(state.global_step, state.max_steps)


class CountingCollator:
    """A Trainer's data collator that counts each batch's real and computed token positions: every
    `*input_ids` tensor against its `*attention_mask` (a padding-free batch, with none, is all real)."""

    def __init__(self, collator, counts: TokenCounts, phase: str = "train"):
        self.collator, self.counts, self.phase = collator, counts, phase

    def __call__(self, examples):
        batch = self.collator(examples)
        for key, ids in batch.items():
            if key.endswith("input_ids") and isinstance(ids, torch.Tensor):
                mask = batch.get(key.removesuffix("input_ids") + "attention_mask")
                self.counts.add(self.phase, float(ids.numel() if mask is None else mask.sum()), ids.numel())
        return batch


def count_padding(trainer, logs: ForwardLogs) -> None:
    """The trainer's batches counted into `logs`, which reports their padding share with each log."""
    trainer.data_collator = CountingCollator(trainer.data_collator, logs.counts)


def trained_as_held(trainer, launch: LaunchConfig
                    ) -> tuple[torch.nn.Module, Holding, list[torch.nn.Parameter], dict[str, str]]:
    """The trained model as the trainer's processes hold it (unwrapped from DDP; under FSDP2 still
    sharded, so every process takes part in what reads it), how they hold it (a sharded one is sampled
    layer by layer, never gathered whole), the parameters its optimizer updated, and the `rlhf.held_as`
    tag. Training is over: the optimizer's state is dropped."""
    from accelerate import PartialState

    state = PartialState()
    trainer.optimizer.state.clear()  # its moments are in the trainer's checkpoints; what follows needs the memory
    model = trainer.accelerator.unwrap_model(trainer.model)
    # offloaded as accelerate offloads the trained one
    holding = holding_for(trainer.accelerator, launch, "per_layer", None)
    return model, holding, [p for p in model.parameters() if p.requires_grad], held_as(model, state.num_processes)


def prepare_sharding(trainer) -> None:
    """What a TRL trainer's model needs before `train()` prepares it. Under FSDP: the LoRA adapters TRL
    put on it given their initial values on the first process (`models.restore_adapters`), and the model
    sharded here as PPO shards its models (`stages.runtime.holding.Sharded`: a unit per decoder layer, the first
    process sending each tensor as it reads it from the checkpoint, offloaded as the accelerate config's
    `fsdp_offload_params` says, under bf16 autocast reducing gradients in float32); accelerate's FSDP2
    preparation leaves a model that is already sharded as it is, and maps the optimizer onto its shards."""
    if not trainer.is_fsdp_enabled:
        return
    restore_adapters(trainer.model)
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = trainer.accelerator.state.fsdp_plugin
    offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    if offload and not torch.cuda.is_available():
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)  # pinned host memory needs an accelerator
    # Resolved on the model as loaded: accelerate resolves it again when preparing, by the layer class's
    # name, which a sharded layer's class (FSDP2's subclass) no longer has.
    plugin.set_auto_wrap_policy(trainer.model)
    autocast = torch.bfloat16 if trainer.args.bf16 else None
    Sharded(accelerator=trainer.accelerator, gather="per_layer", autocast_dtype=autocast,
            offload_trained=offload).place_trained(trainer.model)


def untrained_evaluation(trainer) -> dict[str, float]:
    """The evaluation `eval_on_start` ran before the first step (the trainer state keeps it across resumes)."""
    return next(entry for entry in trainer.state.log_history if entry.get("step") == 0 and "eval_loss" in entry)


def last_trainer_checkpoint(output_dir: Path, reporting: Reporting) -> str | None:
    """The newest complete `checkpoint-N` folder an interrupted earlier attempt left, if any. Complete:
    its `trainer_state.json`, which the trainer writes after the weights, optimizer, scheduler and random
    states, is whole JSON at step N. transformers' own `get_last_checkpoint` takes the newest folder
    whatever it holds, so a kill mid-save would make every retry fail; a newer, incomplete one is
    passed over with a warning."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    folder = output_dir / "trainer"
    found = [(int(path.name.split("-")[-1]), path) for path in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
             if path.is_dir() and path.name.split("-")[-1].isdigit()] if folder.is_dir() else []
    for step, path in sorted(found, reverse=True):
        try:
            if json.loads((path / "trainer_state.json").read_text())["global_step"] == step:
                return str(path)
            reason = "its trainer_state.json is at another step"
        except (OSError, ValueError, KeyError) as error:
            reason = f"its trainer_state.json is missing or torn ({type(error).__name__})"
        reporting.warning(f"{path} is passed over for the resume: {reason} (a kill mid-save)")
    return None


def trainer_arguments(cfg: TrainingConfig, output_dir: Path) -> dict:
    """Keyword arguments shared by TRL's SFTConfig, RewardConfig and DPOConfig. Sharded, the
    trainers keep the process state `stages.launch.local` set up (where FSDP2 is switched on for
    CPU runs too) instead of resetting it."""
    autocast_dtype = resolve_precision(cfg.precision).autocast_dtype
    sharded = {"accelerator_config": {"use_configured_state": True}} if cfg.launch.sharded else {}
    return sharded | dict(
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
