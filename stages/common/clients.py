"""What every client of a server shares: when a request is tried again and after how long, and the bearer
token it sends. Used by the remote reward terms' client (`stages.rewards.remote`) and the environment
servers' (`stages.envs.served`, `stages.envs.openenv_client`)."""

from __future__ import annotations

import os
import random

import httpx

BACKOFF_MAX_S = 30.0
"""The longest wait between two tries."""
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try (the server is busy or restarting); other 4xx are the request's fault."""
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts a request to which never leaves this machine."""


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


def bearer(api_key_env: str | None, field: str) -> dict[str, str]:
    """The `Authorization` header carrying the token in the environment variable `api_key_env` (none where
    it is None); `LookupError` naming the variable and the config `field` that names it where it is unset."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise LookupError(f"the environment variable {api_key_env} ({field}) is not set")
    return {"Authorization": f"Bearer {key}"}


def exposed_token(url: str, api_key_env: str | None) -> str | None:
    """Why a bearer token sent to `url` could be read on the way (plain http to a host that is not this
    machine), or None where it cannot (no token, https, or a loopback host)."""
    host = httpx.URL(url).host
    if api_key_env is None or url.startswith("https://") or host in LOOPBACK:
        return None
    return f"the token in {api_key_env} is sent over plain http to {host}, readable by anyone on the path; use https"
