"""What an episode acts against: the `Environment` interface, the built-in tool-calling environment
(`ToolEnvironment`) and how the config names one (`environment_factory`).

An environment is two methods:

    reset(row) -> messages                    the conversation the model answers first
    step(assistant_text) -> (messages, reward, done)

`row` is the prompt record: `messages` (its chat messages) and the declared columns (`reward.columns`).
`step` gets the model's turn as text (special tokens kept, the end-of-turn token not) and answers
with the messages to append (None: nothing more to say), the turn's reward and whether the episode
is over. Tools are plain typed Python functions with Google-style docstrings; their JSON schema
(`tool_schemas`) goes to the chat template's tools section where the template has one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import NamedTuple, Protocol

from rlhf.config_ppo import EnvironmentConfig
from stages.common.errors import StageUserError
from stages.common.user_code import imported_function, on_import_path


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


class Environment(Protocol):
    """One prompt's environment for one episode."""

    def reset(self, row: dict) -> list[dict]:
        """The conversation the model answers first."""
        ...

    def step(self, assistant_text: str) -> Step | tuple:
        """The environment's answer to the model's turn."""
        ...


class TooManyMalformedCalls(Exception):
    """An episode made more malformed tool calls than `environment.max_malformed_calls` allows."""


TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
"""A call in the Hermes / Qwen convention: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""


def parse_tool_calls(text: str) -> list[dict | str] | None:
    """The calls in a turn, each `{"name", "arguments"}` or, where malformed, the reason as text;
    None where the turn calls nothing (it is the model's answer)."""
    found = TOOL_CALL.findall(text)
    if not found:
        return None
    calls: list[dict | str] = []
    for body, closed in found:
        if not closed:
            calls.append("the call is not closed with </tool_call>")
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"the call is not JSON: {e.msg}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
                not isinstance(call.get("arguments", {}), dict):
            calls.append('the call must be {"name": <tool>, "arguments": {...}}')
            continue
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """Each tool's JSON schema from its signature and docstring, as chat templates take them."""
    from transformers.utils import get_json_schema

    return [get_json_schema(tool) for tool in tools]


class ToolEnvironment:
    """The model answers, calling tools on the way: a turn with `<tool_call>`s gets each tool's result
    as a `tool` message; a turn without one is the answer, and ends the episode. A call that cannot be
    parsed, names no tool, or raises is answered with the error and costs `malformed_call_reward`;
    past `max_malformed_calls` of them the episode fails."""

    def __init__(self, tools: list[Callable], settings: EnvironmentConfig):
        self.tools = {tool.__name__: tool for tool in tools}
        self.settings = settings
        self.malformed = 0

    def reset(self, row: dict) -> list[dict]:
        self.malformed = 0
        return list(row["messages"])

    def step(self, assistant_text: str) -> Step:
        calls = parse_tool_calls(assistant_text)
        if calls is None:
            return Step(None, 0.0, True)
        results, reward = [], 0.0
        for call in calls:
            name, (answer, ran) = ("", (f"error: {call}", False)) if isinstance(call, str) else (call["name"],
                                                                                             self._run(call))
            if not ran:
                self.malformed += 1
                reward += self.settings.malformed_call_reward
                if self.malformed > self.settings.max_malformed_calls:
                    raise TooManyMalformedCalls(f"{self.malformed} malformed tool calls (the last: {answer})")
            results.append({"role": "tool", "name": name, "content": answer})
        return Step(results, reward, False)

    def schemas(self) -> list[dict]:
        """The tools' schemas, for the chat template's tools section."""
        return tool_schemas(list(self.tools.values()))

    def _run(self, call: dict) -> tuple[str, bool]:
        """A well-formed call's result as text and True, or `error: ...` and False where the tool is
        unknown or raises."""
        tool = self.tools.get(call["name"])
        if tool is None:
            return f"error: no tool {call['name']!r} (tools: {', '.join(self.tools)})", False
        try:
            return str(tool(**call["arguments"])), True
        except Exception as e:  # noqa: BLE001 - the model's call was wrong: it is told why, as the tool's answer
            return f"error: {type(e).__name__}: {e}", False


EnvironmentFactory = Callable[[dict], Environment]
"""A prompt record -> a fresh environment for its episode."""


def environment_factory(settings: EnvironmentConfig) -> tuple[EnvironmentFactory | None, Callable | None]:
    """What the config names: a factory of environments (`tools`, wrapped in `ToolEnvironment`, or
    `factory`), or a whole-episode rollout function (`rollout`), imported from `settings.paths` first."""
    on_import_path(settings.paths)

    def named(field: str) -> Callable:
        return imported_function(getattr(settings, field), f"environment.{field}", EnvironmentSetupError,
                                 "environment.paths")

    if settings.rollout is not None:
        return None, named("rollout")
    if settings.factory is not None:
        return named("factory"), None
    tools_of = named("tools")

    def tool_environment(row: dict) -> Environment:
        return ToolEnvironment(list(tools_of(row)), settings)

    return tool_environment, None
