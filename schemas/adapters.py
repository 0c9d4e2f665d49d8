"""Adapters from the formats users bring to the plain form the contracts check.

- `plain`: `prompt` plus `response` (or `completion`) for SFT, `chosen`/`rejected` for pairs.
- `hh`: Anthropic HH-RLHF transcripts: `chosen` and `rejected` are whole
  "\\n\\nHuman: ... \\n\\nAssistant: ..." dialogues; their shared history is the prompt.
- `chat`: message lists (UltraFeedback-binarized style): `chosen`/`rejected` (or SFT
  `messages`) are lists of {role, content} ending with the assistant's reply. A `tool` message
  (a tool's answer, with an optional string `name`) follows the assistant turn that called it.

Every adapter returns the frame with `prompt` (the last user turn, for the contract's checks),
the reply columns as text, and `prompt_messages` (the whole prompt conversation, rendered later
with the model's own chat template), plus the problems it found, row by row. The chat adapter's
SFT records also keep the whole conversation, normalised, as JSON (`messages`): a transcript
(`is_transcript`: a tool turn, or several assistant turns) is trained on every assistant turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from schemas.errors import Problem

ROLES = ("system", "user", "assistant", "tool")
Messages = list[dict[str, str]]


class _RowError(ValueError):
    def __init__(self, column: str | None, reason: str):
        super().__init__(reason)
        self.column, self.reason = column, reason


def _as_messages(value: Any, column: str) -> Messages:
    if isinstance(value, np.ndarray):  # Parquet and datasets hand lists back as arrays
        value = value.tolist()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _RowError(column, "expected a list of {role, content} messages, got text") from None
    if not isinstance(value, list) or not value:
        raise _RowError(column, "expected a non-empty list of {role, content} messages")
    messages = []
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _RowError(column, f"message {i} is not a {{role, content}} object with string values")
        if m["role"] not in ROLES:
            raise _RowError(column, f"message {i} has unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        messages.append({"role": m["role"], "content": m["content"]} | _tool_name(m, i, column))
        if m["role"] == "tool" and (i == 1 or messages[-2]["role"] not in ("assistant", "tool")):
            raise _RowError(column, f"message {i} is a tool's answer that follows no assistant turn (its call)")
    return messages


def _tool_name(message: dict, i: int, column: str) -> dict[str, str]:
    """A tool message's `name` (the tool that answered), where it has one."""
    if message["role"] != "tool" or message.get("name") is None:
        return {}
    if not isinstance(message["name"], str):
        raise _RowError(column, f"message {i}: a tool message's name must be a string")
    return {"name": message["name"]}


def is_transcript(messages: Messages) -> bool:
    """A conversation trained on every assistant turn rather than its last reply: it has a tool turn,
    or more than one assistant turn."""
    return any(m["role"] == "tool" for m in messages) or sum(m["role"] == "assistant" for m in messages) > 1


def _split_reply(messages: Messages, column: str) -> tuple[Messages, str]:
    if messages[-1]["role"] != "assistant":
        raise _RowError(column, "conversation does not end with an assistant reply")
    if not any(m["role"] == "user" for m in messages[:-1]):
        raise _RowError(column, "conversation has no user turn before the assistant reply")
    return messages[:-1], messages[-1]["content"]


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def parse_hh(transcript: Any, column: str) -> Messages:
    """'\\n\\nHuman: hi\\n\\nAssistant: hello' -> [{user: hi}, {assistant: hello}]."""
    if not isinstance(transcript, str):
        raise _RowError(column, "must be a string")
    parts = _HH_TURN.split(transcript)
    if parts[0].strip() or len(parts) < 3:
        raise _RowError(column, "not an HH transcript: expected '\\n\\nHuman: ... \\n\\nAssistant: ...'")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[speaker], "content": text.strip()}
            for speaker, text in zip(parts[1::2], parts[2::2], strict=True)]


def last_user_message(messages: Messages) -> str:
    """What the user said last in a conversation: how a prompt is shown to people (tables, summaries)."""
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


def _user_prompt(prompt: Any) -> str | None:
    return json.dumps([{"role": "user", "content": prompt}]) if isinstance(prompt, str) else None


