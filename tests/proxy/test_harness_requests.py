"""Requests as harnesses send them, replayed from ``shared/fixtures/harnesses`` (Codex CLI 0.171.0): each
defect a new user met with them is a test here (the harnesses themselves run in ``tests/harnesses``).

Every check is against what the engine received: the prompt token ids it was asked to complete.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.proxy import keys
from tests.conftest import TEMPLATES, TEMPLATES_DIR
from tests.harness import ProxyHarness, store_snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "codex-0.171.0"


def codex_body(name: str) -> dict[str, Any]:
    return copy.deepcopy(json.loads((FIXTURES / name).read_text())["body"])


TASK = "[case:codex-think] Read marker.txt and tell me what it says."
STOCK_TASK = "[case:codex-shell] Read marker.txt and tell me what it says."
CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "cat marker.txt"}}\n</tool_call>'


@pytest.fixture
async def fake(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    """Codex's first request is ~30 KB of JSON (a 17.7k-character developer prompt, 12 tools)."""
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], max_model_len=32768)
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine


@pytest.fixture
async def proxy(fake: FakeEngine, store: Any) -> AsyncIterator[ProxyHarness]:
    template = str(TEMPLATES_DIR / "qwen3_style.jinja")
    async with ProxyHarness.running(engine_urls=[fake.url], store=store, fake=fake, chat_template=template) as harness:
        yield harness


async def open_session(proxy: ProxyHarness, messages: list[dict[str, Any]] | None = None, **fields: Any) -> dict:
    body: dict[str, Any] = {"sample": {"messages": messages} if messages is not None else {}, **fields}
    body.setdefault("generation", {"max_new_tokens": 64})
    status, session = await proxy.request("POST", "/v1/sessions", json=body)
    assert status == 201, session
    return session


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


async def respond(proxy: ProxyHarness, session: dict, body: dict[str, Any]) -> tuple[int, Any]:
    status, answer = await proxy.request("POST", "/v1/responses", json=body, token=session["api_key"])
    if status == 200 and isinstance(answer, str):  # a stream
        events = sse_events(answer)
        assert events[-1]["type"] == "response.completed", events[-1]
        return status, events
    return status, answer


def prompt_text(fake: FakeEngine, index: int = -1) -> str:
    return fake.decode(fake.prompts[index])


async def node_of(proxy: ProxyHarness, session: dict, response_id: str):
    return (await proxy.app[keys.STORE].get_path(session["session_id"], response_id))[-1]


async def test_codex_stock_first_request_is_answered(proxy: ProxyHarness, fake: FakeEngine):
    """It was a 400 on ``reasoning: {"summary": "auto"}``, then on the namespace tool, then on web_search."""
    session = await open_session(proxy)
    fake.queue(CALL)
    status, events = await respond(proxy, session, codex_body("responses-turn1-stock-config.json"))
    assert status == 200, events
    completed = events[-1]["response"]
    call = next(item for item in completed["output"] if item["type"] == "function_call")
    assert call["name"] == "exec_command" and "namespace" not in call
    prompt = prompt_text(fake)
    # the namespace's member functions are rendered as functions; web_search is left out
    for name in ("exec_command", "spawn_agent", "close_agent", "wait_agent", "update_goal"):
        assert f'"name": "{name}"' in prompt
    assert "web_search" not in prompt
    node = await node_of(proxy, session, completed["id"])
    assert node.meta["tools_left_out"] == [{"type": "web_search"}]
    assert node.meta["tool_namespaces"]["spawn_agent"] == "multi_agent_v1"
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("tools_left_out_total", api="responses", type="web_search") == 1


async def test_a_call_to_a_namespace_function_goes_back_with_its_namespace(proxy: ProxyHarness, fake: FakeEngine):
    session = await open_session(proxy)
    fake.queue('<tool_call>\n{"name": "spawn_agent", "arguments": {"message": "count the files"}}\n</tool_call>')
    status, events = await respond(proxy, session, codex_body("responses-turn1-stock-config.json"))
    assert status == 200, events
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    call = next(item for item in done if item["type"] == "function_call")
    assert call["name"] == "spawn_agent" and call["namespace"] == "multi_agent_v1"
    status, _ = await proxy.request("GET", f"/v1/responses/{events[-1]['response']['id']}")
    assert status == 404  # store: false, as Codex sends it; the stream's final object carries the same item
    final = next(item for item in events[-1]["response"]["output"] if item["type"] == "function_call")
    assert final == call


