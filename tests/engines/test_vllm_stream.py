"""The vLLM client's streamed completions, against the fake engine on a real port."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.base import CompletionPiece, SamplingParams
from rollout_proxy.engines.streaming import DONE, SSEReader
from rollout_proxy.engines.vllm_http import VLLMEngine

PARAMS = SamplingParams(max_tokens=64, temperature=1.0, top_p=1.0, top_k=0)
REPLY = "A reply with a few tokens, héhé ✓, to stream."


class Sink:
    def __init__(self, fail_after: int | None = None) -> None:
        self.begun: list[list[int]] = []
        self.pieces: list[CompletionPiece] = []
        self._fail_after = fail_after

    async def begin(self, prompt_ids: np.ndarray) -> None:
        self.begun.append(prompt_ids.tolist())

    async def piece(self, piece: CompletionPiece) -> None:
        self.pieces.append(piece)
        if self._fail_after is not None and len(self.pieces) >= self._fail_after:
            raise RuntimeError("the consumer went away")


@pytest.fixture
async def served(tokenizer_dir):
    fake = FakeEngine(tokenizer_dir, max_model_len=40_000)
    async with FakeEngineServer(fake) as url:
        engine = VLLMEngine(url)
        try:
            yield fake, engine
        finally:
            await engine.close()


def test_sse_reader_cuts_events_across_reads() -> None:
    reader = SSEReader()
    stream = b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b":\n\ndata: [DONE]\n\n'
    events = [event for index in range(len(stream)) for event in reader.feed(stream[index : index + 1])]
    assert events == [b'{"a": 1}', b'{"b":', DONE]
    assert not reader.pending


async def test_a_streamed_completion_is_the_plain_one_in_pieces(served):
    fake, engine = served
    fake.queue(REPLY, REPLY)
    prompt = np.asarray(fake.encode("Hello there"), dtype=np.int32)
    plain = await engine.complete(prompt, PARAMS)  # learns: no routing
    assert engine.returns_routing is False
    sink = Sink()
    streamed = await engine.complete(prompt, PARAMS, sink=sink)
    assert fake.completions[-1]["stream"] is True
    assert sink.begun == [prompt.tolist()]
    assert len(sink.pieces) == len(plain.output_ids)  # one per token, as vLLM steps
    assert np.array_equal(np.concatenate([p.token_ids for p in sink.pieces]), plain.output_ids)
    assert "".join(piece.text for piece in sink.pieces) == plain.text
    for field in ("output_ids", "output_logprobs", "prompt_ids"):
        assert np.array_equal(getattr(streamed, field), getattr(plain, field)), field
    assert (streamed.text, streamed.finish_reason) == (plain.text, plain.finish_reason)


async def test_a_first_chunk_past_aiohttps_line_limit_is_read(served):
    fake, engine = served
    engine.returns_routing = False
    fake.queue(REPLY)
    prompt = np.asarray(fake.encode(" river" * 30_000)[:30_000], dtype=np.int32)  # ~200 KB of prompt ids
    sink = Sink()
    completion = await engine.complete(prompt, PARAMS, sink=sink)
    assert np.array_equal(completion.prompt_ids, prompt)
    assert completion.text == REPLY


async def test_a_sink_that_fails_closes_the_engines_response(served):
    fake, engine = served
    engine.returns_routing = False
    fake.delay = 1.0
    fake.queue(" ".join(["word"] * 40))
    prompt = np.asarray(fake.encode("Hi"), dtype=np.int32)
    with pytest.raises(RuntimeError):
        await engine.complete(prompt, PARAMS, sink=Sink(fail_after=2))
    async with asyncio.timeout(5):
        while not fake.disconnects:  # noqa: ASYNC110 (set by the engine's handler)
            await asyncio.sleep(0.01)
    assert fake.generations[-1].finish_reason == "abort"
