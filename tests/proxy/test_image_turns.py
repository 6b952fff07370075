"""Multi-turn image conversations on the three APIs, through the official SDKs, against the fake vLLM serving the
tiny Idefics3 model's files: every prompt the engine ran is a prefix of the trajectory (the expanded image spans
the engine echoed included, nothing re-tokenized), each image's span, hash and size are where the trajectory
says with loss weight 0, every call sent every image of its prompt in order, and a streamed image turn relays
the same tokens."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import numpy as np
import pytest
from PIL import Image

from devtools.fake_engine import FakeEngine, FakeEngineServer
from devtools.fake_moe import FakeMoE, image_features
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness
from tests.proxy.test_stream_release import sse_events
from tests.routing.test_routing_flow import routing_of

CALL = '<tool_call>\n{"name": "screenshot", "arguments": {}}\n</tool_call>'
TOOL = {
    "type": "function",
    "function": {"name": "screenshot", "description": "The screen", "parameters": {"type": "object", "properties": {}}},
}


def png(width: int, height: int, color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


RED, BLUE, SCREEN = png(200, 120, "red"), png(40, 300, "blue"), png(320, 200, "gray")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def read_chat_stream(stream: Any) -> tuple[str, str]:
    """A streamed Chat Completions answer as the client reads it: its text, and its id (every chunk's)."""
    text, response_id = "", None
    async for chunk in stream:
        response_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert response_id is not None, "the stream had no chunk"
    return text, response_id


@pytest.fixture
async def proxy(vlm_engine: FakeEngine, store) -> AsyncIterator[ProxyHarness]:
    """The proxy renders with the model's own files (the engine's model root): the template and the processor
    config of the engine."""
    async with ProxyHarness.running(engine_urls=[vlm_engine.url], store=store, fake=vlm_engine) as harness:
        yield harness


def span_ids(fake: FakeEngine) -> list[int]:
    return fake.encode("<fake_token_around_image><global-img>" + "<image>" * 16 + "<fake_token_around_image>")


async def assert_exact(proxy: ProxyHarness, response_id: str, images: list[bytes]) -> dict[str, Any]:
    """The trajectory is what the engine ran and sampled, call by call, and its images are ``images``."""
    fake = proxy.fake
    assert fake is not None
    trajectory = await proxy.trajectory(response_id)
    total, weights = trajectory["total_token_ids"], trajectory["total_loss_weight"]
    # the turns' calls (a first streamed turn is preceded by the one-token routing probe on /v1/completions)
    generations = [generation for generation in fake.generations if generation.request_id.startswith("generate-")]
    for generation in generations:
        prompt = generation.prompt
        assert total[: len(prompt)] == prompt
        assert total[len(prompt) : len(prompt) + len(generation.tokens)] == generation.tokens
        assert all(weight == 1.0 for weight in weights[len(prompt) : len(prompt) + len(generation.tokens)])
    last = generations[-1]
    assert len(total) == len(last.prompt) + len(last.tokens)
    assert [image["sha256"] for image in trajectory["images"]] == [sha(data) for data in images]
    for image, data in zip(trajectory["images"], images, strict=True):
        with Image.open(io.BytesIO(data)) as opened:
            assert (image["width"], image["height"], image["bytes"]) == (*opened.size, len(data))
        assert total[image["start"] : image["start"] + image["length"]] == span_ids(fake)
        assert not any(weights[image["start"] : image["start"] + image["length"]])
    assert sum(image["length"] for image in trajectory["images"]) == sum(
        1 for token in total if token in set(span_ids(fake))
    )
    # each call sent every image of its prompt, in order, named by its hash; none went to /v1/completions
    for request, generation in zip(fake.generate_requests, generations, strict=True):
        shown = [image for image in trajectory["images"] if image["start"] < len(generation.prompt)]
        assert [part["uuid"] for part in request["content_parts"]] == [image["sha256"] for image in shown]
    assert not fake.completions
    assert proxy.app[keys.METRICS].value("prompt_drift_total") == 0
    return trajectory


async def test_chat_completions_an_image_tool_loop_is_token_exact(proxy: ProxyHarness):
    fake = proxy.fake
    assert fake is not None
    fake.queue(CALL, "The screen is gray.", "Blue, tall.")
    session = await proxy.create_session([])
    client = session.client
    history: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this? Then look at the screen."},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ],
        }
    ]
    first = await client.chat.completions.create(model="policy", messages=history, tools=[TOOL])
    call = first.choices[0].message.tool_calls[0]
    history += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "the screenshot follows"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(SCREEN)}}]},
    ]
    second = await client.chat.completions.create(model="policy", messages=history, tools=[TOOL])
    history += [
        {"role": "assistant", "content": second.choices[0].message.content},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this one?"},
                {"type": "image_url", "image_url": {"url": data_url(BLUE)}},
            ],
        },
    ]
    stream = await client.chat.completions.create(model="policy", messages=history, tools=[TOOL], stream=True)
    text, last_id = await read_chat_stream(stream)
    assert text == "Blue, tall."
    await assert_exact(proxy, last_id, [RED, SCREEN, BLUE])


