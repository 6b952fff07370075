"""The fake engine's dev-mode routes answer like the real vLLM recorded in tests/fixtures/vllm-dev-0.32.

Each test replays a recorded scenario against the fake (same requests, same order) and holds
its answers to the recording: the same status, the same JSON structure, and the same body
where vLLM's is deterministic (everything but completions and their ids). Streamed
completions, prompt_logprobs and /sleep are recorded but not replayed: the proxy never
streams from an engine, scores prompts or sleeps one, and the fake serves none of them.

The first test checks the recording itself, so a re-recording that lost a behaviour (a
reload that changed nothing, a pause that did not cut) fails here, not silently in the fake.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-dev-0.32"
#: Scripted reply for in-flight requests: long enough to be cut, no EOS (id 2) in it.
LONG_REPLY = list(range(1000, 1064))


def load(scenario: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{scenario}.json").read_text())


def recorded(scenario: dict[str, Any], label: str) -> dict[str, Any]:
    return next(step for step in scenario["steps"] if step["label"] == label)


def answer_of(step: dict[str, Any]) -> tuple[int, Any]:
    response = step["response"]
    return response["status"], json.loads(response["text"]) if response["text"] else None


def shape(value: Any, key: str = "") -> Any:
    """The structure of a JSON value: keys, nesting and value types (token-keyed maps by value type)."""
    if isinstance(value, dict):
        if key == "top_logprobs_entry":
            return {"<token>": sorted({shape(v) for v in value.values()})}
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        item_key = "top_logprobs_entry" if key == "top_logprobs" else key
        shapes = [shape(item, item_key) for item in value]
        return [shapes[0]] if shapes and all(s == shapes[0] for s in shapes) else shapes
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def completion_shape(body: dict[str, Any]) -> Any:
    """A completion's shape with its token lists reduced to one item (a cut may leave them empty)."""
    body = json.loads(json.dumps(body))
    for c in body["choices"]:
        for k in ("token_ids",):
            c[k] = c[k][:1]
        if c.get("logprobs"):
            c["logprobs"] = {k: v[:1] for k, v in c["logprobs"].items()}
    return shape(body)


@dataclass
class Fake:
    engine: FakeEngine
    url: str
    http: aiohttp.ClientSession

    async def replay(self, step: dict[str, Any]) -> tuple[int, Any]:
        """Send a recorded request to the fake, exactly (raw bodies raw)."""
        request = step["request"]
        kwargs: dict[str, Any] = {}
        if "raw_body" in request:
            kwargs = {"data": request["raw_body"].encode(), "headers": {"Content-Type": "application/json"}}
        elif "body" in request:
            kwargs = {"json": request["body"]}
        async with self.http.request(request["method"], self.url + request["path"], **kwargs) as answer:
            text = await answer.text()
            return answer.status, json.loads(text) if text else None

    async def same_as(self, step: dict[str, Any]) -> Any:
        """Replay a dev-route step: vLLM's status and body; for an error, all but the message's text."""
        status, body = await self.replay(step)
        real_status, real = answer_of(step)
        assert status == real_status, (step["label"], body)
        if status < 400:
            assert body == real, step["label"]
        else:
            assert shape(body) == shape(real), (step["label"], body)
            assert {**body["error"], "message": ""} == {**real["error"], "message": ""}, step["label"]
        return body

    async def completion_like(self, step: dict[str, Any], answer: tuple[int, Any]) -> dict[str, Any]:
        """A fake completion answer with the recorded status and structure; returns its choice."""
        status, body = answer
        real_status, real = answer_of(step)
        assert status == real_status, (step["label"], body)
        assert completion_shape(body) == completion_shape(real), step["label"]
        return body["choices"][0]


@pytest.fixture
async def fake(tokenizer_dir: Path) -> AsyncIterator[Fake]:
    engine = FakeEngine(tokenizer_dir, model_name="smollm2")
    async with FakeEngineServer(engine) as url, aiohttp.ClientSession() as http:
        yield Fake(engine, url, http)


