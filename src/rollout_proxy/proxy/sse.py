"""Server-sent events for ``stream: true``: a turn's events written as the client's API frames them.

The response starts (200, ``text/event-stream``) only with the turn's first output, so a
request refused before the engine answered (validation, an unknown ``previous_response_id``, no
engine, every failover spent) is an ordinary JSON error with its status. After that, a failure
is one SSE ``error`` event and the end of the stream (never an error body after a started
response). A client that goes away ends the turn's iteration, which aborts the engine call.

Deltas the engine sent together (read in one go, or while the loop was busy) are written together: one
write, one syscall, for what is ready at once (``TurnDelta.more``); nothing waits for a delta not yet
sampled. The turn's last frames go out with the end of the body: each write is a syscall, which costs
more than framing a delta.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import orjson
import structlog
from aiohttp import web

from rollout_proxy.core.streaming import StreamEvent, TurnDelta, TurnDone, TurnStarted
from rollout_proxy.errors import ProxyError

log = structlog.get_logger(__name__)

_DUMP_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
#: frames of deltas that were ready together written at most this many at a time (a write a syscall)
MAX_HELD_FRAMES = 256

#: One SSE event: its ``event:`` name (None: none) and its data (``[DONE]`` is sent as is).
Frame = tuple[str | None, Any]


class Framing(Protocol):
    """How one API writes a streamed turn (``chat_stream``, ``responses_stream``)."""

    def start(self, started: TurnStarted) -> list[Frame]: ...

    def frames(self, event: StreamEvent) -> list[Frame]: ...

    def error(self, error: ProxyError) -> list[Frame]: ...


def encode(frames: list[Frame]) -> bytes:
    parts = []
    for name, data in frames:
        head = f"event: {name}\n".encode() if name else b""
        body = data.encode() if isinstance(data, str) else orjson.dumps(data, option=_DUMP_OPTIONS)
        parts.append(head + b"data: " + body + b"\n\n")
    return b"".join(parts)


async def serve_stream(
    request: web.Request,
    events: AsyncGenerator[StreamEvent, None],
    framing_for: Callable[[TurnStarted], Framing],
) -> web.StreamResponse:
    """Write ``events`` as SSE; ``framing_for(started)`` makes the ``Framing`` once the turn is prepared."""
    async with contextlib.aclosing(events):
        started = await anext(events)
        if not isinstance(started, TurnStarted):
            raise ProxyError("a streamed turn did not start with its TurnStarted event")
        framing = framing_for(started)
        first = await anext(events)  # until here, failures are the non-streamed turn's (a JSON error)
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "X-Request-Id": str(structlog.contextvars.get_contextvars().get("request_id", "")),
            },
        )
        try:
            await response.prepare(request)
            frames = framing.start(started)
            event: StreamEvent = first
            while True:
                frames += framing.frames(event)
                if isinstance(event, TurnDone):
                    await _write(request, response, frames, last=True)  # with the end of the body: one write
                    break
                if not (isinstance(event, TurnDelta) and event.more) or len(frames) >= MAX_HELD_FRAMES:
                    await _write(request, response, frames)  # what was ready together, in one write
                    frames = []
                event = await anext(events)
        except ConnectionResetError:
            return response  # the client left: closing ``events`` aborts the engine call
        except ProxyError as exc:
            log.warning("stream_failed", status=exc.status, error=exc.message)
            await _write_quietly(request, response, framing.error(exc))
        except Exception:
            log.exception("stream_failed_unexpectedly", path=request.path)
            error = ProxyError("internal error; see the proxy's log for the request id")
            await _write_quietly(request, response, framing.error(error))
    return response  # every path above ended the body with its last write, or found the client gone


async def _write(
    request: web.Request, response: web.StreamResponse, frames: list[Frame], *, last: bool = False
) -> None:
    """``frames`` in one write; ``last``: the body's end (the chunked encoding's last chunk) goes with them."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
    if last:
        await response.write_eof(encode(frames))
    else:
        await response.write(encode(frames))


async def _write_quietly(request: web.Request, response: web.StreamResponse, frames: list[Frame]) -> None:
    """The error event, and the end of the body with it."""
    with contextlib.suppress(ConnectionResetError):
        await _write(request, response, frames, last=True)
