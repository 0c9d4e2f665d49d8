"""The one retry rule every server client follows (`stages.common.clients.retried` and its async twin),
on hand-made tries: which failures are tried again, after how long, how many times, and that a client
that does not retry timeouts says so by a parameter."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlhf.sections.base import ServerClientConfig
from stages.common import clients
from stages.common.clients import RequestFailed, TryFailed, http_failures, retried, retried_async

CFG = ServerClientConfig(url="http://127.0.0.1:1", max_retries=2, backoff_s=1.0)


@pytest.fixture()
def waits(monkeypatch) -> list[float]:
    """The waits between tries, recorded instead of slept (sync and async alike)."""
    slept: list[float] = []

    async def sleep_async(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(clients.time, "sleep", slept.append)
    monkeypatch.setattr(clients.asyncio, "sleep", sleep_async)
    return slept


class Tries:
    """An attempt that fails with `failures` in turn, then returns "ok"; it counts its calls and retries."""

    def __init__(self, *failures: Exception):
        self.failures, self.calls, self.retries = list(failures), 0, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"

    def counted(self) -> None:
        self.retries += 1


def run(kind: str, attempt: Tries, **rules) -> str:
    """`attempt` under the sync helper, or under the async one as a coroutine."""
    if kind == "sync":
        return retried(attempt, CFG, on_retry=attempt.counted, **rules)

    async def awaited() -> str:
        return attempt()

    return asyncio.run(retried_async(awaited, CFG, on_retry=attempt.counted, **rules))


def busy(status: int = 503, **headers: str) -> TryFailed:
    return TryFailed(f"HTTP {status}", httpx.Response(status, headers=headers))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_busy_answers_and_lost_connections_are_tried_again_and_counted(kind, waits):
    attempt = Tries(busy(503), TryFailed("ConnectError: refused"))
    assert run(kind, attempt) == "ok"
    assert attempt.calls == 3 and attempt.retries == 2 and len(waits) == 2
    # full jitter below the doubling bound: 1 s before the second try, 2 s before the third
    assert 0.0 <= waits[0] <= 1.0 and 0.0 <= waits[1] <= 2.0


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_every_retried_status_is_tried_again(kind, status, waits):
    attempt = Tries(busy(status))
    assert run(kind, attempt) == "ok" and attempt.retries == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("status", [400, 401, 404, 413, 422, 501])
def test_another_status_is_the_requests_fault_and_fails_at_once(kind, status, waits):
    attempt = Tries(busy(status))
    with pytest.raises(RequestFailed) as raised:
        run(kind, attempt)
    assert str(raised.value) == f"HTTP {status}"  # no "after N tries": it was tried once, on purpose
    assert attempt.calls == 1 and attempt.retries == 0 and waits == []


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_tries_run_out_after_max_retries_and_the_last_reason_says_so(kind, waits):
    attempt = Tries(busy(503), busy(502), busy(504), busy(503))
    with pytest.raises(RequestFailed, match=r"^HTTP 504, after 3 tries$"):
        run(kind, attempt)
    assert attempt.calls == 3 and attempt.retries == 2 and len(waits) == 2


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_retry_after_is_honoured_up_to_the_longest_wait(kind, waits):
    attempt = Tries(busy(429, **{"Retry-After": "7"}), busy(503, **{"Retry-After": "3600"}))
    assert run(kind, attempt) == "ok"
    assert waits == [7.0, clients.BACKOFF_MAX_S]


def test_a_retry_after_date_falls_back_to_the_backoff(waits):
    attempt = Tries(busy(503, **{"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}))
    assert run("sync", attempt) == "ok" and 0.0 <= waits[0] <= 1.0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_timeout_is_tried_again_unless_the_client_says_not(kind, waits):
    slow = TryFailed("no answer within 1 s", timed_out=True)
    retrying = Tries(slow)
    assert run(kind, retrying) == "ok" and retrying.retries == 1
    not_retrying = Tries(slow)
    with pytest.raises(RequestFailed, match=r"^no answer within 1 s$"):
        run(kind, not_retrying, retry_timeouts=False)
    assert not_retrying.calls == 1 and not_retrying.retries == 0
    connection_lost = Tries(TryFailed("ConnectError: refused"))  # only timeouts are spared the retry
    assert run(kind, connection_lost, retry_timeouts=False) == "ok" and connection_lost.retries == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_what_is_not_a_failed_try_passes_through_untouched(kind, waits):
    attempt = Tries(ValueError("the answer is no JSON object"))
    with pytest.raises(ValueError, match="no JSON object"):
        run(kind, attempt)
    assert attempt.calls == 1 and waits == []


def test_httpx_failures_are_failed_tries_and_a_timeout_says_so():
    with pytest.raises(TryFailed) as raised, http_failures("no answer within 2 s"):
        raise httpx.ReadTimeout("timed out")
    assert raised.value.reason == "no answer within 2 s" and raised.value.timed_out
    with pytest.raises(TryFailed) as raised, http_failures("no answer within 2 s"):
        raise httpx.ConnectError("connection refused")
    assert raised.value.reason == "ConnectError: connection refused" and not raised.value.timed_out
    assert raised.value.answer is None
