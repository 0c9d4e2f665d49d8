"""Stage 3, the alternative to reward + PPO: direct preference optimisation with TRL's `DPOTrainer`.

    loss = -log sigmoid(beta * [(log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))])

The policy starts from the SFT checkpoint and the reference is the SFT model, frozen. Pairs are
encoded as the reward stage encodes them (`encode_pairs`: the prompt rendered with the chat
template, each reply ended by the token that ends a reply), so DPO trains on the very token
sequences the reward model would score. After training the policy is judged by PPO's own
evaluation (`stages.rl.evaluation.evaluate`, with DPO's `evaluation` and `sampling` sections): held-out
prompts, the SFT policy's responses from `evaluation.seed` as the baseline, KL to SFT per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pandas as pd
import torch
from accelerate import PartialState
from transformers import PreTrainedTokenizerBase, PrinterCallback, set_seed
from trl import DPOConfig as TRLDPOConfig
from trl import DPOTrainer

from rlhf.config import DPOConfig
from stages.common.reporting import Reporting
from stages.engines.vllm_server import sampler_for
from stages.memory.phases import Counts
from stages.resolved import resolved
from stages.rl.evaluation import HeldOut, evaluate, warn_over_kl_budget
from stages.rl.old_logprobs import by_precision
from stages.rl.ppo_models import Models
from stages.rl.rollout import policy_sampler, single_turn
from stages.runtime.holding import Holding, Sharded
from stages.runtime.lora import copied, lora_config
from stages.runtime.models import (
    device,
    disable_dropout,
    encode_pairs,
    frozen_dtype_of,
    load_causal_lm,
    load_tokenizer,
    resolve_precision,
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


@dataclass(frozen=True)
class DPOInputs:
    sft_location: str
    """The SFT checkpoint: the policy's start and its reference."""
    train: pd.DataFrame
    """Validated preference pairs."""
    evaluation: pd.DataFrame
    """Held-out pairs of the same contract (DPO's loss and implicit-reward accuracy on them)."""
    eval_prompts: pd.DataFrame
    """Validated held-out prompts for the final evaluation against the SFT policy."""


@dataclass(frozen=True)
class DPOResult:
    checkpoint: Path
    """The final policy as a plain Hugging Face folder."""
    metrics: dict[str, float]
    evaluation: pd.DataFrame
    """Held-out prompts with DPO and SFT responses and the KL of the DPO response (as PPO's)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Precision tags for the run."""


