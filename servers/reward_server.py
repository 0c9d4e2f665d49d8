"""Our reward model served over HTTP (`rlhf serve-reward`): the `score` protocol of
`stages.rewards.remote`, answered by a `RewardScorer`, so a served score is the in-process one.

    POST /score  {"prompts": [[{role, content}, ...] | str], "responses": [str], "complete": [bool]?}
                 -> {"scores": [float], "raw": [float], "truncated": [bool]}   normalised as the
                 checkpoint says, raw, and whether an input was cut to the model's positions
    GET  /score  -> what is served: the checkpoint, its run, the normalisation
    GET  /health -> {"ok": true}

Concurrent requests are batched: whatever arrives while the model scores (up to `max_batch`
responses) is scored together in the next pass, on one thread that owns the model. Served with
FastAPI on uvicorn (both maintained, both in our lock): vLLM's pooling route would need vLLM's own
environment, refuses our demo model's head size on the CPU, and knows neither our chat rendering of
a prompt nor our normalisation; this serves the very scorer the RL stage runs.

What a request may hold and cost is bounded (`Limits`), so that no request can knock the server over
or starve the others: a body past `max_body_bytes` or more than `max_rows` responses is refused with
413, a text past `max_chars` or a message that is not `{role, content}` with 422 (naming the row),
each before anything is queued; at most `max_queue` requests wait (then 503 with `Retry-After`); a
request not answered within `timeout_s` gets 504 and is not scored once abandoned. A pass that fails
is retried request by request, so a request that cannot be scored fails alone (422, with the reason: a
lone surrogate the tokenizer cannot encode, say). An input longer than
the model's positions keeps its last ones (the response's end, where the score is read) and says so
(`truncated`). With a token (`api_key`), every route but `/health` wants `Authorization: Bearer` (`servers.auth`).
A connection must send a request's head within uvicorn's keep-alive timeout (`RequestDeadline`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import h11
import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from uvicorn.protocols.http.h11_impl import H11Protocol

from servers.auth import CHALLENGE, UNAUTHORIZED, authorized
from stages.rewards.scoring import RewardScorer


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one request may hold and how long it may wait (module docstring)."""

    max_body_bytes: int = 8 * 2**20
    """A request body's bytes at most (413 past it)."""
    max_rows: int = 512
    """Responses in one request at most (413 past it)."""
    max_chars: int = 32_000
    """Characters in one response or one message at most (422 past it)."""
    max_queue: int = 256
    """Requests waiting to be scored at most (503 with Retry-After past it)."""
    timeout_s: float = 60.0
    """Seconds a request may wait for its scores (504 past it; it is then not scored)."""
    api_key: str | None = None
    """The bearer token every route but /health wants; None: no token."""


class Message(BaseModel):
    """One chat message of a prompt."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str


class ScoreRequest(BaseModel):
    """One request: responses to score, each after its prompt."""

    prompts: list[list[Message] | str] = Field(min_length=1)
    """Each response's prompt: chat messages, or a user message's text."""
    responses: list[str]
    """The responses, as the policy wrote them."""
    complete: list[bool] | None = None
    """False where a response was cut off at the length limit (scored without an end token); unset: all complete."""

    @model_validator(mode="after")
    def _same_lengths(self) -> ScoreRequest:
        if len(self.responses) != len(self.prompts) or len(self.complete or self.prompts) != len(self.prompts):
            raise ValueError(f"prompts ({len(self.prompts)}), responses ({len(self.responses)}) and complete "
                             f"({len(self.complete or self.prompts)}) must be as long as each other")
        return self

    def conversations(self) -> list[list[dict] | str]:
        return [p if isinstance(p, str) else [m.model_dump() for m in p] for p in self.prompts]

    def over(self, limits: Limits) -> HTTPException | None:
        """The refusal where the request holds more than `limits` allow, naming the first row over."""
        if len(self.responses) > limits.max_rows:
            return HTTPException(413, f"{len(self.responses)} responses in one request, over the limit of "
                                      f"{limits.max_rows} (--max-rows): split the batch")
        for row, (prompt, response) in enumerate(zip(self.prompts, self.responses, strict=True)):
            texts = [("response", response)] + ([("prompt", prompt)] if isinstance(prompt, str) else
                                                [(f"message {i}", m.content) for i, m in enumerate(prompt)])
            for what, text in texts:
                if len(text) > limits.max_chars:
                    return HTTPException(422, f"row {row}: the {what} has {len(text)} characters, over the limit "
                                              f"of {limits.max_chars} (--max-chars)")
        return None


class Refusal(BaseModel):
    """A refused request's answer: FastAPI's list of what failed validation, or the reason in a sentence."""

    detail: str | list[dict]


REFUSALS = {status: {"model": Refusal, "description": what} for status, what in [
    (401, "no bearer token, or not the server's"), (413, "a body or batch over the limits"),
    (422, "a request not of the schema, over the limits, or that cannot be scored"),
    (503, "the queue is full: try again"), (504, "not scored within the timeout")]}
"""What `/score` may answer besides its scores, in its OpenAPI schema."""


DRAIN_BYTES = 64 * 2**20
"""A refused body is read on and dropped up to this many bytes, so that its client, still sending, reads
the 413 rather than a reset connection; past it the connection is closed."""


async def _drain(receive, seen: int) -> None:
    """Read and drop the rest of a refused body (up to `DRAIN_BYTES`): nothing of it is kept."""
    while seen <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return
        seen += len(message.get("body", b""))


class BodyLimit:
    """ASGI middleware: a body past `max_bytes` (by its Content-Length, or as it streams in) gets 413,
    never held whole in memory."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _drain(receive, 0)
            return await _refuse_body(send, int(length), self.max_bytes)
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                if message.get("more_body"):
                    await _drain(receive, seen)
                raise HTTPException(413, f"the body is over the limit of {self.max_bytes} bytes (--max-body-mb)")
            return message

        await self.app(scope, bounded, send)


