"""Read, adapt, check and render one data source: the only way data enters a stage.

`load_validated` either returns a clean frame in the canonical form

    prompt           the prompt as the model sees it (rendered with the tokenizer's chat template)
    prompt_messages  the prompt conversation as JSON, for re-rendering with another tokenizer
    response | chosen, rejected   reply texts (no end-of-sequence token)
    messages         SFT in the chat format, where a record is a transcript (a tool turn, or several
                     assistant turns): each record's whole conversation as JSON, trained on every
                     assistant turn (absent otherwise, so single-reply data keeps its form and digest)

or raises one `DataContractError` listing every refused record. Nothing is trained on data
that did not pass through here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import pandera.pandas as pa

from schemas.adapters import ADAPTERS, REQUIRED, detect_format, is_transcript
from schemas.contracts import CONTRACTS, REPLY_COLUMNS, SFTTranscript
from schemas.errors import DataContractError, Problem
from schemas.readers import read_table

Kind = Literal["sft", "preference", "prompt"]
Format = Literal["auto", "plain", "hh", "chat"]


@dataclass(frozen=True)
class LengthBudget:
    """Token limits a record must fit, measured with the model's tokenizer."""

    max_prompt_length: int
    max_length: int
    """Prompt plus reply plus the end-of-sequence token."""


@dataclass(frozen=True)
class ValidatedData:
    frame: pd.DataFrame
    source: str
    kind: str
    format: str
    digest: str
    """sha256 of the canonical records: the identity of the data for lineage and caching."""
    dropped_duplicates: int = 0

    def summary(self) -> str:
        dropped = f", {self.dropped_duplicates} duplicates dropped" if self.dropped_duplicates else ""
        return (f"{self.source}: {len(self.frame)} valid {self.kind} records ({self.format} format{dropped}), "
                f"digest {self.digest[:12]}")


def render_prompt(messages: list[dict[str, str]], tokenizer=None) -> str:
    """The text a model is prompted with: the tokenizer's chat template with the generation
    prompt when it has one, else the single user turn as is, else a plain transcript."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def data_digest(frame: pd.DataFrame) -> str:
    records = frame.reset_index(drop=True).to_json(orient="records", force_ascii=False)
    return hashlib.sha256(records.encode("utf-8")).hexdigest()


def _contract_problems(error: pa.errors.SchemaErrors) -> list[Problem]:
    problems = []
    for case in error.failure_cases.itertuples(index=False):
        row = None if pd.isna(case.index) else int(case.index)
        if case.check == "column_in_dataframe":
            problems.append(Problem(None, str(case.failure_case), "missing column"))
        elif case.check == "not_nullable":
            problems.append(Problem(row, case.column, "missing value (null)"))
        elif case.schema_context == "DataFrameSchema" and row is not None:
            problems.append(Problem(row, None, str(case.check)))  # cross-column rule: one problem per row
        elif str(case.check).startswith(("dtype", "coerce_dtype")):
            problems.append(Problem(row, case.column, f"wrong type: {case.failure_case!r} is not a number"))
        else:
            problems.append(Problem(row, case.column, str(case.check)))
    return problems


def _length_problems(frame: pd.DataFrame, kind: str, tokenizer, budget: LengthBudget) -> list[Problem]:
    problems = []
    prompt_lengths = [len(ids) for ids in tokenizer(list(frame["prompt"]), add_special_tokens=False)["input_ids"]]
    for row, n in zip(frame.index, prompt_lengths, strict=True):
        if n > budget.max_prompt_length:
            problems.append(Problem(int(row), "prompt",
                                    f"{n} tokens, over the prompt budget of {budget.max_prompt_length}"))
    for column in REPLY_COLUMNS[kind]:
        reply = tokenizer(list(frame[column]), add_special_tokens=False)["input_ids"]
        for row, n_prompt, ids in zip(frame.index, prompt_lengths, reply, strict=True):
            total = n_prompt + len(ids) + 1
            if total > budget.max_length:
                problems.append(Problem(int(row), column,
                                        f"{total} tokens with the prompt, over the budget of {budget.max_length}"))
    return problems


def _duplicate_rows(frame: pd.DataFrame, kind: str, unit: str) -> list[Problem]:
    """Records whose prompt conversation and replies repeat an earlier record's."""
    key = frame[["prompt_messages", *REPLY_COLUMNS[kind]]].astype(str)
    repeated = key.duplicated(keep="first")
    if not repeated.any():
        return []
    first_seen = frame.index.to_series().groupby([key[c] for c in key.columns], sort=False).transform("first")
    return [Problem(int(row), None, f"duplicate of {unit} {int(first_seen[row])}") for row in frame.index[repeated]]


