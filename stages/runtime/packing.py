"""Padding-free passes over prompt + response: a batch's sequences laid end to end in a few rows,
position ids restarting at each sequence, so a forward computes real tokens only.

The padded layout of a PPO batch is (B, Tq) left-padded prompts beside (B, T) right-padded
responses: every row is as long as the longest prompt plus the longest response. The packed layout
puts each sequence's real tokens (its prompt, then its response) into rows of `capacity` tokens,
first-fit by decreasing length; transformers reads the restarts of the position ids as sequence
boundaries and builds a block-diagonal causal mask (SDPA and eager attention, with
`attention_mask=None`), so no sequence sees another. Outputs come back to the padded (B, T) layout
by index (`Packed.logits`, `Packed.hidden`); where the response mask is 0 they hold some other real
output, as the padded layout holds padding's there, and every use of them is masked as before.

Rows are at most as long as the longest sequence (`capacity`): attention costs rows x capacity^2
and runs over the masked-out blocks too, so longer rows would trade padding for attention work.

Shapes: B sequences, Tq prompt columns, T response columns, R packed rows, C = capacity,
K kept logit columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stages.common.batches import Sequences
from stages.runtime.compiling import Compiler
from stages.runtime.models import Precision


@dataclass(frozen=True, kw_only=True)
class Packed:
    """One batch in the packed layout, and the maps back to the padded one."""

    ids: torch.Tensor  # (R, C) token ids; the tail of a row that no sequence fills is `pad_id`
    positions: torch.Tensor  # (R, C) each token's position within its own sequence
    kept: torch.Tensor  # (K,) the columns whose outputs predict a response token in some row: `logits_to_keep`
    logit_index: torch.Tensor  # (B, T) into the flattened (R * K) kept outputs; 0 where masked
    hidden_index: torch.Tensor  # (B, T) into the flattened (R * C) outputs; 0 where masked
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
    """Rows of the flattened outputs by `index`. # (R, X, D), (B, T) -> (B, T, D)"""
    flat = outputs.reshape(-1, outputs.shape[-1])  # (R * X, D)
    return _RowsByIndex.apply(flat, index)


