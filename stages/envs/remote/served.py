"""Environments behind HTTP (`environment.server`): each episode's `reset` and `step` are requests.

The model's turns stay token ids on this side (`stages.envs.loop`); the server sees chat messages,
and its messages enter the context as the template's delta, as an in-process environment's do.
Two protocols:

    ours (and verifiers: `rlhf serve-env --kind verifiers` serves one on it), `servers.env_server`:
      GET  / (or /health)         {"protocol": "rlhf-env/1", "serves": "ours" | "verifiers", "name": ...}
      GET  /dataset?split=train   {"rows": [{"messages": [...], <columns>...}]}   (404: it has none)
      POST /reset {"row": {...}}  {"episode": id, "messages": [...], "tools": [schemas] | null}
      POST /step  {"episode": id, "turn": n, "assistant": {text, content, reasoning, calls}}
                                  {"messages": [...] | null, "reward": float, "done": bool, "restart": bool}
                                  (`restart`, optional: the messages are a rewritten history, `Step.restart`)
      POST /close {"episode": id}
      POST /reset_many {"rows": [...]}, /step_many {"steps": [{"episode", "turn", "assistant"}, ...]},
           /close_many {"episodes": [{"episode": id}, ...]}   (each with "timeout_s", "at_once")
                                  {"results": [{"status": 200, "answer": {...}} | {"status": n, "error": ...}]}
                                  a round's resets, steps or closes in one request, each item answered as its
                                  own request would be (servers that say `"batches": true` at GET /), at most
                                  `at_once` at a time, or 504 where not done within `timeout_s`
    openenv: an OpenEnv server's websocket sessions (`stages.envs.remote.openenv_client`).

Failure rules, as remote rewards' (`stages.rewards.remote`; `stages.common.clients`): a request that
cannot connect or gets HTTP 408, 429 or 5xx is retried up to `max_retries` times after exponential
backoff with full jitter; one that takes longer than `timeout_s` is not asked again (a slow server
stays slow: the episode fails, the others' turns go on). Any other refusal, or an answer that is not
what the protocol promises, fails the episode (`failed`: out of the update, counted in
`rollout/failed_share`), not the run. A server that restarted forgets its episodes: a step it answers
404 is replayed on a new episode (the reset and every earlier turn, each answer checked against the
one recorded), so a restart costs no episode of a deterministic environment. A server that does not
answer at all is refused before any stage trains (`EnvironmentServer.check`). In a batch, an item the
server lost (404) or could not take now (408, 429, 5xx) is sent again alone, by the rules above.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import httpx

from rlhf.sections.base import DataSource
from rlhf.sections.environment import EnvironmentServerConfig
from stages.common.clients import (
    RETRIED_STATUSES,
    RequestFailed,
    TryFailed,
    bearer,
    exposed_token,
    http_failures,
    retried,
)
from stages.common.errors import StageUserError
from stages.envs.environment import Step
from stages.envs.parsers import AssistantTurn, turn_body

PROTOCOL = "rlhf-env/1"
BATCH_GRACE_S = 5.0
"""Seconds a batch request may take past `timeout_s`: the server answers each item by `timeout_s` (an item
not done by then with 504), then the answer has to travel."""
T = TypeVar("T")


class EnvironmentServerError(StageUserError):
    """An environment server that does not answer, or is not what the config says it is."""


class EpisodeRequestFailed(Exception):
    """A request about one episode failed for good: the episode fails, with this reason."""


class EpisodeLost(EpisodeRequestFailed):
    """The server does not know the episode (it restarted): the episode may be replayed."""


class Retried(Protocol):
    """What counts its requests tried again: an episode on a server."""

    retries: int


class EnvironmentServer:
    """A client of one environment server, shared by every episode of a run (`httpx.Client` is thread-safe)."""

    def __init__(self, cfg: EnvironmentServerConfig):
        self.cfg = cfg
        self.url = cfg.url.rstrip("/")
        self._client: httpx.Client | None = None
        self._action_schema: dict | None = None
        self._schema_lock = threading.Lock()

    def describe(self) -> str:
        return f"the {self.cfg.kind} environment server at {self.cfg.url}"

    def headers(self) -> dict[str, str]:
        try:
            return bearer(self.cfg.api_key_env, "environment.server.api_key_env")
        except LookupError as e:
            raise EnvironmentServerError(f"{self.describe()}: {e}") from None

    def exposed_token(self) -> str | None:
        """A warning where a bearer token would travel in plain text (http to a host that is not this machine)."""
        exposed = exposed_token(self.cfg.url, self.cfg.api_key_env)
        return f"{self.describe()}: {exposed}" if exposed else None

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.cfg.max_concurrent + 4)
            self._client = httpx.Client(timeout=self.cfg.timeout_s, headers=self.headers(), limits=limits)
        return self._client

    def check(self, timeout: float = 10.0) -> dict:
        """What the server says it serves; `EnvironmentServerError` for one that does not answer, or
        serves another protocol or kind than the config's. One request, no retries."""
        path = "/health" if self.cfg.kind == "openenv" else "/"
        try:
            answer = httpx.get(self.url + path, headers=self.headers(), timeout=timeout)
        except httpx.HTTPError as e:
            raise EnvironmentServerError(f"{self.describe()}: the server does not answer ({type(e).__name__}: {e}); "
                                         "start it before the run (`rlhf serve-env`)") from None
        if answer.status_code != 200:
            raise EnvironmentServerError(f"{self.describe()}: GET {path} answered HTTP {answer.status_code}: "
                                         f"{answer.text[:200]!r}")
        if self.cfg.kind == "openenv":
            return {"serves": "openenv"}
        try:
            info = answer.json()
        except (ValueError, RecursionError):  # not JSON; or thousands of nested brackets
            info = None
        if not isinstance(info, dict) or info.get("protocol") != PROTOCOL:
            raise EnvironmentServerError(f"{self.describe()}: GET / is not an {PROTOCOL} server's answer: "
                                         f"{answer.text[:200]!r} (an OpenEnv server is kind 'openenv')")
        if self.cfg.kind == "verifiers" and info.get("serves") != "verifiers":
            raise EnvironmentServerError(f"{self.describe()}: the server serves {info.get('serves')!r}, not a "
                                         "verifiers environment (`rlhf serve-env --kind verifiers`)")
        return info

    def dataset(self, split: str) -> list[dict]:
        """The environment's own prompts (`prompts: {path: "env:"}`), as records: `messages` and columns."""
        self.check()
        try:
            body = self.request("GET", f"/dataset?split={split}", None)
        except EpisodeRequestFailed as e:
            raise EnvironmentServerError(f"{self.describe()}: no {split} dataset ({e})") from None
        rows = body.get("rows")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise EnvironmentServerError(f"{self.describe()}: GET /dataset answered no list of rows")
        return rows

    def request(self, method: str, path: str, body: dict | None, episode: Retried | None = None,
                grace_s: float = 0.0) -> dict:
        """One request's JSON object, retried as the module says (each retry counted in `episode`'s
        `retries`, where it is for one; `grace_s` seconds past `timeout_s` allowed, a batch's), `EpisodeLost`
        on a 404 of an episode's route, `EpisodeRequestFailed` once it gives up or the answer is no JSON object."""
        def attempt() -> dict:
            with http_failures(f"no answer within {self.cfg.timeout_s:g} s (environment.server.timeout_s)"):
                answer = self.client.request(method, self.url + path, json=body,
                                             timeout=self.cfg.timeout_s + grace_s)
            if answer.status_code == 200:
                return _object(answer, f"{method} {path}")
            reason = f"HTTP {answer.status_code}: {answer.text[:300]}"
            if answer.status_code == 404 and body is not None and "episode" in body:
                raise EpisodeLost(f"{method} {path}: {reason}")
            raise TryFailed(reason, answer)

        try:
            return self.retried(attempt, episode)
        except RequestFailed as e:
            raise EpisodeRequestFailed(f"{method} {path}: {e}") from None

    def batches(self) -> bool:
        """Whether the server takes a round's resets and steps as one request (it says so at GET /); no answer: no."""
        try:
            return bool(self.check().get("batches"))
        except EnvironmentServerError:
            return False

    def batch(self, path: str, items: list[dict], at_once: int) -> list[dict | Exception | None]:
        """`items` as one request to a batch route (`/reset_many`: rows; `/step_many`, `/close_many`: bodies),
        retried as one request is: each item's answer; None for one to send again alone (the server lost its
        episode, or could not take it now); `EpisodeRequestFailed` for one refused, or for every item where
        the request itself failed (raised). The server answers `at_once` items at a time."""
        single = path.removesuffix("_many")
        body = self.request("POST", path, {{"/reset": "rows", "/step": "steps"}.get(single, "episodes"): items,
                                           "timeout_s": self.cfg.timeout_s, "at_once": at_once}, grace_s=BATCH_GRACE_S)
        results = body.get("results")
        if not isinstance(results, list) or len(results) != len(items) or \
                not all(isinstance(result, dict) for result in results):
            raise EpisodeRequestFailed(f"POST {path}: not one result per item: {str(results)[:200]!r}")
        out: list[dict | Exception | None] = []
        for result in results:
            status, answer = result.get("status"), result.get("answer")
            if status == 200 and isinstance(answer, dict):
                out.append(answer)
            elif status == 504:  # the server's deadline for the item, `timeout_s`: a slow one is not asked again
                out.append(EpisodeRequestFailed(f"POST {single}: no answer within {self.cfg.timeout_s:g} s "
                                                "(environment.server.timeout_s)"))
            elif status in RETRIED_STATUSES or (status == 404 and single == "/step"):
                out.append(None)
            else:
                out.append(EpisodeRequestFailed(f"POST {single}: HTTP {status}: {str(result.get('error'))[:300]}"))
        return out

    def retried(self, attempt: Callable[[], T], episode: Retried | None = None) -> T:
        """`attempt` tried by `stages.common.clients.retried` on this server's settings, a timeout not again (a
        slow server stays slow), each retry counted in `episode`'s `retries`; `RequestFailed` once it gives up."""
        def counted() -> None:
            if episode is not None:
                episode.retries += 1

        return retried(attempt, self.cfg, retry_timeouts=False, on_retry=counted)

    def action_schema(self) -> dict:
        """An OpenEnv server's action schema (`GET /schema`'s `action`), asked once and kept."""
        with self._schema_lock:
            if self._action_schema is None:
                action = self.request("GET", "/schema", None).get("action")
                if not isinstance(action, dict):
                    raise EpisodeRequestFailed(f"GET /schema: no action schema in the answer ({str(action)[:200]!r})")
                self._action_schema = action
            return self._action_schema

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


