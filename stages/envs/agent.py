"""Agent programs as environments (`environment.agent: module:function`): the user's own program,
unchanged, calling the policy through an OpenAI-compatible endpoint.

The program is an async function `(row, client) -> reward | AgentResult`, `client` an
`openai.AsyncOpenAI` pointed at the policy. Each chat completion it asks for is an observation of the
episode loop (`stages.envs.loop`), and the policy's turn that the loop samples is the completion it gets
back, its tool calls in OpenAI's structured form as the family's parser read them. So to the loop an
agent episode is an `Environment`:

    reset(row)  the program starts; its first request's messages are the prompt, its tools the template's
    step(turn)  the turn is the answer to the request; the program's next request, or its end, the step

Token in, token out. The trainer keeps the ids it sampled for every turn, never the text the program
sends back. A request whose messages extend the last one's (that request's messages, then the assistant
turn, then new messages) appends the new messages to the episode, rendered by the chat template as a
delta after the turn (a fixed base). A request that does not (a summarising agent, a sub-agent's fresh
context) starts a new chain of the same episode (`Step.restart`): its messages are rendered whole, the
next turns are sampled on that context alone, and the chain trains on its episode's row attending to
itself only (`stages.envs.episode`), with the episode's one reward and advantage.

The endpoint (`AgentEndpoint`) is one per run: an aiohttp server on 127.0.0.1 at a free port, on its own
event loop, which also runs the programs. Every request must carry the run's token (a fresh random one)
and name a live episode on its path (`/episodes/<id>/v1/chat/completions`), so an episode's program
reaches only its own (or, on `/v1/chat/completions`, as its `model`: for a caller with one client per base
URL, verifiers' interception in its bridge). The program's reward lands on the last turn; an
`AgentResult` may add a reward per turn and columns for the reward terms. A program that raises, or
takes longer than `environment.tool_timeout_s` to ask again (or to return) after the policy's turn, its
tools' time, fails its episode, not the run.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aiohttp import web
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from stages.envs.environment import Step
from stages.envs.parsers import AssistantTurn

START_TIMEOUT_S = 30.0
"""Seconds the endpoint may take to start listening."""


@dataclass(frozen=True)
class AgentResult:
    """What an agent program may return instead of a bare reward."""

    reward: float
    """The episode's reward: it lands on the model's last turn."""
    turn_rewards: tuple[float, ...] = ()
    """A reward per model turn, in order, added to each turn's last token (fewer than the turns: the first ones)."""
    columns: dict = field(default_factory=dict)
    """Values the reward terms and the samples table read beside the record's own columns (`reward.columns`)."""


AgentFunction = Callable[[dict, Any], Awaitable["float | AgentResult"]]
"""`(row, client) -> reward | AgentResult`, `client` an `openai.AsyncOpenAI` pointed at the policy."""


class AgentFailed(Exception):
    """The agent program raised, timed out, ended before asking the policy anything, or asked with nothing new."""


