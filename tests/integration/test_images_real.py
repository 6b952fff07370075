"""Images through the proxy against a real vLLM serving the tiny Idefics3 model (``--enable-scale-out``): on each
API a multi-turn conversation with images has zero drifted tokens. vLLM's own answers (kept by the recording
relay) are the reference: each prompt it ran (its ``prompt_token_ids``, expanded by its processor) extends the
previous turn exactly, the trajectory is the last prompt and output, and the spans it reported
(``mm_placeholders``) are the trajectory's images, each with loss weight 0.

The reference trainer then rebuilds a finished two-turn image conversation's inputs from its feed entry (the
trajectory's tokens, the entry's image bytes through the model's image processor) and scores every sampled
token: its logprobs must be vLLM's within ``TRAINER_TOLERANCE``."""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image, ImageDraw

from tests.harness import ProxyHarness
from tests.integration.conftest import RecordingRelay, TokenAudit, VLLMServers
from tests.integration.test_streaming_real import StreamRecorder
from tests.proxy.test_image_turns import read_chat_stream

MAX_TOKENS = 12

#: max |trainer − vLLM| logprob over the sampled tokens of an image conversation, both in fp32 on the same
#: weights (other kernels and summation orders). Measured on the development machine: 3e-5, and at most 5e-5
#: over 24 seeds of this conversation; one CI machine measured 2.1e-3 once (mean 2.5e-4), a cause not found and
#: not seen again, the same commit passing there on the next run. The bound is the teacher pass's (fp32 decode
#: vs prefill, ``OPD_TOLERANCE``) with headroom, not a fit: what it must catch is two orders above, a wrong or
#: missing picture, or a span one token off, moves the logprobs by tenths of a nat and more
#: (``tests/trainer/test_vision.py``). The numbers: docs/images.md.
TRAINER_TOLERANCE = 5e-3
#: the conversation's sampling seed: the same tokens on every run of a machine, whatever the engine ran before
TRAINER_SEED = 7
#: max |teacher - sampling| logprob per trained token of a teacher pass on the same weights (``test_opd_real``)
OPD_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def vlm_server(vllm_servers: VLLMServers) -> Iterator[str]:
    from devtools.engine_env import ensure_vlm_checkpoint

    ensure_vlm_checkpoint()
    yield vllm_servers.get("vlm").base_url
    vllm_servers.stop("vlm")


@pytest.fixture
async def vlm_relay(vlm_server: str) -> AsyncIterator[RecordingRelay]:
    async with RecordingRelay.serving(vlm_server) as recorder:
        yield recorder


@pytest.fixture
async def vlm_proxy(vlm_relay: RecordingRelay) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[vlm_relay.url]) as harness:
        yield harness


def picture(size: tuple[int, int], colors: tuple[str, str]) -> bytes:
    image = Image.new("RGB", size, colors[0])
    ImageDraw.Draw(image).rectangle((size[0] // 2, 0, size[0], size[1]), fill=colors[1])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


RED, SKY, SCREEN = (
    picture((200, 120), ("red", "white")),
    picture((40, 300), ("blue", "yellow")),
    picture((320, 200), ("gray", "black")),
)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def a_picture_a_turn(client: openai.AsyncOpenAI) -> str:
    """A two-turn chat: RED with the first question, SKY with the second; the second answer's id."""
    history: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe this picture."},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ],
        }
    ]
    first = await client.chat.completions.create(model="smollm2-vlm", messages=history)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this?"},
                {"type": "image_url", "image_url": {"url": data_url(SKY)}},
            ],
        },
    ]
    second = await client.chat.completions.create(model="smollm2-vlm", messages=history)
    return second.id


def check(relay: RecordingRelay, trajectory: dict[str, Any], images: list[bytes], audit: TokenAudit) -> None:
    """Every turn went to vLLM's generate route with every image of its prompt; each prompt vLLM ran extends the
    previous turn; the trajectory is vLLM's last prompt and output, its images vLLM's spans."""
    assert not relay.completions and relay.generations
    turns = []
    for request, response in relay.generations:
        choice = response["choices"][0]
        spans = [(span["offset"], span["length"]) for span in (response.get("mm_placeholders") or {}).get("image", [])]
        assert len(request["content_parts"]) == len(spans)
        turns.append((response["prompt_token_ids"], choice["token_ids"], spans, request))
    for (prompt, output, _, _), (next_prompt, _, _, _) in itertools.pairwise(turns):
        previous = prompt + output
        audit.compare(next_prompt[: len(previous)], previous)
        assert next_prompt[: len(previous)] == previous, "drift: the next prompt does not extend the last turn"
    prompt, output, spans, request = turns[-1]
    total = trajectory["total_token_ids"]
    audit.compare(total, prompt + output)
    assert total == prompt + output
    assert [(image["start"], image["length"]) for image in trajectory["images"]] == spans
    assert [image["sha256"] for image in trajectory["images"]] == [hashlib.sha256(data).hexdigest() for data in images]
    assert [part["uuid"] for part in request["content_parts"]] == [image["sha256"] for image in trajectory["images"]]
    weights = trajectory["total_loss_weight"]
    for start, length in spans:
        assert not any(weights[start : start + length])
    for turn_prompt, turn_output, _, _ in turns:
        assert all(weight == 1.0 for weight in weights[len(turn_prompt) : len(turn_prompt) + len(turn_output)])


