"""The viewer's two outside sources, alone: token pieces from a decoder, grades from a feed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from rollout_proxy.errors import EngineUnavailable
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.ui.grades import GradeBook
from rollout_proxy.ui.pieces import PieceCache
from rollout_proxy.wire.feed import FeedGroup
from rollout_proxy.wire.trajectory import Trajectory


class Decoder:
    """Decodes id N as "<N>", counting what it is asked; may hang or fail on given ids."""

    def __init__(self, *, hang: frozenset[int] = frozenset(), fail: frozenset[int] = frozenset()) -> None:
        self.asked: list[int] = []
        self.hang, self.fail = hang, fail

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        (token,) = token_ids
        self.asked.append(token)
        if token in self.hang:
            await asyncio.Event().wait()
        if token in self.fail:
            raise EngineUnavailable("the engine is unreachable (connection refused or reset)")
        return f"<{token}>"


async def test_each_id_is_decoded_once_per_model_and_remembered():
    cache, decoder = PieceCache(), Decoder()
    first = await cache.pieces(decoder, "m", [5, 3, 5, 9])
    assert first.texts == ["<5>", "<3>", "<5>", "<9>"] and first.error is None
    again = await cache.pieces(decoder, "m", [9, 3, 7])
    assert again.texts == ["<9>", "<3>", "<7>"]
    assert sorted(decoder.asked) == [3, 5, 7, 9]  # nothing twice
    await cache.pieces(decoder, "other-model", [3])
    assert decoder.asked.count(3) == 2  # another tokenizer, another piece


async def test_a_hung_decoder_costs_its_pieces_within_the_deadline():
    cache, decoder = PieceCache(deadline=0.3), Decoder(hang=frozenset({2}))
    started = time.monotonic()
    pieces = await cache.pieces(decoder, "m", [1, 2, 3])
    assert time.monotonic() - started < 5
    assert pieces.texts[1] is None and "within 0.3s" in pieces.error
    assert pieces.texts[0] in ("<1>", None)  # what was decoded before the deadline is kept


async def test_a_failing_decoder_says_why_and_keeps_the_rest():
    cache = PieceCache()
    pieces = await cache.pieces(Decoder(fail=frozenset({2})), "m", [1, 2, 3])
    assert pieces.texts == ["<1>", None, "<3>"] and "unreachable" in pieces.error
    healed = await cache.pieces(Decoder(), "m", [1, 2, 3])
    assert healed.texts == ["<1>", "<2>", "<3>"] and healed.error is None


def group(index: int, kind: str = "grpo") -> FeedGroup:
    trajectories = [
        Trajectory(response_id=f"resp_{index}_{n}", session_id=f"sess_{index}", total_token_ids=[1, 2, 3])
        for n in range(2)
    ]
    advantages: list = [[0.1, 0.2, 0.3], [-0.1, -0.2, -0.3]] if kind == "tok" else [1.0, -1.0]
    return FeedGroup(
        group_id=f"g{index}",
        job_id="job",
        step=index,
        sample_index=0,
        trajectories=trajectories,
        rewards=[1.0, 0.0],
        advantages=advantages,
        advantage_kind=kind,
    )


async def test_the_grade_book_follows_the_feed_and_rereads_token_advantages(tmp_path: Path):
    feed = JsonlFeed(tmp_path / "feed.jsonl")
    book = GradeBook(feed, page=2)
    assert await book.refresh() is None and book.of_session("sess_0") == {}
    for index in range(3):
        await feed.publish(group(index))
    await feed.publish(group(3, kind="tok"))
    assert await book.refresh() is None  # four entries, in pages of two
    assert book.of_response("resp_2_1").reward == 0.0 and book.of_response("resp_2_1").advantage == -1.0
    assert set(book.of_session("sess_1")) == {"resp_1_0", "resp_1_1"}
    per_token = book.of_response("resp_3_1")
    assert per_token.advantage is None and per_token.advantage_kind == "tok"
    assert await book.token_advantages(per_token) == [-0.1, -0.2, -0.3]
    assert await book.token_advantages(book.of_response("resp_0_0")) is None
    await feed.publish(group(4))
    assert book.of_response("resp_4_0") is None
    await book.refresh()
    assert book.of_response("resp_4_0").step == 4  # read on from where it stopped
    # a rollout with branches: one list per sequence; the graded trajectory's tokens are its main sequence's
    branched = group(5, kind="tok")
    branched.trajectories[0].branches = [Trajectory(total_token_ids=[4, 5])]
    branched.advantages[0] = [[0.1, 0.2, 0.3], [0.4, 0.5]]
    await feed.publish(branched)
    await book.refresh()
    assert await book.token_advantages(book.of_response("resp_5_0")) == [0.1, 0.2, 0.3]


async def test_no_feed_no_grades():
    book = GradeBook(None)
    assert not book.available and await book.refresh() is None and book.of_response("resp_x") is None