def _has_transcripts(frame: pd.DataFrame, kind: str, fmt: str) -> bool:
    """Chat-format SFT records of which some are transcripts: their whole conversations are kept."""
    return (kind == "sft" and fmt == "chat" and "messages" in frame.columns
            and any(is_transcript(json.loads(m)) for m in frame["messages"]))


def _rendered_prompts(conversations: pd.Series, tokenizer) -> list[str]:
    """Each JSON conversation rendered for the model; a conversation repeated across records
    (one prompt, several preference pairs) is rendered once."""
    rendered = {m: render_prompt(json.loads(m), tokenizer) for m in dict.fromkeys(conversations)}
    return [rendered[m] for m in conversations]


def load_validated(
    source: str,
    kind: Kind,
    *,
    format: Format = "auto",
    split: str = "train",
    tokenizer=None,
    budget: LengthBudget | None = None,
    duplicates: Literal["error", "drop"] = "error",
    columns: tuple[str, ...] = (),
) -> ValidatedData:
    """Read `source`, adapt it from `format`, check it against the `kind` contract, render its
    prompts with `tokenizer`, and check lengths against `budget` (when both are given). `columns`:
    extra columns the records must have and the result keeps as they are (a reward function's inputs)."""
    raw, unit = read_table(source, split)
    absent = [c for c in columns if c not in raw.columns]
    if absent:
        raise DataContractError(source, [Problem(None, c, "missing column (the config declares it as one the stage "
                                                          "reads)") for c in absent], unit)
    fmt = detect_format(raw, kind) if format == "auto" else format
    if (fmt, kind) not in REQUIRED:
        raise DataContractError(source, [Problem(None, None, f"format {fmt!r} does not apply to {kind} data")])
    missing = [c for c in REQUIRED[fmt, kind]
               if c not in raw.columns and not (c == "response" and "completion" in raw.columns)]
    if missing:
        problems = [Problem(None, c, f"missing column (the {fmt} format needs {', '.join(REQUIRED[fmt, kind])})")
                    for c in missing]
        raise DataContractError(source, problems, unit)

    frame, problems = ADAPTERS[fmt](raw, kind)
    duplicate_rows = _duplicate_rows(frame, kind, unit) if len(frame) else []
    if duplicates == "error":
        problems += duplicate_rows
    else:
        frame = frame.drop(index=[p.row for p in duplicate_rows])
    transcripts = _has_transcripts(frame, kind, fmt)
    for contract in (CONTRACTS[kind], SFTTranscript) if transcripts else (CONTRACTS[kind],):
        try:
            contract.validate(frame, lazy=True)
        except pa.errors.SchemaErrors as e:
            problems += _contract_problems(e)
    if problems:
        raise DataContractError(source, problems, unit)

    frame["prompt"] = _rendered_prompts(frame["prompt_messages"], tokenizer)
    if tokenizer is not None and budget is not None:
        problems += _length_problems(frame, kind, tokenizer, budget)
    if problems:
        raise DataContractError(source, problems, unit)

    kept = ["prompt", "prompt_messages", *REPLY_COLUMNS[kind]]
    if kind == "preference" and "margin" in frame.columns:
        kept.append("margin")
    if transcripts:
        kept.append("messages")
    kept += [c for c in columns if c not in kept]
    canonical = frame[kept].astype({c: "float64" if c == "margin" else object for c in kept})
    return ValidatedData(frame=canonical, source=source, kind=kind, format=fmt, digest=data_digest(canonical),
                         dropped_duplicates=0 if duplicates == "error" else len(duplicate_rows))
