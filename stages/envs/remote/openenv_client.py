"""Episodes on an OpenEnv server (`environment.server.kind: openenv`, openenv-core 0.3.0's protocol).

OpenEnv's `POST /reset` and `POST /step` build a fresh environment for every request (they keep no
episode), so an episode is one websocket session: `<url>/ws` (http -> ws, https -> wss), opened at
`reset`, with the bearer token of `environment.server.api_key_env` where one is set. Each frame is
JSON; the server answers each with `{"type": "observation", "data": {"observation": {...}, "reward":
number | null, "done": bool}}` or `{"type": "error", "data": {"message", "code"}}`.

    reset(row)   GET /schema once per server (`EnvironmentServer.action_schema`), then, on a new socket,
                 {"type": "reset", "data": <the row's columns but `messages` and `prompt`>}. The
                 episode's first messages are the row's, unless the reset observation has a non-empty
                 `messages` list of chat messages (then those). An MCP environment (its action schema
                 admits `list_tools` / `call_tool`) is asked {"type": "step", "data": {"type":
                 "list_tools"}}; its tools become OpenAI function schemas (`schemas()`).
    step(turn)   a turn with calls: each well-formed call is one {"type": "call_tool", "tool_name",
                 "arguments"} step, in order, answered by a `tool` message {"role": "tool", "name",
                 "content"}: the result's text parts joined by newlines, or "error: <message>" for the
                 observation's `error` (or a result flagged `is_error`). A malformed call (its reason)
                 is answered "error: <reason>", as is any call to an environment without tools, with
                 no request. The steps' rewards add up (null counts 0); the turn is `done` if a step
                 says so, and no later call of the turn is sent then.
                 A turn without calls, where the action schema has exactly one required field and it
                 is a string (a text action: the echo template's `message`): the step {<field>:
                 turn.content}; its reward and done are the turn's, and where not done its observation's
                 non-empty string fields (one: its text; several: `field: text` lines) are the next
                 `user` message. Otherwise (an MCP environment, any other action) the turn is the
                 episode's answer: no request, reward 0, done.
    close()      {"type": "close"}, a short wait for the server to close the socket, then ours closed.
                 It never raises.

Failures, as `EnvironmentServer.request`'s: opening the episode (connect and reset) is retried up to
`max_retries` times by `EnvironmentServer.retried` where it cannot connect, is refused with HTTP
408, 429 or 5xx, the socket closes before the reset is answered, or the server is at capacity
(`CAPACITY_REACHED`); waiting past `timeout_s` (to connect, or for any answer) is not retried. Once
the episode is open nothing is retried (the server's session holds the episode's state): a lost
connection, an error frame or an answer that is not what the protocol promises fails the episode
(`EpisodeRequestFailed`), not the run. Keep-alive pings are off: a tool that blocks the server's event
loop would miss them, and `timeout_s` bounds every wait anyway.
"""

from __future__ import annotations

import json
import math
import time

from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection, connect

from stages.common.clients import RequestFailed, TryFailed
from stages.envs.environment import Step
from stages.envs.parsers import AssistantTurn, ToolCall
from stages.envs.remote.served import EnvironmentServer, EpisodeRequestFailed, checked_messages, jsonable

CLOSE_WAIT_S = 2.0
"""Seconds `close` waits for the server to close the socket, and the closing handshake at most."""
MAX_MESSAGE_BYTES = 100 * 2 ** 20
"""The largest frame taken from the server (OpenEnv's own client takes 100 MB)."""
NOT_SENT = ("messages", "prompt")
"""The row's fields the reset does not send: the conversation is this side's."""
TOOL_ACTIONS = frozenset({"list_tools", "call_tool"})


class _Retriable(EpisodeRequestFailed):
    """The episode could not be opened, in a way worth another try (no connection, no room)."""


