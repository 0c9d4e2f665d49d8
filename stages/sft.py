"""Stage 1: supervised fine-tuning on demonstrations, with TRL's `SFTTrainer`.

Plain Python: a frozen config, a base model location and validated data in; a checkpoint
folder and metrics out. The loss covers only the response tokens and the EOS that ends them:
records are encoded with `encode_replies` and handed to TRL with a completion mask. A transcript
(chat data with a tool turn or several assistant turns, kept whole as `messages`) is rendered with
the chat template turn by turn (`encode_transcript`) and learned on every assistant turn; the user's,
the tools' and the template's text around them is context.
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
from schemas.adapters import is_transcript, last_user_message
from stages.common.errors import StageUserError
from stages.common.reporting import Reporting
from stages.engines.sampler import HFSampler, Sampling
from stages.memory.phases import Counts
from stages.resolved import resolved
from stages.runtime.lora import lora_config
from stages.runtime.models import encode_replies, load_causal_lm, load_tokenizer, saved_dtype_and_tags, stop_token_ids
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
class SFTInputs:
    model_location: str
    """The base causal LM: a local folder or a hub name."""
    train: pd.DataFrame
    """Validated (prompt, response) records; chat transcripts also with `messages` (schemas.validate)."""
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


class TranscriptTemplateError(StageUserError):
    """A chat template that renders a transcript's earlier turns differently once a message is added."""


def encode_transcript(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                      template: str = "the tokenizer's") -> tuple[list[int], list[int]]:
    """A whole conversation's token ids and its completion mask: 1 on each assistant turn's tokens (its
    content and the end-of-turn text the template closes it with), 0 on everything else. Each assistant
    turn is what `messages[:i + 1]` adds to the rendering of `messages[:i]` with the generation prompt, so
    the template must only append; `template` names it in the refusal where it does not."""
    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    input_ids, mask, rendered = [], [], ""
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        opened, closed = render(i, True), render(i + 1, False)
        for shorter, longer, what in ((rendered, opened, f"message {i + 1}'s turn is opened"),
                                      (opened, closed, f"assistant message {i + 1} is added")):
            if not longer.startswith(shorter):
                raise TranscriptTemplateError(
                    f"{template} chat template is not prefix-preserving: once {what} it renders the conversation "
                    f"so far differently ({shorter[-40:]!r} is not the start of what follows), so a transcript's "
                    "assistant turns cannot be told from the rest. Training on transcripts (tool turns, several "
                    "assistant turns) needs a template that only appends: set the stage's `chat_template`")
        context, turn = ids(opened[len(rendered):]), ids(closed[len(opened):])
        input_ids += context + turn
        mask += [0] * len(context) + [1] * len(turn)
        rendered = closed
    return input_ids, mask


def _encoded(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase,
             template: str = "the tokenizer's") -> datasets.Dataset:
    """Input ids and completion masks: (prompt, response) records as `encode_replies` encodes them,
    transcripts (`messages`) by `encode_transcript`."""
    prompt_ids, reply_ids = encode_replies(tokenizer, list(frame["prompt"]), list(frame["response"]))
    input_ids = [p + r for p, r in zip(prompt_ids, reply_ids, strict=True)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, reply_ids, strict=True)]
    if "messages" in frame.columns:
        for row, conversation in enumerate(frame["messages"]):
            messages = json.loads(conversation)
            if is_transcript(messages):
                input_ids[row], masks[row] = encode_transcript(tokenizer, messages, template)
    return datasets.Dataset.from_dict({"input_ids": input_ids, "completion_mask": masks})


def build_trainer(cfg: SFTConfig, inputs: SFTInputs, output_dir: Path,
                  reporting: Reporting = Reporting()) -> SFTTrainer:
    """TRL's SFTTrainer set up from our config: completion-only loss, no checkpoints of its own.
    The model keeps the dropout its config sets: regularisation for supervised learning, as TRL does.
    With `cfg.lora`, TRL wraps it with LoRA adapters (peft) and trains those alone."""
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(inputs.model_location, trust_remote_code=cfg.trust_remote_code,
                               chat_template=cfg.chat_template)
    model = load_causal_lm(inputs.model_location, tokenizer, trust_remote_code=cfg.trust_remote_code)
    # Padding-free: records past the length budget were refused, so TRL's `max_length` has nothing to cut.
    padding_free = {"padding_free": True, "max_length": None} if cfg.padding_free else {}
    args = TRLSFTConfig(**trainer_arguments(cfg, output_dir) | padding_free, completion_only_loss=True, packing=False)
    template = f"the stage's ({cfg.chat_template})" if cfg.chat_template else f"{inputs.model_location}'s"
    logs = ForwardLogs(reporting)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=_encoded(inputs.train, tokenizer, template),
        eval_dataset=_encoded(inputs.evaluation, tokenizer, template),
        processing_class=tokenizer,
        callbacks=[logs],
        peft_config=None if cfg.lora is None else lora_config(cfg.lora, "CAUSAL_LM", model),
    )
    trainer.remove_callback(PrinterCallback)  # `reporting`, not stdout, receives the logs
    count_padding(trainer, logs)
    prepare_sharding(trainer)
    return trainer


def train_sft(cfg: SFTConfig, inputs: SFTInputs, output_dir: Path,
              reporting: Reporting = Reporting()) -> SFTResult | None:
    """Fine-tune the base causal LM (or, with `cfg.lora`, LoRA adapters on it, merged into the saved
    checkpoint) on validated (prompt, response) records. On several processes every one trains, samples
    and takes part in saving (a sharded model needs them all); only the main one writes and returns."""
    cfg = resolved("sft", cfg, Counts(), (inputs.model_location, None), reporting)
    trainer = build_trainer(cfg, inputs, output_dir, reporting)
    tokenizer = trainer.processing_class
    train_output = trainer.train(resume_from_checkpoint=last_trainer_checkpoint(output_dir, reporting))
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