class _RowsByIndex(torch.autograd.Function):
    """`flat.index_select(0, index)`, whose backward adds the gradient rows back with `index_add_`:
    autograd's own backward of indexing (`index_put_` with accumulation) was 13x slower on the CPU,
    1.4 ms of a 10 ms step of the demo's model."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # (N, D), (B, T) -> (B, T, D)
        ctx.save_for_backward(index)
        ctx.rows = flat.shape[0]
        return flat.index_select(0, index.reshape(-1)).view(*index.shape, flat.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        width = grad.shape[-1]
        return grad.new_zeros(ctx.rows, width).index_add_(0, index.reshape(-1), grad.reshape(-1, width)), None


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


def pack(sequences: Sequences, pad_id: int, bucket: Callable[[int], int] | None = None) -> Packed:
    """The batch's sequences, prompt then response, packed into rows as long as the longest one.
    Prompts are left-padded (`query_mask` a suffix of each row), responses right-padded (`mask` a
    prefix), so each sequence's real tokens are one run of the joined (B, Tq + T) row, moved whole
    to its place. `bucket` (a compiled pass's, `stages.runtime.compiling.bucketed`) rounds the rows'
    length, their count and the kept columns up, the extra rows and columns padding whose outputs
    nothing reads. # (B, Tq), (B, Tq), (B, T), (B, T) -> Packed"""
    queries, query_mask, responses, mask = sequences.queries, sequences.query_mask, sequences.responses, sequences.mask
    device, width = queries.device, queries.shape[1]
    bucket = bucket or (lambda n: n)
    prompt_lengths = query_mask.sum(dim=1).cpu()  # (B,)
    response_lengths = mask.sum(dim=1).long().cpu()  # (B,)
    lengths = prompt_lengths + response_lengths
    capacity = bucket(int(lengths.max()))
    sizes = lengths.tolist()
    bins = first_fit_decreasing(sizes, capacity)
    bins += [[] for _ in range(bucket(len(bins)) - len(bins))]  # rows of padding alone
    row, start, used = [0] * len(sizes), [0] * len(sizes), []  # each sequence's packed row and first column
    for r, members in enumerate(bins):
        filled = 0
        for i in members:
            row[i], start[i], filled = r, filled, filled + sizes[i]
        used.append(filled)
    row, start = torch.tensor(row), torch.tensor(start)
    # Every real token of the joined rows, moved to (its sequence's row, start + its position in the sequence).
    joined = torch.cat([queries, responses], dim=1).cpu()  # (B, Tq + T)
    real = torch.cat([query_mask.cpu().bool(), mask.cpu() > 0], dim=1)  # (B, Tq + T)
    b, column = real.nonzero(as_tuple=True)
    position = column - (width - prompt_lengths[b])  # 0 at the sequence's first real token
    ids = torch.full((len(bins), capacity), pad_id, dtype=queries.dtype)
    ids[row[b], start[b] + position] = joined[b, column]
    # A row's unfilled tail counts on from 0: a sequence of its own, that no real token attends to.
    positions = torch.arange(capacity).repeat(len(bins), 1) - torch.tensor(used).unsqueeze(1)  # (R, C)
    positions[row[b], start[b] + position] = chain_positions(real, sequences.restarts, width)[b, column]
    # The output at column (start + prompt length + t - 1) predicts response token t.
    steps = torch.arange(responses.shape[1])  # (T,)
    columns = (start + prompt_lengths - 1).unsqueeze(1) + steps  # (B, T)
    predicted = mask.cpu() > 0
    kept = torch.unique(columns[predicted])  # (K,) sorted
    column_to_kept = torch.full((capacity,), -1, dtype=torch.long)
    column_to_kept[kept] = torch.arange(len(kept))
    kept = torch.cat([kept, kept[-1:].repeat(bucket(len(kept)) - len(kept))])  # a bucket's extra columns: unread
    rows = row.unsqueeze(1).expand_as(columns)
    columns = columns.clamp(max=capacity - 1)
    # Where the mask is 0, the output at row 0, column 0: some real output, as a padded pass holds padding's
    # outputs there; every use of them is masked.
    logit_index = torch.where(predicted, rows * len(kept) + column_to_kept[columns], 0)
    hidden_index = torch.where(predicted, rows * capacity + columns, 0)
    return Packed(ids=ids.to(device), positions=positions.to(device), kept=kept.to(device),
                  logit_index=logit_index.to(device), hidden_index=hidden_index.to(device),
                  real_tokens=int(lengths.sum()))


def chain_positions(real: torch.Tensor, restarts: torch.Tensor | None, width: int) -> torch.Tensor:
    """Each real token's position id: counted from its sequence's first token, or from the first token
    of its chain where the response holds later chains (`Sequences.restarts`). A position that drops
    back is where transformers starts a new block of the causal mask. # (B, Tq + T) -> (B, Tq + T)"""
    offsets = real.long().cumsum(1) - 1  # (B, Tq + T) each real token's place in its sequence
    if restarts is None:
        return offsets
    restart = torch.nn.functional.pad(restarts.cpu() > 0, (width, 0)) & real  # (B, Tq + T)
    chain_start = torch.where(restart, offsets, 0).cummax(dim=1).values
    return offsets - chain_start


@dataclass(frozen=True, kw_only=True)
class PackedSequences:
    """Whole token sequences (a reward model's prompt + response) packed into rows, as `pack` packs
    a PPO batch, and where each one's last token landed."""

    ids: torch.Tensor  # (R, C) token ids; a row's unfilled tail is `pad_id`
    positions: torch.Tensor  # (R, C) each token's position within its own sequence
    last: torch.Tensor  # (N,) each sequence's last token, as an index into the flattened (R * C) outputs


def pack_sequences(sequences: list[list[int]], pad_id: int) -> PackedSequences:
    """Token sequences end to end in rows as long as the longest, first fit by decreasing length,
    positions restarting at each. # N sequences -> (R, C), (R, C), (N,)"""
    sizes = [len(ids) for ids in sequences]
    capacity = max(sizes)
    bins = first_fit_decreasing(sizes, capacity)
    ids = torch.full((len(bins), capacity), pad_id, dtype=torch.long)
    positions = torch.zeros(len(bins), capacity, dtype=torch.long)
    last = [0] * len(sequences)
    for r, members in enumerate(bins):
        filled = 0
        for i in members:
            ids[r, filled:filled + sizes[i]] = torch.tensor(sequences[i], dtype=torch.long)
            positions[r, filled:filled + sizes[i]] = torch.arange(sizes[i])
            filled += sizes[i]
            last[i] = r * capacity + filled - 1
        # The tail counts on from 0: a sequence of its own, that no real token attends to.
        positions[r, filled:] = torch.arange(capacity - filled)
    return PackedSequences(ids=ids, positions=positions, last=torch.tensor(last, dtype=torch.long))


def packs_sequences(setting: bool | str, sequences: list[list[int]]) -> bool:
    """Whether a pass over these sequences runs packed under `padding_free` (`auto`: where packing
    computes `AUTO_SAVING` fewer positions than padding each to the longest)."""
    if setting is False or not sequences:
        return False
    if setting is True:
        return True
    sizes = [len(ids) for ids in sequences]
    rows = len(first_fit_decreasing(sizes, max(sizes)))
    return rows * max(sizes) <= (1 - AUTO_SAVING) * len(sizes) * max(sizes)


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
    compiler: Compiler = field(default_factory=Compiler)
    """Runs the models compiled, at bucketed shapes, or as they are (`ppo.compile`)."""

    def layout(self, sequences: Sequences) -> Packed | None:
        """The packed layout of this batch, or None to run it padded; the pass counted either way. A
        batch with later chains (`Sequences.restarts`) is always packed: only restarting positions
        keep a chain from attending to the one before it."""
        queries, query_mask, responses, mask = sequences.queries, sequences.query_mask, sequences.responses, \
            sequences.mask
        bucket = self.compiler.bucket  # a compiled pass's shapes (`stages.runtime.forward._padded`), else as they are
        padded = bucket(len(queries)) * bucket(queries.shape[1] + bucket(responses.shape[1]))
        chained = sequences.restarts is not None and bool(sequences.restarts.any())
        packed = None if self.padding_free is False and not chained else \
            pack(sequences, self.pad_id, self.compiler.bucket)
        if packed is not None and self.padding_free == "auto" and not chained and \
                packed.computed_tokens > (1 - AUTO_SAVING) * padded:
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
