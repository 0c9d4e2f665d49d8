"""The reward model as the RL stage and the reward stage's normalisation use it: `load_reward_model`
(a one-output sequence classifier), `RewardScorer` (the score at the last real token of prompt +
response + end token, whichever side the batch is padded on, with the gain and bias fitted after
training, `fit_normalization`, stored in the checkpoint's config under `NORMALIZATION_KEY`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from schemas.validate import render_prompt
from stages.common.batches import per_row
from stages.common.tensors import last_token_index
from stages.memory.phases import SCORING_BATCH
from stages.runtime.models import (
    device,
    disable_dropout,
    encode_replies,
    encode_reply_ids,
    fit_to_tokenizer,
    load_pretrained,
    load_tokenizer,
    position_ids_for,
    reply_end_id,
)
from stages.runtime.packing import PackedSequences, TokenCounts, pack_sequences, packs_sequences

NORMALIZATION_KEY = "rlhf_reward_normalization"


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


class RewardScorer:
    """Scores (prompt, response) texts with a reward checkpoint, on the normalised scale.

    Prompts are conversations ([{role, content}, ...]) or plain user texts; they are rendered
    with this model's own chat template, so the policy may use a different tokenizer.

        scorer = RewardScorer.from_pretrained("path/to/checkpoint")
        scorer.score([[{"role": "user", "content": "Describe the cat."}]], ["The cat is warm."])
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, gain: float = 1.0,
                 bias: float = 0.0):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model, self.tokenizer, self.gain, self.bias = model.eval(), tokenizer, gain, bias
        self._own_adapters = {id(m) for m in model.modules() if isinstance(m, BaseTunerLayer)}
        """Adapter layers the reward model came with (a LoRA reward model not yet merged): part of it, always on."""
        self.counts: TokenCounts | None = None
        """Where each scoring pass adds its real and computed positions (phase `score`); None: not counted."""
        self.padding_free: bool | str = False
        """Score packed sequences, not padded batches (`ppo.padding_free`: True, `auto` where it saves a tenth)."""
        self.policy_tokens = False
        """The policy's prompt ids are this model's (`shares_tokenizer`): read as they are, not rendered again."""

    @classmethod
    def from_pretrained(cls, location: str | Path, *, dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False, place=None) -> RewardScorer:
        """`place(model)` puts the model where it runs (PPO's holding may shard it); default: this device."""
        tokenizer = load_tokenizer(str(location), trust_remote_code=trust_remote_code)
        model = load_reward_model(str(location), tokenizer, dtype=dtype, trust_remote_code=trust_remote_code,
                                  fresh_head=False)
        norm = getattr(model.config, NORMALIZATION_KEY, None) or {"gain": 1.0, "bias": 0.0}
        return cls(place(model) if place else model.to(device()), tokenizer, norm["gain"], norm["bias"])

    def encode(self, prompts: list, responses: list[str], complete: list[bool] | None = None,
               prompt_ids: list[list[int]] | None = None) -> list[list[int]]:
        """Prompt + response ids; a response marked not `complete` gets no reply-end token, so a
        reply cut off at the length limit is scored as the unfinished text it is. `prompt_ids`: the
        prompts already rendered and encoded by this model's tokenizer (the policy's, where
        `policy_tokens`), used as they are."""
        if prompt_ids is None:
            conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
            rendered = [render_prompt(messages, self.tokenizer) for messages in conversations]
            prompt_ids, reply_ids = encode_replies(self.tokenizer, rendered, list(responses), complete)
        else:
            reply_ids = encode_reply_ids(self.tokenizer, list(responses), complete)
        return [p + r for p, r in zip(prompt_ids, reply_ids, strict=True)]

    @torch.no_grad()
    def raw_scores(self, sequences: list[list[int]], batch_size: int = SCORING_BATCH) -> torch.Tensor:
        """Model outputs at the last real token of each id sequence, from the reward model as it was
        trained: any adapters on it are off while it scores. # -> (N,)"""
        scores = []
        with self.adapters_off():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start:start + batch_size]
                if packs_sequences(self.padding_free, chunk):
                    packed = pack_sequences(chunk, self.tokenizer.pad_token_id)
                    self._count(sum(map(len, chunk)), packed.ids.numel())
                    scores.append(packed_scores(self.model, packed).float().cpu())
                    continue
                batch = self.tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(self.model.device)
                self._count(float(batch["attention_mask"].sum()), batch["input_ids"].numel())
                scores.append(last_token_scores(self.model, batch["input_ids"], batch["attention_mask"]).float().cpu())
        return torch.cat(scores) if scores else torch.empty(0)

    def _count(self, real: float, computed: float) -> None:
        if self.counts is not None:
            self.counts.add("score", real, computed)

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


def packed_scores(model: PreTrainedModel, packed: PackedSequences) -> torch.Tensor:
    """The score head read at each packed sequence's last token; no attention mask, the position
    ids' restarts keep the sequences apart. # -> (N,)"""
    on = model.device
    hidden = model.base_model(input_ids=packed.ids.to(on), position_ids=packed.positions.to(on)).last_hidden_state
    return model.score(hidden.reshape(-1, hidden.shape[-1])[packed.last.to(on)]).squeeze(-1)


def shares_tokenizer(scorer_tokenizer: PreTrainedTokenizerBase, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether a reward model reads the policy's prompts token for token: the same vocabulary, chat
    template and reply end, so the policy's prompt ids are the ones `RewardScorer.encode` would make."""
    return (scorer_tokenizer.get_vocab() == tokenizer.get_vocab()
            and getattr(scorer_tokenizer, "chat_template", None) == getattr(tokenizer, "chat_template", None)
            and reply_end_id(scorer_tokenizer) == reply_end_id(tokenizer))


def fit_normalization(reference_scores: torch.Tensor) -> tuple[float, float]:
    """Gain and bias that map the reference scores to mean 0 and standard deviation 1."""
    mean, std = reference_scores.mean().item(), reference_scores.std().item()
    gain = 1.0 / max(std, 1e-6)
    return gain, -mean * gain


@dataclass(frozen=True, kw_only=True)
class Scores:
    """What the reward said of each episode: a batch over the episodes' rows. # (B,) each"""

    terms: dict[str, torch.Tensor] = per_row()
    """Each term of `reward` by name: the reward model's normalised score with a cut-off response
    given `missing_eos_score` (when set), clipped to `score_clip` (when set); each function's
    values (NaN where it gave none); each server's (NaN where its score never arrived)."""
    reward: torch.Tensor = per_row()
    """The reward PPO trains on: the terms' weighted sum."""
    reported: torch.Tensor = per_row()
    """What figures and tables show as `score`: the reward model's normalised score, or without a
    reward model the terms' weighted sum."""
    dropped: torch.Tensor = per_row()
    """(B,) bool: a remote term's score never arrived (`remote.on_failure: drop`): the response trains
    nothing and leaves its group's baseline alone. All False without remote terms."""
    raw: dict[str, torch.Tensor] = per_row()
    """The reward model's outputs as it is (a cut-off response scored without an end token), before
    normalisation, under its term's name; empty without a reward model."""