async def _refuse_body(send, length: int, limit: int) -> None:
    body = (f'{{"detail": "a body of {length} bytes is over the limit of {limit} bytes (--max-body-mb)"}}').encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class Busy(Exception):
    """The queue is full."""


@dataclass
class _Pending:
    request: ScoreRequest
    done: asyncio.Future


@dataclass(kw_only=True)
class Batcher:
    """Scores requests in passes of at most `max_batch` responses, one pass at a time."""

    scorer: RewardScorer
    max_batch: int = 64
    max_queue: int = 256
    queue: asyncio.Queue = field(init=False)
    passes: int = 0
    """Scoring passes so far (a figure for the tests and the log: fewer than requests means batching)."""

    def __post_init__(self) -> None:
        self.queue = asyncio.Queue(self.max_queue)

    async def score(self, request: ScoreRequest) -> tuple[list[float], list[float], list[bool]]:
        """(normalised scores, raw scores, truncated); `Busy` where `max_queue` requests already wait."""
        done = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait(_Pending(request, done))
        except asyncio.QueueFull:
            raise Busy from None
        return await done

    async def _next(self) -> _Pending:
        """The next queued request still waited for (one abandoned by its timeout is dropped)."""
        while (pending := await self.queue.get()).done.done():
            pass
        return pending

    async def run(self) -> None:
        """Forever: take what is queued (a request at least, then more while they fit in `max_batch`),
        score it in one pass off the event loop, answer each request."""
        carried: _Pending | None = None
        while True:
            taken = [carried or await self._next()]
            carried, size = None, len(taken[0].request.responses)
            while not self.queue.empty():
                pending = self.queue.get_nowait()
                if pending.done.done():
                    continue
                if size + len(pending.request.responses) > self.max_batch:
                    carried = pending  # the next pass's first
                    break
                taken.append(pending)
                size += len(pending.request.responses)
            await self._answer(taken)

    async def _answer(self, taken: list[_Pending]) -> None:
        """Score `taken` in one pass and answer each; a pass that fails is tried request by request, so only
        a request that cannot be scored gets the error."""
        try:
            raw, truncated = await asyncio.to_thread(self._raw, [p.request for p in taken])
        except Exception as e:  # noqa: BLE001 - the request(s) at fault get the error, the server goes on
            if len(taken) > 1:
                for pending in taken:
                    await self._answer([pending])
            elif not taken[0].done.done():
                taken[0].done.set_exception(e)
            return
        self.passes += 1
        start = 0
        for pending in taken:
            n = len(pending.request.responses)
            mine, cut = raw[start:start + n], truncated[start:start + n]
            start += n
            if not pending.done.done():
                pending.done.set_result((self.scorer.normalize(mine).tolist(), mine.tolist(), cut))

    def _raw(self, requests: list[ScoreRequest]) -> tuple[torch.Tensor, list[bool]]:
        """Raw scores of every response of `requests`, each input cut to the model's positions (its last ones)."""
        prompts = [p for r in requests for p in r.conversations()]
        responses = [x for r in requests for x in r.responses]
        complete = [c for r in requests for c in (r.complete or [True] * len(r.responses))]
        sequences = self.scorer.encode(prompts, responses, complete)
        positions = getattr(self.scorer.model.config, "max_position_embeddings", None) or max(map(len, sequences))
        truncated = [len(ids) > positions for ids in sequences]
        return self.scorer.raw_scores([ids[-positions:] for ids in sequences]), truncated


