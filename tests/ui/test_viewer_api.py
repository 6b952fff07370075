"""The viewer's admin read API over HTTP (both stores): what the page shows comes from here.

A proxy over the fake engine (Qwen3-style template: tool calls) serving a JSONL trainer
feed; sessions are recorded through the openai client (``recording.record``). Then the
parts outside the store are taken away: a dead engine (no text pieces, everything else
still shown) and a dead feed (no grades; a reward filter is a 503, not a wrong answer).
"""

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer, FakeMoE
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.state.redis_feed import RedisStreamFeed
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.scenarios.test_outages import RedisServer
from tests.ui.recording import ADVANTAGE, ANSWER, REWARD, open_session, record


@pytest.fixture
async def engine(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    async with FakeEngineServer(fake) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
def feed_path(tmp_path: Path) -> Path:
    return tmp_path / "feed.jsonl"


@pytest.fixture
async def viewer(engine: FakeEngine, store, feed_path: Path) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(
        engine_urls=[engine.url], store=store, fake=engine, feed=f"jsonl:{feed_path}"
    ) as harness:
        yield harness


@dataclass
class Fetched:
    status: int
    headers: Mapping[str, str]
    text: str


async def fetch(http: aiohttp.ClientSession, url: str) -> Fetched:
    async with http.get(url) as answer:
        return Fetched(answer.status, answer.headers, await answer.text())


async def get(harness: ProxyHarness, path: str, **query: str) -> dict:
    suffix = "?" + "&".join(f"{name}={value}" for name, value in query.items()) if query else ""
    status, body = await harness.request("GET", path + suffix)
    assert status == 200, body
    return body


async def listed(harness: ProxyHarness, **query: str) -> list[str]:
    return [item["session_id"] for item in (await get(harness, "/v1/admin/sessions", **query))["data"]]


async def test_sessions_are_listed_newest_first_and_filtered_as_the_page_asks(viewer, feed_path):
    feed = JsonlFeed(feed_path)
    graded = await record(viewer, feed=feed, job="job-a", step=2)
    ungraded = await record(viewer, job="job-b", step=0)
    still_open, _ = await open_session(viewer, job="job-b")

    page = await get(viewer, "/v1/admin/sessions")
    assert [item["session_id"] for item in page["data"]] == [still_open, ungraded.session_id, graded.session_id]
    assert page["next"] is None and page["feed"] is True and page["grades_error"] is None
    newest, middle, oldest = page["data"]
    assert (newest["status"], newest["job_id"], newest["turns"], newest["rewards"]) == ("open", "job-b", 0, [])
    assert (oldest["status"], oldest["result_status"], oldest["job_id"], oldest["step"]) == (
        "finished",
        "success",
        "job-a",
        2,
    )
    # three turns and the forked one are generated; the appended message is injected
    assert (oldest["turns"], oldest["injected"], oldest["forks"]) == (4, 1, 1)
    assert oldest["finish_reasons"] == ["stop"] and oldest["responses"] == [graded.turns[2]]
    assert oldest["rewards"] == [REWARD] and middle["rewards"] == []

    assert await listed(viewer, job="job-b") == [still_open, ungraded.session_id]
    assert await listed(viewer, status="finished") == [ungraded.session_id, graded.session_id]
    assert await listed(viewer, forks="true") == [ungraded.session_id, graded.session_id]
    assert await listed(viewer, forks="false") == [still_open]
    assert await listed(viewer, finish_reason="stop", job="job-a") == [graded.session_id]
    assert await listed(viewer, finish_reason="length") == []
    assert await listed(viewer, graded="true") == [graded.session_id]
    assert await listed(viewer, min_reward="0.5", max_reward="1") == [graded.session_id]
    assert await listed(viewer, min_reward="0.8") == []
    assert await listed(viewer, drift="true") == []
    assert await listed(viewer, policy_version="7") == []

    one, cursor, pages = [], None, 0
    while True:
        body = await get(viewer, "/v1/admin/sessions", limit="1", **({"cursor": cursor} if cursor else {}))
        one += [item["session_id"] for item in body["data"]]
        cursor, pages = body["next"], pages + 1
        if cursor is None:
            break
    assert one == [still_open, ungraded.session_id, graded.session_id] and pages <= 4


async def test_a_sessions_tree_has_every_node_its_fork_and_its_injected_messages(viewer, feed_path):
    recorded = await record(viewer, feed=JsonlFeed(feed_path))
    body = await get(viewer, f"/v1/admin/sessions/{recorded.session_id}")
    nodes = {node["id"]: node for node in body["nodes"]}
    first, second, third = recorded.turns
    assert set(nodes) == {*recorded.turns, recorded.forked, recorded.injected}
    assert [nodes[rid]["parent_id"] for rid in recorded.turns] == [None, first, second]
    assert nodes[first]["finish_reason"] == nodes[second]["finish_reason"] == "tool_calls"
    assert nodes[third]["messages"][-1] == {"role": "assistant", "content": ANSWER}
    # the fork: provenance, and the rewritten messages it added
    fork = nodes[recorded.forked]
    assert fork["parent_id"] is None and fork["fork"] == {"diverged_from": first, "at_message": 1}
    assert fork["messages"][1] == {"role": "assistant", "content": "Probably sunny."}
    injected = nodes[recorded.injected]
    assert injected["kind"] == "injected" and injected["parent_id"] == recorded.forked
    assert injected["messages"] == [{"role": "user", "content": "Thanks!"}] and injected["output_tokens"] == 0
    assert all(node["prompt_tokens"] > 0 for node in body["nodes"])
    # the second turn's inputs are the first's tool result; its output the second call
    assert [message["role"] for message in nodes[second]["messages"]] == ["tool", "assistant"]
    assert nodes[second]["n_input_messages"] == 1
    assert body["grades"] == {
        third: {
            "group_id": "job-weather/step-0/sample-0",
            "job_id": "job-weather",
            "step": 0,
            "index": 0,
            "reward": REWARD,
            "advantage": ADVANTAGE,
            "advantage_kind": "seq",
        }
    }
    assert body["session"]["status"] == "finished" and "engine" not in body["session"]
    assert body["summary"]["nodes"] == 5
    # the branches: how each node relates to the tree, and which sequence trains it
    assert nodes[first]["branch"]["kind"] == "new_conversation"
    assert nodes[second]["branch"] == {"kind": "continuation", "label": None, "from": first, "at_message": None}
    assert nodes[recorded.forked]["branch"] == {"kind": "rewrite", "label": None, "from": first, "at_message": 1}
    sequences = body["sequences"]
    assert [sequence["leaf"] for sequence in sequences] == [recorded.forked, third]  # the latest leaf first
    assert sequences[0]["main"] and sequences[0]["trained"] == [recorded.forked]
    assert sequences[1]["trained"] == [first, second, third] and sequences[1]["branch"]["kind"] == "new_conversation"
    sampled = sum(nodes[rid]["output_tokens"] for rid in nodes)
    assert body["tokens"] == {"sampled": sampled, "trained": sampled, "dropped": 0}


async def test_a_trajectorys_tokens_are_the_trainers_with_pieces_nodes_and_grade(viewer, feed_path, engine):
    recorded = await record(viewer, feed=JsonlFeed(feed_path))
    third = recorded.turns[2]
    body = await get(viewer, f"/v1/admin/responses/{third}/tokens")
    trajectory = body["trajectory"]
    for name in ("total_token_ids", "total_loss_weight", "total_token_logprobs", "messages", "forks"):
        assert trajectory[name] == recorded.trajectory[name], name
    ids = trajectory["total_token_ids"]
    # each piece is its token decoded alone, by the engine's tokenizer
    assert body["pieces_error"] is None
    assert body["pieces"] == [engine.decode([token]) for token in ids]
    assert "".join(body["pieces"]) == engine.decode(ids)
    # segments: contiguous, covering every token; sampled output is exactly where the weight is 1
    segments = body["segments"]
    assert segments[0]["start"] == 0 and segments[-1]["end"] == len(ids)
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(segments))
    sampled = {i for s in segments if s["part"] == "output" for i in range(s["start"], s["end"])}
    assert sampled == {i for i, weight in enumerate(trajectory["total_loss_weight"]) if weight == 1.0}
    assert [s["node_id"] for s in segments if s["part"] == "output"] == recorded.turns
    # every message says which node it came from: the sample and turn 1 from the first node
    assert len(body["message_nodes"]) == len(trajectory["messages"])
    assert body["message_nodes"][0] == recorded.turns[0] and body["message_nodes"][-1] == third
    assert body["grade"]["reward"] == REWARD and body["grade"]["advantage"] == ADVANTAGE
    assert body["token_advantages"] is None and body["grades_error"] is None
    # the policy versions the engine fleet records per token (when it does) reach the listing
    versions = sorted({str(span["version"]) for span in trajectory.get("policy_versions") or []})
    tree = await get(viewer, f"/v1/admin/sessions/{recorded.session_id}")
    assert {version for node in tree["nodes"] for version in node["policy_versions"]} >= set(versions)
    for version in versions:
        assert await listed(viewer, policy_version=version) == [recorded.session_id]


