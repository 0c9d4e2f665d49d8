"""PNG curves for the MLflow UI (matplotlib, headless)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curves(history: list[dict[str, float]], keys: list[str], title: str):
    """One panel per metric against the iteration number."""
    figure, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    iterations = [row["iteration"] for row in history]
    for axis, key in zip(axes[0], keys, strict=True):
        axis.plot(iterations, [row.get(key, float("nan")) for row in history], linewidth=1.5)
        axis.set_title(key)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def overoptimization(history: list[dict[str, float]], gold: dict[int, float], window: int = 5,
                     proxy: str = "proxy score (normalised)"):
    """Proxy score (`rollout/score`: the reward model's, normalised, or the reward functions' weighted
    sum where there is no reward model; `proxy` labels it) and gold reward of each iteration's rollouts
    against their KL to the reference: where the proxy keeps rising and the gold flattens or falls,
    the policy is exploiting the reward model. Faint points per iteration, lines a running mean."""
    rows = [row for row in history if row["iteration"] in gold]
    kl = [row["rollout/kl"] for row in rows]
    series = ((proxy, [row["rollout/score"] for row in rows], "tab:blue"),
              ("gold reward", [gold[row["iteration"]] for row in rows], "tab:green"))
    figure, proxy_axis = plt.subplots(figsize=(6.4, 4.2))
    gold_axis = proxy_axis.twinx()
    for axis, (label, values, color) in zip((proxy_axis, gold_axis), series, strict=True):
        axis.scatter(kl, values, color=color, alpha=0.25, s=10)
        axis.plot(running_mean(kl, window), running_mean(values, window), color=color, linewidth=1.8, label=label)
        axis.set_ylabel(label, color=color)
    proxy_axis.set_xlabel("KL(policy || reference) per sequence, rollouts")
    proxy_axis.grid(alpha=0.3)
    lines = proxy_axis.get_lines() + gold_axis.get_lines()
    proxy_axis.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    proxy_axis.set_title(f"Over-optimisation: proxy and gold reward against KL\n(points: iterations; lines: running "
                         f"mean of {window})", fontsize=10)
    figure.tight_layout()
    return figure


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the `window - 1` before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]
