"""``value_at``: a key's value found in compact JSON by the short key and one compare, where a search for
key and value as one needle would find it (the engine's echo of the prompt, a resent history)."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_proxy.wire.json_bytes import value_at

ECHO_KEY = b'"prompt_token_ids":'


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 99), min_size=1, max_size=6),
    st.lists(st.sampled_from(["ours", "other", "longer", "text", "spaced"]), max_size=4),
)
def test_the_echo_is_found_where_the_whole_marker_first_is(prompt: list[int], decoys: list[str]):
    """The place is the first where the key and the whole prompt stand together, as a search for both at
    once finds it, among other echoes: another prompt, a longer one, a spaced one, the key inside a text."""
    ours = orjson.dumps(prompt)
    pieces = {
        "ours": ECHO_KEY + ours,
        "other": ECHO_KEY + orjson.dumps([*prompt[:-1], prompt[-1] + 1]),
        "longer": ECHO_KEY + orjson.dumps([*prompt, 7]),
        "text": b'"text":"\\"prompt_token_ids\\":' + ours + b'"',
        "spaced": ECHO_KEY + b" " + ours,
    }
    body = b"{" + b",".join(pieces[decoy] for decoy in decoys) + b"}"
    marker_at = body.find(ECHO_KEY + ours)
    assert value_at(body, ECHO_KEY, ours) == (marker_at + len(ECHO_KEY) if marker_at >= 0 else -1)
