"""Two ways of doing the same thing, timed side by side in one run (these machines are noisy)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def alternate(ways: Sequence[tuple[str, Callable[[], object]]], rounds: int, calls: int) -> dict[str, float]:
    """Each way's median µs per call over ``rounds`` rounds of ``calls`` calls, the order reversed every
    other round, so that a slow spell of the machine falls on both."""
    times: dict[str, list[float]] = {name: [] for name, _ in ways}
    for round_index in range(rounds):
        for name, way in ways if round_index % 2 == 0 else ways[::-1]:
            started = time.perf_counter()
            for _ in range(calls):
                way()
            times[name].append((time.perf_counter() - started) / calls * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}
