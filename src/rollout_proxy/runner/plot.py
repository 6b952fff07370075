"""The job's per-step numbers as a PNG: reward mean and spread, tokens and trained tokens.

Drawn with matplotlib's Agg canvas directly (no pyplot, no global backend switch, no
display needed); imported only when a plot is written, so the proxy never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollout_proxy.runner.progress import StepStats

PLOT_NAME = "steps.png"


def write_step_plot(steps: Sequence[StepStats], path: Path, *, title: str = "") -> Path:
    """Two panels over the steps: reward (mean, ±std, min–max band) and tokens (all, trained). Blocking."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    rewards_axes, tokens_axes = figure.subplots(2, 1, sharex=True)
    x = [s.step for s in steps]
    means = [s.reward_mean for s in steps]
    stds = [s.reward_std for s in steps]
    lows, highs = [s.reward_min for s in steps], [s.reward_max for s in steps]
    rewards_axes.vlines(x, lows, highs, linewidth=8, alpha=0.25, label="min–max")  # seen for one step too
    if len(x) > 1:
        rewards_axes.fill_between(x, lows, highs, alpha=0.1)
    rewards_axes.errorbar(x, means, yerr=stds, marker="o", capsize=4, label="mean ± std")
    rewards_axes.set_ylabel("reward")
    rewards_axes.legend(loc="best")
    rewards_axes.grid(alpha=0.3)
    tokens_axes.plot(x, [s.tokens for s in steps], marker="o", label="tokens")
    tokens_axes.plot(x, [s.trained_tokens for s in steps], marker="s", label="trained tokens (loss weight 1)")
    tokens_axes.set_ylabel("tokens per step")
    tokens_axes.set_xlabel("step")
    tokens_axes.set_xticks(x)
    tokens_axes.legend(loc="best")
    tokens_axes.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
