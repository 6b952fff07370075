"""The request middleware: context for logs, and the one place errors become HTTP.

Errors are OpenAI-style bodies (``{"error": {"message", "type", "param", "code"}}``):
our ``ProxyError`` tree by its status, aiohttp's own HTTP errors (unknown route,
body too large, a body that does not decode) in the same shape, anything else as a
logged 500 (always a bug). What aiohttp refuses before any handler runs (malformed
HTTP) is worded the same way by ``proxy/server.py``.

An Anthropic client reads Anthropic's shape instead (``{"type": "error", "error": {"type", "message"}}``,
``proxy.anthropic_answers``), with ``x-should-retry`` saying whether to try again: on the Messages routes
(at the root and under a session's ``base_url``, unknown ones there included) and for any request that
carries ``anthropic-version``, which every Anthropic SDK sends.
"""

from __future__ import annotations

import math
import time

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from rollout_proxy.errors import InvalidRequest, MethodNotAllowed, NotFound, PayloadTooLarge, ProxyError
from rollout_proxy.ids import new_request_id
from rollout_proxy.proxy.anthropic_answers import error_body, should_retry
from rollout_proxy.proxy.http import json_response
from rollout_proxy.wire.errors import WireFormatError

log = structlog.get_logger(__name__)


def _http_error(exc: web.HTTPException) -> ProxyError:
    """aiohttp's own HTTP errors (raised before or around our handlers) as our error tree."""
    if exc.status == 413:
        return PayloadTooLarge(f"request body too large: {exc.text}")
    if exc.status == 404:
        return NotFound("no such endpoint")
    if exc.status == 405:
        return MethodNotAllowed(f"{exc.reason}: this endpoint does not take that method")
    if exc.status < 500:
        return InvalidRequest(exc.reason)
    return ProxyError(exc.reason)


@web.middleware
async def request_middleware(request: web.Request, handler) -> web.StreamResponse:
    request_id = request.headers.get("X-Request-Id") or new_request_id()
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.perf_counter()
    anthropic = is_anthropic(request)
    try:
        response = await handler(request)
    except ProxyError as exc:
        response = _error_response(exc, anthropic=anthropic)
    except WireFormatError as exc:
        response = _error_response(InvalidRequest(exc.message, param=exc.param, code=exc.code), anthropic=anthropic)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_response(_http_error(exc), anthropic=anthropic)
        if "Allow" in exc.headers:  # a 405 says which methods the route takes
            response.headers["Allow"] = exc.headers["Allow"]
    except (web.RequestPayloadError, HttpProcessingError):  # a body read outside read_json_object
        unreadable = InvalidRequest("the request body could not be read", code="unreadable_body")
        response = _error_response(unreadable, anthropic=anthropic)
    except Exception:
        log.exception("unhandled_error", path=request.path)
        error = ProxyError("internal error; see the proxy's log for the request id")
        response = _error_response(error, anthropic=anthropic)
    response.headers["X-Request-Id"] = request_id
    log.info(
        "request",
        method=request.method,
        path=request.path,
        status=response.status,
        ms=round((time.perf_counter() - started) * 1000, 1),
    )
    return response


#: Where Anthropic's clients call: the Messages routes at the root, and everything under a session's
#: ``base_url`` + ``/v1`` (the path they append).
ANTHROPIC_PATHS = ("/v1/messages/", "/v1/v1/")


def is_anthropic(request: web.Request) -> bool:
    """Whether the caller reads Anthropic's error shape (see the module docstring)."""
    path = request.path
    return path == "/v1/messages" or path.startswith(ANTHROPIC_PATHS) or "anthropic-version" in request.headers


def _error_response(exc: ProxyError, *, anthropic: bool = False) -> web.Response:
    if exc.status >= 500:
        log.warning("request_failed", status=exc.status, error=exc.message)
    if anthropic:
        response = json_response(error_body(exc), status=exc.status)
        response.headers["x-should-retry"] = "true" if should_retry(exc.status) else "false"
    else:
        response = json_response(exc.to_body(), status=exc.status)
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return response
