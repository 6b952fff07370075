"""Counters and gauges for ``/metrics`` (Prometheus text format), kept per application.

Everything the proxy cannot avoid (forks, prompt drift, unparsed tool calls,
non-finite logprobs, failovers, aborted turns) is counted here, so it is visible,
never silent. Gauges (``set``) say how things are now: engines per state, turns
waiting for a resume, the fleet's policy version.
"""

from __future__ import annotations

from collections import defaultdict

Key = tuple[str, tuple[tuple[str, str], ...]]


class Metrics:
    def __init__(self) -> None:
        self._counters: dict[Key, float] = defaultdict(float)
        self._gauges: dict[Key, float] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._counters[(name, tuple(sorted(labels.items())))] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        """A gauge: the value now (it replaces the last one)."""
        self._gauges[(name, tuple(sorted(labels.items())))] = value

    def value(self, name: str, **labels: str) -> float:
        return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def gauge(self, name: str, **labels: str) -> float | None:
        return self._gauges.get((name, tuple(sorted(labels.items()))))

    def counters(self) -> dict[str, float]:
        """Every counter summed over its labels, by name (without the ``rollout_proxy_`` prefix)."""
        totals: dict[str, float] = {}
        for (name, _), value in self._counters.items():
            totals[name] = totals.get(name, 0.0) + value
        return totals

    def render(self) -> str:
        lines = []
        for (name, labels), value in sorted([*self._counters.items(), *self._gauges.items()]):
            label_text = ",".join(f'{key}="{val}"' for key, val in labels)
            lines.append(
                f"rollout_proxy_{name}{{{label_text}}} {value:g}" if label_text else f"rollout_proxy_{name} {value:g}"
            )
        return "\n".join(lines) + "\n"
