"""A small OpenEnv environment, written as a user would with openenv-core 0.3.0's own API: an MCP
environment whose one tool, `lookup(key)`, reads a value given at the episode's reset.

    reset(secret=...)      the episode's secret (the prompt row's `secret` column; "" without one)
    lookup("secret")       the secret, and a reward of 1.0 on that step
    lookup(<another key>)  a tool error ("no key ..."), reward 0.0

Each websocket session (`/ws`) gets its own instance, hence its own secret: the FastMCP server and its
tool are built in `__init__`, so the tool's closure reads this instance's state. Serve it from the
repository root, in the OpenEnv environment (`make env-openenv`), with one worker (sessions live in
the process):

    .env-openenv/bin/python -m uvicorn examples.openenv_lookup.server:app --host 127.0.0.1 --port 8410
"""

from __future__ import annotations

import os
from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

REWARD = 1.0
"""The reward of a step that looks the secret up."""


class LookupEnv(MCPEnvironment):
    """One episode: a secret set at reset, and a tool that reads it."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # required for max_concurrent_envs > 1

    def __init__(self):
        mcp = FastMCP("lookup")
        self._secret = ""

        @mcp.tool()
        def lookup(key: str) -> str:
            """Look a key up in this episode's table.

            Args:
                key: The key to look up ("secret" is the only one).
            """
            if key != "secret":
                raise ValueError(f"no key {key!r} (keys: 'secret')")
            return self._secret

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, secret: str = "",
              **kwargs: Any) -> Observation:
        self._secret = str(secret)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(done=False, reward=None)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """Plain HTTP `/step` (stateless in OpenEnv: a fresh instance per request)."""
        self._state.step_count += 1
        return self._rewarded(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """The websocket session's step (the server calls this one where a class overrides it)."""
        self._state.step_count += 1
        return self._rewarded(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    @staticmethod
    def _rewarded(action: Action, observation: Observation) -> Observation:
        if isinstance(action, CallToolAction) and isinstance(observation, CallToolObservation) and \
                action.tool_name == "lookup" and observation.error is None:
            observation.reward = REWARD
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)  # no action but the MCP ones reaches here

    @property
    def state(self) -> State:
        return self._state


app = create_app(LookupEnv, CallToolAction, CallToolObservation, env_name="openenv_lookup",
                 max_concurrent_envs=int(os.environ.get("OPENENV_LOOKUP_MAX_ENVS", "16")))
