"""Opening the trainer feed: a JSONL path that cannot be written is refused when the feed opens."""

from __future__ import annotations

import pytest

from rollout_proxy.errors import StoreUnavailable
from rollout_proxy.state.feed import JsonlFeed, open_feed


async def test_a_jsonl_feed_makes_its_directory_and_file_when_opened(tmp_path):
    path = tmp_path / "job" / "run-1" / "feed.jsonl"
    feed = await open_feed(f"jsonl:{path}")
    assert isinstance(feed, JsonlFeed) and path.is_file() and path.read_bytes() == b""


async def test_opening_a_jsonl_feed_again_leaves_what_it_holds(tmp_path):
    path = tmp_path / "feed.jsonl"
    path.write_bytes(b'{"id": "1"}\n')
    await open_feed(f"jsonl:{path}")
    assert path.read_bytes() == b'{"id": "1"}\n'


@pytest.mark.parametrize(
    ("where", "reason"),
    [("dir", "Is a directory"), ("under-a-file", "File exists")],  # the system's words (mkdir of its directory)
)
async def test_a_jsonl_feed_that_cannot_be_written_is_refused_when_opened(tmp_path, where, reason):
    (tmp_path / "file").write_text("x")
    path = tmp_path if where == "dir" else tmp_path / "file" / "feed.jsonl"
    with pytest.raises(StoreUnavailable) as raised:
        await open_feed(f"jsonl:{path}")
    assert raised.value.message == f"cannot write the feed file {str(path)!r}: {reason}"


async def test_a_feed_url_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="unknown feed 'kafka://x'"):
        await open_feed("kafka://x")
