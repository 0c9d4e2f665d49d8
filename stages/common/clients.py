"""What every client of a server shares: when a request is tried again and after how long (`retried`, and
`retried_async` for an event loop's client), and the bearer token it sends. Used by the remote reward
terms' client (`stages.rewards.remote`) and the environment servers' (`stages.envs.remote.served`,
`stages.envs.remote.openenv_client`); the settings are a `ServerClientConfig`'s.

The rules: a try that cannot connect, or is answered HTTP 408, 429 or 5xx (`RETRIED_STATUSES`), is tried
again, up to `max_retries` more times, after exponential backoff from `backoff_s` with full jitter (an
answer's `Retry-After` instead, where it gives one), at most `BACKOFF_MAX_S`; another status is the
request's fault and is not; a try that got no answer within its time is tried again only where the client
says so (`retry_timeouts`). A client's attempt says how a try failed by raising `TryFailed`; anything else
it raises passes through at once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx

from rlhf.sections.base import ServerClientConfig
from stages.common.hosts import LOOPBACK

T = TypeVar("T")
BACKOFF_MAX_S = 30.0
"""The longest wait between two tries."""
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try (the server is busy or restarting); other 4xx are the request's fault."""


class TryFailed(Exception):
    """One try of a request failed: `reason` says how; `answer`, the HTTP answer that refused it (its status
    says whether it is tried again, its `Retry-After` when; None: no answer); `timed_out`, none came in time."""

    def __init__(self, reason: str, answer: Any = None, timed_out: bool = False):
        super().__init__(reason)
        self.reason, self.answer, self.timed_out = reason, answer, timed_out


class RequestFailed(Exception):
    """A request given up on: its last try's reason, with how many tries it took where it ran out of them."""


def retried(attempt: Callable[[], T], cfg: ServerClientConfig, *, retry_timeouts: bool = True,
            on_retry: Callable[[], object] | None = None) -> T:
    """`attempt()`'s result, tried again as the module says while it raises `TryFailed` (`on_retry` called
    before each retry: a client counts them); `RequestFailed` once the rules give up."""
    for tries in itertools.count(1):  # until a try returns, or the rules give up
        try:
            return attempt()
        except TryFailed as failed:
            wait = _pause(failed, tries, cfg, retry_timeouts)
        if on_retry is not None:
            on_retry()
        time.sleep(wait)


async def retried_async(attempt: Callable[[], Awaitable[T]], cfg: ServerClientConfig, *, retry_timeouts: bool = True,
                        on_retry: Callable[[], object] | None = None) -> T:
    """`retried` on an event loop: `await attempt()`, the waits `asyncio.sleep`, the same rules."""
    for tries in itertools.count(1):  # until a try returns, or the rules give up
        try:
            return await attempt()
        except TryFailed as failed:
            wait = _pause(failed, tries, cfg, retry_timeouts)
        if on_retry is not None:
            on_retry()
        await asyncio.sleep(wait)


def _pause(failed: TryFailed, tries: int, cfg: ServerClientConfig, retry_timeouts: bool) -> float:
    """Seconds to wait before try `tries + 1` after `failed`; `RequestFailed` where the rules give up: a
    status not in `RETRIED_STATUSES`, a timeout where `retry_timeouts` is False, or `max_retries` spent."""
    refused = failed.answer is not None and failed.answer.status_code not in RETRIED_STATUSES
    if refused or (failed.timed_out and not retry_timeouts):
        raise RequestFailed(failed.reason) from None
    if tries > cfg.max_retries:
        raise RequestFailed(f"{failed.reason}, after {tries} tries") from None
    return backoff(tries - 1, cfg.backoff_s, failed.answer)


@contextmanager
def http_failures(timed_out: str) -> Iterator[None]:
    """httpx's failures inside as `TryFailed`: no answer in time with the reason `timed_out`, any other
    (no connection, one dropped) with its type and message."""
    try:
        yield
    except httpx.TimeoutException:
        raise TryFailed(timed_out, timed_out=True) from None
    except httpx.HTTPError as e:
        raise TryFailed(f"{type(e).__name__}: {e}") from None


def backoff(attempt: int, first_s: float, answer: Any = None) -> float:
    """Seconds to wait before try `attempt + 2`: the answer's `Retry-After` where it gives one, else
    exponential backoff from `first_s` with full jitter, at most `BACKOFF_MAX_S` either way."""
    wait = retry_after(answer) if answer is not None else None
    if wait is not None:
        return min(BACKOFF_MAX_S, wait)
    return random.uniform(0.0, min(BACKOFF_MAX_S, first_s * 2 ** attempt))


def retry_after(answer: Any) -> float | None:
    """A 429's or 503's `Retry-After` in seconds (None: absent or a date, which the backoff stands in for);
    `answer`: an httpx answer, or any with case-insensitive `headers` (a websocket handshake's)."""
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
