"""Padding-free passes over prompt + response: a batch's sequences laid end to end in a few rows,
position ids restarting at each sequence, so a forward computes real tokens only.

The padded layout of a PPO batch is (B, Tq) left-padded prompts beside (B, T) right-padded
responses: every row is as long as the longest prompt plus the longest response. The packed layout
puts each sequence's real tokens (its prompt, then its response) into rows of `capacity` tokens,
first-fit by decreasing length; transformers reads the restarts of the position ids as sequence
boundaries and builds a block-diagonal causal mask (SDPA and eager attention, with
`attention_mask=None`), so no sequence sees another. Outputs come back to the padded (B, T) layout
by index (`Packed.logits`, `Packed.hidden`), zero where the response mask is 0, and every loss
downstream is unchanged.

Rows are at most as long as the longest sequence (`capacity`): attention costs rows x capacity^2
and runs over the masked-out blocks too, so longer rows would trade padding for attention work.

Shapes: B sequences, Tq prompt columns, T response columns, R packed rows, C = capacity,
K kept logit columns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from stages.runtime.models import Precision


@dataclass(frozen=True, kw_only=True)
class Packed:
    """One batch in the packed layout, and the maps back to the padded one."""

    ids: torch.Tensor  # (R, C) token ids; the tail of a row that no sequence fills is `pad_id`
    positions: torch.Tensor  # (R, C) each token's position within its own sequence
    kept: torch.Tensor  # (K,) the columns whose outputs predict a response token in some row: `logits_to_keep`
    logit_index: torch.Tensor  # (B, T) into the flattened (R * K) kept outputs; R * K (a zero row) where masked
    hidden_index: torch.Tensor  # (B, T) into the flattened (R * C) outputs; R * C (a zero row) where masked
    real_tokens: int
    """Prompt and response tokens of every sequence: what a padding-free pass computes, less the rows' tails."""

    def logits(self, kept_outputs: torch.Tensor) -> torch.Tensor:
        """The model's outputs at `kept` columns, at each response token's place. # (R, K, V) -> (B, T, V)"""
        return _gather(kept_outputs, self.logit_index)

    def hidden(self, outputs: torch.Tensor) -> torch.Tensor:
        """Outputs at every column, at each response token's place. # (R, C, H) -> (B, T, H)"""
        return _gather(outputs, self.hidden_index)

    @property
    def computed_tokens(self) -> int:
        return self.ids.numel()


