"""PPO's one batch type. `Rollout` is what sampling gives (`stages.rl.ppo_rollout`); `TrainingBatch`
is a rollout with what the update trains towards (`stages.rl.advantages`), and a micro-batch is
some of its rows, trimmed (`micro_batch`).

Each field says which axis it runs along (`prompt_columns`, `response_columns`, `per_row`), so
taking rows (`rows_of`), joining consecutive batches (`concat`) and dropping all-padding columns
(`trimmed`) are written once, over `dataclasses.fields`: a new field is declared in one place.

    prompt columns    (B, Tq) left-padded: the prompt's ids and mask
    response columns  (B, T) right-padded: response ids, mask and every per-token figure (in a multi-turn
                      episode, everything after the prompt); (B, T, k) for k figures per token
    per row           (B,) tensors, or lists with one item per row

The masks over the response columns, each (B, T), one meaning each:

    mask        every real token after the prompt: what the forward passes attend to
    trainable   the model's own tokens (a single response: `mask`; an episode: its turns, not the tool
                results or the template's glue; none of a failed episode's or of a response a remote
                term left unscored): what the KL, the advantages, whitening and the losses count
    loss_mask   `trainable` less the responses cut off without an end token, with
                `mask_truncated_responses`; None otherwise (a `TrainingBatch` field)
    counted     `loss_mask` where set, else `trainable`: the tokens a loss term sums and divides by
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from stages.envs.episode import Episode
from stages.rewards.scoring import Scores

PAD_ID = "pad_id"
"""A `pad` that stands for the tokenizer's padding id, given to `concat`."""

_AXIS, _PAD = "axis", "pad"
Batch = TypeVar("Batch")


def prompt_columns(pad: float | str = 0, **kwargs: Any) -> Any:
    """A (B, Tq) field, left-padded with `pad`."""
    return field(metadata={_AXIS: "prompt", _PAD: pad}, **kwargs)


def response_columns(pad: float | str = 0.0, **kwargs: Any) -> Any:
    """A (B, T) field over response tokens, right-padded with `pad`; None where a run has none."""
    return field(metadata={_AXIS: "response", _PAD: pad}, **kwargs)


def per_row(**kwargs: Any) -> Any:
    """A (B,) tensor, or a list with one item per row."""
    return field(metadata={_AXIS: "row"}, **kwargs)


@dataclass(kw_only=True)
class Rollout:
    """One iteration's episodes as sampled, with the passes PPO needs besides sampling."""

    queries: torch.Tensor = prompt_columns(pad=PAD_ID)  # (B, Tq) prompt ids
    query_mask: torch.Tensor = prompt_columns()  # (B, Tq)
    responses: torch.Tensor = response_columns(pad=PAD_ID)  # (B, T) truncated after the first EOS, then padding
    mask: torch.Tensor = response_columns()  # (B, T) 1.0 on real response tokens
    logprobs: torch.Tensor = response_columns()  # (B, T) the old policy's, masked
    ref_logprobs: torch.Tensor = response_columns()  # (B, T) the reference's, masked
    values: torch.Tensor | None = response_columns()  # (B, T) the critic's, masked; None without a critic
    entropy: torch.Tensor = response_columns()  # (B, T)
    has_eos: torch.Tensor = per_row()  # (B,) the episode ended: an end token, or the model answered (status `ok`)
    texts: list[str] = per_row()  # what the reward terms score: each episode's answer, decoded
    prompts: list[str] = per_row()  # the prompts, rendered
    teacher_logprobs: torch.Tensor | None = response_columns(default=None)
    """(B, T) the distillation teacher's log-probs of the sampled tokens, masked; None without a teacher."""
    teacher_top: torch.Tensor | None = response_columns(default=None)
    """(B, T, k) with `teacher.top_k`: the teacher's k most likely tokens at each position; None otherwise."""
    teacher_bins: torch.Tensor | None = response_columns(default=None)
    """(B, T, k + 1) with `teacher.top_k`: the teacher's log-probs of those tokens and of all the others together."""
    engine_logprobs: torch.Tensor | None = response_columns(default=None)
    """(B, T) the sampling engine's own log-probs (vLLM), masked; None: the trainer sampled."""
    trainable: torch.Tensor = response_columns()
    """(B, T) 1.0 on the model's own tokens: what the KL, the advantages and the losses count (a single
    response's every real token; an episode's turns, not its tool results or glue, none of a failed one's)."""
    turn_rewards: torch.Tensor = response_columns()
    """(B, T) each turn's reward (`step`'s) on its turn's last token; 0 everywhere for a single response."""
    episodes: list[Episode] = per_row()
    """Each row's episode (its turns, tool calls, status, transcript): a single response is an episode of one turn."""