@dataclass(kw_only=True)
class Relay:
    """One episode between its program and the loop: the program's requests waiting for the policy, the
    policy's answers waiting for the program, and the program's task."""

    requests: asyncio.Queue = field(default_factory=asyncio.Queue)
    replies: asyncio.Queue = field(default_factory=asyncio.Queue)
    run: asyncio.Task | None = None

    async def next(self, timeout_s: float) -> dict | None:
        """The program's next request, or None once the program is over; `AgentFailed` where neither
        comes within `timeout_s`."""
        asked = asyncio.ensure_future(self.requests.get())
        await asyncio.wait({asked, self.run}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if asked.done():
            return asked.result()
        asked.cancel()
        if not self.run.done():
            raise AgentFailed(f"the agent program neither asked the policy again nor returned within "
                              f"environment.tool_timeout_s ({timeout_s:g} s)")
        return None

    def end(self) -> None:
        """The episode let go (on the endpoint's loop): its program cancelled, a request still waiting answered 410."""
        if self.run is not None and not self.run.done():
            self.run.cancel()
        self.replies.put_nowait(None)

    async def answer(self, message: dict, timeout_s: float) -> dict | None:
        """`message` answers the waiting request; then the program's next request, or None once it is over."""
        await self.replies.put(message)
        return await self.next(timeout_s)


class SharedConnections(DefaultAsyncHttpxClient):
    """The endpoint's one httpx connection pool for every episode's client. A program that closes its client
    (`async with client:`) must not close the others' connections: `aclose` leaves it open, `close_pool` closes it."""

    async def aclose(self) -> None:
        return None

    async def close_pool(self) -> None:
        await super().aclose()


class AgentEndpoint:
    """The policy's chat-completions endpoint for a run's agent programs, and the event loop they run on.
    verifiers' bridge (`servers/verifiers_bridge.py`) serves its harness's requests on one too."""

    IDLE_S: ClassVar[float] = 30.0
    """Seconds a connection may sit without a request (silent from the start, headers left half-sent, or kept
    alive) before the endpoint closes it: a client cannot hold sockets forever. httpx, which the OpenAI client
    uses, lets its own idle connections go after 5 s, so no request races the close."""

    def __init__(self, keep_alive: bool = True):
        self.keep_alive = keep_alive
        """False: each answer closes its connection, for clients that never close theirs (verifiers'
        interception keeps one per rollout: kept-alive sockets piled up to the process's limit)."""
        self.token = secrets.token_urlsafe(32)
        self.live: dict[str, Relay] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-endpoint", daemon=True)
        self._thread.start()
        self.url = self.call(self._serve(), START_TIMEOUT_S)

    def call(self, coroutine, timeout: float | None = None):
        """`coroutine` run on the endpoint's loop, from a caller's thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _serve(self) -> str:
        self._http = SharedConnections()
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)  # the episode named by the body's `model`
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.IDLE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    @property
    def shared_url(self) -> str:
        """One base URL for every episode, each request naming its episode's key as its `model`: for a caller
        that keeps one client per base URL (verifiers' interception), so its episodes share one connection pool."""
        return f"{self.url}/v1"

    @staticmethod
    def key_of(client) -> str:
        """The episode key of a client `client(key)` made (its path's)."""
        return str(client.base_url).rstrip("/").split("/")[-2]

    def client(self, key: str):
        """An `openai.AsyncOpenAI` for episode `key`'s path, with the run's token, on the endpoint's one
        connection pool: a client of its own would build an SSL context (the CA bundle read) per episode,
        38 ms each here, on the loop every program runs on."""
        return AsyncOpenAI(base_url=f"{self.url}/episodes/{key}/v1", api_key=self.token, max_retries=0, timeout=None,
                           http_client=self._http)

    def close(self) -> None:
        """Every program still running cancelled, the server stopped, the loop ended."""
        async def stop():
            for relay in list(self.live.values()):
                relay.end()
            await self._runner.cleanup()
            await self._http.close_pool()

        try:
            self.call(stop(), START_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(START_TIMEOUT_S)

    async def _completion(self, request):
        """A program asks the policy: the request waits in its episode's relay until the loop's turn answers it.
        Every answer, refusals included, closes its connection where the endpoint does not keep them alive."""
        response = await self._answer(request)
        if not self.keep_alive:
            response.force_close()
        return response

    async def _answer(self, request):
        header = request.headers.get("Authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode()):
            return web.json_response({"error": {"message": "a bearer token is required"}}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        key = request.match_info.get("episode")
        if key is not None and key not in self.live:
            return _no_episode()
        try:
            body = await request.json()
        except ValueError as e:  # not JSON, or not UTF-8
            return web.json_response({"error": {"message": f"the body is not JSON: {e}"}}, status=400)
        if not isinstance(body, dict) or body.get("n", 1) != 1 or not isinstance(body.get("messages"), list) \
                or not all(isinstance(m, dict) for m in body["messages"]):
            return web.json_response({"error": {"message": "a JSON object with a list of messages (objects), and one "
                                                           "choice (n: 1)"}}, status=400)
        relay = self.live.get(key if key is not None else str(body.get("model")))
        if relay is None:
            return _no_episode()
        await relay.requests.put(body)
        message = await relay.replies.get()
        if message is None:
            return web.json_response({"error": {"message": "the episode is over"}}, status=410)
        return await completion_response(request, body, message, self.keep_alive)


def _no_episode():
    return web.json_response({"error": {"message": "no such episode"}}, status=404)


async def completion_response(request, body: dict, message: dict, keep_alive: bool):
    """`message` as an OpenAI chat completion (or its one-chunk stream, where the request streams)."""
    reason = "tool_calls" if message.get("tool_calls") else "stop"
    completion = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": body.get("model", "policy"), "choices": [{"index": 0, "message": message,
                                                                     "finish_reason": reason}],
                  "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    if not body.get("stream"):
        return web.json_response(completion)
    chunk = completion | {"object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": message, "finish_reason": reason}]}
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    if not keep_alive:
        stream.force_close()  # before the headers are sent
    await stream.prepare(request)
    await stream.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
    await stream.write_eof()
    return stream


class AgentEpisode:
    """One episode of an agent program, as the loop's `Environment`."""

    def __init__(self, endpoint: AgentEndpoint, function: AgentFunction, timeout_s: float):
        self.endpoint, self.function = endpoint, function
        self.timeout_s = timeout_s
        """Seconds the program may take to ask again, or to return, after the policy's turn (`tool_timeout_s`)."""
        self.key, self.relay = uuid.uuid4().hex, Relay()
        self.seen: list[dict] = []
        """The last request's messages: what the next request extends."""
        self.tools: list[dict] | None = None
        self.names: dict[str, str] = {}
        """The tool calls' ids of the last turn -> their names (a tool message may name only the id)."""
        self.turns = 0
        self.turn_rewards: tuple[float, ...] = ()
        self.columns: dict = {}

    def reset(self, row: dict) -> list[dict]:
        self.endpoint.live[self.key] = self.relay
        self.endpoint.call(self._start(row))
        request = self.endpoint.call(self.relay.next(self.timeout_s))
        if request is None:
            self._result()  # raises why it ended
            raise AgentFailed("the agent program ended before asking the policy anything")
        self.seen, self.tools = request["messages"], request.get("tools") or None
        return [chat_message(m, {}) for m in self.seen]

    async def _start(self, row: dict) -> None:
        self.relay.run = asyncio.ensure_future(self.function(row, self.endpoint.client(self.key)))

    def schemas(self) -> list[dict] | None:
        """The tools the program's first request offered, for the chat template's tools section."""
        return self.tools

    def step(self, turn: AssistantTurn) -> Step:
        reply = openai_message(turn, self.turns)
        self.turns += 1
        self.names = {call["id"]: call["function"]["name"] for call in reply.get("tool_calls", [])}
        request = self.endpoint.call(self.relay.answer(reply, self.timeout_s))
        if request is None:
            result = self._result()
            self.turn_rewards, self.columns = result.turn_rewards, result.columns
            return Step(None, float(result.reward), True)
        messages, seen = request["messages"], self.seen
        self.seen = messages
        if not extends(messages, seen):  # a summary, a sub-agent's fresh context: a new chain of the episode
            names = self.names | {call["id"]: call["function"]["name"] for m in messages if m.get("role") == "assistant"
                                  for call in m.get("tool_calls") or [] if "id" in call}
            return Step([chat_message(m, names) for m in messages], 0.0, False, restart=True)
        new = messages[len(seen) + 1:]
        if not new:
            raise AgentFailed("the agent asked again with nothing after the policy's turn")
        return Step([chat_message(m, self.names) for m in new], 0.0, False)

    def _result(self) -> AgentResult:
        """What the finished program returned, or why it failed (`AgentFailed`)."""
        run = self.relay.run
        if run.cancelled():
            raise AgentFailed("the agent program was cancelled")
        error = run.exception()
        if error is not None:
            raise AgentFailed(f"the agent program raised {type(error).__name__}: {error}") from error
        result = run.result()
        return result if isinstance(result, AgentResult) else AgentResult(reward=float(result))

    def close(self) -> None:
        """The episode let go: its program cancelled if it still runs."""
        relay = self.endpoint.live.pop(self.key, None)
        if relay is not None:
            self.endpoint.loop.call_soon_threadsafe(relay.end)


def openai_message(turn: AssistantTurn, at: int) -> dict:
    """The policy's turn as an OpenAI assistant message: its answer, reasoning (`reasoning_content`) and
    well-formed calls (arguments as JSON text, ids of this turn's own)."""
    message = turn.message()  # the chat message the transcript records; OpenAI's calls carry ids and JSON text
    calls = [{"id": f"call_{at}_{index}", "type": "function",
              "function": {"name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])}}
             for index, call in enumerate(message.pop("tool_calls", []))]
    return message | ({"tool_calls": calls} if calls else {})


def chat_message(message: dict, names: dict[str, str]) -> dict:
    """A program's message as the loop renders it: role, text content, and a tool message's tool name
    (its own `name`, else the one its `tool_call_id` was given in the last turn)."""
    out = {"role": message.get("role", "user"), "content": text_of(message.get("content"))}
    if out["role"] == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": {
            "name": call["function"]["name"], "arguments": json.loads(call["function"].get("arguments") or "{}")}}
            for call in message["tool_calls"]]
    name = message.get("name") or names.get(message.get("tool_call_id", ""))
    return out | ({"name": name} if name else {})


