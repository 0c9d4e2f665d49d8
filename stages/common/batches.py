"""Batches as dataclasses whose fields say which axis they run along, so that taking rows
(`rows_of`), joining consecutive batches (`concat`) and dropping all-padding columns (`trimmed`) are
written once, over `dataclasses.fields`: a new field is declared in one place.

    prompt columns    (B, Tq) left-padded: the prompt's ids and mask
    response columns  (B, T) right-padded: response ids, mask and every per-token figure (in a multi-turn
                      episode, everything after the prompt); (B, T, k) for k figures per token
    per row           (B,) tensors, lists with one item per row, or dicts of either
    nested            another such batch over the same rows (a component's own fields: the teacher's
                      marks, the scores); its fields say their own axes
    fields without an axis are the batch's as a whole (the iteration it belongs to) and are kept as they are

`Sequences` is the four tensors every forward pass over prompt + response takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, NamedTuple, TypeVar

import torch

PAD_ID = "pad_id"
"""A `pad` that stands for the tokenizer's padding id, given to `concat`."""

_AXIS, _PAD = "axis", "pad"
Batch = TypeVar("Batch")


def prompt_columns(pad: float | str = 0, **kwargs: Any) -> Any:
    """A (B, Tq) field, left-padded with `pad`."""
    return field(metadata={_AXIS: "prompt", _PAD: pad}, **kwargs)


def response_columns(pad: float | str = 0.0, **kwargs: Any) -> Any:
    """A (B, T) or (B, T, k) field over response tokens, right-padded with `pad`."""
    return field(metadata={_AXIS: "response", _PAD: pad}, **kwargs)


def per_row(**kwargs: Any) -> Any:
    """A (B,) tensor, a list with one item per row, or a dict of them."""
    return field(metadata={_AXIS: "row"}, **kwargs)


def nested(**kwargs: Any) -> Any:
    """Another batch dataclass over the same rows, whose own fields say their axes."""
    return field(metadata={_AXIS: "nested"}, **kwargs)


class Sequences(NamedTuple):
    """Prompts and what follows them, as one batch: what every forward pass over prompt + response
    takes. A named tuple, so it passes through DDP's and FSDP2's forward hooks as its tensors."""

    queries: torch.Tensor  # (B, Tq) left-padded prompt ids
    query_mask: torch.Tensor  # (B, Tq) 1 on real prompt tokens
    responses: torch.Tensor  # (B, T) right-padded ids after the prompt
    mask: torch.Tensor  # (B, T) 1.0 on every real token after the prompt: what the passes attend to
    restarts: torch.Tensor | None = None
    """(B, T) 1.0 on the first token of an episode's later chain (a rewritten history,
    `stages.envs.episode`): its tokens attend to their own chain only, positions counted from it. The
    passes then run packed (`stages.runtime.packing.pack`). None, or all 0: every row one sequence."""


def _axis(f: dataclasses.Field) -> str | None:
    return f.metadata.get(_AXIS)


def rows_of(batch: Batch, rows: list[int] | torch.Tensor) -> Batch:
    """These rows, in this order (padding columns kept). # (B, ...) -> (len(rows), ...)"""
    if not isinstance(rows, torch.Tensor):
        rows = torch.tensor(rows, dtype=torch.long)
    positions = rows.tolist()

    def pick(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[rows.to(value.device)]
        if isinstance(value, dict):
            return {key: pick(item) for key, item in value.items()}
        return [value[i] for i in positions]

    def taken(f: dataclasses.Field) -> Any:
        value = getattr(batch, f.name)
        if _axis(f) is None:
            return value
        return rows_of(value, rows) if _axis(f) == "nested" else pick(value)

    return dataclasses.replace(batch, **{f.name: taken(f) for f in dataclasses.fields(batch)})


def concat(chunks: list[Batch], pad_id: int) -> Batch:
    """Batches of consecutive prompts as one: prompt columns padded on the left, response columns on
    the right, to the widest of them (padding is masked out, and position ids count real tokens only).
    Fields without an axis are the first chunk's."""
    if len(chunks) == 1:
        return chunks[0]
    return _joined(chunks, _widest(chunks, "prompt"), _widest(chunks, "response"), pad_id)


def _widest(chunks: list, axis: str) -> int:
    """The most columns any chunk's fields along `axis` have (0 where the batch has none)."""
    return max((getattr(c, f.name).shape[1] for c in chunks for f in dataclasses.fields(c) if _axis(f) == axis),
               default=0)


def _joined(chunks: list[Batch], width: int, steps: int, pad_id: int) -> Batch:
    def join(pieces: list) -> Any:
        if isinstance(pieces[0], dict):
            return {key: join([p[key] for p in pieces]) for key in pieces[0]}
        if isinstance(pieces[0], torch.Tensor):
            return torch.cat(pieces)
        return [item for piece in pieces for item in piece]

    def joined(f: dataclasses.Field) -> Any:
        pieces = [getattr(c, f.name) for c in chunks]
        axis = _axis(f)
        if axis is None:
            return pieces[0]
        if axis == "nested":
            return _joined(pieces, width, steps, pad_id)
        pad = pad_id if f.metadata.get(_PAD) == PAD_ID else f.metadata.get(_PAD)
        if axis == "prompt":  # (b, tq) -> (b, width)
            pieces = [torch.nn.functional.pad(x, (width - x.shape[1], 0), value=pad) for x in pieces]
        elif axis == "response":  # (b, t, ...) -> (b, steps, ...): padded along the second axis
            pieces = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, steps - x.shape[1]), value=pad)
                      for x in pieces]
        return join(pieces)

    return dataclasses.replace(chunks[0], **{f.name: joined(f) for f in dataclasses.fields(chunks[0])})


def trimmed(batch: Batch) -> Batch:
    """Without the leading prompt columns and trailing response columns that no row uses: a batch
    is padded for its longest prompt and response, a micro-batch of it need not be. Position ids
    count real tokens, so dropping all-padding columns changes no position."""
    first = int(batch.query_mask.any(dim=0).long().argmax())  # first prompt column with a real token
    end = int(batch.mask.any(dim=0).nonzero().max()) + 1  # past the last response column with a real token
    return _cut(batch, {"prompt": slice(first, None), "response": slice(None, end)})


def _cut(batch: Batch, kept: dict[str, slice]) -> Batch:
    def cut(f: dataclasses.Field) -> Any:
        value, axis = getattr(batch, f.name), _axis(f)
        if axis == "nested":
            return _cut(value, kept)
        return value[:, kept[axis]] if axis in kept else value

    return dataclasses.replace(batch, **{f.name: cut(f) for f in dataclasses.fields(batch)})
