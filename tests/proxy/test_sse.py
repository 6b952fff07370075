"""SSE frames as clients parse them: an optional ``event:`` line, one ``data:`` line, a blank line."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_proxy.core.streaming import StreamEvent, TurnDelta, TurnDone, TurnStarted
from rollout_proxy.errors import ProxyError
from rollout_proxy.proxy.sse import Frame, encode, serve_stream
from rollout_proxy.tokenization.parsers.incremental import ViewDelta


def parse(stream: bytes) -> list[tuple[str | None, str]]:
    """What an SSE client reads: (event name or None, data) per event."""
    events = []
    for block in stream.decode().split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("event"), fields["data"]))
    return events


def test_named_and_unnamed_frames_and_done():
    stream = encode([("message_start", {"type": "message_start"}), (None, {"id": "x"}), (None, "[DONE]")])
    assert stream.endswith(b"\n\n")
    assert parse(stream) == [
        ("message_start", '{"type":"message_start"}'),
        (None, '{"id":"x"}'),
        (None, "[DONE]"),  # sent as is, not as a JSON string
    ]


def test_data_is_one_line_of_json_even_with_newlines_in_the_text():
    """A newline inside the data would end the event early; JSON escapes it."""
    stream = encode([(None, {"delta": "line one\n\nline two"})])
    [(name, data)] = parse(stream)
    assert name is None and orjson.loads(data) == {"delta": "line one\n\nline two"}


def test_numpy_values_and_integer_keys_are_serialized():
    stream = encode([(None, {"ids": np.array([1, 2], dtype=np.int32), "top": {3: -0.5}})])
    [(_, data)] = parse(stream)
    assert orjson.loads(data) == {"ids": [1, 2], "top": {"3": -0.5}}


def test_no_frames_write_nothing():
    assert encode([]) == b""


class OneFramePerEvent:
    """A ``Framing`` writing each delta's content as one frame."""

    def start(self, started: TurnStarted) -> list[Frame]:
        return [("start", {"id": started.response_id})]

    def frames(self, event: StreamEvent) -> list[Frame]:
        if isinstance(event, TurnDelta):
            return [(None, {"content": event.view.content})]
        return [(None, "[DONE]")]

    def error(self, error: ProxyError) -> list[Frame]:
        return [("error", {"message": error.message})]


def delta(content: str, *, more: bool) -> TurnDelta:
    return TurnDelta(np.zeros(1, np.int32), np.zeros(1, np.float32), ViewDelta(content=content), more=more)


async def test_deltas_ready_together_go_out_in_one_write_and_none_waits_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``more``: another delta was ready with this one; those are one write (one syscall, one chunk). A delta
    with nothing ready behind it is written before the next event is even asked for. The last frames go
    with the end of the body, in the same write."""
    writes: list[bytes] = []
    ends: list[bytes] = []  # what each ``write_eof`` wrote with the end of the body
    written_before: list[int] = []  # writes done when each event after the first was asked for
    original, original_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def counted(self: web.StreamResponse, data: bytes) -> None:
        writes.append(bytes(data))
        await original(self, data)

    async def counted_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        ends.append(bytes(data))
        await original_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted)
    monkeypatch.setattr(web.StreamResponse, "write_eof", counted_eof)
    deltas = [delta("a", more=True), delta("b", more=True), delta("c", more=False), delta("d", more=False)]
    done = TurnDone(result=None)  # type: ignore[arg-type]  # the framing above does not read it

    async def events() -> AsyncGenerator[StreamEvent, None]:
        yield TurnStarted("resp_1", "policy", np.zeros(0, np.int32), 0.0, {})
        yield deltas[0]
        for event in [*deltas[1:], done]:
            written_before.append(len(writes))
            yield event

    async def handler(request: web.Request) -> web.StreamResponse:
        return await serve_stream(request, events(), lambda started: OneFramePerEvent())

    app = web.Application()
    app.router.add_post("/", handler)
    async with (
        TestServer(app) as server,
        aiohttp.ClientSession() as http,
        http.post(server.make_url("/")) as response,
    ):
        body = await response.read()
    expected: list[tuple[str | None, Any]] = [("start", {"id": "resp_1"})]
    expected += [(None, {"content": event.view.content}) for event in deltas] + [(None, "[DONE]")]
    assert body == encode(expected)  # every frame, in order
    assert (
        [parse(write) for write in writes]
        == [
            parse(encode(expected[:4])),  # the start and a, b, c: ready together
            parse(encode(expected[4:5])),  # d alone
        ]
    )
    assert parse(ends[0]) == parse(encode(expected[5:]))  # the end of the body, with the last frames
    assert written_before == [0, 0, 1, 2]  # c's write came before d was asked for, d's before the end