async def test_responses_an_image_in_a_tool_output_is_token_exact(proxy: ProxyHarness):
    fake = proxy.fake
    assert fake is not None
    fake.queue(CALL, "A gray screen, and red.")
    session = await proxy.create_session([])
    client = session.client
    tool = {"type": "function", "name": "screenshot", "description": "The screen", "parameters": {"type": "object"}}
    items: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look at this, then at the screen."},
                {"type": "input_image", "image_url": data_url(RED)},
            ],
        }
    ]
    first = await client.responses.create(model="policy", input=items, tools=[tool], store=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": data_url(SCREEN)}]
    second = await client.responses.create(
        model="policy",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}],
        previous_response_id=first.id,
        tools=[tool],
    )
    assert second.output_text == "A gray screen, and red."
    trajectory = await assert_exact(proxy, second.id, [RED, SCREEN])
    assert trajectory["messages"][2]["role"] == "tool"  # the image sits in the tool result


async def test_messages_an_image_in_a_tool_result_is_token_exact(proxy: ProxyHarness):
    fake = proxy.fake
    assert fake is not None
    fake.queue(CALL, "Gray.")
    session = await proxy.create_session([])
    tool = {"name": "screenshot", "description": "The screen", "input_schema": {"type": "object", "properties": {}}}

    def image(data: bytes) -> dict[str, Any]:
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
        }

    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key=session.api_key, max_retries=0) as sdk:
        history: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image(RED)]}]
        first = await sdk.messages.create(model="policy", max_tokens=256, messages=history, tools=[tool])
        (call,) = [block for block in first.content if block.type == "tool_use"]
        history += [
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": [image(SCREEN)]},
                    {"type": "text", "text": "Again:"},
                    image(RED),
                ],
            },
        ]
        counted = await sdk.messages.count_tokens(model="policy", messages=history, tools=[tool])
        second = await sdk.messages.create(model="policy", max_tokens=256, messages=history, tools=[tool])
    assert second.content[-1].text == "Gray."
    assert counted.input_tokens == len(fake.generations[-1].prompt)  # the images' spans counted as the engine ran them
    await assert_exact(proxy, second.id, [RED, SCREEN, RED])


