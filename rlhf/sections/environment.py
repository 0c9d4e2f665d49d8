"""The RL stage's environments, `ppo.environment`: multi-turn episodes against tools, a factory's
environments, a rollout function of the user's, or an environment served over HTTP (docs/environments.md)."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from rlhf.sections.base import ServerClientConfig, ServerURL, _Frozen


class EnvironmentServerConfig(ServerClientConfig):
    """An environment behind HTTP: each episode's `reset` and `step` are requests to a server
    (docs/environments.md, "Environment servers"); the model's turns stay token ids on this side."""

    url: ServerURL
    """The server's base URL, as `rlhf serve-env` prints it (`http://127.0.0.1:8400`)."""
    kind: Literal["ours", "verifiers", "openenv"] = "ours"
    """`ours`: our protocol; `verifiers`: a verifiers environment on it (`rlhf serve-env`); `openenv`: OpenEnv's."""
    timeout_s: PositiveFloat = 60.0
    """Seconds one request may take; past them the episode fails (a slow answer is not asked for again)."""
    max_concurrent: PositiveInt = 16
    """Episodes with requests in flight at once at most (16 here, not 8: a round's resets and steps run at once)."""


class EnvironmentConfig(_Frozen):
    """Multi-turn episodes: the policy acts over several turns against an environment, e.g. calling tools
    (docs/environments.md). Exactly one of `tools`, `factory`, `rollout`, `server` and `agent` says what it is."""

    MERGED: ClassVar[dict[str, str]] = {
        "turn_tokens": "sampling.response_length is each turn's budget in an episode (environment.episode_tokens "
                       "the whole episode's)",
        "paths": "ppo.paths: the folders in front of the import path for every module:function the stage names",
    }
    AGENTS_AT_ONCE: ClassVar[int] = 16
    """Agent episodes stepped at once by default: their programs wait on the policy and their own tools, not this
    process's CPU (each episode's thread only waits for its program's next request)."""
    TOOL_PARSERS: ClassVar = ("auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "harmony", "deepseek", "glm",
                              "pythonic")
    tools: str | None = None
    """`module:function` giving a prompt record's tools (typed Python functions) to the built-in tool-calling loop."""
    factory: str | None = None
    """`module:function` giving a prompt record's environment (`reset(row)`, `step(turn)`), for other environments."""
    rollout: str | None = None
    """`module:function` `(row, engine, tokenizer) -> Episode`: a whole episode by hand, for what the loop cannot do."""
    server: EnvironmentServerConfig | None = None
    """An environment served over HTTP (`rlhf serve-env`, verifiers, OpenEnv); its rewards are turn rewards."""
    agent: str | None = None
    """`module:function`, `async (row, client) -> reward | AgentResult`: an agent program that calls the policy."""
    max_turns: PositiveInt = 4
    """Assistant turns an episode may take; one that wants more ends `truncated`."""
    episode_tokens: PositiveInt = 96
    """Tokens after the prompt an episode holds at most: the model's turns, tool results and the template's glue."""
    malformed_call_reward: float = -1.0
    """Reward of a turn whose tool call cannot be parsed or run (the model is told the error as the tool's answer)."""
    max_malformed_calls: int = Field(1, ge=0)
    """Malformed calls an episode may make; one more and it fails (left out of the update, `rollout/failed_share`)."""
    tool_parser: str = "auto"
    """How a turn's reasoning and tool calls are read: `auto`, a convention's name, or `module:function`."""
    max_turn_chars: PositiveInt = 500_000
    """Characters of a turn parsed at most; a longer one is read as one malformed call, unparsed (a guard for
    parsers we did not write: ours take linear time)."""
    tool_timeout_s: PositiveFloat = 30.0
    """Seconds a tool call may run (the model is told it timed out), or an agent take to ask again (it fails)."""
    max_tool_output_chars: PositiveInt = 4096
    """Characters of a tool's answer kept; the rest is cut, and the answer says so."""
    max_failed_share: float = Field(0.5, ge=0.0, le=1.0)
    """Share of an iteration's episodes that may fail; past it the run stops, naming the first failures' reasons."""
    schedule: Literal["rounds", "continuous"] = "rounds"
    """`rounds`: every episode's next turn sampled together, then every environment answers; `continuous`:
    each episode's turn sampled as soon as its environment answered, so a slow tool holds only its own."""
    concurrent_episodes: PositiveInt | None = None
    """Episodes whose environment (reset, step) runs at once, each on a thread; unset: a server's
    `max_concurrent`, else 1 (in-process environments one after another)."""

    @model_validator(mode="after")
    def _one_environment(self) -> EnvironmentConfig:
        """Exactly one of tools, factory, rollout, server and agent, all but the server `module:function`."""
        given = {name: getattr(self, name) for name in ("tools", "factory", "rollout", "server", "agent")
                 if getattr(self, name)}
        if len(given) != 1:
            raise ValueError("environment: give exactly one of tools, factory, rollout, server and agent "
                             f"(given: {', '.join(given) or 'none'})")
        for name, location in [*given.items(), ("tool_parser", self.tool_parser)]:
            if name == "server":
                continue
            known = self.TOOL_PARSERS if name == "tool_parser" else ()
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", location) and location not in known:
                raise ValueError(f"environment.{name}: {location!r} is not 'module:function' nor one of {known}")
        return self

    @property
    def environments_at_once(self) -> int:
        """`concurrent_episodes`, or its default: a server's `max_concurrent`, `AGENTS_AT_ONCE` for agent
        programs, else 1."""
        if self.concurrent_episodes is not None:
            return self.concurrent_episodes
        if self.agent is not None:
            return self.AGENTS_AT_ONCE
        return self.server.max_concurrent if self.server is not None else 1
