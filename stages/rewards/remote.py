"""Rewards from a server: the terms of the RL stage's `reward` section with `remote` settings.

Two kinds of server, one client (`RemoteReward`), called on the main process once per batch:

    score   POST {url} {"prompts": [[{role, content}, ...]], "responses": [str], "complete": [bool]}
            -> {"scores": [float | null, ...]}  one per response (`rlhf serve-reward` serves our reward
            model this way; null: no score for that response)
    judge   POST {url}/chat/completions, one request per response (OpenAI-compatible), greedy, the
    compare user's `template` filled with the prompt and the response, each response fenced in
            <response> tags (a closing tag inside it broken), so that the policy cannot end its own text
            and write the judge's instructions. `judge`: the answer's one number (a restated scale and a
            denominator set aside), or the first group of `score_pattern`; several numbers, one outside
            `score_range`, or one not finite: unscored. `compare`: the response and the SFT policy's to
            the same prompt as A and B, in an order drawn from their texts (half the rows each way, the
            same on a rerun); 1 where the answer's first A or B names the response, else 0

Requests run concurrently on one event loop (httpx), at most `max_concurrent` in flight and
`max_rpm` started per minute. A request that times out, cannot connect or gets HTTP 408, 429 or 5xx
is retried up to `max_retries` times after exponential backoff with full jitter (a `Retry-After`
header is honoured up to 30 s; `stages.common.clients`); another 4xx is not retried. A body that is
not what the kind promises fails its request without a retry. A response whose score never arrives is None, with
why; the RL stage drops it from the update, or stops past `max_failed_share` of a batch: never a silent 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from rlhf.sections.base import RemoteRewardConfig
from rlhf.sections.reward_terms import RewardTerm
from stages.common.clients import (
    RequestFailed,
    TryFailed,
    bearer,
    exposed_token,
    http_failures,
    retried_async,
)
from stages.common.errors import StageUserError

JUDGE_MAX_TOKENS = 16
"""Tokens a judge may answer with (greedy): enough for a number and a word around it."""

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SCALE = re.compile(r"(?<![\d.])\d+(?:\.\d+)?\s*(?:-|–|to)\s*\d+(?:\.\d+)?(?![\d.])", re.I)
"""A scale the judge restates ("1-10", "0 to 10"): not its score."""
_OUT_OF = re.compile(r"(?P<score>[-+]?(?:\d+\.?\d*|\.\d+))\s*(?:/|out of)\s*\d+(?:\.\d+)?", re.I)
"""A score with its denominator ("7 out of 10", "7/10"): the score."""
_CHOICE = re.compile(r"\b([AB])\b")


class RemoteRewardError(StageUserError):
    """A reward server refused, was unreachable, or answered what a score cannot be; the message names
    the term, the URL, the status and the batch."""


@dataclass
class RemoteOutcome:
    """One batch's scores from a server, and what getting them cost."""

    values: list[float | None]
    """One per response; None where no score arrived (`failures` says why)."""
    failures: dict[int, str] = field(default_factory=dict)
    """Row -> why its score never arrived (the last try's status or error)."""
    retries: int = 0
    """Requests sent again after a retriable failure."""
    seconds: float = 0.0
    """Wall time of the whole batch."""