async def test_the_teacher_pass_sends_a_trajectorys_images_as_the_student_did_and_scores_its_tokens(
    vlm_engine: FakeEngine, vlm_dir: Path
):
    """On-policy distillation with images: the teacher (the same weights here) gets the student's tokens with each
    span collapsed and the images in order, as the student's engine did; its expansion is the recorded one, so
    it scores every trained token as it was sampled; with a context inserted the spans move along whole."""
    teacher = FakeEngine(vlm_dir, model_name="fake-teacher")
    vlm_engine.queue("Red.", "Blue.")
    async with (
        FakeEngineServer(teacher) as teacher_url,
        ProxyHarness.running(engine_urls=[vlm_engine.url], fake=vlm_engine, teachers=f"math={teacher_url}") as proxy,
    ):
        session = await proxy.create_session([])
        messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(RED)}},
                    {"type": "text", "text": "Color?"},
                ],
            }
        ]
        first = await session.client.chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And this?"},
                    {"type": "image_url", "image_url": {"url": data_url(BLUE)}},
                ],
            },
        ]
        second = await session.client.chat.completions.create(model="policy", messages=messages)
        trajectory = await proxy.trajectory(second.id)
        url = f"/v1/admin/sessions/{session.session_id}/teacher_pass"
        status, plain = await proxy.request("POST", url, json={"response_id": second.id, "teacher": "math"})
        assert status == 200, plain
        sent, scored = teacher.generate_requests[-1], teacher.generations[-1].prompt
        context = [{"qa_index": 0, "message": {"role": "user", "content": "Hint: a primary color."}}]
        status, hinted = await proxy.request(
            "POST", url, json={"response_id": second.id, "teacher": "math", "teacher_context": context}
        )
        assert status == 200, hinted
    total, spans = trajectory["total_token_ids"], trajectory["images"]
    assert [part["uuid"] for part in sent["content_parts"]] == [sha(RED), sha(BLUE)] == [s["sha256"] for s in spans]
    assert sent["sampling_params"]["prompt_logprobs"] == 0 and sent["sampling_params"]["max_tokens"] == 1
    assert len(sent["token_ids"]) == len(total) - sum(span["length"] - 1 for span in spans)  # each span one marker
    assert scored == total and not teacher.completions  # expanded by the teacher as recorded; no text route
    weights = np.asarray(trajectory["total_loss_weight"])
    values = plain["total_teacher_logprobs"]
    assert all((value is None) == (weight == 0) for value, weight in zip(values, weights, strict=True))
    sampled = np.asarray(trajectory["total_token_logprobs"], dtype=np.float32)[weights > 0]
    assert np.array_equal(np.asarray([v for v in values if v is not None], dtype=np.float32), sampled)
    injected = hinted["n_tokens_injected"]
    view = teacher.generations[-1].prompt  # as the teacher expanded it: its spans where the proxy said (else a 502)
    red, blue = ((span["start"], span["start"] + span["length"]) for span in spans)
    assert injected > 0 and len(view) == len(total) + injected
    assert view[red[0] : red[1]] == total[red[0] : red[1]]  # before the context: in place
    assert view[blue[0] + injected : blue[1] + injected] == total[blue[0] : blue[1]]  # after it: moved along


async def test_an_image_turn_cut_by_an_abort_pause_is_continued_with_its_images(vlm_engine: FakeEngine):
    """``--abort-policy continue``: after the resume the call is sent again with the kept tokens after the
    prompt (its spans still collapsed where they are, its images again), and the turn is one exact node."""
    fake = vlm_engine
    fake.queue("Red.", "A red square, seen from above, in the morning light.")  # the continuation: the fake's own
    async with ProxyHarness.running(engine_urls=[fake.url], fake=fake, abort_policy="continue") as proxy:
        session = await proxy.create_session([])
        messages: list[Any] = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}]}
        ]
        # a first turn: the engine is then known to return no routing, so a cut turn can be continued
        warm = await session.client.chat.completions.create(model="policy", messages=messages)
        messages += [warm.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        fake.delay = 1.0
        call = asyncio.ensure_future(session.client.chat.completions.create(model="policy", messages=messages))
        async with asyncio.timeout(20):
            while not any(len(generation.tokens) >= 3 for generation in fake.generating):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        status, _ = await proxy.request("POST", "/v1/admin/pause", json={"mode": "abort"})
        assert status == 200
        status, _ = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 1})
        assert status == 200
        answer = await call
        _, first, second = fake.generate_requests
        kept = fake.generations[1].tokens
        assert len(kept) > 0 and fake.generations[1].finish_reason == "abort"
        assert second["token_ids"] == first["token_ids"] + kept  # the prompt, collapsed as before, then the kept
        assert second["content_parts"] == first["content_parts"]
        assert answer.choices[0].message.content.startswith(fake.decode(kept))
        trajectory = await assert_exact(proxy, answer.id, [RED])
        assert [span["version"] for span in trajectory["policy_versions"]] == [
            0,
            0,
            1,
        ]  # the warm turn, then both parts


