"""Comparing two policies' responses to the same prompts: a win rate and its standard error."""

from __future__ import annotations

import numpy as np


def win_rate(ours: list[float], theirs: list[float], groups: list[str]) -> tuple[float, float]:
    """Share of paired responses where `ours` beats `theirs` (ties count half), and its standard
    error. Responses to one prompt are not independent, so the error is taken over the prompts
    (`groups`): the standard deviation of the per-prompt win rates over sqrt(number of prompts)."""
    wins = np.where(np.asarray(ours) > np.asarray(theirs), 1.0, np.where(np.asarray(ours) < np.asarray(theirs), 0.0, 0.5))
    if len(wins) == 0:
        return float("nan"), float("nan")
    per_prompt = [wins[np.asarray(groups) == g].mean() for g in dict.fromkeys(groups)]
    se = float(np.std(per_prompt, ddof=1) / np.sqrt(len(per_prompt))) if len(per_prompt) > 1 else float("nan")
    return float(wins.mean()), se
