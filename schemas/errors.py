"""Row-level data problems and the one error that carries all of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Problem:
    """One reason one record (or the whole file, when `row` is None) was refused."""

    row: int | None
    """1-based record number: the line number for JSONL, the data row for CSV, else the record index."""
    column: str | None
    reason: str


class DataContractError(ValueError):
    """Every problem found in one data source, reported together (validation is lazy)."""

    def __init__(self, source: str, problems: list[Problem], unit: str = "row"):
        self.source = source
        self.unit = unit
        self.problems = sorted(set(problems), key=lambda p: (p.row or 0, p.column or "", p.reason))
        super().__init__(self.report())

    def report(self, limit: int = 50) -> str:
        n = len(self.problems)
        lines = [f"{self.source}: {n} problem{'s' if n != 1 else ''}"]
        for p in self.problems[:limit]:
            where = f"{self.unit} {p.row}" if p.row is not None else "file"
            column = f", column '{p.column}'" if p.column else ""
            lines.append(f"  {where}{column}: {p.reason}")
        if n > limit:
            lines.append(f"  ... and {n - limit} more")
        return "\n".join(lines)
