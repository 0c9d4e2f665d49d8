"""pandera contracts for the three kinds of data the pipeline consumes.

Each contract checks the plain-text form every input format is adapted to (see
`schemas.adapters`): `prompt` is the user's turn, the other columns are assistant replies.
Columns are typed `Any` and checked element by element, so a wrong type is reported on its
own row rather than as one column-level dtype failure. Extra columns are allowed.
`SFTTranscript` checks, besides, the whole conversations a chat-format SFT file keeps (`messages`).
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _not_blank(value: Any) -> bool:
    return not isinstance(value, str) or value.strip() != ""


class SFTExample(pa.DataFrameModel):
    """A demonstration: a prompt and the response the model should learn to give."""

    prompt: Series[Any] = pa.Field(nullable=False)
    response: Series[Any] = pa.Field(nullable=False)

    @pa.check("prompt", "response", element_wise=True, error="must be a string")
    def text(cls, value: Any) -> bool:
        return _is_text(value)

    @pa.check("prompt", "response", element_wise=True, error="must not be blank")
    def not_blank(cls, value: Any) -> bool:
        return _not_blank(value)

    class Config:
        strict = False


TRANSCRIPT_ROLES = ("system", "user", "assistant", "tool")


def _is_transcript_json(value: Any) -> bool:
    """A JSON list of {role, content} messages of known roles, with string values, ending with an assistant turn."""
    try:
        messages = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        return False
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and m.get("role") in TRANSCRIPT_ROLES and isinstance(m.get("content"), str)
                    for m in messages)
            and messages[-1]["role"] == "assistant")


class SFTTranscript(pa.DataFrameModel):
    """A demonstration as a whole conversation (`messages`, JSON), trained on each of its assistant turns."""

    messages: Series[Any] = pa.Field(nullable=False)

    @pa.check("messages", element_wise=True,
              error="must be a JSON list of {role, content} messages (system, user, assistant, tool) ending with an "
                    "assistant turn")
    def transcript(cls, value: Any) -> bool:
        return _is_transcript_json(value)

    class Config:
        strict = False


class PreferencePair(pa.DataFrameModel):
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) response."""

    prompt: Series[Any] = pa.Field(nullable=False)
    chosen: Series[Any] = pa.Field(nullable=False)
    rejected: Series[Any] = pa.Field(nullable=False)
    margin: Series[float] | None = pa.Field(nullable=False, coerce=True)
    """Optional per-pair margin for the Bradley-Terry loss."""

    @pa.check("prompt", "chosen", "rejected", element_wise=True, error="must be a string")
    def text(cls, value: Any) -> bool:
        return _is_text(value)

    @pa.check("prompt", "chosen", "rejected", element_wise=True, error="must not be blank")
    def not_blank(cls, value: Any) -> bool:
        return _not_blank(value)

    @pa.dataframe_check(error="chosen is identical to rejected")
    def chosen_differs(cls, df: pd.DataFrame) -> Series[bool]:
        return df["chosen"].astype(object) != df["rejected"].astype(object)

    class Config:
        strict = False


class PromptExample(pa.DataFrameModel):
    """A prompt alone, for rollouts and evaluation."""

    prompt: Series[Any] = pa.Field(nullable=False)

    @pa.check("prompt", element_wise=True, error="must be a string")
    def text(cls, value: Any) -> bool:
        return _is_text(value)

    @pa.check("prompt", element_wise=True, error="must not be blank")
    def not_blank(cls, value: Any) -> bool:
        return _not_blank(value)

    class Config:
        strict = False


CONTRACTS: dict[str, type[pa.DataFrameModel]] = {
    "sft": SFTExample,
    "preference": PreferencePair,
    "prompt": PromptExample,
}
# The reply columns of each kind: what follows the prompt and counts against the length budget.
REPLY_COLUMNS: dict[str, tuple[str, ...]] = {"sft": ("response",), "preference": ("chosen", "rejected"), "prompt": ()}