def _apply(frame: pd.DataFrame, adapt_row: Callable[[pd.Series], dict]) -> tuple[pd.DataFrame, list[Problem]]:
    rows, problems = {}, []
    for number, record in frame.iterrows():
        try:
            rows[number] = adapt_row(record)
        except _RowError as e:
            problems.append(Problem(int(number), e.column, e.reason))
    adapted = pd.DataFrame.from_dict(rows, orient="index")
    adapted.index.name = "row"
    extra = [c for c in frame.columns if c not in adapted.columns]
    return adapted.join(frame[extra]) if len(adapted) else adapted, problems


def adapt_plain(frame: pd.DataFrame, kind: str) -> tuple[pd.DataFrame, list[Problem]]:
    frame = frame.copy()
    if kind == "sft" and "response" not in frame.columns and "completion" in frame.columns:
        frame = frame.rename(columns={"completion": "response"})
    if "prompt" in frame.columns:
        frame["prompt_messages"] = frame["prompt"].map(_user_prompt)
    return frame, []


def _pair_row(record: pd.Series, conversation: Callable[[Any, str], Messages]) -> dict:
    """A preference pair from two whole conversations that must share everything but the last reply."""
    chosen_prompt, chosen = _split_reply(conversation(record["chosen"], "chosen"), "chosen")
    rejected_prompt, rejected = _split_reply(conversation(record["rejected"], "rejected"), "rejected")
    if chosen_prompt != rejected_prompt:
        raise _RowError(None, "chosen and rejected continue different prompts")
    return {"prompt": last_user_message(chosen_prompt), "chosen": chosen, "rejected": rejected,
            "prompt_messages": json.dumps(chosen_prompt)}


def adapt_hh(frame: pd.DataFrame, kind: str) -> tuple[pd.DataFrame, list[Problem]]:
    return _apply(frame, lambda record: _pair_row(record, parse_hh))


def adapt_chat(frame: pd.DataFrame, kind: str) -> tuple[pd.DataFrame, list[Problem]]:
    def sft_row(record: pd.Series) -> dict:
        messages = _as_messages(record["messages"], "messages")
        prompt, response = _split_reply(messages, "messages")
        first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if is_transcript(messages) and not any(m["role"] == "user" for m in messages[:first_reply]):
            raise _RowError("messages", f"message {first_reply + 1} is an assistant turn with no user turn before it")
        return {"prompt": last_user_message(prompt), "response": response, "prompt_messages": json.dumps(prompt),
                "messages": json.dumps(messages)}

    def pair_row(record: pd.Series) -> dict:
        return _pair_row(record, _as_messages)

    def prompt_row(record: pd.Series) -> dict:
        messages = _as_messages(record["messages"], "messages")
        if messages[-1]["role"] != "user":
            raise _RowError("messages", "a prompt conversation must end with a user turn")
        return {"prompt": messages[-1]["content"], "prompt_messages": json.dumps(messages)}

    return _apply(frame, {"sft": sft_row, "preference": pair_row, "prompt": prompt_row}[kind])


ADAPTERS = {"plain": adapt_plain, "hh": adapt_hh, "chat": adapt_chat}
# The columns each format needs, by kind; checked before adapting so a missing column is one clear error.
REQUIRED = {
    ("plain", "sft"): ("prompt", "response"),
    ("plain", "preference"): ("prompt", "chosen", "rejected"),
    ("plain", "prompt"): ("prompt",),
    ("hh", "preference"): ("chosen", "rejected"),
    ("chat", "sft"): ("messages",),
    ("chat", "preference"): ("chosen", "rejected"),
    ("chat", "prompt"): ("messages",),
}


def _is_message_list(value: Any) -> bool:
    return isinstance(value, (list, np.ndarray))


def detect_format(frame: pd.DataFrame, kind: str) -> str:
    """Guess the format from the columns and the first record; `plain` when unsure."""
    first = frame.iloc[0] if len(frame) else pd.Series(dtype=object)
    if kind in ("sft", "prompt") and "messages" in frame.columns and "prompt" not in frame.columns:
        return "chat"
    if kind == "preference" and "chosen" in frame.columns:
        if _is_message_list(first.get("chosen")):
            return "chat"
        if "prompt" not in frame.columns:
            return "hh"
    return "plain"
