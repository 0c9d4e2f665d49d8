"""When a request to a server is tried again, and after how long: shared by the remote reward terms'
client (`stages.rewards.remote`) and the environment servers' (`stages.envs.served`)."""

from __future__ import annotations

import random

import httpx

BACKOFF_MAX_S = 30.0
"""The longest wait between two tries."""
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try (the server is busy or restarting); other 4xx are the request's fault."""


def backoff(attempt: int, first_s: float, answer: httpx.Response | None = None) -> float:
    """Seconds to wait before try `attempt + 2`: the answer's `Retry-After` where it gives one, else
    exponential backoff from `first_s` with full jitter, at most `BACKOFF_MAX_S` either way."""
    wait = retry_after(answer) if answer is not None else None
    if wait is not None:
        return min(BACKOFF_MAX_S, wait)
    return random.uniform(0.0, min(BACKOFF_MAX_S, first_s * 2 ** attempt))


def retry_after(answer: httpx.Response) -> float | None:
    """A 429's or 503's `Retry-After` in seconds (None: absent or a date, which the backoff stands in for)."""
    try:
        return max(0.0, float(answer.headers["retry-after"]))
    except (KeyError, ValueError):
        return None
