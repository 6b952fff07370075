"""SSE frames as clients parse them: an optional ``event:`` line, one ``data:`` line, a blank line."""

from __future__ import annotations

import numpy as np
import orjson

from rollout_proxy.proxy.sse import encode


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