STORY = " ".join(f"river{n}" for n in range(30))


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_streamed_image_turn_streams_before_half_of_it_is_sampled(vlm_dir: Path, api: str):
    """A streamed turn whose prompt holds an image streams from vLLM's generate route as a text turn streams from
    /v1/completions: the client has its first content before half the answer is sampled (read off the fake's
    generation in flight, not a clock), and the record is token-exact, the engine's echoed spans included."""
    engine = FakeEngine(vlm_dir, delay=2.0)  # ~20 ms a token
    async with (
        FakeEngineServer(engine) as url,
        ProxyHarness.running(engine_urls=[url], fake=engine) as proxy,
        aiohttp.ClientSession() as http,
    ):
        engine.queue(STORY)
        planned = len(engine.encode(STORY)) + 1  # and the end-of-turn token
        session = await proxy.create_session([], max_new_tokens=400)
        if api == "chat":
            path = "/v1/chat/completions"
            content: list[dict[str, Any]] = [
                {"type": "text", "text": "Tell me about this picture."},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ]
        else:
            path = "/v1/messages"
            content = [
                {"type": "text", "text": "Tell me about this picture."},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()},
                },
            ]
        body = {
            "model": "policy",
            "max_tokens": 400,
            "stream": True,
            "messages": [{"role": "user", "content": content}],
        }
        response = await http.post(proxy.url + path, json=body, headers={"Authorization": f"Bearer {session.api_key}"})
        assert response.status == 200, await response.text()
        text, response_id, sampled_at_first_content = "", None, None
        async for event in sse_events(response):
            if api == "chat":
                response_id = event.get("id", response_id)
                delta = ((event.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
            else:
                if event.get("type") == "message_start":
                    response_id = event["message"]["id"]
                delta = (
                    (event.get("delta") or {}).get("text") or "" if event.get("type") == "content_block_delta" else ""
                )
            if delta and sampled_at_first_content is None:
                (generation,) = engine.generating
                sampled_at_first_content = len(generation.tokens)
            text += delta
        assert text == STORY
        assert sampled_at_first_content is not None and sampled_at_first_content < planned / 2, (
            f"the first content came after {sampled_at_first_content} of {planned} tokens"
        )
        assert [request["stream"] for request in engine.generate_requests] == [True]
        assert response_id is not None
        await assert_exact(proxy, response_id, [RED])


async def test_an_image_conversation_on_a_moe_engine_keeps_a_routing_row_for_every_token(proxy: ProxyHarness):
    """Routing rows hold with images: on an MoE engine each token of the trajectory, image spans included, has
    the row its engine call returned (``routed_experts_prompt_start`` past the parent's rows, as for text), the
    image positions routed by the picture (the fake's MoE mixes each image's content in there, as a real one
    routes by the image's features): rows a proxy that shifted a span or dropped an image's rows cannot match.
    The streamed last turn is one plain call (vLLM streams no routing), relayed as a stream."""
    fake = proxy.fake
    assert fake is not None
    moe = fake.moe = FakeMoE(num_layers=3, top_k=2, num_experts=8)
    fake.queue("A red one.", "Now blue.")
    session = await proxy.create_session([])
    history: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ],
        }
    ]
    first = await session.client.chat.completions.create(model="policy", messages=history)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(BLUE)}}]},
    ]
    stream = await session.client.chat.completions.create(model="policy", messages=history, stream=True)
    text, last_id = await read_chat_stream(stream)
    assert text == "Now blue."
    trajectory = await assert_exact(proxy, last_id, [RED, BLUE])
    ids = trajectory["total_token_ids"]
    routing = routing_of(trajectory)
    assert routing.shape == (len(ids), 3, 2)
    assert (routing[:-1] >= 0).all() and (routing[-1] == -1).all()  # none for the last sampled token, as vLLM
    # the second call asked only for the rows past its parent's (the first call's prompt and answer)
    (turn1, turn2) = fake.generate_requests
    assert (
        "routed_experts_prompt_start" not in turn1["sampling_params"]
        or not turn1["sampling_params"]["routed_experts_prompt_start"]
    )
    assert (
        turn2["sampling_params"]["routed_experts_prompt_start"]
        == len(fake.generations[0].prompt) + len(fake.generations[0].tokens) - 1
    )
    digests = [int.from_bytes(hashlib.sha256(part["url"].encode()).digest()[:6]) for part in turn2["content_parts"]]
    spans = [{"offset": image["start"], "length": image["length"]} for image in trajectory["images"]]
    expected = moe.rows(ids[:-1], image_features(len(ids), spans, digests))
    assert np.array_equal(routing[:-1], expected)
    by_placeholder = moe.rows(ids[:-1])  # what rows computed from the placeholder tokens alone would be
    for span in spans:
        inside = slice(span["offset"], span["offset"] + span["length"])
        assert not np.array_equal(routing[inside], by_placeholder[inside])