class _Failed(Exception):
    """A request that will not be retried (again): `reason` names the status or the error."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Pace:
    """`max_rpm`: request starts at least 60 / max_rpm seconds apart (shared by one batch's requests)."""

    interval: float
    next_start: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def wait(self) -> None:
        async with self.lock:
            now = time.monotonic()
            start = max(now, self.next_start)
            self.next_start = start + self.interval
        await asyncio.sleep(start - now)


@dataclass
class _Batch:
    """What one batch's requests share: the connection, the server's limits, and the outcome they fill."""

    client: httpx.AsyncClient
    """The connection to the server, with its timeout and headers."""
    limit: asyncio.Semaphore
    """`max_concurrent`: requests in flight at once."""
    pace: _Pace | None
    """`max_rpm`'s spacing of request starts; None: unpaced."""
    outcome: RemoteOutcome
    """The batch's scores, failures and retries."""


class RemoteReward:
    """A remote term's client: `score(prompts, responses, complete, batch)` -> `RemoteOutcome`."""

    def __init__(self, term: RewardTerm):
        assert term.remote is not None, term
        self.term, self.cfg = term, term.remote
        self._model: str | None = self.cfg.extra_body.get("model")

    def describe(self) -> str:
        return f"reward term {self.term.name!r} ({self.cfg.kind} at {self.cfg.url})"

    @property
    def endpoint(self) -> str:
        return self.cfg.url.rstrip("/") + "/chat/completions" if self.cfg.judges else self.cfg.url

    def headers(self) -> dict[str, str]:
        try:
            return bearer(self.cfg.api_key_env, "remote.api_key_env")
        except LookupError as e:
            raise RemoteRewardError(f"{self.describe()}: {e}") from None

    def exposed_token(self) -> str | None:
        """A warning where a bearer token would travel in plain text (http to a host that is not this machine)."""
        exposed = exposed_token(self.cfg.url, self.cfg.api_key_env)
        return f"{self.describe()}: {exposed}" if exposed else None

    def check(self, timeout: float = 10.0) -> None:
        """Refuse a server that does not answer, before anything trains: one request, no retries. A
        judge's server must list its models (`/models`); a scoring server must answer a GET on its URL
        at all (any status but a connection failure or a 5xx)."""
        try:
            self._probe(timeout)
        except TryFailed as e:
            raise RemoteRewardError(f"{self.describe()}: {e.reason}") from None

    def _probe(self, timeout: float = 10.0) -> None:
        """`check`'s one request (a judge's first listed model kept); `TryFailed` saying why the server fails it."""
        url = self.cfg.url.rstrip("/") + "/models" if self.cfg.judges else self.cfg.url
        try:
            answer = httpx.get(url, headers=self.headers(), timeout=timeout)
        except httpx.HTTPError as e:
            raise TryFailed(f"the server does not answer ({type(e).__name__}: {e}); start it before the run",
                            timed_out=isinstance(e, httpx.TimeoutException)) from None
        if answer.status_code >= 500 or (self.cfg.judges and answer.status_code != 200):
            raise TryFailed(f"GET {url} answered HTTP {answer.status_code}: {answer.text[:200]!r}", answer)
        if self.cfg.judges and self._model is None:
            try:
                listed = _json(answer)
            except _Failed as e:
                raise TryFailed(f"GET {url}: {e.reason}", answer) from None
            models = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
            if not models:
                raise TryFailed(f"GET {url} lists no model; set remote.extra_body.model", answer)
            self._model = models[0]

    def lineage(self) -> str:
        """What the run's tag says of this term: kind, URL, weight, the template's digest for a judge,
        and the run whose checkpoint a scoring server says it serves (`rlhf serve-reward` says so)."""
        cfg, served = self.cfg, ""
        if cfg.judges:
            if self._model is None:
                try:
                    self.check()
                except RemoteRewardError:
                    pass  # the run's own requests will say what is wrong
            digest = hashlib.sha256(cfg.prompt_template.encode()).hexdigest()[:12]
            served = f", template {digest}, model {self._model}"
        else:
            try:
                run_id = httpx.get(cfg.url, headers=self.headers(), timeout=10.0).json().get("run_id")
            except (httpx.HTTPError, ValueError, RecursionError, AttributeError):
                run_id = None
            served = f", serving run {run_id}" if run_id else ""
        return f"{self.term.name}={cfg.kind} {cfg.url} (weight {self.term.weight:g}{served})"

    def score(self, prompts: list[list[dict]], responses: list[str], complete: list[bool],
              batch: int | str, references: list[str] | None = None) -> RemoteOutcome:
        """The server's scores for these responses (`batch`: the iteration, or which evaluation;
        `references`: the SFT policy's response to each one's prompt, which a `choice` judge compares
        it with)."""
        assert (references is not None) == self.cfg.pairwise, self.describe()
        start = time.monotonic()
        outcome = _run(self._score(prompts, responses, complete, references))
        outcome.seconds = time.monotonic() - start
        return outcome

    async def _score(self, prompts: list[list[dict]], responses: list[str], complete: list[bool],
                     references: list[str] | None) -> RemoteOutcome:
        cfg, size = self.cfg, self.cfg.responses_per_request
        if cfg.judges and self._model is None:
            await self._resolve_model()
        groups = [list(range(i, min(i + size, len(responses)))) for i in range(0, len(responses), size)]
        outcome = RemoteOutcome(values=[None] * len(responses))
        timeout = httpx.Timeout(cfg.timeout_s)
        async with httpx.AsyncClient(timeout=timeout, headers=self.headers()) as client:
            batch = _Batch(client, asyncio.Semaphore(cfg.max_concurrent),
                           _Pace(60.0 / cfg.max_rpm) if cfg.max_rpm else None, outcome)

            async def one(rows: list[int]) -> None:
                reference = references[rows[0]] if references is not None else None
                policy_first = reference is not None and _policy_first(responses[rows[0]], reference)
                body = self._body([prompts[i] for i in rows], [responses[i] for i in rows],
                                  [complete[i] for i in rows], reference, policy_first)
                try:
                    values = await self._send(batch, body, len(rows), policy_first)
                except _Failed as e:
                    outcome.failures.update({i: e.reason for i in rows})
                    return
                for i, value in zip(rows, values, strict=True):
                    if value is None:
                        outcome.failures[i] = "the server gave no score (null)"
                    outcome.values[i] = value

            await asyncio.gather(*(one(rows) for rows in groups))
        return outcome

    async def _resolve_model(self) -> None:
        """The judge's model, the server's first listed, asked for with the requests' retries and backoff."""
        try:
            await retried_async(lambda: asyncio.to_thread(self._probe), self.cfg)
        except RequestFailed as e:
            raise RemoteRewardError(f"{self.describe()}: {e}") from None

    def _body(self, prompts: list[list[dict]], responses: list[str], complete: list[bool], reference: str | None,
              policy_first: bool) -> dict:
        if self.cfg.kind == "score":
            return {"prompts": prompts, "responses": responses, "complete": complete}
        (messages,), (response,) = prompts, responses
        prompt = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        filled = {"{prompt}": prompt, "{response}": fenced(response)}
        if reference is not None:
            a, b = (response, reference) if policy_first else (reference, response)
            filled |= {"{a}": fenced(a), "{b}": fenced(b)}
        content = re.sub("|".join(re.escape(k) for k in filled), lambda m: filled[m.group()], self.cfg.prompt_template)
        return {"model": self._model, "messages": [{"role": "user", "content": content}],
                "max_tokens": JUDGE_MAX_TOKENS, "temperature": 0.0, **self.cfg.extra_body}

    async def _send(self, batch: _Batch, body: dict, rows: int, policy_first: bool) -> list[float | None]:
        """One request's values (`rows` of them; `policy_first`: as `_values` reads them), within the
        batch's limits, retried as the module says (each retry counted in `batch.outcome`); `_Failed`
        once it gives up."""
        async def attempt() -> list[float | None]:
            if batch.pace is not None:
                await batch.pace.wait()
            async with batch.limit:
                with http_failures(f"no answer within {self.cfg.timeout_s:g} s (remote.timeout_s)"):
                    answer = await batch.client.post(self.endpoint, json=body)
                if answer.status_code != 200:
                    raise TryFailed(f"HTTP {answer.status_code}: {answer.text[:200]!r}", answer)
                return self._values(answer, rows, policy_first)

        def counted() -> None:
            batch.outcome.retries += 1

        try:
            return await retried_async(attempt, self.cfg, on_retry=counted)
        except RequestFailed as e:
            raise _Failed(str(e)) from None

    def _values(self, answer: httpx.Response, rows: int, policy_first: bool) -> list[float | None]:
        """The scores in a 200 answer, checked: `_Failed` for a body that is not what the kind promises
        (`policy_first`: a `choice` judge's A is the response judged)."""
        body = _json(answer)
        if self.cfg.judges:
            try:
                text = body["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError):
                raise _Failed(f"not a chat completion: {answer.text[:200]!r}") from None
            if not isinstance(text, str):
                raise _Failed(f"the judge's content is not text: {answer.text[:200]!r}")
            if self.cfg.pairwise:
                choice = _CHOICE.search(text)
                if choice is None:
                    raise _Failed(f"the judge's answer names neither A nor B: {text[:200]!r}")
                return [float((choice.group(1) == "A") == policy_first)]
            return [self._judged_number(text)]
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list) or len(scores) != rows:
            raise _Failed(f"expected {{'scores': [{rows} numbers]}}, got {answer.text[:200]!r}")
        values: list[float | None] = []
        for value in scores:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise _Failed(f"{value!r} is not a finite number, in {answer.text[:200]!r}")
            values.append(None if value is None else float(value))
        return values


    def _judged_number(self, text: str) -> float:
        """A `number` judge's score: `score_pattern`'s first group, else the one number of the answer once a
        restated scale ("1-10", "0 to 10") and a denominator ("7 out of 10", "7/10") are set aside; `_Failed`
        where there is none, or several, or it is not a finite number within the term's range."""
        if self.cfg.score_pattern is not None:
            found = re.search(self.cfg.score_pattern, text)
            numbers = [found.group(1).strip()] if found and _NUMBER.fullmatch(found.group(1).strip()) else []
        else:
            plain = _OUT_OF.sub(r"\g<score>", _SCALE.sub(" ", text))
            numbers = _NUMBER.findall(plain)
        if len(numbers) != 1:
            where = " in score_pattern's group" if self.cfg.score_pattern else ""
            raise _Failed(f"the judge's answer has {'no' if not numbers else 'more than one'} number{where}"
                          f"{'' if len(numbers) < 2 else '; set remote.score_pattern to say which is the score'}: "
                          f"{text[:200]!r}")
        value, within = float(numbers[0]), self.cfg.scores_within
        if not math.isfinite(value) or (within is not None and not within[0] <= value <= within[1]):
            raise _Failed(f"the judge's score {numbers[0]} is not a finite number"
                          + (f" within score_range [{within[0]:g}, {within[1]:g}]" if within else "")
                          + f": {text[:200]!r}")
        return value


def fenced(text: str) -> str:
    """A policy's response as a judge's prompt holds it: between <response> tags, a closing tag inside it
    broken (`</response>` becomes `</ response>`), so the text cannot end itself early."""
    return "<response>\n" + re.sub(r"</(\s*)response", r"</ \1response", text, flags=re.I) + "\n</response>"


def _run(coroutine):
    """`asyncio.run(coroutine)`, on a thread of its own where this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _json(answer: httpx.Response):
    """The answer's JSON; `_Failed` for a body that is not JSON, or that Python will not read (an integer
    of over 4,300 digits: ValueError; thousands of nested brackets: RecursionError)."""
    try:
        return answer.json()
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _Failed(f"HTTP {answer.status_code} with a body that is not JSON ({type(e).__name__}): "
                      f"{answer.text[:200]!r}") from None


def _policy_first(response: str, reference: str) -> bool:
    """Whether a `choice` judge sees the response as A: a coin drawn from both texts, so that half the
    rows put it first (a judge's bias for a position cancels) and a rerun asks the same."""
    return hashlib.sha256(f"{response}\0{reference}".encode()).digest()[0] % 2 == 0


def remote_rewards(terms: list[RewardTerm]) -> list[RemoteReward]:
    """A client for each remote term."""
    return [RemoteReward(term) for term in terms]


def remote_values(clients: list[RemoteReward], prompts: list[list[dict]], responses: list[str], complete: list[bool],
                  batch: int | str, references: list[str] | None = None
                  ) -> tuple[dict[str, list[float | None]], int]:
    """Each remote term's scores by name (None where none arrived), and the retries it took; a `choice`
    judge compares each response with `references` (without them it is not asked: the SFT policy's
    own responses have nothing to be compared with). A term that failed more than `max_failed_share`
    of the batch stops the run (`RemoteRewardError`)."""
    values, retries = {}, 0
    for client in clients:
        if client.cfg.pairwise and references is None:
            continue
        outcome = client.score(prompts, responses, complete, batch, references if client.cfg.pairwise else None)
        if len(outcome.failures) > client.cfg.max_failed_share * len(responses):
            row, reason = min(outcome.failures.items())
            raise RemoteRewardError(f"{client.describe()}: batch {batch}: no score for {len(outcome.failures)} of "
                                    f"{len(responses)} responses, past remote.max_failed_share "
                                    f"{client.cfg.max_failed_share:g} (first: row {row}, {reason})")
        values[client.term.name], retries = outcome.values, retries + outcome.retries
    return values, retries


__all__ = ["RemoteOutcome", "RemoteReward", "RemoteRewardConfig", "RemoteRewardError", "remote_rewards",
           "remote_values"]
