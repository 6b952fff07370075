"""The proxy's Prometheus metrics (``/metrics``), kept per application on ``prometheus_client``.

Everything the proxy cannot avoid (forks, prompt drift, unparsed tool calls, non-finite
logprobs, failovers, aborted turns) is counted here, so it is visible, never silent; gauges
say how things are now (engines per state, calls in flight, open sessions, the policy
version); histograms say how long things take (a turn, an engine call, the proxy's own share
of a turn, waits in the pause queue and for an engine slot, the store) and how long turns are
in tokens.

Every metric is declared in ``DECLARED`` (its kind, HELP text, label names, buckets), so
``/metrics`` has a HELP and a TYPE line for each and a typo fails a test
(``tests/test_metrics.py`` checks every name used in ``src``). A name missing from the table
still works, with a placeholder HELP, so code written elsewhere never fails on a metric.

Each ``Metrics`` has its own ``CollectorRegistry``: two apps in one process (tests) never
share a number. Several worker processes (``serve --workers N``, ``proxy/workers.py``) share
one ``PROMETHEUS_MULTIPROC_DIR``, an empty directory set *before* Python starts
(prometheus_client reads it at import): each worker writes its values there and ``render``
sums counters and histograms over all workers, and gauges by their ``multiprocess_mode``
(``livesum`` for what adds up, ``max``/``mostrecent`` for what every worker sees the same; a
dead worker leaves the sum once ``prometheus_client.multiprocess.mark_process_dead`` is called
for it). ``value``, ``gauge`` and ``counters`` always answer for this process only.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

PREFIX = "rollout_proxy_"

Kind = Literal["counter", "gauge", "histogram"]
GaugeMode = Literal["livesum", "max", "mostrecent"]

#: seconds, for a turn or an engine call (a long generation takes minutes)
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: seconds, for what the proxy itself adds (sub-millisecond when all is well)
OVERHEAD = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: seconds, for one store call (memory: microseconds; Redis: about a millisecond)
STORE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
#: seconds, for a wait in the pause queue or for an engine slot (a pause lasts a weight update)
WAIT = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: tokens of one turn
TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True, slots=True)
class Declared:
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    mode: GaugeMode = "livesum"  # gauges across worker processes


def _counter(help: str, *labels: str) -> Declared:
    return Declared("counter", help, labels)


def _gauge(help: str, *labels: str, mode: GaugeMode = "livesum") -> Declared:
    return Declared("gauge", help, labels, mode=mode)


def _histogram(help: str, buckets: tuple[float, ...], *labels: str) -> Declared:
    return Declared("histogram", help, labels, buckets)


#: Every metric the proxy writes, by name without the ``rollout_proxy_`` prefix.
DECLARED: dict[str, Declared] = {
    # turns and the response tree
    "turns_total": _counter("Turns answered, by API (chat, responses).", "api"),
    "generated_tokens_total": _counter("Tokens the policy generated, over all turns."),
    "policy_turns_total": _counter(
        "Turns answered, by the session's policy (base or a registered LoRA one).", "policy"
    ),
    "policy_generated_tokens_total": _counter(
        "Tokens generated, by the policy that sampled them (base or a registered LoRA one).", "policy"
    ),
    "streamed_turns_total": _counter(
        "Streamed turns (stream: true), by API and how they ended: completed, disconnected (the client left; "
        "the engine call was aborted, nothing recorded) or failed (an SSE error event, nothing recorded).",
        "api",
        "outcome",
    ),
    "stream_view_mismatch_total": _counter(
        "Streamed turns whose released deltas disagreed with the final parse (a parser bug; the record is exact)."
    ),
    "forks_total": _counter("Requests whose history rewrote an earlier message: a fork, by API.", "api"),
    "sample_placements_total": _counter(
        "Conversations placed from the root of a session with sample messages, by API and how they held the "
        "sample: prefix, contained (in order, within the client's own prompt), inserted (none of it: the proxy "
        "put it after the leading system/developer messages), absent (none of it, taken as sent: chat), "
        "partial or out_of_order (taken as sent, flagged on the node).",
        "api",
        "placement",
    ),
    "client_sampling_ignored_total": _counter(
        "Generation parameters a client sent that its session ignored (client_sampling: ignore), by API and field.",
        "api",
        "field",
    ),
    "tools_left_out_total": _counter(
        "Tools a request sent that the policy cannot call (hosted, custom/freeform), left out of the prompt, "
        "by API and tool type.",
        "api",
        "type",
    ),
    "prompt_drift_total": _counter("Turns whose engine-reported prompt differed from the tokens the proxy sent."),
    "unchecked_prompts_total": _counter(
        "Engine answers that did not echo the prompt they consumed, so the drift check could not run (refused "
        "with --prompt-echo require, the default; recorded and flagged with --prompt-echo count)."
    ),
    "nonfinite_logprobs_total": _counter("Sampled tokens whose logprob was not finite (stored as a placeholder)."),
    "injected_nodes_total": _counter("Nodes of messages the policy did not generate (POST .../messages)."),
    "sibling_parents_total": _counter(
        "Turns whose conversation ends where several nodes of the same content do (a group's samples with the "
        "same visible answer) and that continue the one the client was answered, by API and by what told it: "
        "tool_call_id, reasoning, signature (a signed thinking block), history (an earlier turn's reasoning).",
        "api",
        "by",
    ),
    "parent_ambiguities_total": _counter(
        "Turns whose conversation ends where several nodes of the same content do and nothing the client echoed "
        "tells which it was answered: the newest not yet continued was taken (else the newest), recorded on the "
        "node as parent_ambiguity, by API.",
        "api",
    ),
    "parents_by_signature_total": _counter(
        "Turns whose parent was named by the signature of the thinking the client echoed, not by content alone "
        "(two nodes with the same messages and different tokens), by API.",
        "api",
    ),
    "tool_parse_total": _counter(
        "Tool-call parsing of generated turns, by outcome (none, calls, unparsed).", "outcome"
    ),
    "routing_malformed_total": _counter("Turns whose MoE routed experts the engine sent malformed (dropped)."),
    "routing_disagreements_total": _counter("Positions where a turn's routed experts disagreed with its parent's."),
    # rendering
    "renders_total": _counter("Bridge-token renders, by where they were rendered (local, engine).", "source"),
    "render_checks_total": _counter(
        "Local renders checked against the engine's, by check and outcome.", "check", "outcome"
    ),
    "render_fallbacks_total": _counter("Times local rendering gave way to the engine's, by reason.", "reason"),
    # the fleet
    "engine_retries_total": _counter("Engine calls retried on the same or another engine."),
    "engine_failovers_total": _counter("Turns that moved to another engine after a failure."),
    "engine_call_failures_total": _counter("Failed engine calls, by error kind.", "kind"),
    "engine_state_changes_total": _counter("Engine state changes, by the state entered.", "state"),
    "abort_resubmissions_total": _counter(
        "Turns resubmitted after an abort or a weight change, by policy and reason.", "policy", "reason"
    ),
    "pauses_total": _counter("Fleet pauses for a weight update, by mode.", "mode"),
    "pause_seconds_total": _counter("Seconds the fleet spent paused."),
    "resumes_total": _counter("Fleet resumes."),
    "engines": _gauge("Engines of the fleet, by state.", "state", mode="mostrecent"),
    "policy_version": _gauge("The fleet's policy version.", mode="max"),
    "engines_paused": _gauge("1 while the fleet is paused for a weight update.", mode="max"),
    "paused_turns": _gauge("Turns waiting at the pause gate for a resume."),
    "engine_in_flight": _gauge("Calls in flight on each engine (label: the engine's short id).", "engine"),
    # LoRA policies (engines.policies; at most MAX_POLICIES, and per policy only the served names in use)
    "policy_publishes_total": _counter(
        "Adapter versions published, by policy and outcome (published, partial: some engine drained for it, "
        "refused: no engine took it).",
        "policy",
        "outcome",
    ),
    "policy_publish_seconds": _histogram(
        "Seconds a publish took (every engine loaded or failed), by policy.", LATENCY, "policy"
    ),
    "policy_current_version": _gauge("Each LoRA policy's current version.", "policy", mode="max"),
    "policy_in_use": _gauge(
        "Calls holding a LoRA policy's served name now (over all engines), by policy and served name.",
        "policy",
        "served",
    ),
    "policy_adapter_reloads_total": _counter(
        "Adapters loaded again on an engine that lost them (a restart) or joined late, by policy.", "policy"
    ),
    # HTTP
    "requests_total": _counter("Requests answered, by route and status.", "route", "status"),
    "errors_total": _counter("Error answers (4xx and 5xx), by status.", "status"),
    "open_sessions": _gauge("Sessions created and neither finished nor expired (this process's)."),
    # how long things take
    "turn_seconds": _histogram(
        "Seconds a turn took, as the plugin waited (streaming included), by API.", LATENCY, "api"
    ),
    "engine_seconds": _histogram("Seconds of one engine call, by engine and path.", LATENCY, "engine", "path"),
    "overhead_seconds": _histogram(
        "Seconds of a turn not spent in engine calls: the proxy's own share.", OVERHEAD, "api"
    ),
    "queue_wait_seconds": _histogram(
        "Seconds a turn waited before its engine call: at the pause gate, for its job's request bound "
        "(concurrency) or for an engine slot.",
        WAIT,
        "reason",
    ),
    "store_seconds": _histogram("Seconds of one state-store call, by operation.", STORE, "op"),
    "turn_tokens": _histogram("Tokens of one turn: its prompt and what the policy generated.", TOKENS, "kind"),
}

Metric = Counter | Gauge | Histogram


class OpenSessions:
    """Open sessions of this process: created and neither finished nor past their expiry.

    What it holds goes with its sessions: at their finish, and at their expiry when counted (every
    scrape, and the app's expiry timer each second), so it stays the size of the open sessions whether
    or not anyone scrapes ``/metrics``."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def opened(self, session_id: str, expires_at: float) -> None:
        self._expiry[session_id] = expires_at
        heapq.heappush(self._heap, (expires_at, session_id))

    def closed(self, session_id: str) -> None:
        self._expiry.pop(session_id, None)
        if len(self._heap) > 2 * len(self._expiry) + 64:  # finished sessions leave stale entries: drop them
            self._heap = [(at, sid) for sid, at in self._expiry.items()]
            heapq.heapify(self._heap)

    def count(self, now: float) -> int:
        while self._heap and self._heap[0][0] <= now:
            expires_at, session_id = heapq.heappop(self._heap)
            if self._expiry.get(session_id) == expires_at:
                del self._expiry[session_id]
        return len(self._expiry)


class Metrics:
    """One application's metrics: ``inc`` a counter, ``set`` a gauge, ``observe`` a histogram."""

    def __init__(self) -> None:
        shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared_dir:  # prometheus_client writes its value files there from the first metric on
            os.makedirs(shared_dir, exist_ok=True)
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Metric] = {}
        self._children: dict[tuple[object, ...], Metric] = {}
        self.sessions = OpenSessions()
        for name in DECLARED:
            self._metric(name, ())

    def _metric(self, name: str, labels: tuple[str, ...]) -> Metric:
        metric = self._metrics.get(name)
        if metric is not None:
            return metric
        declared = DECLARED.get(name) or Declared(
            "histogram"
            if name.endswith(("_seconds", "_tokens"))
            else "counter"
            if name.endswith("_total")
            else "gauge",
            f"{name} (undeclared: add it to rollout_proxy.metrics.DECLARED)",
            labels,
            LATENCY if name.endswith("_seconds") else TOKENS,
        )
        full, labelnames = PREFIX + name, declared.labels
        created: Metric
        if declared.kind == "counter":
            created = Counter(full, declared.help, labelnames, registry=self.registry)
        elif declared.kind == "gauge":
            created = Gauge(full, declared.help, labelnames, registry=self.registry, multiprocess_mode=declared.mode)
        else:
            created = Histogram(full, declared.help, labelnames, registry=self.registry, buckets=declared.buckets)
        self._metrics[name] = created
        return created

    def _child(self, name: str, labels: dict[str, str]) -> Metric:
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:  # prometheus_client's labels() takes a lock and builds a key: once per label set
            metric = self._metric(name, tuple(sorted(labels)))
            child = metric.labels(**{k: str(v) for k, v in labels.items()}) if labels else metric
            self._children[key] = child
        return child

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        child = self._child(name, labels)
        assert isinstance(child, Counter | Gauge), f"{name} is not a counter"
        child.inc(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        """A gauge: the value now (it replaces the last one)."""
        child = self._child(name, labels)
        assert isinstance(child, Gauge), f"{name} is not a gauge"
        child.set(value)

    def add(self, name: str, delta: float, **labels: str) -> None:
        """A gauge moved by ``delta`` (calls in flight: +1 when one starts, -1 when it ends)."""
        child = self._child(name, labels)
        assert isinstance(child, Gauge), f"{name} is not a gauge"
        child.inc(delta)

    def forget(self, name: str, **labels: str) -> None:
        """Drop one label set of a metric (a served name unloaded): labels stay bounded over a long run."""
        child = self._children.pop((name, *labels.items()), None)
        if child is None:
            return
        if isinstance(child, Gauge):
            child.set(0)  # a worker's value file keeps the last value (multiprocess): zero, not stale
        declared = DECLARED.get(name)
        order = declared.labels if declared is not None else tuple(sorted(labels))
        with contextlib.suppress(KeyError):
            self._metrics[name].remove(*(str(labels[label]) for label in order))

    def observe(self, name: str, value: float, **labels: str) -> None:
        """One observation of a histogram (seconds, tokens)."""
        child = self._child(name, labels)
        assert isinstance(child, Histogram), f"{name} is not a histogram"
        child.observe(value)

    @contextlib.contextmanager
    def timer(self, name: str, **labels: str) -> Iterator[None]:
        """Observe the seconds the ``with`` block took, whether it raised or not."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - started, **labels)

    def _sample(self, suffix: str, name: str, labels: dict[str, str]) -> float | None:
        return self.registry.get_sample_value(PREFIX + name + suffix, {k: str(v) for k, v in labels.items()})

    def value(self, name: str, **labels: str) -> float:
        """A counter's value for these labels (0 until counted); a histogram's count of observations."""
        suffix = "_count" if isinstance(self._metrics.get(name), Histogram) else ""
        return self._sample(suffix, name, labels) or 0.0

    def gauge(self, name: str, **labels: str) -> float | None:
        return self._sample("", name, labels)

    def counters(self) -> dict[str, float]:
        """Every counter that has counted something, summed over its labels, by name (no prefix)."""
        totals: dict[str, float] = {}
        for name, metric in self._metrics.items():
            if not isinstance(metric, Counter):
                continue
            for family in metric.collect():
                total = sum(s.value for s in family.samples if s.name.endswith("_total"))
                if total:
                    totals[name] = total
        return totals

    def render(self) -> str:
        """The Prometheus text exposition: this process's registry, or every worker's when multiprocess."""
        self.set("open_sessions", self.sessions.count(time.time()))
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged).decode()
        return generate_latest(self.registry).decode()