def _gather(outputs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of the flattened outputs by `index`, a zero row where the index is one past the end.
    # (R, X, D), (B, T) -> (B, T, D)"""
    flat = outputs.reshape(-1, outputs.shape[-1])  # (R * X, D)
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
    return flat[index]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequences (by index) into bins of at most `capacity` tokens: longest first, each into the
    first bin with room. Every length must fit. # -> one list of indices per bin"""
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a row of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return bins


def pack(queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor,
         pad_id: int) -> Packed:
    """The batch's sequences, prompt then response, packed into rows as long as the longest one.
    Prompts are left-padded (`query_mask` a suffix of each row), responses right-padded (`mask` a
    prefix). # (B, Tq), (B, Tq), (B, T), (B, T) -> Packed"""
    prompt_lengths = query_mask.sum(dim=1).tolist()
    response_lengths = mask.sum(dim=1).long().tolist()
    lengths = [a + b for a, b in zip(prompt_lengths, response_lengths, strict=True)]
    capacity = max(lengths)
    bins = first_fit_decreasing(lengths, capacity)
    ids = torch.full((len(bins), capacity), pad_id, dtype=queries.dtype)
    positions = torch.arange(capacity).repeat(len(bins), 1)  # (R, C); a row's unfilled tail counts on from 0
    where = torch.zeros(queries.shape[0], 2, dtype=torch.long)  # each sequence's (row, first column)
    width = queries.shape[1]
    queries_cpu, responses_cpu = queries.cpu(), responses.cpu()
    for row, members in enumerate(bins):
        start = 0
        for i in members:
            a, b = prompt_lengths[i], response_lengths[i]
            ids[row, start:start + a] = queries_cpu[i, width - a:]
            ids[row, start + a:start + a + b] = responses_cpu[i, :b]
            positions[row, start:start + a + b] = torch.arange(a + b)
            where[i] = torch.tensor([row, start])
            start += a + b
        positions[row, start:] = torch.arange(capacity - start)
    # The output at column (start + a + t - 1) predicts response token t.
    steps = torch.arange(responses.shape[1])  # (T,)
    columns = where[:, 1:] + torch.tensor(prompt_lengths).unsqueeze(1) - 1 + steps  # (B, T)
    real = mask.cpu() > 0
    kept = torch.unique(columns[real])  # (K,) sorted
    column_to_kept = torch.full((capacity,), -1, dtype=torch.long)
    column_to_kept[kept] = torch.arange(len(kept))
    rows = where[:, :1].expand_as(columns)
    logit_index = torch.where(real, rows * len(kept) + column_to_kept[columns.clamp(max=capacity - 1)],
                              len(bins) * len(kept))
    hidden_index = torch.where(real, rows * capacity + columns.clamp(max=capacity - 1), len(bins) * capacity)
    device = queries.device
    return Packed(ids=ids.to(device), positions=positions.to(device), kept=kept.to(device),
                  logit_index=logit_index.to(device), hidden_index=hidden_index.to(device),
                  real_tokens=sum(lengths))


def padding_share(real_tokens: float, computed_tokens: float) -> float:
    """The share of a pass's computed positions that hold no real token."""
    return 0.0 if computed_tokens <= 0 else 1.0 - real_tokens / computed_tokens


# --- how a pass computes, and what it computed --------------------------------------------------

AUTO_SAVING = 0.10
"""`padding_free: auto` packs a pass when it computes at least this share fewer positions. Packed rows
attend through an explicit block mask (no causal fast path): 4-5% slower at equal token counts on the
development CPU (docs/performance.md), so a smaller saving is not taken."""


class TokenCounts:
    """Real and computed token positions per phase (`update`, `reference`, ...) since the last `shares()`."""

    def __init__(self) -> None:
        self.counts: dict[str, list[float]] = {}

    def add(self, phase: str, real: float, computed: float) -> None:
        real_so_far, computed_so_far = self.counts.get(phase, (0.0, 0.0))
        self.counts[phase] = [real_so_far + real, computed_so_far + computed]

    def shares(self) -> dict[str, float]:
        """`perf/padding_share/<phase>` for every phase counted, then counting starts again."""
        shares = {f"perf/padding_share/{phase}": padding_share(real, computed)
                  for phase, (real, computed) in sorted(self.counts.items())}
        self.reset()
        return shares

    def reset(self) -> None:
        self.counts = {}


@dataclass(frozen=True, kw_only=True)
class Passes:
    """How the passes over prompt + response compute: their precision, padded or packed
    (`padding_free`), and which phase's counts they add to."""

    precision: Precision
    padding_free: bool | str = False
    """True: always packed; `auto`: packed where it saves `AUTO_SAVING` of the positions; False: padded."""
    pad_id: int = 0
    """Fills the unused tail of a packed row."""
    counts: TokenCounts | None = None
    """Where each pass adds its real and computed positions; None: not counted."""
    phase: str = "forward"

    def at(self, phase: str) -> Passes:
        """The same passes, counted under `phase`."""
        return replace(self, phase=phase)

    def layout(self, queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor,
               mask: torch.Tensor) -> Packed | None:
        """The packed layout of this batch, or None to run it padded; the pass counted either way."""
        padded = queries.numel() + responses.numel()
        packed = None if self.padding_free is False else pack(queries, query_mask, responses, mask, self.pad_id)
        if packed is not None and self.padding_free == "auto" and packed.computed_tokens > (1 - AUTO_SAVING) * padded:
            packed = None
        if self.counts is not None:
            real = float(query_mask.sum() + mask.sum())
            self.counts.add(self.phase, real, padded if packed is None else packed.computed_tokens)
        return packed


# --- micro-batches by tokens ----------------------------------------------------------------------


def micro_batch_cost(prompt_lengths: list[int], response_lengths: list[int], packed: bool) -> int:
    """Positions one pass over these rows computes: their tokens packed, else rows x the longest prompt
    plus the longest response (a micro-batch is trimmed to its own widths)."""
    if packed:
        return sum(prompt_lengths) + sum(response_lengths)
    return len(prompt_lengths) * (max(prompt_lengths, default=0) + max(response_lengths, default=0))


def micro_batches_needed(prompt_lengths: list[int], response_lengths: list[int], budget: int, packed: bool) -> int:
    """How many micro-batches of at most `budget` computed positions these rows take, cut greedily
    longest first (a row over the budget alone is one micro-batch)."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: -(prompt_lengths[i] + response_lengths[i]))
    count, run = 0, []
    for i in order:
        trial = run + [i]
        if run and micro_batch_cost([prompt_lengths[j] for j in trial], [response_lengths[j] for j in trial],
                                    packed) > budget:
            count, run = count + 1, [i]
        else:
            run = trial
    return count + (1 if run else 0)


def split_by_tokens(lengths: list[int], count: int) -> list[list[int]]:
    """Rows (by index) into `count` micro-batches of about equal tokens: longest first, cut where the
    running total passes each k / count of the whole, so rows of like length go together (little
    padding where a pass is padded). Every micro-batch gets a row; `count` <= rows. # -> indices per micro-batch"""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    total = float(sum(lengths))
    runs: list[list[int]] = [[] for _ in range(count)]
    before, run = 0.0, 0
    for position, i in enumerate(order):
        # The run this row's midpoint falls in, one run further at most (none is skipped), and far
        # enough that the rows left still reach every later run.
        wanted = int((before + lengths[i] / 2) / total * count) if total else 0
        run = max(min(wanted, run + 1 if position else 0, count - 1), count - (len(order) - position))
        runs[run].append(i)
        before += lengths[i]
    return runs