REFUSED_AS = {401: "unauthorized", 404: "no_route", 405: "no_route", 413: "too_large", 422: "invalid",
              503: "busy", 504: "timeout"}
"""What a refusal's status is counted as, at `GET /score`."""


@dataclass
class RequestCounts:
    """Requests answered (refusals included), and refused by cause (`REFUSED_AS`): shown at `GET /score`."""

    answered: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class RequestLog:
    """ASGI middleware: each request logged in one line on stderr (method, path without its query, status,
    milliseconds), and counted in `counts`."""

    def __init__(self, app, counts: RequestCounts):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), 500

        async def sent(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            self.counts.answered += 1
            if status >= 400:
                cause = REFUSED_AS.get(status, str(status))
                self.counts.refused[cause] = self.counts.refused.get(cause, 0) + 1
            print(f"{scope['method']} {scope['path'][:200]} {status} {(time.monotonic() - started) * 1000:.1f}ms",
                  file=sys.stderr, flush=True)


class RequestDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline on each request's head: a connection that has not sent a
    whole request line and headers within `timeout_keep_alive` seconds of connecting (or of its last answer) is
    closed, however slowly its bytes trickle in. uvicorn arms that timer only after an answer, and any byte
    disarms it, so silent and slow-loris connections were held forever, each counted against
    `limit_concurrency` until the server answered everyone 503."""

    def connection_made(self, transport) -> None:  # noqa: ANN001 - asyncio's transport
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)  # the timer runs on: `handle_events` disarms it once a request's head is whole
        self.handle_events()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:  # a request half-sent: nothing to say to it
                pass
            self.transport.close()


def reward_app(scorer: RewardScorer, served: dict[str, str | None], max_batch: int = 64,
               limits: Limits = Limits()) -> FastAPI:
    """The app: `served` says what it serves (checkpoint, run id), shown at `GET /score`."""
    batcher = Batcher(scorer=scorer, max_batch=max_batch, max_queue=limits.max_queue)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    def checked_token(request: Request) -> None:
        if not authorized(limits.api_key, request.headers.get("authorization")):
            raise HTTPException(401, UNAUTHORIZED, headers=CHALLENGE)

    app = FastAPI(title="rlhf reward model", lifespan=lifespan,
                  description="Scores (prompt, response) pairs with a reward checkpoint.")
    counts = RequestCounts()
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(RequestLog, counts=counts)  # the outermost layer: it sees BodyLimit's refusals too

    @app.post("/score", dependencies=[Depends(checked_token)], responses=REFUSALS)
    async def score(request: ScoreRequest) -> dict[str, list]:
        if (refusal := request.over(limits)) is not None:
            raise refusal
        try:
            scores, raw, truncated = await asyncio.wait_for(batcher.score(request), limits.timeout_s)
        except Busy:
            raise HTTPException(503, f"{limits.max_queue} requests are waiting (--max-queue): try again",
                                headers={"Retry-After": "1"}) from None
        except TimeoutError:
            raise HTTPException(504, f"not scored within {limits.timeout_s:g} s (--timeout-s)") from None
        except Exception as e:  # noqa: BLE001 - scored alone, this request failed: its input cannot be scored
            raise HTTPException(422, f"this request cannot be scored: {type(e).__name__}: {e}") from None
        return {"scores": scores, "raw": raw, "truncated": truncated}

    @app.get("/score", dependencies=[Depends(checked_token)])
    async def info() -> dict:
        return {**served, "normalization": {"gain": scorer.gain, "bias": scorer.bias}, "passes": batcher.passes,
                "requests": {"answered": counts.answered, "refused": counts.refused},
                "protocol": "POST {prompts, responses, complete?} -> {scores, raw, truncated}"}

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app