async def test_chat_images_over_three_turns_have_zero_drift(
    vlm_proxy: ProxyHarness, vlm_relay: RecordingRelay, audit: TokenAudit
):
    session = await vlm_proxy.create_session([], max_new_tokens=MAX_TOKENS, temperature=0.0)
    history: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe this picture."},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ],
        }
    ]
    last = None
    for follow_up in (
        [{"type": "text", "text": "And this one?"}, {"type": "image_url", "image_url": {"url": data_url(SKY)}}],
        "Which of the two is brighter?",
        None,
    ):
        answer = await session.client.chat.completions.create(model="smollm2-vlm", messages=history)
        last = answer
        history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        if follow_up is not None:
            history.append({"role": "user", "content": follow_up})
    assert last is not None
    check(vlm_relay, await vlm_proxy.trajectory(last.id), [RED, SKY], audit)


async def test_responses_images_over_two_turns_have_zero_drift(
    vlm_proxy: ProxyHarness, vlm_relay: RecordingRelay, audit: TokenAudit
):
    session = await vlm_proxy.create_session([], max_new_tokens=MAX_TOKENS, temperature=0.0)
    client = session.client

    def turn(text: str, data: bytes) -> list[dict[str, Any]]:
        return [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": data_url(data)}],
            }
        ]

    first = await client.responses.create(model="smollm2-vlm", input=turn("What is on the screen?", SCREEN))
    second = await client.responses.create(
        model="smollm2-vlm", previous_response_id=first.id, input=turn("And here?", RED)
    )
    check(vlm_relay, await vlm_proxy.trajectory(second.id), [SCREEN, RED], audit)


async def test_messages_images_over_two_turns_have_zero_drift(
    vlm_proxy: ProxyHarness, vlm_relay: RecordingRelay, audit: TokenAudit
):
    session = await vlm_proxy.create_session([], max_new_tokens=MAX_TOKENS, temperature=0.0)

    def image(data: bytes) -> dict[str, Any]:
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
        }

    history: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image(SKY)]}]
    async with anthropic.AsyncAnthropic(base_url=vlm_proxy.url, api_key=session.api_key, max_retries=0) as sdk:
        first = await sdk.messages.create(model="smollm2-vlm", max_tokens=MAX_TOKENS, messages=history)
        history += [
            {"role": "assistant", "content": first.content or "…"},
            {
                "role": "user",
                "content": [
                    image(SCREEN),
                    {"type": "text", "text": "Compare it with this, and the first again:"},
                    image(SKY),
                ],
            },
        ]
        second = await sdk.messages.create(model="smollm2-vlm", max_tokens=MAX_TOKENS, messages=history)
    check(vlm_relay, await vlm_proxy.trajectory(second.id), [SKY, SCREEN, SKY], audit)


async def test_the_trainer_scores_an_image_conversation_as_vllm_sampled_it(vlm_proxy: ProxyHarness, tmp_path):
    pytest.importorskip("torch")
    from devtools.engine_env import ensure_vlm_checkpoint
    from rollout_proxy.trainer.batch import rollouts_of
    from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner
    from rollout_proxy.trainer.mismatch import mismatch_report
    from rollout_proxy.wire.feed import FeedGroup
    from rollout_proxy.wire.trajectory import Trajectory

    session = await vlm_proxy.create_session([], max_new_tokens=MAX_TOKENS, temperature=1.0, seed=TRAINER_SEED)
    await a_picture_a_turn(session.client)
    status, finished = await vlm_proxy.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success"}
    )
    assert status == 200, finished
    (main,) = [Trajectory.model_validate(t) for t in finished["trajectories"]]
    assert len(main.images) == 2
    group = FeedGroup(
        group_id="job/step-0/sample-0",
        job_id="job",
        step=0,
        sample_index=0,
        trajectories=[main],
        rewards=[1.0],
        advantages=[1.0],
        advantage_kind="grpo",
        images=finished["images"],
    )
    group = FeedGroup.model_validate_json(group.model_dump_json())  # as a trainer reads the entry
    rollouts = rollouts_of(group)
    learner = GRPOLearner(ensure_vlm_checkpoint(), GRPOConfig(temperature=1.0))
    scored = learner.score(rollouts)
    trained = int((main.loss_weight() > 0).sum())
    assert sum(len(part.trainer) for part in scored) == trained > 0
    (part,) = scored
    assert not main.image_token_mask()[part.positions].any()
    delta = abs(part.trainer.astype("float64") - part.sampler.astype("float64"))
    report = mismatch_report(scored, trainer_version=int(part.versions.max()), threshold=TRAINER_TOLERANCE)
    print(
        f"image conversation: {trained} sampled tokens, max |trainer - vLLM| {delta.max():.3g}, mean {delta.mean():.3g}"
    )
    assert report.tokens == trained == report.with_images.tokens  # every one sampled at the trainer's version
    per_token = [
        {"position": int(at), "sampled": float(s), "trainer": float(t), "delta": float(d)}
        for at, s, t, d in zip(part.positions, part.sampler, part.trainer, delta, strict=True)
    ]
    assert delta.max() < TRAINER_TOLERANCE, {"worst": report.as_dict()["worst"], "tokens": per_token}


