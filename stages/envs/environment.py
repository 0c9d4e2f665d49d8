"""What an episode acts against: the `Environment` interface, the built-in tool-calling environment
(`ToolEnvironment`) and how the config names one (`environment_factory`).

An environment is two methods:

    reset(row) -> messages                    the conversation the model answers first
    step(turn) -> (messages, reward, done)

`row` is the prompt record: `messages` (its chat messages) and the declared columns (`reward.columns`).
`step` gets the model's turn parsed (`stages.envs.parsers.AssistantTurn`: `text` as sampled,
special tokens kept and the end-of-turn token not; `content`, `reasoning` and `calls` as the
family's convention reads them) and answers with the messages to append (None: nothing more to
say), the turn's reward and whether the episode is over. Tools are plain typed Python functions
with Google-style docstrings; their JSON schema
(`tool_schemas`) goes to the chat template's tools section where the template has one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

from rlhf.sections.environment import EnvironmentConfig
from stages.common.errors import StageUserError
from stages.common.user_code import imported_function
from stages.envs.parsers import AssistantTurn, ToolCall


class EnvironmentSetupError(StageUserError):
    """An environment could not be built or used as configured."""


class Step(NamedTuple):
    """What the environment says after one of the model's turns (a plain tuple does as well)."""

    messages: list[dict] | None
    """Messages appended to the conversation (tool results, another role's turn); None: nothing more."""
    reward: float = 0.0
    """This turn's reward: it lands on the turn's last token."""
    done: bool = False
    """The episode is over."""
    restart: bool = False
    """`messages` are the whole next context, not an addition: the history rewritten (a summary, a
    sub-agent's fresh context). The episode goes on in a new chain whose turns see that context alone."""


class Environment(Protocol):
    """One prompt's environment for one episode."""

    def reset(self, row: dict) -> list[dict]:
        """The conversation the model answers first."""
        ...

    def step(self, turn: AssistantTurn) -> Step | tuple:
        """The environment's answer to the model's turn."""
        ...

    # Optional: `schemas()`, the tools' JSON schemas for the chat template, `close()`, called once
    # the episode is over (a server's episode is let go), `retries`, its requests to a server tried
    # again (`rollout/environment_retries`), and what an agent program gave at its end: `turn_rewards`,
    # added to the turns in order, and `columns`, beside the record's.


class TooManyMalformedCalls(Exception):
    """An episode made more malformed tool calls than `environment.max_malformed_calls` allows."""


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """Each tool's JSON schema from its signature and docstring, as chat templates take them."""
    from transformers.utils import get_json_schema

    return [get_json_schema(tool) for tool in tools]


class ToolEnvironment:
    """The model answers, calling tools on the way: a turn with calls gets each tool's result as a
    `tool` message; a turn without one is the answer, and ends the episode. A turn's calls run at once,
    each for `tool_timeout_s` at most, their answers cut to `max_tool_output_chars`. A call that cannot
    be parsed, names no tool, raises or times out is answered with the error and costs
    `malformed_call_reward`; past `max_malformed_calls` of them the episode fails."""

    def __init__(self, tools: list[Callable], settings: EnvironmentConfig):
        self.tools = {tool.__name__: tool for tool in tools}
        self.settings = settings
        self.malformed = 0

    def reset(self, row: dict) -> list[dict]:
        self.malformed = 0
        return list(row["messages"])

    def step(self, turn: AssistantTurn) -> Step:
        if not turn.calls_tools:
            return Step(None, 0.0, True)
        answers = run_calls(self.tools, turn.calls, self.settings.tool_timeout_s)
        results, reward = [], 0.0
        for call, (answer, ran) in zip(turn.calls, answers, strict=True):
            if not ran:
                self.malformed += 1
                reward += self.settings.malformed_call_reward
                if self.malformed > self.settings.max_malformed_calls:
                    raise TooManyMalformedCalls(f"{self.malformed} malformed tool calls (the last: {answer[:200]})")
            name = call.name if isinstance(call, ToolCall) else ""
            content = cut(answer, self.settings.max_tool_output_chars) if ran else answer  # our errors are short
            results.append({"role": "tool", "name": name, "content": content})
        return Step(results, reward, False)

    def schemas(self) -> list[dict]:
        """The tools' schemas, for the chat template's tools section."""
        return tool_schemas(list(self.tools.values()))


def cut(answer: str, limit: int) -> str:
    """A tool's answer cut to `limit` characters, saying how much was left out."""
    return answer if len(answer) <= limit else f"{answer[:limit]}... [cut: {len(answer) - limit} more characters]"


def run_calls(tools: dict[str, Callable], calls: list[ToolCall | str], timeout_s: float) -> list[tuple[str, bool]]:
    """Each call's answer as text and whether it ran, the calls at once, each on a daemon thread given
    `timeout_s`: a tool still running then is answered `error: timed out` and left behind (a thread
    cannot be stopped, but a daemon one neither blocks the turn nor the process's exit)."""
    answers: list[tuple[str, bool] | None] = [None] * len(calls)

    def run(at: int, call: ToolCall) -> None:
        tool = tools.get(call.name)
        if tool is None:
            answers[at] = f"error: no tool {call.name!r} (tools: {', '.join(tools)})", False
            return
        try:
            answers[at] = str(tool(**call.arguments)), True
        except BaseException as e:  # noqa: BLE001 - the model's call was wrong: it is told why, as the tool's answer
            answers[at] = f"error: {type(e).__name__}: {str(e)[:500]}", False

    threads = []
    for at, call in enumerate(calls):
        if isinstance(call, str):
            answers[at] = f"error: {call}", False
            continue
        thread = threading.Thread(target=run, args=(at, call), name=f"tool-{call.name}", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [answer if answer is not None else (f"error: the tool did not answer within {timeout_s:g} s", False)
            for answer in answers]


EnvironmentFactory = Callable[[dict], Environment]
"""A prompt record -> a fresh environment for its episode."""


def environment_factory(settings: EnvironmentConfig) -> tuple[EnvironmentFactory | None, Callable | None]:
    """What the config names: a factory of environments in this process (`tools`, wrapped in
    `ToolEnvironment`, or `factory`), or a whole-episode rollout function (`rollout`), imported from
    the import path (`ppo.paths` in front: `stages.ppo.build_rollouts`; a server's `--path`). (A
    `server`'s episodes: `stages.envs.loop.served_episodes`; an `agent`'s: `stages.envs.loop.agent_episodes`.)"""

    def named(field: str) -> Callable:
        return imported_function(getattr(settings, field), f"environment.{field}", EnvironmentSetupError,
                                 "ppo.paths")

    if settings.rollout is not None:
        return None, named("rollout")
    if settings.factory is not None:
        return named("factory"), None
    tools_of = named("tools")

    def tool_environment(row: dict) -> Environment:
        return ToolEnvironment(list(tools_of(row)), settings)

    return tool_environment, None
