"""Grading a group with the job's graders: rewards, metrics and advantages.

Each grader (of either kind, ``sdk.execution.grade``) is called with the seed's
retries and within its own ``Runtime.max_concurrency``; the group's reward is the
graders' rewards summed with their weights.

Standard GRPO, as the seed's example computes it: within a group,
``(r - mean) / (std + 1e-6)`` with the sample standard deviation (n - 1); a group of
one gets its raw reward (mean 0, std 1). Custom advantages from group graders
replace it; several are averaged with the graders' weights (one is used as is),
sequence-level ones expanded to every token when mixed with token-level ones. A rollout's
advantage applies to each of its sequences (``Trajectory.sequences()``: the main one and its
branches); token-level ones are per sequence (``wire.feed.token_advantage_rows``).
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_proxy.runner.executor import InProcessExecutor, PluginExecutor
from rollout_proxy.runner.retries import with_retries
from rollout_proxy.sdk.decorators import Plugin
from rollout_proxy.sdk.execution import Attempt, Grades, PluginCall, grade
from rollout_proxy.sdk.types import ChatCompletionSample, GroupGraderResult, PluginContext, Trajectory
from rollout_proxy.wire.feed import token_advantage_rows, token_advantage_value

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
    results: Sequence[tuple[float, GroupGraderResult]], token_counts: Sequence[Sequence[int]]
) -> tuple[str, list[Any]] | None:
    """("seq" | "tok", advantages) from the graders that returned any, or None.

    ``token_counts[i]``: the token count of each sequence of rollout i (``trajectory.sequences()``). A "tok"
    rollout's advantages are one flat list for a rollout of one sequence, else one list per sequence
    (``wire.feed.token_advantage_rows``)."""
    custom = [(w, r) for w, r in results if r.seq_advantages is not None or r.tok_advantages is not None]
    if not custom:
        return None
    total_weight = sum(w for w, _ in custom)
    custom = [(w / total_weight if total_weight > 0 else 1.0 / len(custom), r) for w, r in custom]
    if all(r.seq_advantages is not None for _, r in custom):
        total = [0.0] * len(token_counts)
        for weight, result in custom:
            for index, value in enumerate(result.seq_advantages or []):
                total[index] += weight * value
        return "seq", total
    tokens = [[[0.0] * count for count in counts] for counts in token_counts]
    for weight, result in custom:
        for index, counts in enumerate(token_counts):
            for rows, values in zip(tokens[index], _token_advantages(result, index, counts), strict=True):
                for position, value in enumerate(values):
                    rows[position] += weight * value
    return "tok", [token_advantage_value(rows) for rows in tokens]


def _token_advantages(result: GroupGraderResult, index: int, counts: Sequence[int]) -> list[list[float]]:
    """Rollout ``index``'s per-token advantages, one row per sequence (a sequence-level one repeated on each
    sequence's tokens)."""
    if result.tok_advantages is not None:
        return token_advantage_rows(result.tok_advantages[index], counts)
    assert result.seq_advantages is not None  # only results carrying one or the other get here
    return [[result.seq_advantages[index]] * count for count in counts]


@dataclass(slots=True)
class GroupGrade:
    """What the job's graders said about a group, together."""

    rewards: list[float]
    grader_rewards: dict[str, list[float]]
    metrics: list[dict[str, float]]
    custom: tuple[str, list[Any]] | None


def combine_grades(weighted: Sequence[tuple[float, Grades]], trajectories: Sequence[Trajectory]) -> GroupGrade:
    """Weighted rewards, rewards by grader, every call's metrics, and custom advantages, if any."""
    group_results = [(weight, g.group_result) for weight, g in weighted if g.group_result is not None]
    token_counts = [[len(s.total_token_ids or []) for s in t.sequences()] for t in trajectories]
    return GroupGrade(
        rewards=weighted_rewards([(weight, g.rewards) for weight, g in weighted], len(trajectories)),
        grader_rewards={g.grader: g.rewards for _, g in weighted},
        metrics=[metric for _, g in weighted for metric in g.metrics],
        custom=custom_advantages(group_results, token_counts),
    )


def _no_op() -> None:
    return None


class Graders:
    """The job's graders with their weights, each behind its own concurrency limit."""

    def __init__(
        self,
        graders: Sequence[tuple[Plugin, float]],
        *,
        on_failed_attempt: Callable[[], None] = _no_op,
        executor: PluginExecutor | None = None,
    ):
        self.plugins = list(graders)
        self._on_failed_attempt = on_failed_attempt
        self._executor = executor or InProcessExecutor()
        self._limits: dict[str, asyncio.Semaphore] = {}
        for plugin, _ in self.plugins:
            self._limits.setdefault(plugin.spec.name, asyncio.Semaphore(plugin.spec.runtime.max_concurrency))

    async def grade_group(
        self, what: str, context: PluginContext, sample: ChatCompletionSample, trajectories: list[Trajectory]
    ) -> GroupGrade:
        """Every grader in turn (raises ``SampleDropped`` / ``JobFailed`` as the seed's statuses say)."""
        weighted = []
        for grader, weight in self.plugins:
            call = self._retried_call(f"{what}: grader {grader.spec.name}")
            weighted.append((weight, await grade(grader, context, sample, trajectories, call=call)))
        return combine_grades(weighted, trajectories)

    def _retried_call(self, what: str) -> PluginCall:
        async def call(grader: Plugin, *args: Any) -> Attempt:
            limit = self._limits[grader.spec.name]

            async def limited() -> Attempt:
                return await self._executor.attempt(grader, *args, limit=limit)

            return await with_retries(what, limited, on_failed_attempt=self._on_failed_attempt)

        return call
