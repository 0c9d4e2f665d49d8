"""The `preferences` tool, an MCP server shared by every rollout (started as `python -m tools_world.toolset`)."""

from __future__ import annotations

import verifiers.v1 as vf

from rlhf.demo.tools import liked_text


class WorldState(vf.State):
    liked: str = ""


class Preferences(vf.Toolset[vf.ToolsetConfig, WorldState]):
    TOOL_PREFIX = None  # the tool is called `preferences`, as in the world's transcripts

    @vf.tool
    def preferences(self, subject: str) -> str:
        """Look up which adjectives this user likes to hear about a subject.

        Args:
            subject: the thing the user asked about.
        """
        return liked_text(self.state.liked)


if __name__ == "__main__":
    Preferences.run()