class OpenEnvEpisode:
    """One episode on an OpenEnv server: one websocket session, as the module says."""

    def __init__(self, server: EnvironmentServer):
        self.server = server
        self.socket: ClientConnection | None = None
        self.tools: list[dict] | None = None
        self.mcp = False
        self.text_field: str | None = None
        self.retries = 0

    def reset(self, row: dict) -> list[dict]:
        self.close()  # a second reset starts a new session
        schema = self.server.action_schema()
        self.mcp = admits_tools(schema)
        self.text_field = None if self.mcp else text_field(schema)
        data = jsonable({key: value for key, value in row.items() if key not in NOT_SENT})
        observation, _, _ = self._opened({"type": "reset", "data": data})
        try:
            shown = observation.get("messages")
            messages = list(checked_messages(shown, "reset")) if isinstance(shown, list) and shown else \
                list(row["messages"])
            if self.mcp:
                listed, _, _ = self._exchanged({"type": "step", "data": {"type": "list_tools"}}, "list_tools")
                self.tools = openai_tools(listed.get("tools"))
        except BaseException:
            self._dropped()  # the episode fails at its start: its session is let go at once
            raise
        return messages

    def schemas(self) -> list[dict] | None:
        """The MCP environment's tools as OpenAI function schemas; None where it has none."""
        return self.tools

    def step(self, turn: AssistantTurn) -> Step:
        if self.socket is None:
            raise EpisodeRequestFailed("step: the episode is not open (no reset, or it was closed)")
        if turn.calls:
            return self._called(turn.calls)
        if self.text_field is None:
            return Step(None, 0.0, True)
        observation, reward, done = self._exchanged({"type": "step", "data": {self.text_field: turn.content}},
                                                    f"step ({self.text_field})")
        return Step(None if done else [{"role": "user", "content": observation_text(observation)}], reward, done)

    def _called(self, calls: list[ToolCall | str]) -> Step:
        messages, reward, done = [], 0.0, False
        for call in calls:
            if isinstance(call, str):
                messages.append({"role": "tool", "name": "", "content": f"error: {call}"})
            elif not self.mcp:
                messages.append({"role": "tool", "name": call.name,
                                 "content": "error: the environment has no tools; answer in text"})
            else:
                action = {"type": "call_tool", "tool_name": call.name, "arguments": jsonable(call.arguments)}
                observation, step_reward, done = self._exchanged({"type": "step", "data": action},
                                                                 f"call_tool {call.name!r}")
                messages.append({"role": "tool", "name": call.name, "content": tool_text(observation)})
                reward += step_reward
                if done:
                    break
        return Step(messages, reward, done)

    def _opened(self, reset: dict) -> tuple[dict, float, bool]:
        """A new session's socket, and the reset's answer on it: retried as the module says."""
        cfg = self.server.cfg

        def attempt() -> tuple[dict, float, bool]:
            try:
                self.socket = connect(websocket_url(self.server.url), additional_headers=self.server.headers(),
                                      open_timeout=cfg.timeout_s, close_timeout=CLOSE_WAIT_S, ping_interval=None,
                                      max_size=MAX_MESSAGE_BYTES)
                return self._exchanged(reset, "reset", opening=True)
            except TimeoutError:
                self._dropped()
                raise TryFailed(f"reset: no connection within {cfg.timeout_s:g} s (environment.server.timeout_s)",
                                timed_out=True) from None
            except InvalidStatus as e:  # its `Retry-After` is honoured, as an HTTP answer's
                raise TryFailed(f"reset: GET /ws answered HTTP {e.response.status_code}", e.response) from None
            except _Retriable as e:
                self._dropped()
                raise TryFailed(str(e)) from None
            except (OSError, WebSocketException) as e:
                self._dropped()
                raise TryFailed(f"reset: cannot connect to {websocket_url(self.server.url)} "
                                f"({type(e).__name__}: {e})") from None
            except EpisodeRequestFailed:
                self._dropped()
                raise

        try:
            return self.server.retried(attempt, self)
        except RequestFailed as e:
            raise EpisodeRequestFailed(str(e)) from None

    def _exchanged(self, message: dict, where: str, opening: bool = False) -> tuple[dict, float, bool]:
        """One frame sent and its answer received, checked: (observation, reward, done). A connection lost
        while `opening` the episode may be tried again; once it is open, not."""
        lost = _Retriable if opening else EpisodeRequestFailed
        try:
            frame = json.dumps(message)
        except (TypeError, ValueError) as e:
            raise EpisodeRequestFailed(f"{where}: the request is not JSON ({e})") from None
        try:
            self.socket.send(frame)
        except ConnectionClosed:
            pass  # the server closed first: what it said before (a capacity refusal) is still to be read
        try:
            raw = self.socket.recv(timeout=self.server.cfg.timeout_s)
        except TimeoutError:
            raise EpisodeRequestFailed(f"{where}: no answer within {self.server.cfg.timeout_s:g} s "
                                       "(environment.server.timeout_s)") from None
        except ConnectionClosed as e:
            raise lost(f"{where}: the server closed the connection ({e})") from None
        except (OSError, WebSocketException) as e:
            raise lost(f"{where}: the connection failed ({type(e).__name__}: {e})") from None
        return checked_reply(raw, where)

    def _dropped(self) -> None:
        socket, self.socket = self.socket, None
        if socket is not None:
            try:
                socket.close()
            except Exception:  # noqa: BLE001 - a socket that is going away anyway
                pass

    def close(self) -> None:
        """The session ended on both sides; never raises (the server forgets a dropped session itself)."""
        socket = self.socket
        if socket is None:
            return
        try:
            socket.send(json.dumps({"type": "close"}))
            deadline = time.monotonic() + CLOSE_WAIT_S
            while time.monotonic() < deadline:
                socket.recv(timeout=max(deadline - time.monotonic(), 0.0))
        except Exception:  # noqa: BLE001 - closed (as asked), timed out or gone: the socket is closed below
            pass
        self._dropped()


