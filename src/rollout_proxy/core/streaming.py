"""A generated turn, streamed: the same ``prepare`` → ``sample`` → ``record`` as ``turns``, with the
output relayed while the engine samples it.

The record is the non-streamed one: the fleet's ``sample`` returns the same ``Sampled`` either
way (the engine assembles the streamed chunks into the completion it would have answered), and
``record`` stores it once, after the engine's last chunk. The client sees ``TurnDelta``s (the
chunk's token ids and logprobs, and what the incremental parser could release), then the rest
of the message (``IncrementalParser.finish`` against the final parse, whose tool-call ids are
those already sent), then ``TurnDone``.

What a retry means once something was relayed:
- a call that fails before it relayed anything fails over as without streaming (invisible);
- a call continued after an abort-mode pause (``abort_policy: continue``) starts from the tokens
  already relayed: the client just sees a longer stream;
- a call that would start over (a failover after output was relayed, a regenerated turn) cannot
  take back what the client saw: ``StreamInterrupted`` (an SSE ``error`` event), nothing recorded.

Engines that return MoE routing are not streamed (vLLM does not stream ``routed_experts``): their
turn is one plain call, relayed as one delta when it is done. The consumer leaving (a client
disconnect) cancels the call, which closes the engine's response: vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from rollout_proxy.core.tree import Placement
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.engines.base import CompletionPiece
from rollout_proxy.errors import StreamInterrupted
from rollout_proxy.ids import new_response_id
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import SessionLease
from rollout_proxy.tokenization.parsers.incremental import IncrementalParser, ViewDelta
from rollout_proxy.wire.images import ImageBlob

log = structlog.get_logger(__name__)

_NO_IDS = np.zeros(0, dtype=np.int32)
_NO_LOGPROBS = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class TurnStarted:
    """The turn is prepared (its engine, prompt and id are known); no engine has answered yet."""

    response_id: str
    model: str
    prompt_ids: np.ndarray
    created: float
    meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TurnDelta:
    """Part of the turn: the tokens the engine sampled since the last delta, and what they add to the message."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    view: ViewDelta
    more: bool = False  # another event follows at once: a writer may hold this one back and write both together


@dataclass(frozen=True, slots=True)
class TurnDone:
    """The turn is recorded (its node is what a non-streamed request stores)."""

    result: TurnResult


StreamEvent = TurnStarted | TurnDelta | TurnDone


class _Relay:
    """The fleet's pieces (a ``PieceSink``), parsed and queued for the consumer."""

    def __init__(self, prompt: np.ndarray, parser: IncrementalParser) -> None:
        self.ready: deque[tuple[np.ndarray, np.ndarray, ViewDelta]] = deque()
        self.parser = parser
        self._prompt = prompt
        self._ids: list[np.ndarray] = []
        self._waiter: asyncio.Future[None] | None = None
        self.count = 0  # tokens relayed

    async def begin(self, prompt_ids: np.ndarray) -> None:
        if not self.count:
            return
        relayed = np.concatenate(self._ids)
        head = len(self._prompt)
        if len(prompt_ids) != head + len(relayed) or not np.array_equal(prompt_ids[head:], relayed):
            raise StreamInterrupted(
                "the engine call had to start over after part of the answer was streamed (the engine failed, "
                "or a pause cut the turn and it is regenerated); nothing was recorded: send the request again"
            )

    async def piece(self, piece: CompletionPiece) -> None:
        self.add(piece.token_ids, piece.logprobs, piece.text)

    def add(self, token_ids: np.ndarray, logprobs: np.ndarray, text: str) -> None:
        view = self.parser.feed(text)
        if len(token_ids) or view:
            self._ids.append(token_ids)
            self.count += len(token_ids)
            self.ready.append((token_ids, logprobs, view))
            self.wake()

    def take(self) -> TurnDelta:
        """The oldest ready delta, saying whether another is ready too (``TurnDelta.more``)."""
        token_ids, logprobs, view = self.ready.popleft()
        return TurnDelta(token_ids, logprobs, view, more=bool(self.ready))

    def wake(self, *_: object) -> None:
        """A delta is ready, or the sampling ended (its done callback)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until ``wake``: one future, not a task per wait (a streamed turn waits once per engine read)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class TurnStreamer:
    def __init__(self, turns: TurnRunner) -> None:
        self._turns = turns
        self._parser = turns.parser
        self._metrics = turns.metrics

    async def stream(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        api: str,
        tools: Sequence[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        meta: dict[str, Any] | None = None,
        lease: SessionLease | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> AsyncGenerator[StreamEvent, None]:
        """``TurnStarted``, the turn's deltas as they are sampled, then ``TurnDone``. Errors up to the first
        delta are the non-streamed turn's; leaving early aborts the engine call and records nothing."""
        turns = self._turns
        turn = await turns.prepare_anywhere(session, placement, tools=tools, stop=stop, images=images)
        node_id = new_response_id(session.id)
        yield TurnStarted(node_id, turn.info.model, turn.prompt, time.time(), dict(meta or {}))
        relay = _Relay(turn.prompt, IncrementalParser(self._parser, opened=turn.reasoning_opened))
        sampling = asyncio.ensure_future(turns.sample(session, turn, sink=relay, lease=lease))
        sampling.add_done_callback(relay.wake)
        outcome = "disconnected"
        try:
            while True:
                while relay.ready:
                    yield relay.take()
                if sampling.done():
                    break
                await relay.wait()
            try:
                sampled = sampling.result()
            except BaseException:
                outcome = "failed"
                raise
            completion = sampled.completion
            parser = relay.parser
            if relay.count < len(completion.output_ids):  # not streamed (an MoE engine): relayed as one delta
                if not completion.text.startswith(parser.text):
                    outcome = "failed"
                    raise StreamInterrupted("the turn's output changed after part of it was streamed")
                relay.add(
                    completion.output_ids[relay.count :],
                    completion.output_logprobs[relay.count :],
                    completion.text[len(parser.text) :],
                )
                while relay.ready:
                    yield relay.take()
            view, rest, agrees = parser.finish(turns.parse(completion.text, opened=turn.reasoning_opened))
            if not agrees:
                self._metrics.inc("stream_view_mismatch_total")
                log.warning("stream_view_mismatch", text=completion.text[:200])
            try:
                result = await turns.record(
                    session,
                    placement,
                    turn,
                    sampled,
                    api=api,
                    meta=meta,
                    view=view,
                    node_id=node_id,
                    lease=lease,
                    images=images,
                )
            except BaseException:
                outcome = "failed"
                raise
            outcome = "completed"
            if rest:
                yield TurnDelta(_NO_IDS, _NO_LOGPROBS, rest, more=True)
            yield TurnDone(result)
        finally:
            if not sampling.done():
                sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sampling
            self._metrics.inc("streamed_turns_total", api=api, outcome=outcome)
            if outcome == "disconnected":
                log.info("stream_disconnected", relayed_tokens=relay.count)