async def test_codex_with_a_sample_sees_its_task_once(proxy: ProxyHarness, fake: FakeEngine):
    """The sample's task is Codex's own prompt: it was prepended, so the policy saw it twice."""
    session = await open_session(proxy, [{"role": "user", "content": TASK}])
    fake.queue(CALL, "It says rollout-proxy-codex-marker.")
    first_body, second_body = codex_body("responses-turn1.json"), codex_body("responses-turn2-after-tool-call.json")
    status, first = await respond(proxy, session, first_body)
    assert status == 200, first
    assert prompt_text(fake).count(TASK) == 1
    status, second = await respond(proxy, session, second_body)
    assert status == 200, second
    assert prompt_text(fake).count(TASK) == 1
    # the second turn extends the first: its prompt is the first turn's tokens, then the bridge
    first_node = await node_of(proxy, session, first[-1]["response"]["id"])
    second_node = await node_of(proxy, session, second[-1]["response"]["id"])
    assert second_node.parent_id == first_node.id
    assert fake.prompts[1][: len(fake.prompts[0])] == fake.prompts[0]
    assert "sample_placement" not in first_node.meta  # all of the sample, in order: taken as sent
    trajectory = await proxy.trajectory(second_node.id)
    assert trajectory["total_token_ids"] == fake.prompts[1] + [int(t) for t in second_node.output_ids]


async def test_codex_developer_prompt_reaches_the_policy(proxy: ProxyHarness, fake: FakeEngine):
    session = await open_session(proxy)
    fake.queue("Done.")
    body = codex_body("responses-turn1.json")
    status, _ = await respond(proxy, session, body)
    assert status == 200
    prompt = prompt_text(fake)
    developer = body["input"][0]["content"][0]["text"]
    assert prompt.startswith("<|im_start|>system\n" + developer[:200])
    assert "<skills_instructions>" in prompt  # the second developer message, merged into the system turn


async def test_a_harness_owned_session_records_its_first_request_exactly(proxy: ProxyHarness, fake: FakeEngine):
    session = await open_session(proxy)  # no sample messages
    fake.queue("Hello.")
    status, body = await proxy.request(
        "POST",
        "/v1/responses",
        json={"model": "m", "instructions": "Be brief.", "input": "Say hello."},
        token=session["api_key"],
    )
    assert status == 200, body
    assert prompt_text(fake) == fake.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
        add_generation_prompt=True,
    )


async def test_instructions_and_a_sample_with_a_system_message(proxy: ProxyHarness, fake: FakeEngine):
    """The Agents SDK sends ``instructions`` and the task as input: it was system, system, user, user."""
    sample = [{"role": "system", "content": "You grade answers."}, {"role": "user", "content": "Is 2+2=4?"}]
    session = await open_session(proxy, sample)
    fake.queue("Yes.", "Yes.")
    status, body = await proxy.request(
        "POST",
        "/v1/responses",
        json={"model": "m", "instructions": "Answer yes or no.", "input": "Is 2+2=4?"},
        token=session["api_key"],
    )
    assert status == 200, body
    expected = [{"role": "system", "content": "Answer yes or no."}, {"role": "user", "content": "Is 2+2=4?"}]
    assert prompt_text(fake) == fake.render(expected, add_generation_prompt=True)
    node = await node_of(proxy, session, body["id"])
    assert node.meta["sample_placement"] == "partial"  # the sample's system message is not there: flagged
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("sample_placements_total", api="responses", placement="partial") == 1
    # with none of the sample in the input, the sample goes after the instructions, once
    status, body = await proxy.request(
        "POST",
        "/v1/responses",
        json={"model": "m", "instructions": "Answer yes or no.", "input": "Go."},
        token=session["api_key"],
    )
    assert status == 200, body
    expected = [{"role": "system", "content": "Answer yes or no."}, *sample, {"role": "user", "content": "Go."}]
    assert prompt_text(fake) == fake.render(expected, add_generation_prompt=True)
    assert (await node_of(proxy, session, body["id"])).meta["sample_placement"] == "inserted"


async def test_a_system_prompt_inside_input_stays_first(proxy: ProxyHarness, fake: FakeEngine):
    """LangChain's Responses mode puts its system prompt in ``input``: the policy saw user, system, user."""
    sample = [{"role": "user", "content": "What is the capital of France?"}]
    session = await open_session(proxy, sample)
    fake.queue("Paris.")
    conversation = [{"role": "system", "content": "You are a geographer."}, *sample]
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": conversation}, token=session["api_key"]
    )
    assert status == 200, body
    assert prompt_text(fake) == fake.render(conversation, add_generation_prompt=True)


async def test_the_session_trajectory_answers_for_a_responses_only_session(proxy: ProxyHarness, fake: FakeEngine):
    session = await open_session(proxy)
    status, body = await proxy.request("GET", f"/v1/sessions/{session['session_id']}/trajectory")
    assert status == 404 and "has no response yet" in body["error"]["message"]
    fake.queue("One.")
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": "Count."}, token=session["api_key"]
    )
    assert status == 200, body
    for token in (None, session["api_key"]):  # the admin key, and the session's own token
        kwargs = {} if token is None else {"token": token}
        status, trajectory = await proxy.request("GET", f"/v1/sessions/{session['session_id']}/trajectory", **kwargs)
        assert status == 200, trajectory
        assert trajectory["response_id"] == body["id"]
        assert trajectory["total_token_ids"] == fake.prompts[-1] + body["token_ids"]


# -- client_sampling ---------------------------------------------------------------------------------


