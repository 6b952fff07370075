"""Images in, on every API: each of Chat ``image_url``, Responses ``input_image`` and Messages ``image`` is taken
in, checked and normalized; a bad one is the API's 400 naming where it is, and nothing is stored.

A policy whose model takes no images (SmolLM2 here: no image placeholder rule) refuses a conversation with
images at rendering, storing nothing; on the tiny Idefics3 model's files (``vlm_dir``) the turn is sampled and
stores its node and its images in one write (``tests/proxy/test_image_turns.py``: token for token).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from PIL import Image

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.embedded import serve_app
from rollout_proxy.proxy import keys
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.store import ImageBound
from tests.harness import ProxyHarness, store_snapshot

pytestmark = pytest.mark.parametrize("template_name", ["qwen3_style"])


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


RED = encoded(Image.new("RGB", (8, 6), "red"), "PNG")
BLUE = encoded(Image.new("RGB", (8, 6), "blue"), "PNG")
GREEN = encoded(Image.new("RGB", (8, 6), "green"), "PNG")
JPEG = encoded(Image.new("RGB", (30, 20), "yellow"), "JPEG")
BMP = encoded(Image.new("RGB", (8, 6), "red"), "BMP")
NOISE = encoded(Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)), "PNG")  # ~12 KB
SPECKLED = encoded(Image.frombytes("RGB", (20, 20), os.urandom(20 * 20 * 3)), "PNG")  # ~1.3 KB
WIDE = encoded(Image.new("RGB", (200, 100), "red"), "PNG")  # small in bytes, 20,000 pixels
#: what the proxies of these tests take: 4 KB, 10,000 pixels, 3 images a request, 2 a session
LIMITS = {"max_image_bytes": 4000, "max_image_pixels": 10_000, "max_images_per_request": 3}
SESSION_BOUND = ImageBound(count=2, bytes=100_000)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass(frozen=True)
class Api:
    """One API's request with a user turn of text and images, and where each image is in it."""

    name: str
    path: str
    image: Callable[[bytes, str], dict[str, Any]]
    url: Callable[[str], dict[str, Any]]
    where: Callable[[int], str]  # the param of the image at a content index of the first message
    url_where: Callable[[int], str]

    def body(self, *parts: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        text = {"type": "input_text" if self.name == "responses" else "text", "text": "What is in it?"}
        turn = [*(history or []), {"role": "user", "content": [text, *parts]}]
        if self.name == "chat":
            return {"model": "policy", "messages": turn}
        if self.name == "responses":
            return {"model": "policy", "input": turn, "store": False}
        return {"model": "policy", "max_tokens": 256, "messages": turn}

    def error(self, status: int, body: Any, code: str | None, param: str | None) -> str:
        """The error's message, once its body is the API's own shape with this code and param."""
        assert status == 400, body
        if self.name == "messages":  # Anthropic's shape
            assert body["type"] == "error" and set(body) == {"type", "error"}, body
        else:
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == code, body
        assert error.get("param") == param, body
        return str(error["message"])


CHAT = Api(
    "chat",
    "/v1/chat/completions",
    image=lambda data, mime: {"type": "image_url", "image_url": {"url": data_url(data, mime)}},
    url=lambda url: {"type": "image_url", "image_url": {"url": url}},
    where=lambda index: f"messages[0].content[{index}].image_url.url",
    url_where=lambda index: f"messages[0].content[{index}].image_url.url",
)
RESPONSES = Api(
    "responses",
    "/v1/responses",
    image=lambda data, mime: {"type": "input_image", "image_url": data_url(data, mime)},
    url=lambda url: {"type": "input_image", "image_url": url},
    where=lambda index: f"input[0].content[{index}].image_url",
    url_where=lambda index: f"input[0].content[{index}].image_url",
)
MESSAGES = Api(
    "messages",
    "/v1/messages",
    image=lambda data, mime: {
        "type": "image",
        "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(data).decode()},
    },
    url=lambda url: {"type": "image", "source": {"type": "url", "url": url}},
    where=lambda index: f"messages[0].content[{index}].source.data",
    url_where=lambda index: f"messages[0].content[{index}].source.url",
)
APIS = [CHAT, RESPONSES, MESSAGES]
apis = pytest.mark.parametrize("api", APIS, ids=[api.name for api in APIS])


@pytest.fixture(params=["memory", "redis"])
async def bounded_store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """Each store, empty, bounding a session to ``SESSION_BOUND``."""
    if request.param == "memory":
        yield MemoryStore(image_bound=SESSION_BOUND)
        return
    from rollout_proxy.state.redis import RedisStore

    store = await RedisStore.connect(request.getfixturevalue("redis_url"), image_bound=SESSION_BOUND)
    await store._redis.flushdb()
    yield store
    await store.close()


@pytest.fixture
def running(fake_engine, bounded_store):
    """A proxy with ``LIMITS`` and the given settings, on the test's store."""

    @asynccontextmanager
    async def start(**settings: Any) -> AsyncIterator[ProxyHarness]:
        async with ProxyHarness.running(
            engine_urls=[fake_engine.url], store=bounded_store, fake=fake_engine, **{**LIMITS, **settings}
        ) as harness:
            yield harness

    return start


async def refused(proxy: ProxyHarness, api: Api, body: dict[str, Any], code: str | None, param: str | None) -> str:
    """The request's 400 in a new session (its message), once it is known to have stored nothing."""
    session = await proxy.create_session([])
    before = await store_snapshot(proxy.app[keys.STORE])
    status, answer = await proxy.request("POST", api.path, json=body, token=session.api_key)
    message = api.error(status, answer, code, param)
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    return message


# -- taken in, then refused at rendering (one place) ---------------------------------------------------------


@apis
async def test_a_good_image_the_policy_cannot_take_is_refused_at_rendering_storing_nothing(running, api):
    async with running() as proxy:
        message = await refused(
            proxy,
            api,
            api.body(api.image(RED, "image/png"), api.image(JPEG, "image/jpeg")),
            "images_unsupported_by_model",
            None,
        )
    assert "images are rendered by the proxy itself" in message  # this proxy renders through the engine


@apis
async def test_a_streamed_turn_with_images_is_refused_before_its_stream_starts(running, api):
    async with running() as proxy:
        body = {**api.body(api.image(RED, "image/png")), "stream": True}
        await refused(proxy, api, body, "images_unsupported_by_model", None)


async def test_count_tokens_takes_images_in_and_is_refused_at_rendering(running):
    async with running() as proxy:
        body = MESSAGES.body(MESSAGES.image(RED, "image/png"))
        del body["max_tokens"]
        proxy_api = Api(
            "messages", "/v1/messages/count_tokens", MESSAGES.image, MESSAGES.url, MESSAGES.where, MESSAGES.url_where
        )
        await refused(proxy, proxy_api, body, "images_unsupported_by_model", None)
        await refused(
            proxy, proxy_api, MESSAGES.body(MESSAGES.image(b"nope", "image/png")), "invalid_image", MESSAGES.where(1)
        )


@apis
@pytest.mark.parametrize(
    ("data", "mime", "words"),
    [
        (b"not an image at all", "image/png", "not an image Pillow reads"),
        (SPECKLED[: len(SPECKLED) * 3 // 4], "image/png", "does not decode"),
        (BMP, "image/png", "it is BMP"),
        (NOISE, "image/png", "more than the 4000 taken (--max-image-bytes)"),
        (WIDE, "image/png", "200x100 pixels, more than the 10000 taken"),
        (BLUE, "image/tiff", "'image/tiff' is not taken"),
    ],
    ids=["not-an-image", "truncated", "bmp", "too-many-bytes", "too-many-pixels", "unsupported-type"],
)
async def test_a_bad_image_is_the_apis_400_naming_it_and_nothing_is_stored(running, api, data, mime, words):
    async with running() as proxy:
        body = api.body(api.image(RED, "image/png"), api.image(data, mime))
        message = await refused(proxy, api, body, "invalid_image", api.where(2))
    assert words in message


async def test_anthropic_media_type_must_be_the_images_own(running):
    async with running() as proxy:
        message = await refused(
            proxy, MESSAGES, MESSAGES.body(MESSAGES.image(RED, "image/jpeg")), "invalid_image", MESSAGES.where(1)
        )
    assert "image/png, not the image/jpeg said" in message


@apis
async def test_a_request_with_more_images_than_it_may_hold_is_refused(running, api):
    async with running() as proxy:
        images = [api.image(color, "image/png") for color in (RED, BLUE, GREEN, RED)]  # 4 parts, 3 images
        message = await refused(proxy, api, api.body(*images), "too_many_images", api.where(4))
    assert "4 image parts, more than the 3" in message and "--max-images-per-request" in message


@apis
async def test_an_image_url_is_refused_where_urls_are_off(running, api):
    async with running() as proxy:
        body = api.body(api.url("https://example.invalid/a.png"))
        message = await refused(proxy, api, body, "invalid_image", api.url_where(1))
    assert "--image-urls" in message


async def test_chat_tool_messages_take_text_only(running):
    async with running() as proxy:
        body = {
            "messages": [
                {"role": "user", "content": "Take a screenshot."},
                {"role": "assistant", "content": None, "tool_calls": [_call()]},
                {"role": "tool", "tool_call_id": "c1", "content": [CHAT.image(RED, "image/png")]},
            ]
        }
        message = await refused(proxy, CHAT, body, None, "messages[2].content[0]")
    assert "text parts only" in message


@pytest.mark.parametrize("api", [RESPONSES, MESSAGES], ids=["responses", "messages"])
async def test_tool_results_take_images_where_the_api_does(running, api):
    async with running() as proxy:
        message = await refused(proxy, api, _tool_result_body(api, RED), "images_unsupported_by_model", None)
    assert "images are rendered by the proxy itself" in message


async def test_a_sessions_sample_and_appended_messages_take_no_image(running):
    """Images are stored with the turn that sends them; messages stored without a turn hold none (yet)."""
    user = {"role": "user", "content": [{"type": "text", "text": "look"}, CHAT.image(RED, "image/png")]}
    async with running() as proxy:
        status, body = await proxy.request("POST", "/v1/sessions", json={"sample": {"messages": [user]}})
        assert "a session's sample" in CHAT.error(status, body, None, "sample.messages[0].content")
        session = await proxy.create_session([])
        before = await store_snapshot(proxy.app[keys.STORE])
        path = f"/v1/sessions/{session.session_id}/messages"
        status, body = await proxy.request("POST", path, json={"messages": [user]})
        assert "appended messages" in CHAT.error(status, body, None, "messages[0].content")
        assert await store_snapshot(proxy.app[keys.STORE]) == before


# -- image URLs, where they are fetched ----------------------------------------------------------------------


@dataclass
class ImageServer:
    url: str
    hits: dict[str, int]


@pytest.fixture
async def image_server() -> AsyncIterator[ImageServer]:
    """A local HTTP server of images: one, a slow one, a large one (said and not said), a missing one."""
    hits: dict[str, int] = {}

    async def serve(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        hits[name] = hits.get(name, 0) + 1
        if name == "red.png":
            return web.Response(body=RED, content_type="image/png")
        if name == "slow.png":
            await asyncio.sleep(3)
            return web.Response(body=RED, content_type="image/png")
        if name == "big.png":
            return web.Response(body=NOISE, content_type="image/png")
        if name == "big-chunked.png":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for start in range(0, len(NOISE), 1000):
                await response.write(NOISE[start : start + 1000])
            await response.write_eof()
            return response
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{name}", serve)
    runner, url = await serve_app(app)
    try:
        yield ImageServer(url, hits)
    finally:
        await runner.cleanup()


@apis
@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("slow.png", "longer than 0.5 s (--image-url-timeout)"),
        ("big.png", "more than the 4000 taken"),
        ("big-chunked.png", "more than the 4000 taken"),
        ("missing.png", "answered HTTP 404"),
    ],
)
async def test_an_image_url_that_cannot_be_taken_is_refused_naming_it(running, image_server, api, name, words):
    async with running(image_urls=True, image_url_timeout=0.5) as proxy:
        body = api.body(api.image(RED, "image/png"), api.url(f"{image_server.url}/{name}"))
        message = await refused(proxy, api, body, "invalid_image", api.url_where(2))
    assert words in message


@apis
async def test_a_fetched_image_url_is_taken_in_as_its_bytes(running, image_server, api):
    async with running(image_urls=True) as proxy:
        body = api.body(api.url(f"{image_server.url}/red.png"))
        await refused(proxy, api, body, "images_unsupported_by_model", None)
    assert image_server.hits == {"red.png": 1}


# -- stored with the node, on a model that takes images ---------------------------------------------------


@pytest.fixture
async def vlm_engine(vlm_dir, template_name) -> AsyncIterator[FakeEngine]:
    """The fake vLLM serving the tiny Idefics3 model's files, with the model's own template (one marker per image
    part; the module's ``template_name`` is the text model's)."""
    engine = FakeEngine(vlm_dir)
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine


@pytest.fixture
def running_vlm(vlm_engine, bounded_store):
    """``running``, on the fake engine of a model that takes images."""

    @asynccontextmanager
    async def start(**settings: Any) -> AsyncIterator[ProxyHarness]:
        async with ProxyHarness.running(
            engine_urls=[vlm_engine.url], store=bounded_store, fake=vlm_engine, **{**LIMITS, **settings}
        ) as harness:
            yield harness

    return start


def _history(api: Api, answer: Any, turn: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's conversation, the answer echoed, as each API's client sends its next turn."""
    if api.name == "chat":
        return [*turn["messages"], answer["choices"][0]["message"]]
    if api.name == "responses":
        return [*turn["input"], *answer["output"]]
    return [*turn["messages"], {"role": "assistant", "content": answer["content"]}]


@apis
@pytest.mark.parametrize("resent_history", ["reuse", "check"])
async def test_a_turns_images_are_stored_with_its_node_once_per_session(running_vlm, image_server, api, resent_history):
    """Either way a resent history is taken in (folded again, or its fold reused) the same happens."""
    async with running_vlm(image_urls=True, max_images_per_request=10, resent_history=resent_history) as proxy:
        store = proxy.app[keys.STORE]
        session = await proxy.create_session([])
        first = api.body(api.image(RED, "image/png"), api.url(f"{image_server.url}/red.png"))
        status, answer = await proxy.request("POST", api.path, json=first, token=session.api_key)
        assert status == 200, answer
        held = await store.get_images(session.session_id, [sha(RED), sha(BLUE), sha(GREEN)])
        assert list(held) == [sha(RED)]  # the same bytes inline and by URL: one image
        assert (held[sha(RED)].mime, held[sha(RED)].width, held[sha(RED)].height, held[sha(RED)].data) == (
            "image/png",
            8,
            6,
            RED,
        )
        [node] = await store.get_nodes(session.session_id)
        assert node.messages[0]["content"][1:] == [{"type": "image", "image": sha(RED)}] * 2
        # the next turn resends the history (the URL is not fetched again) and adds a second image: stored
        second = api.body(api.image(BLUE, "image/png"), history=_history(api, answer, first))
        status, answer = await proxy.request("POST", api.path, json=second, token=session.api_key)
        assert status == 200, answer
        assert set(await store.get_images(session.session_id, [sha(RED), sha(BLUE)])) == {sha(RED), sha(BLUE)}
        assert image_server.hits == {"red.png": 1}
        # a third image is past what the session may store (2): refused before sampling, nothing stored
        before = await store_snapshot(store)
        third = api.body(api.image(GREEN, "image/png"), history=_history(api, answer, second))
        status, body = await proxy.request("POST", api.path, json=third, token=session.api_key)
        message = api.error(status, body, "too_many_images", None)
        assert "--max-images-per-session" in message
        assert await store_snapshot(store) == before


async def test_a_refused_turn_stores_no_image(running_vlm, vlm_engine):
    """The engine fails the turn after its images were checked: no node, no image."""
    async with running_vlm(engine_retries=0) as proxy:
        store = proxy.app[keys.STORE]
        session = await proxy.create_session([])
        before = await store_snapshot(store)
        vlm_engine.failures.append((400, "Token id 1 is out of vocabulary"))
        status, body = await proxy.request(
            "POST", CHAT.path, json=CHAT.body(CHAT.image(RED, "image/png")), token=session.api_key
        )
        assert status >= 400, body
        assert await store_snapshot(store) == before
        assert await store.get_images(session.session_id, [sha(RED)]) == {}


def _call() -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}


def _tool_result_body(api: Api, data: bytes) -> dict[str, Any]:
    if api.name == "responses":
        output = [{"type": "input_text", "text": "here"}, api.image(data, "image/png")]
        items = [
            {"role": "user", "content": "Take a screenshot."},
            {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": output},
        ]
        return {"model": "policy", "input": items, "store": False}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [api.image(data, "image/png")]}
    return {
        "model": "policy",
        "max_tokens": 256,
        "messages": [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [result]},
        ],
    }
