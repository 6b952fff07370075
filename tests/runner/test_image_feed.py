"""Images reach the trainer feed and their route: a finished image session's group carries the bytes of exactly
the images its trajectories' spans name, once each, on both feed kinds, so a trainer rebuilds each image from the
entry alone; ``GET /v1/sessions/{id}/images/{sha256}`` answers one stored image to its session and the admin."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from PIL import Image
from pydantic import ValidationError

from devtools.fake_engine import FakeEngine
from rollout_proxy.runner.admin import AdminClient, Finished
from rollout_proxy.runner.publish import GradedGroup
from rollout_proxy.sdk.types import ChatCompletionSample
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.state.redis_feed import RedisStreamFeed
from rollout_proxy.wire.feed import FeedGroup, FeedImage
from tests.harness import ADMIN_KEY, ProxyHarness


def png(width: int, height: int, color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def jpeg(width: int, height: int, color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "JPEG")
    return out.getvalue()


RED, BLUE, GREEN = png(200, 120, "red"), png(40, 300, "blue"), jpeg(64, 48, "green")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_url(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


@pytest.fixture
async def proxy(vlm_engine: FakeEngine, store) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[vlm_engine.url], store=store, fake=vlm_engine) as harness:
        yield harness


@pytest.fixture
async def admin(proxy: ProxyHarness) -> AsyncIterator[AdminClient]:
    async with AdminClient(proxy.url, ADMIN_KEY) as client:
        yield client


@pytest.fixture(params=["jsonl", "redis"])
async def feed(request, tmp_path):
    if request.param == "jsonl":
        yield JsonlFeed(tmp_path / "feed.jsonl")
        return
    redis_feed = await RedisStreamFeed.connect(request.getfixturevalue("redis_url"), stream="image-feed")
    await redis_feed._redis.delete(*redis_feed._keys)
    yield redis_feed
    await redis_feed.close()


SAMPLE = ChatCompletionSample.model_validate({"messages": [], "extra": {"id": "s1"}})


async def rollout(proxy: ProxyHarness, admin: AdminClient, turns: list[list[dict[str, Any]]]) -> Finished:
    """One single-rollout session: each of ``turns`` a user message's parts, answered; then finished."""
    assert proxy.fake is not None
    proxy.fake.queue(*[f"answer {n}" for n in range(len(turns))])
    plugin = await admin.create_session(SAMPLE)
    client = proxy.client(plugin.url, plugin.jwt_token)
    history: list[Any] = []
    for parts in turns:
        history.append({"role": "user", "content": parts})
        answer = await client.chat.completions.create(model="policy", messages=history)
        history.append({"role": "assistant", "content": answer.choices[0].message.content})
    return await admin.finish(plugin.session_id, {"status": "success", "extra": {"id": "s1"}})


def graded(finished: Finished, group_id: str = "job/step-0/sample-0") -> GradedGroup:
    n = len(finished.trajectories)
    return GradedGroup(
        step=0,
        index=0,
        group_id=group_id,
        sample={"id": "s1"},
        trajectories=finished.trajectories,
        rewards=[1.0] * n,
        grader_rewards={},
        metrics=[{}] * n,
        custom=None,
        images=finished.images,
    )


async def test_a_groups_entry_carries_each_named_image_once_and_a_trainer_rebuilds_them(proxy, admin, feed):
    text = {"type": "text", "text": "What is this?"}
    first = await rollout(proxy, admin, [[text, image_url(RED)], [text, image_url(GREEN, "image/jpeg")]])
    second = await rollout(proxy, admin, [[text, image_url(RED)], [text, image_url(BLUE), image_url(RED)]])
    group = first.extend(second)
    entry_id = await feed.publish(graded(group).entry("job", step_groups=1))
    assert entry_id is not None

    (entry,) = await feed.read()
    read = entry.group
    spans = [image for trajectory in read.trajectories for image in trajectory.images]
    assert [image.sha256 for image in spans] == [sha(RED), sha(GREEN), sha(RED), sha(BLUE), sha(RED)]
    assert set(read.images) == {sha(RED), sha(GREEN), sha(BLUE)}  # each once, however often the spans name it
    assert {key: image.mime for key, image in read.images.items()} == {
        sha(RED): "image/png",
        sha(GREEN): "image/jpeg",
        sha(BLUE): "image/png",
    }
    for span in spans:
        data = read.image_bytes(span.sha256)
        assert hashlib.sha256(data).hexdigest() == span.sha256 and len(data) == span.bytes
        with Image.open(io.BytesIO(data)) as opened:
            assert opened.size == (span.width, span.height)
    assert read.image_bytes(sha(GREEN)) == GREEN


