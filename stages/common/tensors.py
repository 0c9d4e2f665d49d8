"""Token-level tensor math every part of a stage shares: where responses end, their masks, masked
statistics, and tokens' log-probabilities and entropies. Pure tensor code: no models, no I/O.

Shapes: B sequences, T response tokens. `mask` is 1.0 on real response tokens (up to and
including the first end token) and 0.0 after them. Tests work each function through by hand
(tests/test_ppo_math.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --- masks and statistics -------------------------------------------------------------------


def is_end(responses: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """True where a token ends a response (any of the model's end tokens). # (B, T) -> (B, T) bool"""
    return torch.isin(responses, torch.tensor(stop_ids, device=responses.device))


def response_mask(responses: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """1.0 up to and including the first end token of each response, 0.0 after it. # (B, T) -> (B, T)"""
    ends = is_end(responses, stop_ids)
    end_seen_before = (ends.cumsum(dim=1) - ends.long()) > 0  # an end token strictly before this position
    return (~end_seen_before).float()


def truncate_after_eos(responses: torch.Tensor, stop_ids: list[int], pad_token_id: int) -> torch.Tensor:
    """Replace every token after the first end token with padding. # (B, T) -> (B, T)"""
    return torch.where(response_mask(responses, stop_ids).bool(), responses, pad_token_id)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last masked-in token: the EOS, or the final token when none was emitted. # (B, T) -> (B,)"""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask).argmax(dim=1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Mean over masked-in entries; with `num_tokens`, the masked sum over that count instead."""
    if num_tokens is not None:
        return (x * mask).sum() / num_tokens
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    return var * n / (n - 1) if unbiased and n > 1 else var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(x - mean) / std over masked-in entries; with shift_mean=False the mean is kept (for rewards).
    `moments` = (mean, unbiased variance) taken elsewhere, e.g. over several processes' entries."""
    mean, var = moments if moments is not None else (masked_mean(x, mask), masked_var(x, mask))
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return (whitened if shift_mean else whitened + mean) * mask


# --- log-probabilities and entropy -----------------------------------------------------------


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(v) of every token under temperature-scaled logits. # (B, T, V) -> (B, T, V)"""
    return F.log_softmax(logits.float() / temperature, dim=-1)


def picked(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-probs (`log_probs`) of these tokens. # (B, T, V), (B, T) -> (B, T)"""
    return logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(token) under temperature-scaled logits, the distribution the tokens were sampled from.
    # (B, T, V), (B, T) -> (B, T)"""
    return picked(log_probs(logits, temperature), tokens)


def entropy_of(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = -sum_v p log p per position. # (B, T, V) -> (B, T)"""
    logps = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logps.exp() * logps).sum(-1)


LOG_FLOOR = -60.0
"""The least log-probability `binned` gives a bin: e^-60 is 1e-26, so a bin that holds (nearly) none of
the mass stays finite, and 0 x (its log-ratio) is 0, not NaN."""


def binned(logps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A distribution over the vocabulary seen as k + 1 bins: the tokens `ids` one by one, and every other
    token together, log(1 - sum_i p(ids_i)). # (B, T, V) log-probs, (B, T, k) -> (B, T, k + 1)"""
    top = logps.gather(-1, ids)  # (B, T, k)
    held = torch.logsumexp(top, dim=-1).clamp(max=0.0)  # log sum_i p(ids_i) <= 0
    rest = torch.where(held > -0.6931, torch.log(-torch.expm1(held)), torch.log1p(-torch.exp(held)))  # log(1 - e^x)
    return torch.cat([top, rest.unsqueeze(-1)], dim=-1).clamp(min=LOG_FLOOR)


def top_bins(logps: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of a distribution (`log_probs`), and `binned`'s k + 1 log-probs over them
    and the rest. # (B, T, V) -> (B, T, k) ids, (B, T, k + 1)"""
    ids = logps.topk(min(k, logps.shape[-1] - 1), dim=-1).indices
    return ids, binned(logps, ids)
