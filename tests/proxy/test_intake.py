"""The intake's one switchable stage: a resent history reused (``--resent-history reuse``, the default) or
every body taken in whole (``check``) gives the same result, answer for answer and token for token.

The same requests go to two proxies, one each way, over the three APIs: a conversation resent and
extended turn by turn (compact JSON as the SDKs send it, and spaced JSON), a history rewritten in the
middle (a fork), the Messages API's moving ``cache_control`` marks, and bodies refused after a resent
history (a bad last item, a string past the bound, a duplicate key, JSON that is no object). Every answer
(status, the error's param and code, the assistant's text and token ids) and every stored node (its
tokens, messages, fork) must be the same both ways.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.proxy import keys
from tests.conftest import TEMPLATES_DIR
from tests.harness import ProxyHarness

TEMPLATE = str(TEMPLATES_DIR / "qwen3_style.jinja")
BIG = "x" * (4 * 1024 * 1024 + 1)


@pytest.fixture
async def pair(fake_engine: FakeEngine, template_name: str) -> AsyncIterator[dict[str, ProxyHarness]]:
    template = TEMPLATE if template_name == "qwen3_style" else ""
    async with (
        ProxyHarness.running(engine_urls=[fake_engine.url], fake=fake_engine, chat_template=template) as reuse,
        ProxyHarness.running(
            engine_urls=[fake_engine.url], fake=fake_engine, chat_template=template, resent_history="check"
        ) as check,
    ):
        assert reuse.app[keys.SETTINGS].resent_history == "reuse"
        yield {"reuse": reuse, "check": check}


async def send(proxy: ProxyHarness, token: str, path: str, body: Any, *, spaced: bool = False) -> tuple[int, Any]:
    data = orjson.dumps(body, option=orjson.OPT_INDENT_2 if spaced else 0) if not isinstance(body, bytes) else body
    headers = {"x-api-key": token, "anthropic-version": "2023-06-01"} if "messages" in path else None
    return await proxy.request("POST", path, data=data, token=None if headers else token, headers=headers)


def summary(status: int, answer: Any) -> Any:
    """What a client sees of an answer, without its ids and times."""
    if status >= 400:
        error = answer.get("error") or {}
        return status, error.get("param"), error.get("code"), error.get("type")
    if "choices" in answer:
        return status, answer["choices"][0]["message"], answer["choices"][0]["token_ids"]
    if "output" in answer:
        return status, [item.get("content") or item.get("arguments") for item in answer["output"]]
    return status, answer.get("content"), answer.get("stop_reason")


async def stored(proxy: ProxyHarness, session_id: str) -> list[Any]:
    nodes = await proxy.app[keys.STORE].get_nodes(session_id) or []
    return [
        (node.prompt_ids.tolist(), node.output_ids.tolist(), node.messages, node.fork is not None, node.api)
        for node in nodes
    ]


async def run_both(pair: dict[str, ProxyHarness], script) -> None:
    """``script(proxy, token)`` yields (path, body, spaced); both proxies answer alike and store alike."""
    seen: dict[str, list[Any]] = {}
    for way, proxy in pair.items():
        status, session = await proxy.request(
            "POST", "/v1/sessions", json={"sample": {}, "generation": {"max_new_tokens": 24}}
        )
        assert status == 201, session
        answers = []
        async for path, body, spaced in script():
            status, answer = await send(proxy, session["api_key"], path, body, spaced=spaced)
            answers.append(summary(status, answer))
            script.last = answer  # the script builds the next turn on this answer
        seen[way] = [answers, await stored(proxy, session["session_id"])]
    assert seen["reuse"] == seen["check"]
    assert any(entry[0] == 200 for entry in seen["reuse"][0]) and any(entry[0] == 400 for entry in seen["reuse"][0])


class ChatScript:
    last: Any = None

    async def __call__(self):
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to two."}]
        for turn in range(3):
            yield "/v1/chat/completions", {"model": "m", "messages": history}, turn == 1
            history = [*history, self.last["choices"][0]["message"], {"role": "user", "content": f"Again {turn}."}]
        rewritten = copy.deepcopy(history)
        rewritten[1]["content"] = "Count to three."  # a fork in the middle
        yield "/v1/chat/completions", {"model": "m", "messages": rewritten}, False
        yield "/v1/chat/completions", {"model": "m", "messages": [*history, {"role": "robot", "content": "?"}]}, False
        yield "/v1/chat/completions", {"model": "m", "messages": [*history, {"role": "user", "content": BIG}]}, False
        raw = orjson.dumps({"model": "m", "messages": history})
        yield "/v1/chat/completions", raw[:-1] + b',"messages":[]}', False  # a key twice: the last wins
        yield "/v1/chat/completions", b"[" + orjson.dumps(history) + b"]", False  # no object


class ResponsesScript:
    last: Any = None

    async def __call__(self):
        items: list[dict[str, Any]] = [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi."},
        ]
        for turn in range(3):
            yield "/v1/responses", {"model": "m", "input": items, "store": False}, turn == 2
            items = [*items, *self.last["output"], {"role": "user", "content": f"More {turn}."}]
        yield "/v1/responses", {"model": "m", "input": [*items, {"type": "image", "url": "x"}], "store": False}, False
        yield "/v1/responses", {"model": "m", "input": [*items, {"role": "user", "content": BIG}]}, False


class MessagesScript:
    last: Any = None

    async def __call__(self):
        system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Hi."}]}]
        for turn in range(3):
            marked = copy.deepcopy(messages)
            marked[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}  # on the newest, as Claude Code
            body = {"model": "m", "max_tokens": 24, "system": system, "messages": marked}
            yield "/v1/messages", body, turn == 1
            reply = {"role": "assistant", "content": self.last["content"]}
            messages = [*messages, reply, {"role": "user", "content": [{"type": "text", "text": f"More {turn}."}]}]
        bad = [*messages, {"role": "user", "content": [{"type": "image", "source": {}}]}]
        yield "/v1/messages", {"model": "m", "max_tokens": 24, "messages": bad}, False
        yield (
            "/v1/messages",
            {"model": "m", "max_tokens": 24, "messages": [*messages, {"role": "user", "content": BIG}]},
            False,
        )


@pytest.mark.parametrize("script", [ChatScript, ResponsesScript, MessagesScript], ids=["chat", "responses", "messages"])
async def test_reusing_a_resent_history_gives_what_taking_it_whole_gives(pair, script):
    await run_both(pair, script())


async def test_the_reused_history_was_reused(pair):
    """Not only the same result: the default way did skip what it had seen (else the test above proves little)."""
    await run_both(pair, ChatScript())
    await run_both(pair, ResponsesScript())
    await run_both(pair, MessagesScript())
    reuse, check = pair["reuse"].app, pair["check"].app
    assert reuse[keys.KNOWN_MESSAGES].resent_bodies > 0 and reuse[keys.KNOWN_INPUTS].resent > 0
    assert check[keys.KNOWN_MESSAGES].resent_bodies == 0 and check[keys.KNOWN_INPUTS].resent == 0
    assert len(check[keys.KNOWN_INPUTS]) == 0