ENV_SCHEME = "env:"
"""A data source read from the environment server: `env:` (its train split) or `env:<split>`."""


def env_source(source: DataSource, settings, folder: Path) -> DataSource:
    """`source` as the stage reads it: an `env:` one fetched from `settings.server` (`ppo.environment`)
    into a JSON-lines file in `folder` named by its content (validated then by the prompt contract,
    as any file); any other unchanged."""
    if not source.path.startswith(ENV_SCHEME):
        return source
    rows = EnvironmentServer(settings.server).dataset(source.path[len(ENV_SCHEME):] or "train")
    payload = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    path = folder / f"env-{hashlib.sha256(payload.encode()).hexdigest()[:16]}.jsonl"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(payload)
        partial.replace(path)  # whole or absent, whoever reads it
    return source.model_copy(update={"path": str(path)})


def served_environment(settings) -> list[EnvironmentServer]:
    """The environment server `settings` (`ppo.environment`, or None) names, as a list of none or one."""
    return [] if settings is None or settings.server is None else [EnvironmentServer(settings.server)]


def server_problems(settings) -> list[str]:
    """The pre-flight check of `ppo.environment` (an `EnvironmentConfig` or None): a server that does
    not answer, or is not what the config says, as one line; none for other environments."""
    problems = []
    for server in served_environment(settings):
        try:
            server.check()
        except EnvironmentServerError as e:
            problems.append(str(e))
    return problems


