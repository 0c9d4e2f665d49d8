"""Our reward model served over HTTP (`rlhf serve-reward`): the `score` protocol of
`stages.rewards.remote`, answered by a `RewardScorer`, so a served score is the in-process one.

    POST /score  {"prompts": [[{role, content}, ...] | str], "responses": [str], "complete": [bool]?}
                 -> {"scores": [float], "raw": [float]}   normalised as the checkpoint says, and raw
    GET  /score  -> what is served: the checkpoint, its run, the normalisation
    GET  /health -> {"ok": true}

Concurrent requests are batched: whatever arrives while the model scores (up to `max_batch`
responses) is scored together in the next pass, on one thread that owns the model. Served with
FastAPI on uvicorn (both maintained, both in our lock): vLLM's pooling route would need vLLM's own
environment, refuses our demo model's head size on the CPU, and knows neither our chat rendering of
a prompt nor our normalisation; this serves the very scorer the RL stage runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field, model_validator

from stages.rewards.scoring import RewardScorer


class ScoreRequest(BaseModel):
    """One request: responses to score, each after its prompt."""

    prompts: list[list[dict[str, str]] | str] = Field(min_length=1)
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


@dataclass
class _Pending:
    request: ScoreRequest
    done: asyncio.Future


@dataclass
class Batcher:
    """Scores requests in passes of at most `max_batch` responses, one pass at a time."""

    scorer: RewardScorer
    max_batch: int = 64
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    passes: int = 0
    """Scoring passes so far (a figure for the tests and the log: fewer than requests means batching)."""

    async def score(self, request: ScoreRequest) -> tuple[list[float], list[float]]:
        done = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(request, done))
        return await done

    async def run(self) -> None:
        """Forever: take what is queued (a request at least, then more while they fit in `max_batch`),
        score it in one pass off the event loop, answer each request."""
        carried: _Pending | None = None
        while True:
            taken = [carried or await self.queue.get()]
            carried, size = None, len(taken[0].request.responses)
            while not self.queue.empty():
                pending = self.queue.get_nowait()
                if size + len(pending.request.responses) > self.max_batch:
                    carried = pending  # the next pass's first
                    break
                taken.append(pending)
                size += len(pending.request.responses)
            try:
                raw = await asyncio.to_thread(self._raw, [p.request for p in taken])
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error, the server goes on
                for pending in taken:
                    pending.done.set_exception(e)
                continue
            self.passes += 1
            start = 0
            for pending in taken:
                n = len(pending.request.responses)
                mine = raw[start:start + n]
                start += n
                pending.done.set_result((self.scorer.normalize(mine).tolist(), mine.tolist()))

    def _raw(self, requests: list[ScoreRequest]) -> torch.Tensor:
        prompts = [p for r in requests for p in r.prompts]
        responses = [x for r in requests for x in r.responses]
        complete = [c for r in requests for c in (r.complete or [True] * len(r.responses))]
        return self.scorer.score(prompts, responses, normalized=False, complete=complete)


def reward_app(scorer: RewardScorer, served: dict[str, str | None], max_batch: int = 64) -> FastAPI:
    """The app: `served` says what it serves (checkpoint, run id), shown at `GET /score`."""
    batcher = Batcher(scorer, max_batch)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="rlhf reward model", lifespan=lifespan,
                  description="Scores (prompt, response) pairs with a reward checkpoint.")

    @app.post("/score")
    async def score(request: ScoreRequest) -> dict[str, list[float]]:
        scores, raw = await batcher.score(request)
        return {"scores": scores, "raw": raw}

    @app.get("/score")
    async def info() -> dict:
        return {**served, "normalization": {"gain": scorer.gain, "bias": scorer.bias}, "passes": batcher.passes,
                "protocol": "POST {prompts, responses, complete?} -> {scores, raw}"}

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app
