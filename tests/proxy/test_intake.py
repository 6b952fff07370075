"""The intake's one switchable stage: a resent history reused (``--resent-history reuse``, the default) or
every body taken in whole (``check``) gives the same result, answer for answer and token for token.

The same requests go to two proxies, one each way, over the three APIs: a conversation resent and
extended turn by turn (compact JSON as the SDKs send it, and spaced JSON), a history rewritten in the
middle (a fork), the Messages API's moving ``cache_control`` marks, and bodies refused after a resent
history (a bad last item, a string past the bound, a duplicate key, JSON that is no object). Every answer
(status, the error's param and code, the assistant's text and token ids) and every stored node (its
tokens, messages, fork) must be the same both ways.

And the same with a harness's session interleaving its main conversation with a subagent's turns (another
system prompt) and side calls (a title request, ``count_tokens``): the main conversation's memory is not
evicted by them, so each of its turns takes in only the items it adds (the memories' counters of items
taken in past the list they resend), and still answers and stores what taking every body whole does.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.limits import MAX_STRING_CHARS
from rollout_proxy.wire.messages import ToolSet
from tests.conftest import TEMPLATES_DIR
from tests.harness import ProxyHarness

TEMPLATE = str(TEMPLATES_DIR / "qwen3_style.jinja")
BIG = "x" * (MAX_STRING_CHARS + 1)


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


def fresh(proxy: ProxyHarness) -> int:
    """Items the memory took in past the list they resend (checked and folded), every API's."""
    return proxy.app[keys.RESENT_HISTORY].fresh_items


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
    if "input_tokens" in answer:
        return status, answer["input_tokens"]
    return status, answer.get("content"), answer.get("stop_reason")


async def stored(proxy: ProxyHarness, session_id: str) -> list[Any]:
    nodes = await proxy.app[keys.STORE].get_nodes(session_id) or []
    return [
        (node.prompt_ids.tolist(), node.output_ids.tolist(), node.messages, node.fork is not None, node.api)
        for node in nodes
    ]


async def run_both(pair: dict[str, ProxyHarness], script) -> None:
    """``script()`` yields (path, body, spaced) or (path, body, spaced, fresh): both proxies answer alike and
    store alike, and where ``fresh`` is given the reusing proxy took in just that many items of the body."""
    seen: dict[str, list[Any]] = {}
    for way, proxy in pair.items():
        status, session = await proxy.request(
            "POST", "/v1/sessions", json={"sample": {}, "generation": {"max_new_tokens": 24}}
        )
        assert status == 201, session
        answers = []
        async for path, body, spaced, *expected in script():
            before = fresh(proxy)
            status, answer = await send(proxy, session["api_key"], path, body, spaced=spaced)
            answers.append(summary(status, answer))
            if way == "reuse" and expected:
                assert (status, fresh(proxy) - before) == (200, expected[0]), (path, len(answers), answer)
            script.last = answer  # the script builds the next turn on this answer
        if way == "check":
            assert fresh(proxy) == 0  # nothing reused, nothing counted
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


#: main turns: with a side call after each, the session sends more lists than it keeps (8)
MAIN_TURNS = 9


class InterleavedChatScript:
    """A main conversation, a subagent started at its second turn (another system prompt) taking a turn after
    each of the main's, and a side call (a title request, new each time) after each: as a harness sends them."""

    last: Any = None

    async def __call__(self):
        main = [{"role": "system", "content": "You are the main agent."}, {"role": "user", "content": "Fix it."}]
        subagent: list[dict[str, Any]] = []
        for turn in range(MAIN_TURNS):
            yield "/v1/chat/completions", {"model": "m", "messages": main}, turn == 3, 2  # only what it adds
            main = [*main, self.last["choices"][0]["message"], {"role": "user", "content": f"Go on {turn}."}]
            if turn >= 1:
                subagent = subagent or [
                    {"role": "system", "content": "You are a search subagent."},
                    {"role": "user", "content": "Find the file."},
                ]
                yield "/v1/chat/completions", {"model": "m", "messages": subagent}, False, 2
                subagent = [*subagent, self.last["choices"][0]["message"], {"role": "user", "content": f"More {turn}."}]
            title = [{"role": "system", "content": "Write a title."}, {"role": "user", "content": f"Fix it, {turn}."}]
            yield "/v1/chat/completions", {"model": "m", "messages": title}, False, 2 if turn == 0 else 1  # the last
            # title's system message reused
        bad = [*main[:-1], {"role": "tool", "content": "no id"}]  # refused after a resent history
        yield "/v1/chat/completions", {"model": "m", "messages": bad}, False