async def test_a_text_entry_is_unchanged(feed, tmp_path):
    group = FeedGroup(
        group_id="g", job_id="job", step=0, sample_index=0, trajectories=[], rewards=[], advantages=[],
        advantage_kind="grpo",
    )  # fmt: skip
    assert "images" not in group.model_dump(mode="json")
    await feed.publish(group)
    (entry,) = await feed.read()
    assert entry.group.images == {}
    if isinstance(feed, JsonlFeed):
        (line,) = (tmp_path / "feed.jsonl").read_bytes().splitlines()
        assert "images" not in orjson.loads(line)["data"]


async def test_an_entry_whose_images_do_not_match_its_spans_is_refused(proxy, admin):
    finished = await rollout(proxy, admin, [[{"type": "text", "text": "Look"}, image_url(RED)]])
    entry = graded(finished).entry("job")
    with pytest.raises(ValidationError, match="not on the entry"):
        FeedGroup.model_validate({**entry.model_dump(mode="json"), "images": {}})
    with pytest.raises(ValidationError, match="do not hash"):
        FeedGroup.model_validate(
            {**entry.model_dump(mode="json"), "images": {sha(RED): FeedImage.of(BLUE, "image/png").model_dump()}}
        )
    with pytest.raises(ValidationError, match="no trajectory's span names"):
        FeedGroup.model_validate(
            {
                **entry.model_dump(mode="json"),
                "images": {
                    sha(RED): FeedImage.of(RED, "image/png").model_dump(),
                    sha(BLUE): FeedImage.of(BLUE, "image/png").model_dump(),
                },
            }
        )


async def test_a_stored_image_is_read_by_its_session_and_the_admin_only(proxy, admin):
    assert proxy.fake is not None
    proxy.fake.queue("red", "nothing")
    plugin = await admin.create_session(SAMPLE)
    client = proxy.client(plugin.url, plugin.jwt_token)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": [image_url(GREEN, "image/jpeg")]}]
    )
    other = await admin.create_session(SAMPLE)
    await proxy.client(other.url, other.jwt_token).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Hi"}]
    )
    path = f"/v1/sessions/{plugin.session_id}/images/{sha(GREEN)}"
    async with aiohttp.ClientSession() as http:
        for token in (plugin.jwt_token, ADMIN_KEY):
            async with http.get(proxy.url + path, headers={"Authorization": f"Bearer {token}"}) as response:
                assert response.status == 200 and response.content_type == "image/jpeg"
                assert await response.read() == GREEN

    status, body = await proxy.request("GET", f"/v1/sessions/{plugin.session_id}/images/{sha(RED)}")
    assert status == 404 and f"holds no image {sha(RED)!r}" in body["error"]["message"]
    status, body = await proxy.request("GET", path, token=other.jwt_token)  # another session's key
    assert status == 404 and body["error"]["param"] == "session_id"
    status, body = await proxy.request("GET", path, token=None)
    assert status == 401

    await admin.finish(plugin.session_id, {"status": "success"})  # a finished session's images stay readable
    async with (
        aiohttp.ClientSession() as http,
        http.get(proxy.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as response,
    ):
        assert response.status == 200 and await response.read() == GREEN


def test_the_openapi_document_shows_the_entrys_images_and_the_image_route():
    from rollout_proxy.proxy.openapi import build_document

    document = build_document()
    schemas = document["components"]["schemas"]
    entry = schemas["FeedGroup"]["properties"]  # the answer's fields, not an open object
    assert {"group_id", "trajectories", "images"} <= set(entry)
    assert entry["images"]["additionalProperties"] == {"$ref": "#/components/schemas/FeedImage"}
    assert set(schemas["FeedImage"]["required"]) == {"mime", "data"}
    assert schemas["SessionFinished"]["properties"]["images"]["additionalProperties"] == {
        "$ref": "#/components/schemas/FeedImage"
    }
    route = document["paths"]["/v1/sessions/{session_id}/images/{sha256}"]["get"]
    assert {"image/png", "image/jpeg"} <= set(route["responses"]["200"]["content"])
    assert "404" in route["responses"]