class EncodedDPOTrainer(DPOTrainer):
    """`DPOTrainer` on pairs already encoded as `prompt_ids`, `chosen_ids`, `rejected_ids`: TRL's
    own tokenisation would append the tokenizer's EOS where our chat templates end a reply with
    their own end-of-turn token, and train on sequences the SFT policy never produces."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)


def encoded_pairs(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    prompt_ids, chosen_ids, rejected_ids = encode_pairs(tokenizer, list(frame["prompt"]), list(frame["chosen"]),
                                                        list(frame["rejected"]))
    return datasets.Dataset.from_dict({"prompt_ids": prompt_ids, "chosen_ids": chosen_ids,
                                       "rejected_ids": rejected_ids})


def build_trainer(cfg: DPOConfig, inputs: DPOInputs, output_dir: Path,
                  reporting: Reporting = Reporting()) -> DPOTrainer:
    """TRL's DPOTrainer from our config. The reference is a frozen copy of the SFT model as loaded
    (embeddings resized as the policy's; under FSDP sharded as soon as made, for TRL's own would be read
    whole on every process); with `cfg.lora`, TRL wraps the policy with LoRA adapters (float32, on
    weights held in `cfg.frozen_dtype`) and the reference is the same model with its adapters
    disabled (no copy: `trainer.ref_model` is None)."""
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(inputs.sft_location, trust_remote_code=cfg.trust_remote_code)
    held = frozen_dtype_of(cfg.frozen_dtype, resolve_precision(cfg.precision))
    frozen = torch.float32 if cfg.lora is None else held  # LoRA: only the adapters train
    model = load_causal_lm(inputs.sft_location, tokenizer, dtype=frozen, trust_remote_code=cfg.trust_remote_code)
    reference = None
    if cfg.lora is None:
        reference = copied(model).eval().requires_grad_(False)
        if cfg.launch.sharded:  # several processes, FSDP2
            # In host memory too when the accelerate config offloads every model (`fsdp_offload_params`).
            holding = Sharded(accelerator=PartialState(), gather="per_layer", offload_trained=cfg.launch.offload_params)
            reference = holding.frozen(reference)
    args = TRLDPOConfig(**trainer_arguments(cfg, output_dir), beta=cfg.beta, loss_type=[cfg.loss_type],
                        label_smoothing=cfg.label_smoothing, disable_dropout=True)
    logs = ForwardLogs(reporting)
    trainer = EncodedDPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=encoded_pairs(inputs.train, tokenizer),
        eval_dataset=encoded_pairs(inputs.evaluation, tokenizer),
        processing_class=tokenizer,
        callbacks=[logs],
        peft_config=None if cfg.lora is None else lora_config(cfg.lora, "CAUSAL_LM", model),
    )
    trainer.remove_callback(PrinterCallback)
    count_padding(trainer, logs)
    prepare_sharding(trainer)
    return trainer


def evaluation_models(policy: torch.nn.Module, holding: Holding, cfg: DPOConfig, sft_location: str) -> Models:
    """The trained policy beside a frozen SFT reference, held as `holding` holds the policy, for PPO's
    evaluation; no critic, no reward model."""
    tokenizer = load_tokenizer(sft_location, padding_side="left", trust_remote_code=cfg.trust_remote_code)
    frozen = frozen_dtype_of(cfg.frozen_dtype, resolve_precision(cfg.precision))
    reference = load_causal_lm(sft_location, tokenizer, dtype=frozen,
                               trust_remote_code=cfg.trust_remote_code)
    disable_dropout(reference)
    disable_dropout(policy)
    reference = holding.frozen(reference.eval().requires_grad_(False))
    precision = resolve_precision(cfg.precision)
    return Models(policy=policy.to(device()), reference=reference, scorer=None, tokenizer=tokenizer,
                  precision=precision, stop_ids=stop_token_ids(policy), holding=holding,
                  old_logprobs=by_precision(precision.autocast_dtype is not None, "in DPO's evaluations"))


def train_dpo(cfg: DPOConfig, inputs: DPOInputs, output_dir: Path,
              reporting: Reporting = Reporting()) -> DPOResult | None:
    """Train the SFT policy with DPO on validated pairs, then evaluate it against the SFT policy.
    Resumes from the newest trainer checkpoint an interrupted attempt left in `output_dir`.
    On several processes every one trains, evaluates and takes part in saving (a sharded model needs
    them all); only the main one writes and returns."""
    cfg = resolved("dpo", cfg, Counts(dpo_eval_prompts=len(inputs.eval_prompts)), (inputs.sft_location, None),
                   reporting)
    trainer = build_trainer(cfg, inputs, output_dir, reporting)
    train_output = trainer.train(resume_from_checkpoint=last_trainer_checkpoint(output_dir, reporting))
    untrained = untrained_evaluation(trainer)
    final = trainer.evaluate()
    tokenizer = trainer.processing_class
    model, holding, updated, held = trained_as_held(trainer, cfg.launch)

    models = evaluation_models(model, holding, cfg, inputs.sft_location)
    held_out = HeldOut.sample(models, inputs.eval_prompts, cfg.evaluation, cfg.sampling, single_turn(models))
    sampler = sampler_for(cfg, policy_sampler(models), cfg.seed, output_dir / "vllm.log",
                          cfg.launch.engine == "ray")
    try:
        metrics, evaluation = evaluate(models, sampler, held_out, cfg.evaluation, cfg.sampling)
    finally:
        sampler.close()
    saved, tags = saved_dtype_and_tags(cfg, inputs.sft_location, updated)
    checkpoint = output_dir / "checkpoint"
    holding.save_plain(model, tokenizer, checkpoint, saved)  # LoRA merged; sharded: a tensor at a time
    if not PartialState().is_main_process:
        return None
    warn_over_kl_budget(metrics, cfg.evaluation.kl_budget, reporting)
    metrics |= {
        "eval/loss": float(final["eval_loss"]),
        "eval/loss_untrained": float(untrained["eval_loss"]),
        "eval/preference_accuracy": float(final["eval_rewards/accuracies"]),
        "eval/preference_margin": float(final["eval_rewards/margins"]),
        "train/loss": float(train_output.training_loss),
        "train/steps": float(train_output.global_step),
    }
    return DPOResult(checkpoint, metrics, evaluation, tags | held)