async def test_routed_experts_come_with_the_tokens(engine, store, feed_path):
    engine.moe = FakeMoE(num_layers=3, top_k=2, num_experts=8)
    async with ProxyHarness.running(engine_urls=[engine.url], store=store, fake=engine) as harness:
        recorded = await record(harness)
        body = await get(harness, f"/v1/admin/responses/{recorded.turns[2]}/tokens")
    field = body["trajectory"]["routed_experts"]
    rows = np.frombuffer(base64.b64decode(field["data"]), dtype=np.int16).reshape(field["shape"])
    ids = body["trajectory"]["total_token_ids"]
    assert rows.shape == (len(ids), 3, 2) and np.array_equal(rows[:-1], engine.moe.rows(ids[:-1]))
    assert body["feed"] is False and body["grade"] is None


async def test_the_read_api_needs_the_admin_key_and_the_page_needs_none(viewer):
    recorded = await record(viewer)
    _, plugin_token = await open_session(viewer)
    paths = [
        "/v1/admin/sessions",
        f"/v1/admin/sessions/{recorded.session_id}",
        f"/v1/admin/responses/{recorded.turns[0]}/tokens",
    ]
    for path in paths:
        for token in (None, "wrong-key", plugin_token.api_key):
            status, body = await viewer.request("GET", path, token=token)
            assert status == 401 and body["error"]["type"] == "authentication_error", (path, token)
    async with aiohttp.ClientSession() as http:  # the page, as a browser fetches it: no credentials
        page, script, style, missing = [
            await fetch(http, viewer.url + path)
            for path in ("/ui", "/ui/static/viewer.js", "/ui/static/viewer.css", "/ui/static/secrets.txt")
        ]
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert recorded.session_id not in page.text and ADMIN_KEY not in page.text
    # everything it loads comes from this proxy
    assert '<script src="/ui/static/viewer.js"' in page.text and "http" not in page.text
    assert script.headers["Content-Type"].startswith("text/javascript") and "/v1/admin/sessions" in script.text
    assert style.headers["Content-Type"].startswith("text/css")
    assert missing.status == 404 and orjson.loads(missing.text)["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=201", "limit"),
        ("limit=1.5", "limit"),
        ("status=closed", "status"),
        ("forks=yes", "forks"),
        ("graded=1", "graded"),
        ("min_reward=nan", "min_reward"),
        ("max_reward=1e999", "max_reward"),
        ("job=a&job=b", "job"),
        ("colour=red", "colour"),
        ("cursor=garbage", "cursor"),
        ("job=" + "x" * 257, "job"),
    ],
)
async def test_a_query_it_cannot_honour_is_a_400_naming_the_parameter(viewer, query, param):
    status, body = await viewer.request("GET", f"/v1/admin/sessions?{query}")
    assert status == 400 and body["error"]["param"] == param, body


