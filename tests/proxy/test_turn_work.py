"""A conversation's turns cost the proxy the same Python work at turn 60 as at turn 3, on every API and store.

A client resends its whole history each turn, so the bytes grow with the conversation; the proxy's own Python
work must not (the history it has seen is not checked, parsed or walked again). Counted, not timed: the calls
into ``rollout_proxy``'s code per turn, by ``sys.setprofile``, over five turns early and five turns late. A
walk over the path or the history per turn adds a call or a generator step per item (~60 at turn 60, against
~400-500 a turn): what this catches.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import CodeType
from typing import Any

import pytest

import rollout_proxy
from tests.harness import ProxyHarness

pytestmark = pytest.mark.parametrize("template_name", ["qwen3_style"], indirect=False)

OWN_CODE = str(Path(rollout_proxy.__file__).parent)
EARLY, LATE, WINDOW = 3, 60, 5


ASYNC = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


@functools.cache
def _entry(code: CodeType) -> int:
    """Where a call of ``code`` starts (its first RESUME): a coroutine resumed is further on."""
    return next(op.offset for op in dis.get_instructions(code) if op.opname == "RESUME")


class OwnCalls:
    """Calls into the proxy's own functions and each step of its generators, over ``over``; a coroutine
    resumed is not counted (how often one waits depends on when the bytes arrive, not on the work)."""

    def __init__(self) -> None:
        self.count = 0

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(OWN_CODE):
            return
        if not code.co_flags & ASYNC or frame.f_lasti <= _entry(code):
            self.count += 1

    async def over(self, turns: Callable[[], Awaitable[None]]) -> int:
        self.count = 0
        sys.setprofile(self._profile)
        try:
            await turns()
        finally:
            sys.setprofile(None)
        return self.count


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


@pytest.mark.parametrize("api", [chat, responses, messages], ids=["chat", "responses", "messages"])
async def test_a_turns_own_python_work_does_not_grow_with_the_conversation(proxy: ProxyHarness, api: Any):
    session = await proxy.create_session([], max_new_tokens=8)
    turn = api(proxy, session.api_key)
    counter, k = OwnCalls(), 0

    async def turns(count: int) -> None:
        nonlocal k
        for _ in range(count):
            await turn(k)
            k += 1

    await turns(EARLY)
    early = await counter.over(lambda: turns(WINDOW)) / WINDOW
    await turns(LATE - k)
    late = await counter.over(lambda: turns(WINDOW)) / WINDOW
    assert early > 100  # the counter saw the proxy's turns
    assert late <= early * 1.03 + 3, f"{early:.0f} calls a turn at turn {EARLY}, {late:.0f} at turn {LATE}"