class InterleavedResponsesScript:
    """The same over Responses, resent whole as Codex sends it (``store: false``)."""

    last: Any = None

    async def __call__(self):
        main: list[dict[str, Any]] = [
            {"role": "developer", "content": "You are the main agent."},
            {"role": "user", "content": "Fix it."},
        ]
        subagent: list[dict[str, Any]] = []
        added, added_to_subagent = len(main), 2
        for turn in range(MAIN_TURNS):
            yield "/v1/responses", {"model": "m", "input": main, "store": False}, turn == 3, added
            output = self.last["output"]
            main = [*main, *output, {"role": "user", "content": f"Go on {turn}."}]
            added = len(output) + 1
            if turn >= 1:
                subagent = subagent or [
                    {"role": "developer", "content": "You are a search subagent."},
                    {"role": "user", "content": "Find the file."},
                ]
                yield "/v1/responses", {"model": "m", "input": subagent, "store": False}, False, added_to_subagent
                output = self.last["output"]
                subagent = [*subagent, *output, {"role": "user", "content": f"More {turn}."}]
                added_to_subagent = len(output) + 1
            title = [
                {"role": "developer", "content": "Write a title."},
                {"role": "user", "content": f"Fix it, {turn}."},
            ]
            yield "/v1/responses", {"model": "m", "input": title, "store": False}, False, 2
        yield "/v1/responses", {"model": "m", "input": [*main, {"type": "image", "url": "x"}], "store": False}, False