@dataclass(kw_only=True)
class TrainingBatch(Rollout):
    """A rollout with what the update trains towards; a micro-batch is some of its rows, `trimmed`."""

    advantages: torch.Tensor = response_columns()  # (B, T)
    returns: torch.Tensor | None = response_columns()  # (B, T) the critic's targets; None without one (GAE only)
    engine_weights: torch.Tensor | None = response_columns(default=None)
    """(B, T) truncated importance weights for the engine mismatch; None: the trainer sampled, or no correction."""
    loss_mask: torch.Tensor | None = response_columns(default=None)
    """(B, T) the response mask less truncated responses (`mask_truncated_responses`); None: `mask`."""

    @classmethod
    def of(cls, rollout: Rollout, **training: Any) -> TrainingBatch:
        """`rollout`'s fields with the training ones (`advantages`, `returns`, ...) added."""
        return cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}, **training)

    @property
    def counted(self) -> torch.Tensor:
        """The tokens the loss terms count. # (B, T)"""
        return self.trainable if self.loss_mask is None else self.loss_mask


def rows_of(batch: Batch, rows: list[int] | torch.Tensor) -> Batch:
    """These rows, in this order (padding columns kept). # (B, ...) -> (len(rows), ...)"""
    if not isinstance(rows, torch.Tensor):
        rows = torch.tensor(rows, dtype=torch.long, device=batch.responses.device)
    positions = rows.tolist()

    def pick(value: Any) -> Any:
        if value is None:
            return None
        return value[rows] if isinstance(value, torch.Tensor) else [value[i] for i in positions]

    return dataclasses.replace(batch, **{f.name: pick(getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def concat(chunks: list[Batch], pad_id: int) -> Batch:
    """Batches of consecutive prompts as one: prompt columns padded on the left, response columns on
    the right, to the widest of them (padding is masked out, and position ids count real tokens only)."""
    if len(chunks) == 1:
        return chunks[0]
    width = max(c.queries.shape[1] for c in chunks)
    steps = max(c.responses.shape[1] for c in chunks)

    def joined(f: dataclasses.Field) -> Any:
        pieces = [getattr(c, f.name) for c in chunks]
        if pieces[0] is None:
            return None
        if not isinstance(pieces[0], torch.Tensor):
            return [item for piece in pieces for item in piece]
        pad = pad_id if f.metadata.get(_PAD) == PAD_ID else f.metadata.get(_PAD)
        if f.metadata[_AXIS] == "prompt":  # (b, tq) -> (b, width)
            pieces = [torch.nn.functional.pad(x, (width - x.shape[1], 0), value=pad) for x in pieces]
        elif f.metadata[_AXIS] == "response":  # (b, t, ...) -> (b, steps, ...): padded along the second axis
            pieces = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, steps - x.shape[1]), value=pad)
                      for x in pieces]
        return torch.cat(pieces)

    return dataclasses.replace(chunks[0], **{f.name: joined(f) for f in dataclasses.fields(chunks[0])})


def trimmed(batch: Batch) -> Batch:
    """Without the leading prompt columns and trailing response columns that no row uses: a batch
    is padded for its longest prompt and response, a micro-batch of it need not be. Position ids
    count real tokens, so dropping all-padding columns changes no position."""
    first = int(batch.query_mask.any(dim=0).long().argmax())  # first prompt column with a real token
    end = int(batch.mask.any(dim=0).nonzero().max()) + 1  # past the last response column with a real token
    kept = {"prompt": slice(first, None), "response": slice(None, end)}

    def trim(f: dataclasses.Field) -> Any:
        value = getattr(batch, f.name)
        return value if value is None or f.metadata[_AXIS] == "row" else value[:, kept[f.metadata[_AXIS]]]

    return dataclasses.replace(batch, **{f.name: trim(f) for f in dataclasses.fields(batch)})


def micro_batch(batch: TrainingBatch, rows: torch.Tensor) -> TrainingBatch:
    """These rows of a training batch, trimmed: what one forward and backward pass takes."""
    return trimmed(rows_of(batch, rows))


@dataclass(frozen=True, kw_only=True)
class Sampled:
    """This process's share of one iteration's episodes: sampled and scored."""

    batch: Rollout
    messages: list[list[dict]]
    """Each episode's prompt as chat messages."""
    scores: Scores
    rounds: int = 1
    """Sampling rounds it took (more than one with `dynamic_sampling`), each `Prompts.per_iteration` prompts."""
    figures: dict[str, float] = field(default_factory=dict)
    """What sampling and scoring counted besides time (dynamic sampling's rounds, a server's retries)."""
