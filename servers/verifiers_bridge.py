"""verifiers environments (0.4, `verifiers.v1`) served on our protocol, by acting as their model.

A verifiers environment runs a whole rollout itself: its harness calls the model through verifiers'
interception server and runs the tools' calls (MCP servers), and its task scores the trace at the
end (`@vf.reward` methods). To step one from outside, the bridge is the model endpoint: each rollout
is an agent program on `stages.envs.agent.AgentEndpoint`, the door the trainer opens for
`environment.agent`, here in the verifiers environment's process. Each chat-completion request that
reaches it is an observation (what /reset or /step answers), and the model's turn that the next /step
brings is the completion it returns. Each episode's requests name it (its key as the rollout's model,
which verifiers' interception imposes on every request) and carry the endpoint's token, so episodes run
at once stay apart while sharing the interception's one connection pool. A request that rewrites the
history answers the step with `restart` (a new chain of the episode). The final score, the trace's
weighted reward, is the last step's reward; a rollout that ends in an error fails its episode.

The harness is `RelayHarness` by default (an in-process chat loop over the environment's MCP tools,
adding nothing of its own to the conversation); a taskset's own harness is chosen with `--config
'{"agent": {"harness": {"id": ...}}}'`. `__all__` names the harness alone: verifiers' plugin loader
reads it. Runs only in the verifiers environment (`make env-verifiers`), started by `rlhf serve-env`.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import AsyncExitStack

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

from stages.envs.agent import AgentEndpoint, AgentEpisode, AgentFailed, text_of
from stages.envs.environment import Step
from stages.envs.parsers import turn_of_body

__all__ = ["RelayHarness"]

RELAY_ID = "rlhf_relay"
"""The harness's plugin id: verifiers imports a harness by a top-level module name (a dotted one is
looked for under its own package), so this module is also `sys.modules["rlhf_relay"]`."""
sys.modules.setdefault(RELAY_ID, sys.modules[__name__])
START_TIMEOUT_S = 300.0
"""Seconds a rollout may take to reach the model's first turn (its tool servers start) or the next one."""
KEY_VARIABLE = "RLHF_VERIFIERS_BRIDGE_KEY"
"""The environment variable the rollouts' model clients read the endpoint's token from."""


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


class RolloutEnded(Exception):
    """The rollout ended in an error: its episode fails (the request answers HTTP 422)."""


class VerifiersServed:
    """A verifiers environment, its rollouts stepped by our protocol (`servers.env_server.Served`). Each
    rollout is an agent program on an `AgentEndpoint` (`stages.envs.agent`, the trainer's own door for
    `environment.agent`): the harness's requests reach the endpoint with its token, on the episode's path,
    and an `AgentEpisode` turns them into our steps, a rewritten history included (`restart`)."""

    serves = "verifiers"

    def __init__(self, module: str, config: dict):
        self.name = module
        self.endpoint = AgentEndpoint()
        os.environ[KEY_VARIABLE] = self.endpoint.token  # what the rollouts' model clients read
        # Every rollout's model is the endpoint's one base URL, its episode named as the model: verifiers'
        # interception keeps one client (one kept-alive pool) per distinct endpoint config and never closes
        # one, so a base URL per episode (its path) cost a client per rollout, a new connection per request,
        # and sockets that piled up until the process ran out of descriptors.
        self.model = vf.EvalClientConfig(base_url=self.endpoint.shared_url, api_key_var=KEY_VARIABLE)
        base = {"taskset": {"id": module}, "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": RELAY_ID}}}
        self.endpoint.call(self._open(merged(base, config)), START_TIMEOUT_S)

    async def _open(self, config: dict) -> None:
        """The environment loaded and serving, on the endpoint's loop, which runs the rollouts."""
        self.env = vf.load_environment(vf.resolve_env_config(config))
        self.task_cls = type(self.env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self._stack = AsyncExitStack()
        await self._stack.enter_async_context(self.env.serving())

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

    def start(self, row: dict) -> tuple[AgentEpisode, list[dict], list[dict] | None]:
        episode = AgentEpisode(self.endpoint, self._rollout, START_TIMEOUT_S)
        try:
            messages = episode.reset(row)
        except AgentFailed as e:
            episode.close()
            raise RolloutEnded(f"the rollout ended before the model's first turn: {e}") from None
        return episode, messages, episode.schemas()

    def step(self, episode: AgentEpisode, assistant: dict) -> Step:
        try:
            return episode.step(turn_of_body(assistant))
        except AgentFailed as e:
            raise RolloutEnded(str(e)) from None

    def end(self, episode: AgentEpisode) -> None:
        episode.close()

    async def _rollout(self, row: dict, client) -> float:
        """One rollout of `row`'s task, its model the episode's path of the endpoint: the trace's reward."""
        data = self.data_cls.model_validate(task_fields(row, self.data_cls))
        task = self.task_cls(data, self.env.config.taskset.task)
        context = vf.ModelContext(model=AgentEndpoint.key_of(client), client=self.model)
        episode = await self.env.run_episode(task, context)
        trace = episode.traces[0] if episode.traces else None
        if trace is None:
            errors = [str(e) for e in getattr(episode, "errors", [])]
            raise RolloutEnded(f"the rollout failed: no trace (errors: {errors})")
        if trace.errors or not episode.ok:
            errors = [e.message for e in trace.errors]
            raise RolloutEnded(f"the rollout failed: stop {trace.stop_condition}, errors {errors}")
        return float(trace.reward or 0.0)


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
