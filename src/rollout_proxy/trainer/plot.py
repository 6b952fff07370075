"""The trainer's step log as a PNG: reward per step, and the mismatch per step.

Drawn with matplotlib's Agg canvas directly (no pyplot, no display), as ``runner.plot`` does.
The mismatch panel is on a symmetric log scale (an exact match, 0, still shows) with the
report's threshold drawn across it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOT_NAME = "steps.png"


def write_training_plot(records: Sequence[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Two panels over the steps trained: reward (mean ± std, min–max) and mismatch (max, mean |Δ|, k3). Blocking."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    rewards_axes, mismatch_axes = figure.subplots(2, 1, sharex=True)
    x = [record["step"] for record in records]
    reward = [record["reward"] for record in records]
    means, stds = [r["mean"] for r in reward], [r["std"] for r in reward]
    rewards_axes.vlines(
        x, [r["min"] for r in reward], [r["max"] for r in reward], linewidth=8, alpha=0.2, label="min–max"
    )
    rewards_axes.errorbar(x, means, yerr=stds, marker="o", capsize=4, label="mean ± std")
    rewards_axes.set_ylabel("reward")
    rewards_axes.legend(loc="best")
    rewards_axes.grid(alpha=0.3)

    current = [record["mismatch"]["current"] for record in records]
    mismatch_axes.plot(x, [c["max_abs"] for c in current], marker="o", label="max |Δ| (trainer's version)")
    mismatch_axes.plot(x, [c["mean_abs"] for c in current], marker="s", label="mean |Δ|")
    mismatch_axes.plot(x, [c["k3"] for c in current], marker="^", label="k3 KL(sampler ‖ trainer)")
    other = [record["mismatch"]["other_version"] for record in records]
    if any(o["tokens"] for o in other):
        mismatch_axes.plot(
            x, [o["max_abs"] for o in other], marker="x", linestyle=":", label="max |Δ|, tokens of other versions"
        )
    thresholds = {record["mismatch"]["threshold"] for record in records}
    for threshold in sorted(thresholds):
        mismatch_axes.axhline(threshold, color="red", linewidth=1, alpha=0.6, label=f"threshold {threshold:g}")
    mismatch_axes.set_yscale("symlog", linthresh=1e-12)  # k3 is about delta**2 / 2
    mismatch_axes.set_ylim(bottom=0.0)  # all of them are >= 0
    mismatch_axes.set_ylabel("trainer − sampling logprob (nats)")
    mismatch_axes.set_xlabel("step")
    if x:
        mismatch_axes.set_xticks(x)
    mismatch_axes.legend(loc="best", fontsize="small")
    mismatch_axes.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