async def test_unknown_ids_are_404s(viewer):
    for path in (
        "/v1/admin/sessions/sess_0123456789abcdef",
        "/v1/admin/responses/resp_0123456789abcdef0123456789abcdef/tokens",
        "/v1/admin/responses/not-a-response/tokens",
    ):
        status, body = await viewer.request("GET", path)
        assert status == 404 and body["error"]["type"] == "not_found_error", path


async def test_a_dead_engine_costs_the_pieces_only(engine, store):
    server = FakeEngineServer(engine)
    url = await server.start()
    async with ProxyHarness.running(engine_urls=[url], store=store, fake=engine) as harness:
        recorded = await record(harness)
        await server.stop()
        started = time.monotonic()
        body = await get(harness, f"/v1/admin/responses/{recorded.turns[2]}/tokens")
        assert time.monotonic() - started < 10  # refused connections: no waiting on a deadline
        tree = await get(harness, f"/v1/admin/sessions/{recorded.session_id}")
        listing = await get(harness, "/v1/admin/sessions")
    ids = body["trajectory"]["total_token_ids"]
    assert ids == recorded.trajectory["total_token_ids"]
    assert body["pieces"] == [None] * len(ids) and "unreachable" in body["pieces_error"]
    assert len(tree["nodes"]) == 5 and [item["session_id"] for item in listing["data"]] == [recorded.session_id]


async def test_a_dead_feed_costs_the_grades_and_refuses_reward_filters(engine, store, redis_url):
    feed_server = RedisServer()
    feed_server.start()
    try:
        feed = await RedisStreamFeed.connect(feed_server.url)
        async with ProxyHarness.running(
            engine_urls=[engine.url], store=store, fake=engine, feed=feed_server.url
        ) as harness:
            recorded = await record(harness, feed=feed)
            assert (await get(harness, "/v1/admin/sessions"))["data"][0]["rewards"] == [REWARD]
            await feed.close()
            feed_server.kill()
            listing = await get(harness, "/v1/admin/sessions")
            assert [item["session_id"] for item in listing["data"]] == [recorded.session_id]
            assert "trainer feed" in listing["grades_error"]
            status, refused = await harness.request("GET", "/v1/admin/sessions?min_reward=0")
            assert status == 503 and "trainer feed" in refused["error"]["message"]
            tokens = await get(harness, f"/v1/admin/responses/{recorded.turns[2]}/tokens")
            assert tokens["pieces_error"] is None and tokens["grades_error"]
    finally:
        feed_server.stop()