class ServedEpisode:
    """One episode on a server of our protocol: the `Environment` the loop steps. It records its turns
    and the server's answers, to replay them where the server lost the episode."""

    def __init__(self, server: EnvironmentServer):
        self.server = server
        self.episode: str | None = None
        self.tools: list[dict] | None = None
        self.row: dict = {}
        self.first: list[dict] = []
        self.history: list[tuple[dict, dict]] = []  # (turn sent, answer received)
        self.retries = 0

    def reset(self, row: dict) -> list[dict]:
        self.row = row
        return self.begun(row, self.server.request("POST", "/reset", {"row": jsonable(row)}, self))

    def begun(self, row: dict, body: dict) -> list[dict]:
        """The episode of `row` as the server's answer to its reset (`body`) began it: its opening messages."""
        self.row = row
        self.first = self._opened(body)
        return list(self.first)

    def _started(self) -> list[dict]:
        return self._opened(self.server.request("POST", "/reset", {"row": jsonable(self.row)}, self))

    def _opened(self, body: dict) -> list[dict]:
        self.episode = body.get("episode")
        if not isinstance(self.episode, str):
            raise EpisodeRequestFailed(f"POST /reset: no episode id in {str(body)[:200]!r}")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EpisodeRequestFailed(f"POST /reset: tools must be a list of JSON schemas, got {str(tools)[:200]!r}")
        self.tools = tools or None
        return checked_messages(body.get("messages"), "POST /reset", allow_none=False)

    def schemas(self) -> list[dict] | None:
        """The tools' schemas the server gave at reset, for the chat template's tools section."""
        return self.tools

    def step(self, turn: AssistantTurn) -> Step:
        sent = self.asked(turn)
        try:
            answer = self.server.request("POST", "/step", {"episode": self.episode, **sent}, self)
        except EpisodeLost as lost:
            self._replay(lost)
            answer = self.server.request("POST", "/step", {"episode": self.episode, **sent}, self)
        return self.answered(sent, answer)

    def asked(self, turn: AssistantTurn) -> dict:
        """What `POST /step` sends for `turn` (beside the episode's id): its number and the model's turn."""
        return {"turn": len(self.history), "assistant": turn_body(turn)}

    def answered(self, sent: dict, answer: dict) -> Step:
        """The server's answer to the turn `sent`, checked and recorded (for a replay)."""
        step = checked_answer(answer)
        self.history.append((sent, answer))
        return step

    def _replay(self, lost: EpisodeLost) -> None:
        """A new episode on the server, brought to where this one was: its reset and every earlier turn
        sent again, each answer the same as the one recorded (else the episode fails)."""
        self.retries += 1
        if self._started() != self.first:
            raise EpisodeRequestFailed(f"{lost}; replayed on a new episode, the server began it differently")
        for at, (sent, answer) in enumerate(self.history):
            again = self.server.request("POST", "/step", {"episode": self.episode, **sent}, self)
            if again != answer:
                raise EpisodeRequestFailed(f"{lost}; replayed on a new episode, turn {at} was answered differently "
                                           f"({str(again)[:120]!r}, before {str(answer)[:120]!r})")

    def close(self) -> None:
        if self.episode is not None:
            try:
                self.server.client.post(self.server.url + "/close", json={"episode": self.episode}, timeout=5.0)
            except httpx.HTTPError:
                pass  # the server forgets idle episodes itself
            self.episode = None