def websocket_url(url: str) -> str:
    """A server's base URL's `/ws` route: http -> ws, https -> wss."""
    return "ws" + url.rstrip("/").removeprefix("http") + "/ws"


def checked_reply(raw: str | bytes, where: str) -> tuple[dict, float, bool]:
    """An answer frame as (observation, reward, done); `EpisodeRequestFailed` for an error frame (a
    capacity refusal is retriable) or one that is not what the protocol promises."""
    try:
        reply = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        raise EpisodeRequestFailed(f"{where}: the answer is not JSON: {str(raw)[:200]!r}") from None
    data = reply.get("data") if isinstance(reply, dict) else None
    if isinstance(reply, dict) and reply.get("type") == "error":
        data = data if isinstance(data, dict) else {}
        code, details = data.get("code"), data.get("errors")
        said = f"{where}: the server answered {code}: {str(data.get('message'))[:300]}" + \
            (f" {str(details)[:300]}" if details else "")
        raise (_Retriable if code == "CAPACITY_REACHED" else EpisodeRequestFailed)(said)
    if not isinstance(reply, dict) or reply.get("type") != "observation" or not isinstance(data, dict) or \
            not isinstance(data.get("observation"), dict):
        raise EpisodeRequestFailed(f"{where}: the answer is not an observation: {str(raw)[:200]!r}")
    reward, done = data.get("reward"), data.get("done")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise EpisodeRequestFailed(f"{where}: the reward {reward!r} is not a finite number (or null)")
    if not isinstance(done, bool):
        raise EpisodeRequestFailed(f"{where}: done must be true or false, got {done!r}")
    return data["observation"], 0.0 if reward is None else float(reward), done


def admits_tools(schema: dict) -> bool:
    """Whether an action schema is an MCP environment's: a `type` that may be `list_tools` or `call_tool`
    (in it or one of its `anyOf`/`oneOf` variants), or OpenEnv's bare `Action` (which it routes to MCP)."""
    definitions = schema.get("$defs") or {}

    def variants(node: dict) -> list[dict]:
        if isinstance(node.get("$ref"), str):
            node = definitions.get(node["$ref"].rsplit("/", 1)[-1], {})
        inner = [v for key in ("anyOf", "oneOf") for v in node.get(key) or [] if isinstance(v, dict)]
        return [node] + [found for v in inner for found in variants(v)]

    for variant in variants(schema):
        kind = (variant.get("properties") or {}).get("type")
        if isinstance(kind, dict):
            named = {kind.get("const"), kind.get("default"), *(kind.get("enum") or [])}
            if named & TOOL_ACTIONS:
                return True
    return schema.get("title") == "Action" and set(schema.get("properties") or {}) <= {"metadata"}


def text_field(schema: dict) -> str | None:
    """A text action's field: the schema's one required field, where it is a string; else None."""
    required = schema.get("required") or []
    if len(required) != 1:
        return None
    field = (schema.get("properties") or {}).get(required[0])
    return required[0] if isinstance(field, dict) and field.get("type") == "string" else None


def openai_tools(tools: object) -> list[dict] | None:
    """An MCP `list_tools` observation's tools as OpenAI function schemas (None for none); each tool's
    parameters are its `input_schema` (or `inputSchema`)."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise EpisodeRequestFailed(f"list_tools: tools must be a list of named tools, got {str(tools)[:200]!r}")
    schemas = []
    for tool in tools:
        parameters = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
        schemas.append({"type": "function", "function": {"name": tool["name"],
                                                         "description": tool.get("description") or "",
                                                         "parameters": parameters}})
    return schemas or None


def tool_text(observation: dict) -> str:
    """A `call_tool` observation as the tool message's text: the result's text parts, or the error."""
    error = observation.get("error")
    if error:
        message = error.get("message") or error.get("error_type") if isinstance(error, dict) else error
        return f"error: {message}"
    result = observation.get("result")
    if not isinstance(result, dict):
        return _text(result)
    parts = [part["text"] for part in result.get("content") or []
             if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)]
    text = "\n".join(parts) if parts else _text(result.get("data"))
    return f"error: {text}" if result.get("is_error") or result.get("isError") else text


def observation_text(observation: dict) -> str:
    """A text environment's observation as the next user message: its non-empty string fields."""
    texts = {key: value for key, value in observation.items() if isinstance(value, str) and value}
    if len(texts) == 1:
        return next(iter(texts.values()))
    return "\n".join(f"{key}: {value}" for key, value in texts.items())


def _text(value: object) -> str:
    """A JSON value as text: a string as it is, null as nothing, anything else as JSON."""
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)