def text_of(content: Any) -> str:
    """A message's content as text: OpenAI's content parts (`{"type": "text", "text": ...}`), or an MCP tool
    answer's, one per line."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def extends(messages: list[dict], seen: list[dict]) -> bool:
    """Whether `messages` are `seen` (the last request's), then an assistant turn (the policy's, as the
    program kept it), then anything: compared as the loop renders them, roles and text."""
    if len(messages) <= len(seen) or messages[len(seen)].get("role") != "assistant":
        return False
    return all(_same(a, b) for a, b in zip(messages, seen, strict=False))


def _same(a: dict, b: dict) -> bool:
    return a.get("role") == b.get("role") and text_of(a.get("content")) == text_of(b.get("content"))


class AgentEpisodes:
    """A run's agent episodes (`environment.agent`): the endpoint started at the first episode and shared by
    all, each episode on its own path; `close` stops it (the runner's `close`, however the stage ends)."""

    def __init__(self, function: AgentFunction, timeout_s: float):
        self.function, self.timeout_s = function, timeout_s
        self.endpoint: AgentEndpoint | None = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> AgentEpisodes:
        """Itself: the copy of the runner that samples ahead on its own thread shares the run's one endpoint."""
        return self

    def __call__(self, row: dict) -> AgentEpisode:
        with self._lock:  # episodes start on several threads
            if self.endpoint is None:
                self.endpoint = AgentEndpoint()
        return AgentEpisode(self.endpoint, self.function, self.timeout_s)

    def close(self) -> None:
        with self._lock:
            endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.close()
