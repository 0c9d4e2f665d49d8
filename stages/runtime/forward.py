"""Forward passes over prompt + response, as every stage that scores sampled tokens takes them: the
logits that predict each response token (`forward_response`), a body's hidden states before each
(`last_hidden`), padded or packed (`stages.runtime.packing.Passes`), compiled where asked; and the
probe that says whether a model can take packed passes (`padding_free_refusal`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from stages.common.batches import Sequences
from stages.runtime.models import position_ids_for, resolve_precision
from stages.runtime.packing import Passes


def forward_response(model: PreTrainedModel, sequences: Sequences, passes: Passes, want_hidden: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits that predict each response token, and the final hidden states at the same
    positions, from one pass over prompt + response, padded or packed as `passes` says (where
    `mask` is 0, whatever the layout leaves there), compiled where `passes.compiler` is on.
    # -> (B, T, V), (B, T, H) | None"""
    rows, steps = sequences.responses.shape
    packed, run = passes.layout(sequences), passes.compiler(model)
    with passes.precision.autocast(sequences.queries.device):
        if packed is not None:  # no attention mask: the position ids' restarts are the sequences' bounds
            out = run(input_ids=packed.ids, position_ids=packed.positions, output_hidden_states=want_hidden,
                      use_cache=False, logits_to_keep=packed.kept)
            # A model that ignores `logits_to_keep` returns every column.
            kept = out.logits if out.logits.shape[1] == len(packed.kept) else out.logits[:, packed.kept]
            return packed.logits(kept), packed.hidden(out.hidden_states[-1]) if want_hidden else None
        padded = _padded(sequences, passes)
        kept = padded.pop("response_columns") + 1
        # Only the last T' + 1 positions need the vocabulary projection: the logits at position p predict token p + 1.
        out = run(**padded, output_hidden_states=want_hidden, use_cache=False, logits_to_keep=kept)
    # Sliced here as well: a model that ignores `logits_to_keep` returns every position.
    logits = out.logits[:rows, -kept:-1][:, :steps]  # (B, T, V)
    hidden = out.hidden_states[-1][:rows, -kept:-1][:, :steps] if want_hidden else None  # (B, T, H)
    return logits, hidden


def _padded(sequences: Sequences, passes: Passes) -> dict:
    """Prompt + response as one padded batch: ids, attention mask and positions that count real
    tokens only, and `response_columns`, T'. A compiled pass takes bucketed shapes
    (`passes.compiler.bucket`): the responses padded on the right to T', the prompts on the left to
    the bucketed whole width, and rows of one padding token added; nothing reads their outputs.
    # -> (B', Tq' + T') each"""
    queries, query_mask, responses, mask = sequences.queries, sequences.query_mask, sequences.responses, sequences.mask
    (rows, width), steps, bucket = queries.shape, responses.shape[1], passes.compiler.bucket
    columns = bucket(steps)
    prompt_columns = bucket(width + columns) - columns
    extra_rows = bucket(rows) - rows
    if (columns, prompt_columns, extra_rows) != (steps, width, 0):
        pad = passes.pad_id
        queries = torch.nn.functional.pad(queries, (prompt_columns - width, 0, 0, extra_rows), value=pad)
        query_mask = torch.nn.functional.pad(query_mask, (prompt_columns - width, 0, 0, extra_rows))
        query_mask[rows:, -1] = 1  # an added row attends to one token of its own
        responses = torch.nn.functional.pad(responses, (0, columns - steps, 0, extra_rows), value=pad)
        mask = torch.nn.functional.pad(mask, (0, columns - steps, 0, extra_rows))
    attention_mask = torch.cat([query_mask, mask.long()], dim=1)
    return {"input_ids": torch.cat([queries, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids_for(attention_mask), "response_columns": columns}


def last_hidden(base: PreTrainedModel, sequences: Sequences, passes: Passes) -> torch.Tensor:
    """A base model's (no head) final hidden states before each response token, from one pass over
    prompt + response, padded or packed, compiled where `passes.compiler` is on. # -> (B, T, H)"""
    rows, steps = sequences.responses.shape
    packed, run = passes.layout(sequences), passes.compiler(base)
    with passes.precision.autocast(sequences.queries.device):
        if packed is not None:
            return packed.hidden(run(input_ids=packed.ids, position_ids=packed.positions,
                                     use_cache=False).last_hidden_state)
        padded = _padded(sequences, passes)
        kept = padded.pop("response_columns") + 1
        hidden = run(**padded, use_cache=False).last_hidden_state  # (B', Tq' + T', H)
    return hidden[:rows, -kept:-1][:, :steps]  # the states before each response token


def padding_free_refusal(model: PreTrainedModel, base: bool = False) -> str | None:
    """Why `model` cannot take packed passes, or None: a probe of three short sequences (two of them
    packed into one row) run padded and packed, whose outputs must agree (as float round-off allows at
    the model's dtype). A model whose attention ignores the position ids' restarts lets one sequence
    see another; one whose forward takes no `position_ids` or `logits_to_keep` fails outright.
    `base`: a body without a head (`last_hidden`), else a causal LM (`forward_response`)."""
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(12).reshape(3, 4) * 7 + 3) % vocab  # (3, 4) arbitrary real ids
    query_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])  # lengths 6, 3 and 2: a row of 6 holds the two short ones
    on = next(model.parameters()).device
    sequences = Sequences(*(x.to(on) for x in (ids, query_mask, ids[:, :2], mask)))
    try:
        with torch.no_grad():
            ways = [Passes(precision=resolve_precision("fp32"), padding_free=way) for way in (False, True)]
            if base:
                outputs = [last_hidden(model, sequences, way) for way in ways]
            else:
                outputs = [forward_response(model, sequences, way)[0] for way in ways]
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        return f"{type(model).__name__} failed a packed forward pass: {error}"
    padded, packed = (x * sequences.mask.unsqueeze(-1) for x in outputs)
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2
    gap = float((padded - packed).abs().max() / padded.abs().max().clamp(min=1e-6))
    if gap > tolerance:
        return (f"{type(model).__name__}'s packed outputs differ from its padded ones by {gap:.2g} (relative; at most "
                f"{tolerance:g} expected): its attention does not keep packed sequences apart "
                f"(attn_implementation {model.config._attn_implementation!r})")
    return None
