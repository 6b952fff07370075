"""A conversation's turns cost the proxy the same Python work at turn 60 as at turn 3, on every API and store,
with or without an image in the conversation.

A client resends its whole history each turn, so the bytes grow with the conversation; the proxy's own Python
work must not (the history it has seen is not checked, parsed or walked again). Counted, not timed: the calls
into ``rollout_proxy``'s code per turn (``devtools.call_count``), over turns early and turns late. A
walk over the path or the history per turn adds a call or a generator step per item (~60 at turn 60, against
~400-500 a turn): what this catches.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import rollout_proxy
from devtools.call_count import CallCounter
from devtools.fake_engine import FakeEngine
from tests.harness import ProxyHarness

OWN_CODE = Path(rollout_proxy.__file__).parent
EARLY, LATE, WINDOW = 3, 60, 5


def chat(proxy: ProxyHarness, key: str) -> Callable[[int], Awaitable[None]]:
    messages: list[dict[str, Any]] = []

    async def turn(k: int) -> None:
        messages.append({"role": "user", "content": f"Turn {k}: and then?"})
        status, body = await proxy.request(
            "POST", "/v1/chat/completions", json={"model": "m", "messages": messages}, token=key
        )
        assert status == 200, body
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    return turn


def responses(proxy: ProxyHarness, key: str) -> Callable[[int], Awaitable[None]]:
    items: list[dict[str, Any]] = []  # the whole input resent, as Codex sends it

    async def turn(k: int) -> None:
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Turn {k}."}]})
        status, body = await proxy.request(
            "POST", "/v1/responses", json={"model": "m", "input": items, "store": False}, token=key
        )
        assert status == 200, body
        items.extend(body["output"])

    return turn


def messages(proxy: ProxyHarness, key: str) -> Callable[[int], Awaitable[None]]:
    history: list[dict[str, Any]] = []

    async def turn(k: int) -> None:
        history.append({"role": "user", "content": f"Turn {k}: and then?"})
        body = {"model": "m", "max_tokens": 8, "messages": history}  # the session's own value
        status, answer = await proxy.request("POST", "/v1/messages", json=body, token=key)
        assert status == 200, answer
        history.append({"role": "assistant", "content": answer["content"]})

    return turn


def chat_with_an_image(proxy: ProxyHarness, key: str) -> Callable[[int], Awaitable[None]]:
    """A Chat conversation whose first message holds an image: every later turn's prompt holds it too (its span
    found, its bytes read and sent again), and the rest of the conversation is text."""
    out = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(out, "PNG")
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()},
    }
    messages: list[dict[str, Any]] = []

    async def turn(k: int) -> None:
        text = {"type": "text", "text": f"Turn {k}: and then?"}
        messages.append({"role": "user", "content": [text, image] if k == 0 else [text]})
        status, body = await proxy.request(
            "POST", "/v1/chat/completions", json={"model": "m", "messages": messages}, token=key
        )
        assert status == 200, body
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    return turn


async def assert_flat(
    proxy: ProxyHarness, api: Callable[[ProxyHarness, str], Callable[[int], Awaitable[None]]]
) -> None:
    session = await proxy.create_session([], max_new_tokens=8)
    turn = api(proxy, session.api_key)
    counter, k = CallCounter(OWN_CODE), 0

    async def turns(count: int) -> None:
        nonlocal k
        for _ in range(count):
            await turn(k)
            k += 1

    async def calls_a_turn() -> float:
        """The fewest calls a turn over two windows: what else runs in this process (an earlier test's garbage
        finalized, its background tasks) only ever adds calls, and seldom to both windows."""
        counts = []
        for _ in range(2):
            gc.collect()  # earlier tests' garbage finalized now, not inside the window
            await asyncio.sleep(0.05)
            counter.start()
            try:
                await turns(WINDOW)
            finally:
                counts.append(counter.stop() / WINDOW)
        return min(counts)

    await turns(EARLY)
    early = await calls_a_turn()
    await turns(LATE - k)
    late = await calls_a_turn()
    assert early > 100  # the counter saw the proxy's turns
    assert late <= early * 1.03 + 3, f"{early:.0f} calls a turn at turn {EARLY}, {late:.0f} at turn {LATE}"


@pytest.mark.parametrize("template_name", ["qwen3_style"], indirect=False)
@pytest.mark.parametrize("api", [chat, responses, messages], ids=["chat", "responses", "messages"])
async def test_a_turns_own_python_work_does_not_grow_with_the_conversation(proxy: ProxyHarness, api: Any):
    await assert_flat(proxy, api)


@pytest.fixture
async def image_proxy(vlm_engine: FakeEngine, store: Any) -> AsyncIterator[ProxyHarness]:
    """The proxy in front of the fake vLLM serving the tiny Idefics3 model's files (it takes images)."""
    async with ProxyHarness.running(engine_urls=[vlm_engine.url], store=store, fake=vlm_engine) as harness:
        yield harness


async def test_a_conversation_that_holds_an_image_does_not_grow_either(image_proxy: ProxyHarness):
    """Where the prompt's images are is kept on the path's last node, not found by walking the path each turn."""
    await assert_flat(image_proxy, chat_with_an_image)