def checked_messages(messages: object, where: str, allow_none: bool = True) -> list[dict] | None:
    """A server's messages: a list of chat messages, each with a string `role` and a string (or absent)
    `content`; `EpisodeRequestFailed` naming what is wrong otherwise."""
    if messages is None and allow_none:
        return None
    if not isinstance(messages, list):
        raise EpisodeRequestFailed(f"{where}: messages must be a list of chat messages, got {str(messages)[:200]!r}")
    for at, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content", ""), str):
            raise EpisodeRequestFailed(f"{where}: message {at} is not a chat message with a role and a text "
                                       f"content: {str(message)[:200]!r}")
    return messages


def checked_answer(answer: dict) -> Step:
    """A step's answer as a `Step`: messages checked, a finite reward, booleans `done` and `restart`."""
    reward, done, restart = answer.get("reward", 0.0), answer.get("done", False), answer.get("restart", False)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EpisodeRequestFailed(f"POST /step: the reward {reward!r} is not a finite number")
    for name, flag in (("done", done), ("restart", restart)):
        if not isinstance(flag, bool):
            raise EpisodeRequestFailed(f"POST /step: {name} must be true or false, got {flag!r}")
    return Step(checked_messages(answer.get("messages"), "POST /step"), float(reward), done, restart)


def _object(answer: httpx.Response, where: str) -> dict:
    try:
        body = answer.json()
    except (ValueError, RecursionError):  # not JSON (or not UTF-8); or thousands of nested brackets
        body = None
    if not isinstance(body, dict):
        raise EpisodeRequestFailed(f"{where}: the answer is not a JSON object: {answer.text[:200]!r}")
    return body


def jsonable(row: dict) -> dict:
    """A prompt record as JSON: numpy and pandas values (a frame's row) as plain ones."""
    def plain(value):
        if hasattr(value, "tolist"):
            return value.tolist()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {key: plain(value) for key, value in row.items()}