async def until(predicate: Callable[[], bool], what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def sampled_so_far(engine: FakeEngine) -> int:
    return len(engine.generations[-1].tokens) if engine.generations else 0


def test_the_recording_shows_each_behaviour() -> None:
    """What vLLM did when recorded; the fake is held to these files."""

    def choice(scenario: dict[str, Any], label: str) -> dict[str, Any]:
        return answer_of(recorded(scenario, label))[1]["choices"][0]

    abort = load("pause_abort")
    cut = choice(abort, "inflight_plain")
    assert cut["finish_reason"] == "abort" and 0 < len(cut["token_ids"]) < 256
    events = [json.loads(e["data"]) for e in recorded(abort, "inflight_stream")["response"]["events"][:-1]]
    assert events[-2]["choices"][0]["finish_reason"] == "abort" and events[-1]["choices"] == []  # then usage
    pause_at = recorded(abort, "pause_abort")["t_sent"]
    assert recorded(abort, "sent_while_paused")["t_done"] > recorded(abort, "resume")["t_sent"] > pause_at

    wait = load("pause_wait")
    assert recorded(wait, "inflight_plain")["t_done"] <= recorded(wait, "pause_wait")["t_done"]
    assert choice(wait, "inflight_plain")["finish_reason"] == "length"

    keep = load("pause_keep")
    assert choice(keep, "inflight_plain")["token_ids"] == choice(keep, "reference")["token_ids"]
    paused, resumed = recorded(keep, "pause_keep")["t_done"], recorded(keep, "resume")["t_sent"]
    assert resumed - paused > 2.0
    stream = recorded(keep, "inflight_stream")["response"]["events"]
    assert not [e for e in stream if paused + 0.5 < e["t"] < resumed]  # frozen (a chunk may arrive with the answer)
    assert [e for e in stream if e["t"] > resumed]  # and then went on

    reload = load("reload_weights")
    assert answer_of(recorded(reload, "weight_info_after_reload"))[1] == {"weight_version": "1"}
    sequence = recorded(reload, "score_before")["request"]["body"]["prompt"]
    start = len(sequence) - len(choice(reload, "greedy_before")["token_ids"])

    def scored(label: str) -> list[float]:
        lp = choice(reload, label)["prompt_logprobs"]
        return [lp[i][str(sequence[i])]["logprob"] for i in range(start, len(sequence))]

    before, after, restored = scored("score_before"), scored("score_after"), scored("score_restored")
    assert sum(abs(a - b) for a, b in zip(before, after, strict=True)) / len(before) > 0.05
    assert max(abs(a - b) for a, b in zip(before, restored, strict=True)) < 1e-4
    assert reload["notes"]["prefix_cache_hit_tokens_unsalted"] > 0 == reload["notes"]["prefix_cache_hit_tokens_salted"]


@pytest.mark.parametrize("scenario", ["weight_version", "pause_errors"])
async def test_sequential_dev_routes_answer_exactly(fake: Fake, scenario: str) -> None:
    for step in load(scenario)["steps"]:
        await fake.same_as(step)


async def test_pause_abort_cuts_inflight_and_queues_new_requests(fake: Fake) -> None:
    rec = load("pause_abort")
    fake.engine.delay = 3.0
    fake.engine.queue(LONG_REPLY)
    inflight = asyncio.create_task(fake.replay(recorded(rec, "inflight_plain")))
    await until(lambda: sampled_so_far(fake.engine) >= 2, "two sampled tokens")
    await fake.same_as(recorded(rec, "pause_abort"))
    cut = await fake.completion_like(recorded(rec, "inflight_plain"), await asyncio.wait_for(inflight, 5))
    assert cut["finish_reason"] == "abort"
    assert 2 <= len(cut["token_ids"]) < len(LONG_REPLY)
    assert cut["token_ids"] == LONG_REPLY[: len(cut["token_ids"])]
    assert len(cut["logprobs"]["token_logprobs"]) == len(cut["token_ids"])
    await fake.same_as(recorded(rec, "is_paused_true"))

    fake.engine.delay = 0.0
    waiting = asyncio.create_task(fake.replay(recorded(rec, "sent_while_paused")))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await fake.same_as(recorded(rec, "resume"))
    queued = await fake.completion_like(recorded(rec, "sent_while_paused"), await asyncio.wait_for(waiting, 5))
    assert queued["finish_reason"] == "length"  # the default policy's reply is longer than 4 tokens
    await fake.same_as(recorded(rec, "is_paused_false"))


async def test_pause_wait_answers_after_inflight_finished(fake: Fake) -> None:
    rec = load("pause_wait")
    fake.engine.delay = 1.0
    fake.engine.queue(LONG_REPLY)
    inflight = asyncio.create_task(fake.replay(recorded(rec, "inflight_plain")))
    await until(lambda: sampled_so_far(fake.engine) >= 1, "a sampled token")
    await fake.same_as(recorded(rec, "pause_wait"))
    assert fake.engine.generations[-1].finish_reason == "length"  # finished before the pause answered
    done = await fake.completion_like(recorded(rec, "inflight_plain"), await asyncio.wait_for(inflight, 5))
    assert done["finish_reason"] == "length" and len(done["token_ids"]) == 16
    await fake.same_as(recorded(rec, "is_paused_true"))
    fake.engine.delay = 0.0
    waiting = asyncio.create_task(fake.replay(recorded(rec, "sent_while_paused")))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await fake.same_as(recorded(rec, "resume"))
    await fake.completion_like(recorded(rec, "sent_while_paused"), await asyncio.wait_for(waiting, 5))


async def test_pause_keep_freezes_inflight_until_resume(fake: Fake) -> None:
    rec = load("pause_keep")
    fake.engine.delay = 2.0
    fake.engine.queue(LONG_REPLY)
    inflight = asyncio.create_task(fake.replay(recorded(rec, "inflight_plain")))
    await until(lambda: sampled_so_far(fake.engine) >= 2, "two sampled tokens")
    await fake.same_as(recorded(rec, "pause_keep"))
    frozen_at = sampled_so_far(fake.engine)
    await fake.same_as(recorded(rec, "is_paused_true"))
    waiting = asyncio.create_task(fake.replay(recorded(rec, "sent_while_paused")))
    await asyncio.sleep(0.5)
    assert sampled_so_far(fake.engine) == frozen_at and not inflight.done() and not waiting.done()
    await fake.same_as(recorded(rec, "resume"))
    kept = await fake.completion_like(recorded(rec, "inflight_plain"), await asyncio.wait_for(inflight, 10))
    assert kept["finish_reason"] == "length" and kept["token_ids"] == LONG_REPLY[:24]
    await fake.completion_like(recorded(rec, "sent_while_paused"), await asyncio.wait_for(waiting, 10))


async def test_abort_requests_ends_inflight_without_pausing(fake: Fake) -> None:
    rec = load("abort_requests")
    fake.engine.delay = 3.0
    fake.engine.queue(LONG_REPLY)
    inflight = asyncio.create_task(fake.replay(recorded(rec, "inflight_plain")))
    await until(lambda: sampled_so_far(fake.engine) >= 2, "two sampled tokens")
    await fake.same_as(recorded(rec, "abort_requests_all"))
    cut = await fake.completion_like(recorded(rec, "inflight_plain"), await asyncio.wait_for(inflight, 5))
    assert cut["finish_reason"] == "abort" and len(cut["token_ids"]) >= 2
    for label in ("is_paused_false", "abort_requests_unknown_id", "abort_requests_not_an_object"):
        await fake.same_as(recorded(rec, label))


async def test_cache_salt_is_checked_like_vllm(fake: Fake) -> None:
    rec = load("cache_salt")
    await fake.completion_like(recorded(rec, "salted"), await fake.replay(recorded(rec, "salted")))
    await fake.same_as(recorded(rec, "bad_salt"))


async def test_collective_rpc_and_weight_version_around_a_reload(fake: Fake) -> None:
    """The fake's reload is a no-op (its weights are its version); the answers are vLLM's."""
    weight = load("weight_version")
    for label in ("update_weight_version", "weight_info_updated"):  # the state the reload was recorded in
        await fake.same_as(recorded(weight, label))
    rec = load("reload_weights")
    for label in (
        "collective_rpc_no_method",
        "reload_perturbed",
        "weight_info_after_reload",  # a reload does not change the version
        "update_weight_version",
        "weight_info_updated",
        "reload_dense",
    ):
        await fake.same_as(recorded(rec, label))