AGENTS_SDK_DEFAULTS = {"reasoning": {"effort": "none"}, "text": {"verbosity": "low"}}
NO_OPS = {
    "reasoning": {"summary": "auto"},
    "text": {"verbosity": "low", "format": {"type": "text"}},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "abc",
    "parallel_tool_calls": True,
    "client_metadata": {"turn_id": "1"},
    "temperature": 1.0,
    "top_p": 1.0,
    "max_output_tokens": 64,
    "n": 1,
}


@pytest.mark.parametrize("fields", [AGENTS_SDK_DEFAULTS, NO_OPS, {"reasoning": {}}], ids=["agents", "no_ops", "empty"])
async def test_refuse_accepts_what_changes_nothing(proxy: ProxyHarness, fake: FakeEngine, fields):
    session = await open_session(proxy)
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": "Hi.", **fields}, token=session["api_key"]
    )
    assert status == 200, body
    assert "client_sampling" not in (await node_of(proxy, session, body["id"])).meta


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"temperature": 0.2}, "temperature"),
        ({"max_output_tokens": 128000}, "max_output_tokens"),
        ({"top_p": 0.5}, "top_p"),
    ],
)
async def test_refuse_names_a_field_that_changes_sampling(proxy: ProxyHarness, fields, param):
    session = await open_session(proxy)
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": "Hi.", **fields}, token=session["api_key"]
    )
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["code"] == "parameter_pinned_by_session"
    assert "client_sampling: ignore" in body["error"]["message"]
    assert await store_snapshot(proxy.app[keys.STORE]) == before


async def test_ignore_uses_the_session_values_and_records_the_client(proxy: ProxyHarness, fake: FakeEngine):
    session = await open_session(proxy, client_sampling="ignore", generation={"max_new_tokens": 48, "temperature": 0.7})
    asked = {"temperature": 0.2, "max_output_tokens": 128000, "reasoning": {"effort": "high", "summary": "auto"}}
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": "Hi.", "stream": True, **asked}, token=session["api_key"]
    )
    assert status == 200, body
    sent = fake.completions[-1]
    assert sent["temperature"] == 0.7 and sent["max_tokens"] == 48  # the session's, not the client's
    response_id = sse_events(body)[-1]["response"]["id"]
    assert (await node_of(proxy, session, response_id)).meta["client_sampling"] == asked
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("client_sampling_ignored_total", api="responses", field="temperature") == 1
    # Chat Completions, the same session
    status, body = await proxy.request(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 5, "seed": 7},
        token=session["api_key"],
    )
    assert status == 200, body
    assert fake.completions[-1]["max_tokens"] == 48
    assert (await node_of(proxy, session, body["id"])).meta["client_sampling"] == {"max_tokens": 5, "seed": 7}
    status, record = await proxy.request("GET", f"/v1/sessions/{session['session_id']}")
    assert record["client_sampling"] == "ignore"


async def test_chat_left_out_tools_and_an_unknown_tool_type(proxy: ProxyHarness, fake: FakeEngine):
    session = await open_session(proxy)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    freeform = {"type": "custom", "custom": {"name": "apply_patch", "description": "a patch"}}
    status, body = await proxy.request(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "Hi."}], "tools": [weather, freeform]},
        token=session["api_key"],
    )
    assert status == 200, body
    assert "get_weather" in prompt_text(fake) and "apply_patch" not in prompt_text(fake)
    node = await node_of(proxy, session, body["id"])
    assert node.meta["tools_left_out"] == [{"type": "custom", "name": "apply_patch"}]
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await proxy.request(
        "POST",
        "/v1/responses",
        json={"model": "m", "input": "Hi.", "tools": [{"type": "teleport"}]},
        token=session["api_key"],
    )
    assert status == 400 and body["error"]["param"] == "tools[0]", body
    assert "unsupported tool type 'teleport'" in body["error"]["message"]
    clash = {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "get_weather"}]}
    status, body = await proxy.request(
        "POST",
        "/v1/responses",
        json={"model": "m", "input": "Hi.", "tools": [{"type": "function", "name": "get_weather"}, clash]},
        token=session["api_key"],
    )
    assert status == 400 and body["error"]["param"] == "tools[1].tools[0].name", body
    assert await store_snapshot(proxy.app[keys.STORE]) == before


async def test_developer_prompt_through_an_engine_that_would_drop_it(tokenizer_dir: Path):
    """Rendering through the engine's /tokenize (``rendering: engine``) with an engine that hands developer
    messages to a template without a developer branch: they were dropped without a word."""
    fake = FakeEngine(
        tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], max_model_len=32768, developer_role="as_is"
    )
    async with (
        FakeEngineServer(fake) as url,
        ProxyHarness.running(engine_urls=[url], fake=fake, rendering="engine") as proxy,
    ):
        session = await open_session(proxy)
        fake.queue("Done.")
        body = codex_body("responses-turn1.json")
        status, _ = await respond(proxy, session, body)
        assert status == 200
        prompt = prompt_text(fake)
        assert body["input"][0]["content"][0]["text"][:300] in prompt
        assert "<skills_instructions>" in prompt
