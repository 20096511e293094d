"""The online cost model's learning curve: predicted / measured ms of each Auto call, in call order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plot_learning_curve(curve: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """One point per Auto call: the cost model's prediction over the measured time of the same events
    (1.0 = right), log scale, coloured by the coefficients' source (probe, stored, online)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    points = [p for p in curve if p.get("predicted_ms") and p.get("measured_ms")]
    for source in dict.fromkeys(p["source"] for p in points):
        chosen = [p for p in points if p["source"] == source]
        axes.plot([p["call"] + 1 for p in chosen], [p["predicted_ms"] / p["measured_ms"] for p in chosen],
                  "o", label=source)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xlabel("Auto call")
    axes.set_ylabel("predicted / measured ms")
    axes.set_title(title or "online cost model: predicted / measured per call", fontsize=9)
    axes.legend(title="coefficients")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
