"""Server-side traces and timings: a span per request, child spans for the store, rendering and
each engine call, the W3C ``traceparent`` continued from the plugin and passed on to vLLM.

Each application has its own ``Telemetry`` (its own ``TracerProvider``, never OpenTelemetry's
global one, so two apps in one process, as in tests, never mix spans). Spans are exported over
OTLP/HTTP when an endpoint is configured (``--otlp-endpoint`` or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), to the exporters a
caller passes (tests: an in-memory one), and nowhere otherwise: then the tracer is
OpenTelemetry's no-op one, which still carries a plugin's ``traceparent`` on to the engine and
its trace id onto the turn, at no cost beyond parsing the header.

The request's ``Scope`` (its telemetry, the seconds its engine calls took) lives in a context
variable that the middleware sets, so the engine client and the store, which know nothing of
HTTP requests, can add their spans and timings to the request they serve. Outside a request
(health probes, background work) they add none.

Span tree of one turn::

    POST /v1/chat/completions            SERVER, continues the plugin's traceparent
      store lease_session / ...          INTERNAL, one per store call (the session read, with what the
                                         turn reads next)
      render                             INTERNAL, the bridge tokens (local or by the engine)
        engine POST /tokenize            CLIENT, only when the engine renders
      engine POST /v1/completions        CLIENT, one per attempt (retries, failover), engine URL attribute
      store put_node ...
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, MutableMapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rollout_proxy.metrics import Metrics

SERVICE_NAME = "rollout-proxy"
SCOPE_NAME = "rollout_proxy"
#: the standard variables that name an OTLP collector, most specific first
OTLP_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def otlp_endpoint_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The collector the standard OpenTelemetry variables name (``OTEL_SDK_DISABLED=true``: none)."""
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    for name in OTLP_VARIABLES:
        if value := environ.get(name, "").strip():
            return value
    return None


def engine_id(url: str) -> str:
    """A short, stable name for an engine in metric labels: its URL is the operator's, never shown there."""
    return "engine-" + hashlib.sha256(url.encode()).hexdigest()[:8]


class Telemetry:
    """One application's tracer (and the metrics that the request scope times into)."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        otlp_endpoint: str | None = None,
        exporters: Sequence[SpanExporter] = (),
        service_name: str = SERVICE_NAME,
    ) -> None:
        self.metrics = metrics
        self.propagator = TraceContextTextMapPropagator()
        self._provider: TracerProvider | None = None
        if otlp_endpoint or exporters:
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            for exporter in exporters:
                provider.add_span_processor(SimpleSpanProcessor(exporter))
            if otlp_endpoint:
                try:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                except ImportError:
                    raise ValueError(
                        f"traces to {otlp_endpoint} need the OTLP exporter: pip install 'rollout-proxy[otlp]'"
                    ) from None
                endpoint = otlp_endpoint.rstrip("/")
                if not endpoint.endswith("/v1/traces"):
                    endpoint += "/v1/traces"
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
            self._provider = provider
            self.tracer: trace.Tracer = provider.get_tracer(SCOPE_NAME)
        else:
            self.tracer = trace.NoOpTracer()
        #: whether spans are made at all (else only the plugin's trace context is carried on)
        self.recording = self._provider is not None

    def shutdown(self) -> None:
        """Flush what is buffered (the OTLP batch) and stop; blocking, so called off the event loop."""
        if self._provider is not None:
            self._provider.shutdown()


@dataclass(slots=True)
class Scope:
    """What one request's spans and timings need, and what it learns on the way."""

    telemetry: Telemetry
    engine_seconds: float = 0.0


_scope: ContextVar[Scope | None] = ContextVar("rollout_proxy_request_scope", default=None)


@contextlib.contextmanager
def server_span(
    telemetry: Telemetry, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]
) -> Iterator[tuple[Span, Scope]]:
    """A request's span, continuing the ``traceparent`` in ``headers`` if any, and its scope.

    Not recording: no span at all, only the plugin's trace context made current (so it still reaches
    the engine and the turn), which is most of the cost saved when nobody collects traces."""
    parent = telemetry.propagator.extract(carrier=headers)  # aiohttp's headers: case-insensitive, not copied
    scope = Scope(telemetry)
    token = _scope.set(scope)
    try:
        if not telemetry.recording:
            attached = otel_context.attach(parent)
            try:
                yield trace.get_current_span(), scope
            finally:
                otel_context.detach(attached)
            return
        with telemetry.tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes), record_exception=False
        ) as span:
            yield span, scope
    finally:
        _scope.reset(token)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span | None]:
    """A child span of the current request's (nothing outside a request)."""
    scope = _scope.get()
    if scope is None or not scope.telemetry.recording:
        yield None
        return
    with scope.telemetry.tracer.start_as_current_span(name, attributes=attributes) as current:
        yield current


@contextlib.contextmanager
def engine_call(url: str, method: str, path: str) -> Iterator[None]:
    """One engine call: its span (engine URL attribute; the client sends it on with ``inject``), its
    seconds (histogram, and the request's engine time) and the engine's calls-in-flight gauge.
    Nothing outside a request."""
    scope = _scope.get()
    if scope is None:
        yield
        return
    telemetry, label = scope.telemetry, engine_id(url)
    started = time.perf_counter()
    telemetry.metrics.add("engine_in_flight", 1, engine=label)
    attributes = {"rollout_proxy.engine.url": url, "http.request.method": method, "url.path": path}
    try:
        if not telemetry.recording:
            yield
            return
        with telemetry.tracer.start_as_current_span(
            f"engine {method} {path}", kind=SpanKind.CLIENT, attributes=attributes
        ):
            yield  # an error ends the span with its status and the exception recorded
    finally:
        elapsed = time.perf_counter() - started
        scope.engine_seconds += elapsed
        telemetry.metrics.add("engine_in_flight", -1, engine=label)
        telemetry.metrics.observe("engine_seconds", elapsed, engine=label, path=path)


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to outgoing ``headers``; in a request only."""
    scope = _scope.get()
    if scope is not None:
        scope.telemetry.propagator.inject(headers)


def current_trace_id() -> str | None:
    """The current trace's id (32 hex digits), or None when there is no valid trace."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


@contextlib.asynccontextmanager
async def engine_call_async(url: str, method: str, path: str) -> AsyncIterator[None]:
    """``engine_call`` for an ``async with`` chain (a streamed call)."""
    with engine_call(url, method, path):
        yield
