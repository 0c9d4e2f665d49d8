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


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(token) under temperature-scaled logits, the distribution the tokens were sampled from.
    # (B, T, V), (B, T) -> (B, T)"""
    logps = F.log_softmax(logits.float() / temperature, dim=-1)
    return logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_of(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = -sum_v p log p per position. # (B, T, V) -> (B, T)"""
    logps = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logps.exp() * logps).sum(-1)
