"""PNG curves for the MLflow UI (matplotlib, headless)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curves(history: list[dict[str, float]], keys: list[str], title: str):
    """One panel per metric against the iteration number."""
    figure, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    iterations = [row["iteration"] for row in history]
    for axis, key in zip(axes[0], keys):
        axis.plot(iterations, [row.get(key, float("nan")) for row in history], linewidth=1.5)
        axis.set_title(key)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    return figure
