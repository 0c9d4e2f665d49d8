"""Comparing two policies' responses to the same prompts: a win rate and its standard error."""

from __future__ import annotations

import numpy as np


def win_rate(ours: list[float], theirs: list[float], groups: list[str]) -> tuple[float, float]:
    """Share of paired responses where `ours` beats `theirs` (ties count half), and its standard
    error. Responses to one prompt are not independent, so the error is taken over the prompts
    (`groups`): the standard deviation of the per-prompt win rates over sqrt(number of prompts)."""
    ours, theirs, groups = np.asarray(ours, dtype=float), np.asarray(theirs, dtype=float), np.asarray(groups)
    if len(ours) == 0:
        return float("nan"), float("nan")
    wins = 0.5 + 0.5 * np.sign(ours - theirs)  # 1 win, 0.5 tie, 0 loss
    per_prompt = [wins[groups == g].mean() for g in dict.fromkeys(groups.tolist())]
    se = float(np.std(per_prompt, ddof=1) / np.sqrt(len(per_prompt))) if len(per_prompt) > 1 else float("nan")
    return float(wins.mean()), se
