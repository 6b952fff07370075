"""Rewards, metrics and advantages of a graded group.

Standard GRPO, as the seed's example computes it: within a group,
``(r - mean) / (std + 1e-6)`` with the sample standard deviation (n - 1); a group of
one gets its raw reward (mean 0, std 1). Custom advantages from group graders
replace it; several are averaged with the graders' weights (one is used as is),
sequence-level ones expanded to every token when mixed with token-level ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from rollout_proxy.sdk.types import GroupGraderResult

EPSILON = 1e-6


def grpo_advantages(rewards: Sequence[float]) -> list[float]:
    count = len(rewards)
    if count > 1:
        mean = sum(rewards) / count
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (count - 1)) + EPSILON
    else:
        mean, std = 0.0, 1.0
    return [(r - mean) / std for r in rewards]


def weighted_rewards(per_grader: Sequence[tuple[float, Sequence[float]]], n: int) -> list[float]:
    totals = [0.0] * n
    for weight, rewards in per_grader:
        for index, reward in enumerate(rewards):
            totals[index] += weight * reward
    return totals


def aggregate_metrics(records: Iterable[dict[str, float]]) -> dict[str, dict[str, float]]:
    """min / max / mean per key over a step's grader calls."""
    values: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for key, value in record.items():
            values[key].append(float(value))
    return {key: {"min": min(v), "max": max(v), "mean": sum(v) / len(v)} for key, v in sorted(values.items())}


def custom_advantages(
    results: Sequence[tuple[float, GroupGraderResult]], token_counts: Sequence[int]
) -> tuple[str, list[Any]] | None:
    """("seq" | "tok", advantages) from the graders that returned any, or None."""
    custom = [(w, r) for w, r in results if r.seq_advantages is not None or r.tok_advantages is not None]
    if not custom:
        return None
    total_weight = sum(w for w, _ in custom)
    custom = [(w / total_weight if total_weight > 0 else 1.0 / len(custom), r) for w, r in custom]
    if all(r.seq_advantages is not None for _, r in custom):
        total = [0.0] * len(token_counts)
        for weight, result in custom:
            for index, value in enumerate(result.seq_advantages):
                total[index] += weight * value
        return "seq", total
    tokens = [[0.0] * count for count in token_counts]
    for weight, result in custom:
        for index, count in enumerate(token_counts):
            values = (
                result.tok_advantages[index]
                if result.tok_advantages is not None
                else [result.seq_advantages[index]] * count
            )
            row = tokens[index]
            for position, value in enumerate(values):
                row[position] += weight * value
    return "tok", tokens
