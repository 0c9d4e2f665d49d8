"""Read a data source into a DataFrame whose index is the 1-based record number users see.

Local JSONL, JSON, Parquet and CSV files, or any name `datasets.load_dataset` accepts.
Anything unreadable raises `DataContractError` naming the file and, where there is one,
the line; nothing here ever shows a traceback for a user's file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from schemas.errors import DataContractError, Problem

LOCAL_SUFFIXES = {".jsonl": "line", ".json": "record", ".parquet": "row", ".csv": "row"}


def _frame(records: list[dict], start: int = 1, index: list[int] | None = None) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(records) if records else pd.DataFrame()
    frame.index = pd.Index(index if index is not None else range(start, start + len(records)), name="row")
    return frame


def _read_jsonl(path: Path) -> pd.DataFrame:
    records, lines, problems = [], [], []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problems.append(Problem(number, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
                continue
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                problems.append(Problem(number, None, f"malformed JSON: {e.msg} (column {e.colno})"))
                continue
            if not isinstance(record, dict):
                problems.append(Problem(number, None, f"expected a JSON object, got {type(record).__name__}"))
                continue
            records.append(record)
            lines.append(number)
    if problems:
        raise DataContractError(str(path), problems, unit="line")
    return _frame(records, index=lines)


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataContractError(str(path), [Problem(line, None, f"not valid UTF-8 ({e.reason})")], "line") from None


def _read_json(path: Path) -> pd.DataFrame:
    try:
        payload = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DataContractError(str(path), [Problem(e.lineno, None, f"malformed JSON: {e.msg}")], "line") from None
    if isinstance(payload, dict) and isinstance(payload.get("data"), list):
        payload = payload["data"]
    if not isinstance(payload, list):
        raise DataContractError(str(path), [Problem(None, None, "expected a JSON list of objects")])
    bad = [Problem(i, None, f"expected a JSON object, got {type(r).__name__}") for i, r in enumerate(payload, 1)
           if not isinstance(r, dict)]
    if bad:
        raise DataContractError(str(path), bad, unit="record")
    return _frame(payload)


def _read_csv(path: Path) -> pd.DataFrame:
    _read_text(path)  # reports bad encoding with a line number before pandas does
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=True)
    except pd.errors.ParserError as e:
        raise DataContractError(str(path), [Problem(None, None, f"malformed CSV: {e}")]) from None
    frame.index = pd.RangeIndex(1, len(frame) + 1, name="row")
    return frame.astype(object).where(frame.notna(), None)


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several unrelated types for a damaged file
        raise DataContractError(str(path), [Problem(None, None, f"unreadable Parquet: {e}")]) from None
    frame.index = pd.RangeIndex(1, len(frame) + 1, name="row")
    return frame


def _read_hub(name: str, split: str) -> pd.DataFrame:
    import datasets

    try:
        data = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types: no such dataset, no network, bad split
        raise DataContractError(name, [Problem(None, None, f"cannot load with datasets.load_dataset: {e}")]) from None
    frame = data.to_pandas()
    frame.index = pd.RangeIndex(1, len(frame) + 1, name="row")
    return frame


def read_table(source: str, split: str = "train") -> tuple[pd.DataFrame, str]:
    """The records of `source`, indexed by 1-based record number, and the word for that number."""
    path = Path(source)
    suffix = path.suffix.lower()
    if not path.exists():
        if suffix in LOCAL_SUFFIXES or source.startswith((".", "/", "~")):
            raise DataContractError(source, [Problem(None, None, "file not found")])
        return _read_hub(source, split), "row"
    if path.is_dir():
        return _read_hub(source, split), "row"
    if suffix not in LOCAL_SUFFIXES:
        raise DataContractError(source, [Problem(None, None, f"unknown file type {suffix!r}; use "
                                                  + ", ".join(LOCAL_SUFFIXES))])
    if path.stat().st_size == 0:
        raise DataContractError(source, [Problem(None, None, "empty file")])
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}[suffix]
    frame = reader(path)
    if frame.empty:
        raise DataContractError(source, [Problem(None, None, "no records")])
    return frame, LOCAL_SUFFIXES[suffix]