def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As Claude Code sends its messages: a ``cache_control`` mark on the newest one's last block."""
    copied = copy.deepcopy(messages)
    copied[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return copied


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


class InterleavedMessagesScript:
    """The same over the Messages API as Claude Code sends it: the cache mark moving to the newest message
    (so a turn takes in again the message that lost it), a subagent with another system prompt, and side
    calls: a ``count_tokens`` of new text, and a title request resending the main's first message under
    another system prompt."""

    last: Any = None

    async def __call__(self):
        system = [{"type": "text", "text": "You are the main agent.", "cache_control": {"type": "ephemeral"}}]
        main, subagent = [user("Fix it.")], [user("Find the file.")]
        sub_system = [{"type": "text", "text": "You are a search subagent."}]
        for turn in range(MAIN_TURNS):
            body = {"model": "m", "max_tokens": 24, "system": system, "messages": marked(main)}
            yield "/v1/messages", body, turn == 3, 1 if turn == 0 else 3  # the new two, and the one unmarked
            main = [*main, {"role": "assistant", "content": self.last["content"]}, user(f"Go on {turn}.")]
            if turn >= 1:
                body = {"model": "m", "max_tokens": 24, "system": sub_system, "messages": marked(subagent)}
                yield "/v1/messages", body, False, 1 if turn == 1 else 3
                subagent = [*subagent, {"role": "assistant", "content": self.last["content"]}, user(f"More {turn}.")]
            if turn % 2:
                title = {"model": "m", "max_tokens": 24, "system": "Write a title.", "messages": main[:1]}
                yield "/v1/messages", title, False, 1 if turn == 1 else 0  # the same request again: all reused
            else:
                count = {"model": "m", "messages": [user(f"Count {turn}.")]}
                yield "/v1/messages/count_tokens", count, False, 1
        bad = {
            "model": "m",
            "max_tokens": 24,
            "system": system,
            "messages": [*main, user("x" * (MAX_STRING_CHARS + 1))],
        }
        yield "/v1/messages", bad, False


@pytest.mark.parametrize("script", [ChatScript, ResponsesScript, MessagesScript], ids=["chat", "responses", "messages"])
async def test_reusing_a_resent_history_gives_what_taking_it_whole_gives(pair, script):
    await run_both(pair, script())


@pytest.mark.parametrize(
    "script",
    [InterleavedChatScript, InterleavedResponsesScript, InterleavedMessagesScript],
    ids=["chat", "responses", "messages"],
)
async def test_a_subagent_and_side_calls_leave_the_main_conversation_its_memory(pair, script):
    """Each main turn takes in only what it adds, however many subagent turns and side calls came between,
    and the answers and nodes are those of taking every body whole."""
    await run_both(pair, script())


async def test_the_reused_history_was_reused(pair):
    """Not only the same result: the default way did skip what it had seen (else the test above proves little)."""
    await run_both(pair, ChatScript())
    await run_both(pair, ResponsesScript())
    await run_both(pair, MessagesScript())
    reuse, check = pair["reuse"].app, pair["check"].app
    assert reuse[keys.RESENT_HISTORY].resent_bodies > 0 and reuse[keys.RESENT_HISTORY].resent > 0
    assert check[keys.RESENT_HISTORY].resent_bodies == 0 and check[keys.RESENT_HISTORY].resent == 0
    assert check[keys.RESENT_HISTORY].held()["conversations"] == 0


#: a tool per API's form, and the same tool broken two ways: a shape its API refuses, a string past the bound
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = {
    "chat": {"type": "function", "function": {"name": "weather", "description": "Look up.", "parameters": WEATHER}},
    "responses": {"type": "function", "name": "weather", "description": "Look up.", "parameters": WEATHER},
    "messages": {"name": "weather", "description": "Look up.", "input_schema": WEATHER},
}
BAD_TOOLS = {
    "chat": {"type": "function", "function": {"name": 3, "parameters": WEATHER}},
    "responses": {"type": "function", "name": 3, "parameters": WEATHER},
    "messages": {"name": 3, "input_schema": WEATHER},
}


class ToolsScript:
    """A harness's turns resending the same tools (checked once where the history is reused), then a tool
    broken in shape and one with a string past the bound, then the good tools again: every turn is answered
    and stored as when every body is checked whole."""

    last: Any = None

    def __init__(self, api: str) -> None:
        self.api = api

    def body(self, history: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        if self.api == "chat":
            return "/v1/chat/completions", {"model": "m", "messages": history, "tools": tools}
        if self.api == "responses":
            return "/v1/responses", {"model": "m", "input": history, "tools": tools, "store": False}
        return "/v1/messages", {"model": "m", "max_tokens": 24, "messages": history, "tools": tools}

    def answered(self, history: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
        if self.api == "chat":
            reply = [self.last["choices"][0]["message"]]
        elif self.api == "responses":
            reply = self.last["output"]
        else:
            reply = [{"role": "assistant", "content": self.last["content"]}]
        return [*history, *reply, {"role": "user", "content": f"And then {turn}?"}]

    async def __call__(self):
        good, bad = [TOOLS[self.api]], [BAD_TOOLS[self.api]]
        long = (
            [{**TOOLS[self.api], "description": BIG}]
            if self.api != "chat"
            else [{"type": "function", "function": {**TOOLS["chat"]["function"], "description": BIG}}]
        )
        history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        for turn in range(3):
            yield *self.body(history, good), False
            history = self.answered(history, turn)
        for tools in (bad, long):
            yield *self.body(history, tools), False
        yield *self.body(history, good), False


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_tools_checked_once_are_answered_as_tools_checked_every_turn(pair, api):
    await run_both(pair, ToolsScript(api))
    memo = pair["reuse"].app[keys.RESENT_HISTORY]
    intake = memo.intake(api, "input" if api == "responses" else "messages", "another session", expires_at=1e12)
    assert intake.tools_checked([TOOLS[api]])  # the tools' JSON is vouched for, in any session of its API
    assert not intake.tools_checked([BAD_TOOLS[api]])
    other = "chat" if api != "chat" else "messages"
    assert not memo.intake(other, "messages", "another session", expires_at=1e12).tools_checked([TOOLS[api]])
    # and split once: the split its turns made is the one handed out, the refused tools' never kept
    assert memo.held()["tool_sets"] == 1

    def split(tools: Any) -> ToolSet:
        raise AssertionError(f"split again: {tools}")

    assert intake.tool_set([TOOLS[api]], split).functions[0]["function"]["name"] == "weather"
