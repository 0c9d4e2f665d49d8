"""The demo world's tool, as a user would write it for `ppo.environment.tools` (docs/environments.md):
`tools(row)` gives a prompt record's tools, typed Python functions with Google-style docstrings.
Each record carries its user's liked adjectives (`liked`); only `preferences` tells them. Calls are
written in the Hermes convention (`call_text`). Imports nothing of ours: the world builder uses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_NAME = "preferences"


def liked_text(liked: str) -> str:
    """The tool's answer for a record's `liked` column: "warm calm kind" -> "likes: warm, calm, kind"
    (each adjective after a space, as it is written in an answer: the same token to copy)."""
    return "likes: " + ", ".join(liked.split())


def tools(row: dict) -> list[Callable]:
    """The tools of one prompt record (its `liked` column): `preferences`."""
    answer = liked_text(row["liked"])

    def preferences(subject: str) -> str:
        """Look up which adjectives this user likes to hear about a subject.

        Args:
            subject: the thing the user asked about.
        """
        return answer

    return [preferences]


def call_text(subject: str) -> str:
    """The assistant's turn that calls `preferences` on `subject`, exactly:
    `<tool_call>{"name": "preferences", "arguments": {"subject": "cat"}}</tool_call>`."""
    return TOOL_CALL_OPEN + json.dumps({"name": TOOL_NAME, "arguments": {"subject": subject}}) + TOOL_CALL_CLOSE
