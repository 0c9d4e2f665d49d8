"""verifiers environments (0.4, `verifiers.v1`) served on our protocol, by acting as their model.

A verifiers environment runs a whole rollout itself: its harness calls the model through verifiers'
interception server and runs the tools' calls (MCP servers), and its task scores the trace at the
end (`@vf.reward` methods). To step one from outside, the bridge is the model endpoint: each
chat-completion request that reaches it is an observation (what /reset or /step answers), and the
model's turn that the next /step brings is the completion it returns. Each episode has its own
endpoint path (`/episodes/<id>/v1`), so episodes run at once stay apart. The final score, the trace's
weighted reward, is the last step's reward; a rollout that ends in an error fails its episode.

The harness is `RelayHarness` by default (an in-process chat loop over the environment's MCP tools,
adding nothing of its own to the conversation); a taskset's own harness is chosen with `--config
'{"agent": {"harness": {"id": ...}}}'`. `__all__` names the harness alone: verifiers' plugin loader
reads it. Runs only in the verifiers environment (`make env-verifiers`), started by `rlhf serve-env`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from aiohttp import web
from openai import AsyncOpenAI
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

__all__ = ["RelayHarness"]

RELAY_ID = "rlhf_relay"
"""The harness's plugin id: verifiers imports a harness by a top-level module name (a dotted one is
looked for under its own package), so this module is also `sys.modules["rlhf_relay"]`."""
sys.modules.setdefault(RELAY_ID, sys.modules[__name__])
START_TIMEOUT_S = 300.0


def _one_default_ssl_context() -> None:
    """Every httpx (and httpx2, MCP's fork) client of this process that verifies with the default CA
    bundle shares one SSL context. A rollout builds three clients (the interception's to the model,
    the harness's, the MCP one), and each loads the CA bundle: 67% of the bridge's CPU in a
    64-episode profile (py-spy, 2026-11-28), though every one of them talks plain http to 127.0.0.1."""
    import functools
    import importlib

    for name in ("httpx._transports.default", "httpx2._transports.default"):
        try:
            transports = importlib.import_module(name)
        except ImportError:
            continue
        build = transports.create_ssl_context
        shared = functools.cache(lambda trust_env, build=build: build(verify=True, cert=None, trust_env=trust_env))

        def create_ssl_context(verify=True, cert=None, trust_env=True, build=build, shared=shared):
            if verify is True and cert is None:
                return shared(trust_env)
            return build(verify=verify, cert=cert, trust_env=trust_env)

        transports.create_ssl_context = create_ssl_context


_one_default_ssl_context()
"""Seconds a rollout may take to reach the model's first turn (its tool servers start) or the next one."""


class RelayHarness(vf.Harness[vf.HarnessConfig]):
    """The model's loop, in process: the conversation to the model, its tool calls to the MCP
    servers, their answers back as `tool` messages, until a turn calls no tool."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        messages = conversation(data)
        async with AsyncExitStack() as stack:  # the model's client closed with the rollout: its sockets too
            client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                                                                 timeout=None))
            tools, dispatch, servers = await connect_mcp({"mcpServers": {n: {"url": u} for n, u in mcp_urls.items()}},
                                                         stack)
            while True:
                completion = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                  **({"tools": tools} if tools else {}))
                message = completion.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    try:
                        answer = await call_mcp(servers, dispatch, call.function.name,
                                                json.loads(call.function.arguments or "{}"))
                    except Exception as e:  # noqa: BLE001 - the model's call was wrong: it is told why
                        answer = f"error: {type(e).__name__}: {e}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": text_of(answer)})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def conversation(data: vf.TaskData) -> list[dict]:
    """A task's prompt as chat messages: its system prompt, then its prompt (messages, or a user's text)."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, list):
        return system + [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in data.prompt]
    return system + [{"role": "user", "content": data.prompt or ""}]


def text_of(content: Any) -> str:
    """A tool's answer as text: MCP content parts joined."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def assistant_message(assistant: dict, turn: int) -> dict:
    """Our model's turn as an OpenAI chat message: its answer, reasoning and calls (arguments as JSON text)."""
    calls = [{"id": f"call_{turn}_{at}", "type": "function",
              "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
             for at, call in enumerate(c for c in assistant.get("calls", []) if isinstance(c, dict))]
    message = {"role": "assistant", "content": assistant.get("content") or ("" if calls else "")}
    if assistant.get("reasoning"):
        message["reasoning_content"] = assistant["reasoning"]
    return message | ({"tool_calls": calls} if calls else {})


class RolloutEnded(Exception):
    """The rollout ended before the model's next turn, or in an error: the request fails (HTTP 422)."""


@dataclass(kw_only=True)
class _Relay:
    """One episode relayed between verifiers' harness and our protocol: the harness's requests waiting to
    be answered, our answers, the rollout's task (the trainer's record of it is `stages.envs.loop.Running`)."""

    requests: asyncio.Queue = field(default_factory=asyncio.Queue)
    replies: asyncio.Queue = field(default_factory=asyncio.Queue)
    run: asyncio.Task | None = None
    seen: list[dict] = field(default_factory=list)
    """The conversation of the last request: what the next one's new messages follow."""
    turns: int = 0


class VerifiersServed:
    """A verifiers environment, its rollouts stepped by our protocol (`servers.env_server.Served`)."""

    serves = "verifiers"

    def __init__(self, module: str, config: dict):
        self.name = module
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers", daemon=True).start()
        base = {"taskset": {"id": module}, "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": RELAY_ID}}}
        self.live: dict[str, _Relay] = {}
        self._call(self._open(merged(base, config)), START_TIMEOUT_S)

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _open(self, config: dict) -> None:
        self.env = vf.load_environment(vf.resolve_env_config(config))
        self.task_cls = type(self.env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self._stack = AsyncExitStack()
        await self._stack.enter_async_context(self.env.serving())
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._completion)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.endpoint = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def dataset(self, split: str) -> list[dict] | None:
        """The taskset's tasks as records (verifiers has no evaluation split: `eval` is None)."""
        if split != "train":
            return None
        rows = []
        for task in self.env.taskset:
            fields = task.data.model_dump(mode="json", exclude_defaults=True, exclude={"idx", "prompt",
                                                                                      "system_prompt"})
            rows.append({"messages": conversation(task.data), **fields})
        return rows

    def start(self, row: dict) -> tuple[str, list[dict], list[dict] | None]:
        return self._call(self._start(row), START_TIMEOUT_S)

    def step(self, handle: str, assistant: dict) -> tuple[list[dict] | None, float, bool]:
        return self._call(self._step(handle, assistant), START_TIMEOUT_S)

    def end(self, handle: str) -> None:
        live = self.live.pop(handle, None)
        if live is not None and live.run is not None and not live.run.done():
            self.loop.call_soon_threadsafe(live.run.cancel)

    async def _start(self, row: dict) -> tuple[str, list[dict], list[dict] | None]:
        data = self.data_cls.model_validate(task_fields(row, self.data_cls))
        task = self.task_cls(data, self.env.config.taskset.task)
        key, live = uuid.uuid4().hex, _Relay()
        self.live[key] = live
        context = vf.ModelContext(model="policy", client=vf.EvalClientConfig(
            base_url=f"{self.endpoint}/episodes/{key}/v1", api_key_var="RLHF_VERIFIERS_BRIDGE_KEY"))
        live.run = asyncio.create_task(self.env.run_episode(task, context))
        request = await self._next(live)
        if request is None:
            self.live.pop(key, None)
            raise RolloutEnded(f"the rollout ended before the model's first turn: {ended(live)}")
        live.seen = request["messages"]
        return key, live.seen, request.get("tools") or None

    async def _step(self, key: str, assistant: dict) -> tuple[list[dict] | None, float, bool]:
        live = self.live.get(key)
        if live is None:
            raise KeyError(f"unknown episode {key!r}")
        await live.replies.put(assistant_message(assistant, live.turns))
        live.turns += 1
        request = await self._next(live)
        if request is None:
            self.live.pop(key, None)
            episode = live.run.result()
            trace = episode.traces[0] if episode.traces else None
            if trace is None or trace.errors or not episode.ok:
                raise RolloutEnded(f"the rollout failed: {ended(live)}")
            return None, float(trace.reward or 0.0), True
        messages = request["messages"]
        new, live.seen = messages[len(live.seen) + 1:], messages  # after the context and the model's turn
        return [plain_message(m) for m in new], 0.0, False

    async def _next(self, live: _Relay) -> dict | None:
        """The harness's next request, or None once the rollout is over."""
        asked = asyncio.create_task(live.requests.get())
        await asyncio.wait({asked, live.run}, return_when=asyncio.FIRST_COMPLETED)
        if asked.done():
            return asked.result()
        asked.cancel()
        return None

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        """The harness asks the model: the request is the observation; our turn, once it comes, the answer."""
        live = self.live.get(request.match_info["episode"])
        if live is None:
            return web.json_response({"error": {"message": "unknown episode"}}, status=404)
        body = await request.json()
        await live.requests.put(body)
        message = await live.replies.get()
        reason = "tool_calls" if message.get("tool_calls") else "stop"
        completion = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                      "model": body.get("model", "policy"),
                      "choices": [{"index": 0, "message": message, "finish_reason": reason}],
                      "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        # Each answer closes its connection: verifiers' interception keeps a client per rollout that it
        # never closes, and kept-alive connections to here piled up (two sockets each, ~2 per episode,
        # until the process ran out of descriptors after ~10,000 episodes).
        if not body.get("stream"):
            return web.json_response(completion, headers={"Connection": "close"})
        chunk = completion | {"object": "chat.completion.chunk",
                              "choices": [{"index": 0, "delta": message, "finish_reason": reason}]}
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Connection": "close"})
        await stream.prepare(request)
        await stream.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await stream.write_eof()
        return stream


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in, nested dictionaries key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def task_fields(row: dict, data_cls: type) -> dict:
    """A prompt record as a task's data: `messages` as its prompt (a system message as its system
    prompt), the record's other fields that the task's data declares."""
    messages = list(row.get("messages") or [])
    system = messages.pop(0)["content"] if messages and messages[0].get("role") == "system" else None
    fields = {k: v for k, v in row.items() if k in data_cls.model_fields and k not in ("prompt", "system_prompt")}
    return fields | {"prompt": messages} | ({"system_prompt": system} if system else {})


def plain_message(message: dict) -> dict:
    """A harness's message as our loop renders it: role, text content, and the tool's name."""
    out = {"role": message.get("role", "user"), "content": text_of(message.get("content") or "")}
    return out | ({"name": message["name"]} if message.get("name") else {})


def ended(live: _Relay) -> str:
    """Why a rollout ended: its exception, or its trace's errors and stop condition."""
    if live.run is None or not live.run.done():
        return "still running"
    if live.run.cancelled():
        return "cancelled"
    if live.run.exception() is not None:
        return f"{type(live.run.exception()).__name__}: {live.run.exception()}"
    episode = live.run.result()
    trace = episode.traces[0] if episode.traces else None
    if trace is None:
        return f"no trace (errors: {[str(e) for e in getattr(episode, 'errors', [])]})"
    return f"stop {trace.stop_condition}, errors {[e.message for e in trace.errors]}"
