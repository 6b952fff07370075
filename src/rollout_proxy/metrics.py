"""Counters for ``/metrics`` (Prometheus text format), kept per application.

Everything the proxy cannot avoid (forks, prompt drift, unparsed tool calls,
non-finite logprobs) is counted here, so it is visible, never silent.
"""

from __future__ import annotations

from collections import defaultdict


class Metrics:
    def __init__(self) -> None:
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._counters[(name, tuple(sorted(labels.items())))] += value

    def value(self, name: str, **labels: str) -> float:
        return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def counters(self) -> dict[str, float]:
        """Every counter summed over its labels, by name (without the ``rollout_proxy_`` prefix)."""
        totals: dict[str, float] = {}
        for (name, _), value in self._counters.items():
            totals[name] = totals.get(name, 0.0) + value
        return totals

    def render(self) -> str:
        lines = []
        for (name, labels), value in sorted(self._counters.items()):
            label_text = ",".join(f'{key}="{val}"' for key, val in labels)
            lines.append(
                f"rollout_proxy_{name}{{{label_text}}} {value:g}" if label_text else f"rollout_proxy_{name} {value:g}"
            )
        return "\n".join(lines) + "\n"
