"""The telemetry middleware: a server span per request, and its timings and counts in ``/metrics``.

It wraps the error middleware, so it sees every answer as the client does (errors included).
A turn (``POST /v1/chat/completions``, ``POST /v1/responses``) answered without an error is timed
whole, streaming included, and its proxy overhead (the turn's seconds minus its engine calls')
is kept beside it.
"""

from __future__ import annotations

import time

from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from rollout_proxy.proxy import keys
from rollout_proxy.tracing import server_span

#: the routes that are turns, and the API each serves
TURN_ROUTES = {
    ("POST", "/v1/chat/completions"): "chat",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/v1/messages"): "messages",
}


def route_of(request: web.Request) -> str:
    """The route's template (``/v1/sessions/{session_id}``), never the path: a bounded label."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def telemetry_middleware(request: web.Request, handler) -> web.StreamResponse:
    telemetry = request.app[keys.TELEMETRY]
    metrics = telemetry.metrics
    route = route_of(request)
    attributes = {"http.request.method": request.method, "http.route": route, "url.path": request.path}
    status = 500
    with server_span(telemetry, f"{request.method} {route}", request.headers, attributes) as (span, scope):
        started = time.perf_counter()
        response = await handler(request)
        elapsed = time.perf_counter() - started
        status = response.status
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        api = TURN_ROUTES.get((request.method, route))
        if api is not None and status < 400:
            metrics.observe("turn_seconds", elapsed, api=api)
            metrics.observe("overhead_seconds", max(0.0, elapsed - scope.engine_seconds), api=api)
    metrics.inc("requests_total", route=route, status=str(status))
    if status >= 400:
        metrics.inc("errors_total", status=str(status))
    return response