async def test_a_teacher_pass_with_images_scores_each_sampled_token_as_vllm_sampled_it(
    vlm_relay: RecordingRelay, audit: TokenAudit
):
    """On-policy distillation of an image conversation: the teacher (the same server, so the same weights) gets the
    student's tokens with the images as the student's turns sent them, and at temperature 1 its prompt logprob of
    every trained token is the logprob that token was sampled with (``test_opd_real``'s bound: fp32 decode vs
    prefill); the teacher's expansion is the recorded prompt, token for token."""
    async with ProxyHarness.running(engine_urls=[vlm_relay.url], teachers=f"same={vlm_relay.url}") as proxy:
        session = await proxy.create_session([], max_new_tokens=MAX_TOKENS, temperature=1.0)
        history: list[Any] = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(SKY)}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ]
        first = await session.client.chat.completions.create(model="smollm2-vlm", messages=history)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}]},
        ]
        second = await session.client.chat.completions.create(model="smollm2-vlm", messages=history)
        status, scores = await proxy.request(
            "POST",
            f"/v1/admin/sessions/{session.session_id}/teacher_pass",
            json={"response_id": second.id, "teacher": "same"},
        )
        assert status == 200, scores
        trajectory = await proxy.trajectory(second.id)
    request, answer = vlm_relay.generations[-1]
    assert request["sampling_params"]["prompt_logprobs"] == 0
    audit.compare(trajectory["total_token_ids"], answer["prompt_token_ids"])
    assert answer["prompt_token_ids"] == trajectory["total_token_ids"]
    weights = np.asarray(trajectory["total_loss_weight"])
    trained = weights > 0
    teacher = np.asarray([np.nan if v is None else v for v in scores["total_teacher_logprobs"]], dtype=np.float64)
    sampled = np.asarray(trajectory["total_token_logprobs"], dtype=np.float64)
    assert trained.sum() > 0 and not np.isnan(teacher[trained]).any() and np.isnan(teacher[~trained]).all()
    assert np.abs(teacher[trained] - sampled[trained]).max() < OPD_TOLERANCE


async def test_a_streamed_image_turn_is_vllms_own_stream_token_for_token(vlm_server: str, audit: TokenAudit):
    """A streamed chat turn with images streams from vLLM's generate route: the client's text is vLLM's streamed
    text, and the trajectory is the expanded prompt vLLM echoed on its first chunk and the tokens of its chunks,
    with each image's span where vLLM's ``mm_placeholders`` put it."""
    async with (
        StreamRecorder.serving(vlm_server) as relay,
        ProxyHarness.running(engine_urls=[relay.url]) as proxy,
    ):
        session = await proxy.create_session([], max_new_tokens=MAX_TOKENS, temperature=0.0)
        history: list[Any] = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(SCREEN)}},
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ]
        first = await session.client.chat.completions.create(model="smollm2-vlm", messages=history)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(SKY)}}]},
        ]
        stream = await session.client.chat.completions.create(model="smollm2-vlm", messages=history, stream=True)
        text, response_id = await read_chat_stream(stream)
        trajectory = await proxy.trajectory(response_id)
    ((request, chunks),) = relay.streams  # the first turn was a plain call; the second, one stream
    assert request["stream"] is True and [part["uuid"] for part in request["content_parts"]] == [
        hashlib.sha256(data).hexdigest() for data in (SCREEN, SKY)
    ]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    output = [token for choice in choices for token in choice["token_ids"]]
    prompt = chunks[0]["prompt_token_ids"]
    audit.compare(trajectory["total_token_ids"], prompt + output)
    assert trajectory["total_token_ids"] == prompt + output and output
    assert text.strip() == "".join(choice.get("text") or "" for choice in choices).strip()  # as the parser trims
    placed = [(span["offset"], span["length"]) for span in chunks[0]["mm_placeholders"]["image"]]
    assert [(image["start"], image["length"]) for image in trajectory["images"]] == placed
