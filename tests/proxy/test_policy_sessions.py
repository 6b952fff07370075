"""Sessions on LoRA policies over HTTP: a session names its policy, every turn samples with it, and every sampled
token records which policy and which version sampled it.

The fake engine's logprobs are salted with the adapter that sampled each token (``devtools.fake_lora``), so each
check below says which adapter's weights produced a token, not only which name the proxy sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer, fake_logprob
from devtools.fake_lora import adapter_key
from devtools.lora_adapter import build_adapter
from rollout_proxy.runner.admin import AdminClient
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ADMIN_KEY, ProxyHarness, Session

QUESTION = [{"role": "user", "content": "What is two plus two?"}]

#: (policy, version) -> the adapter key that samples it (None: the base model)
Keys = dict[tuple[str, int], str | None]


@pytest.fixture(scope="module")
def adapter_dirs(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: build_adapter(tokenizer_dir, root / name, targets=("q_proj", "v_proj"), seed=seed)
        for seed, name in enumerate(("a1", "a2", "b1"), start=1)
    }


@pytest.fixture
async def served(tokenizer_dir: Path) -> AsyncIterator[tuple[ProxyHarness, FakeFleet]]:
    async with (
        fake_fleet(tokenizer_dir, 2, max_lora_rank=16) as fakes,
        ProxyHarness.running(engine_urls=fakes.urls) as harness,
    ):
        yield harness, fakes


async def register(harness: ProxyHarness, name: str, path: Path | None = None) -> None:
    body: dict[str, Any] = {"name": name, **({"path": str(path)} if path is not None else {})}
    status, answer = await harness.request("POST", "/v1/admin/policies", json=body)
    assert status == 200, answer


async def publish(harness: ProxyHarness, name: str, path: Path) -> int:
    status, answer = await harness.request("POST", f"/v1/admin/policies/{name}/versions", json={"path": str(path)})
    assert status == 200 and answer["failed"] == 0, answer
    return int(answer["version"])


def sent(fakes: FakeFleet) -> list[int]:
    return [len(fake.completions) for fake in fakes.engines]


def models_since(fakes: FakeFleet, before: list[int]) -> list[str]:
    """The served names the calls after ``before`` (``sent``) named, over every engine."""
    return [c["model"] for fake, n in zip(fakes.engines, before, strict=True) for c in fake.completions[n:]]


def owners(trajectory: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """Token index -> the (policy, version) its span says sampled it (a span without ``policy``: the base)."""
    found: dict[int, tuple[str, int]] = {}
    for span in trajectory["policy_versions"]:
        for index in range(span["start"], span["end"]):
            found[index] = (span.get("policy", "base"), span["version"])
    return found


def sampled_by(position: int, token: int, logprob: float, key: str | None) -> bool:
    return bool(np.float32(logprob) == np.float32(fake_logprob(position, token, "default", key)))


def misattributed(trajectory: dict[str, Any], keys: Keys) -> tuple[int, int]:
    """(tokens whose recorded policy and version is not the adapter that sampled them, trained tokens): the
    fake's logprob of each token is that adapter's, at that position (the engine's prompt is everything before)."""
    ids, weights, logprobs = (
        trajectory[name] for name in ("total_token_ids", "total_loss_weight", "total_token_logprobs")
    )
    owner = owners(trajectory)
    trained = [index for index, weight in enumerate(weights) if weight > 0]
    assert trained and set(trained) <= set(owner), "every trained token is in a span"
    wrong = sum(not sampled_by(i, ids[i], logprobs[i], keys[owner[i]]) for i in trained)
    return wrong, len(trained)


async def chat_turns(session: Session, turns: int, *, stream: bool = False) -> list[str]:
    """``turns`` chat turns in one conversation; the response ids."""
    messages: list[dict[str, Any]] = list(QUESTION)
    ids = []
    for turn in range(turns):
        if stream:
            chunks = await session.client.chat.completions.create(model="m", messages=messages, stream=True)
            text, response_id = "", None
            async for chunk in chunks:
                response_id = chunk.id
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
        else:
            answer = await session.client.chat.completions.create(model="m", messages=messages)
            text, response_id = answer.choices[0].message.content or "", answer.id
        assert response_id is not None
        ids.append(response_id)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({turn})"}]
    return ids


async def test_a_session_samples_every_turn_with_its_policy_and_records_it(served, adapter_dirs):
    harness, fakes = served
    await register(harness, "pol", adapter_dirs["a1"])
    lora = await harness.create_session(QUESTION, policy="pol")
    base = await harness.create_session(QUESTION)
    before = sent(fakes)
    lora_ids = await chat_turns(lora, 2) + await chat_turns(lora, 1, stream=True)
    assert models_since(fakes, before) == ["pol@v1"] * 3
    before = sent(fakes)
    base_ids = await chat_turns(base, 2, stream=True)
    assert models_since(fakes, before) == ["base@zero"] * 2  # the base through the zero adapter

    keys: Keys = {("pol", 1): adapter_key(str(adapter_dirs["a1"])), ("base", 0): None}
    lora_path = await harness.trajectory(lora_ids[-1])
    assert {(span.get("policy"), span["version"]) for span in lora_path["policy_versions"]} == {("pol", 1)}
    assert misattributed(lora_path, keys)[0] == 0
    base_path = await harness.trajectory(base_ids[-1])
    assert all(set(span) == {"version", "start", "end"} for span in base_path["policy_versions"])  # as before
    assert misattributed(base_path, keys)[0] == 0
    # the check can fail: the LoRA session's tokens are not the base's
    wrong, trained = misattributed(lora_path, {("pol", 1): None})
    assert wrong == trained

    status, record = await harness.request("GET", f"/v1/sessions/{lora.session_id}")
    assert status == 200 and record["policy"] == "pol"
    status, record = await harness.request("GET", f"/v1/sessions/{base.session_id}")
    assert status == 200 and "policy" not in record  # a base session's record is as before policies

    status, finished = await harness.request(
        "POST", f"/v1/sessions/{lora.session_id}/finish", json={"status": "success", "extra": {}}
    )
    assert status == 200, finished
    [trajectory] = finished["trajectories"]
    assert {span["policy"] for span in trajectory["policy_versions"]} == {"pol"}

    status, metrics = await harness.request("GET", "/metrics", token=None)
    assert 'rollout_proxy_policy_turns_total{policy="pol"} 3.0' in metrics
    assert 'rollout_proxy_policy_turns_total{policy="base"} 2.0' in metrics
    first_conversation = await harness.trajectory(lora_ids[1])  # two turns; the streamed one began another
    generated = sum(weight > 0 for path in (first_conversation, lora_path) for weight in path["total_loss_weight"])
    assert f'rollout_proxy_policy_generated_tokens_total{{policy="pol"}} {float(generated)}' in metrics


async def test_the_responses_and_messages_apis_sample_with_the_sessions_policy(served, adapter_dirs):
    harness, fakes = served
    await register(harness, "pol", adapter_dirs["b1"])
    session = await harness.create_session(QUESTION, policy="pol")
    before = sent(fakes)
    response = await session.client.responses.create(model="m", input="What is two plus two?")
    status, answer = await harness.request(
        "POST",
        "/v1/messages",
        json={"model": "m", "max_tokens": 256, "messages": QUESTION},
        token=session.api_key,
    )
    assert status == 200, answer
    assert models_since(fakes, before) == ["pol@v1", "pol@v1"]
    keys: Keys = {("pol", 1): adapter_key(str(adapter_dirs["b1"]))}
    for response_id in (response.id, answer["id"]):
        assert misattributed(await harness.trajectory(response_id), keys)[0] == 0


async def test_a_policy_no_registry_knows_is_refused_at_creation_in_words(served, adapter_dirs):
    harness, _ = served
    await register(harness, "pol", adapter_dirs["a1"])
    _, listed = await harness.request("GET", "/v1/admin/sessions")
    for policy in ("nope", "Base", ""):
        status, body = await harness.request(
            "POST", "/v1/sessions", json={"sample": {"messages": QUESTION}, "policy": policy}
        )
        assert status == 400 and body["error"]["param"] == "policy", body
        if policy:
            assert "its policies: base, pol" in body["error"]["message"]
    status, body = await harness.request(
        "POST", "/v1/sessions", json={"sample": {"messages": QUESTION}, "policy": ["pol"]}
    )
    assert status == 400 and body["error"]["param"] == "policy"
    _, after = await harness.request("GET", "/v1/admin/sessions")
    assert after == listed  # nothing stored


async def test_a_policy_no_engine_serves_now_is_a_503_in_words(served, adapter_dirs):
    harness, fakes = served
    await register(harness, "empty")  # registered, no version published yet
    status, body = await harness.request(
        "POST", "/v1/sessions", json={"sample": {"messages": QUESTION}, "policy": "empty"}
    )
    assert status == 503 and body["error"]["code"] == "policy_unavailable", body
    assert "has no version yet" in body["error"]["message"]
    await register(harness, "pol", adapter_dirs["a1"])
    session = await harness.create_session(QUESTION, policy="pol")
    for server in fakes.servers:  # every engine down: the turn is a 503, in words
        await server.kill()
    with pytest.raises(openai.APIStatusError) as raised:
        await session.client.chat.completions.create(model="m", messages=QUESTION)
    assert raised.value.status_code == 503


async def test_a_turn_fails_over_to_an_engine_that_serves_its_policy(served, adapter_dirs):
    harness, fakes = served
    await register(harness, "pol", adapter_dirs["a1"])
    session = await harness.create_session(QUESTION, policy="pol")
    await chat_turns(session, 1)
    engine = next(fake for fake in fakes.engines if fake.completions)
    killed = fakes.servers[fakes.engines.index(engine)]
    await killed.kill()
    before = sent(fakes)
    ids = await chat_turns(session, 2)
    assert models_since(fakes, before) == ["pol@v1", "pol@v1"]
    other = next(fake for fake in fakes.engines if fake is not engine)
    assert [c["model"] for c in other.completions[-2:]] == ["pol@v1", "pol@v1"]
    keys: Keys = {("pol", 1): adapter_key(str(adapter_dirs["a1"]))}
    assert misattributed(await harness.trajectory(ids[-1]), keys)[0] == 0


async def test_no_token_is_misattributed_across_an_adapter_update_under_load(served, adapter_dirs):
    """Sessions on two LoRA policies and the base run at once while one policy publishes v2: every sampled
    token's (policy, version) is the adapter the engine actually used (0 misattributed), and v2 took over."""
    harness, fakes = served
    for fake in fakes.engines:
        fake.delay = 0.05  # calls in flight while the update happens
    await register(harness, "a", adapter_dirs["a1"])
    await register(harness, "b", adapter_dirs["b1"])
    keys: Keys = {
        ("a", 1): adapter_key(str(adapter_dirs["a1"])),
        ("a", 2): adapter_key(str(adapter_dirs["a2"])),
        ("b", 1): adapter_key(str(adapter_dirs["b1"])),
        ("base", 0): None,
    }
    policies = ["a", "b", "base"] * 4
    sessions = [await harness.create_session(QUESTION, policy=policy) for policy in policies]
    running = [
        asyncio.ensure_future(chat_turns(session, 4, stream=index % 2 == 1)) for index, session in enumerate(sessions)
    ]
    await asyncio.sleep(0.12)  # the first turns are in flight
    assert not any(task.done() for task in running)
    assert await publish(harness, "a", adapter_dirs["a2"]) == 2
    leaves = [ids[-1] for ids in await asyncio.gather(*running)]

    seen: dict[str, set[tuple[str, int]]] = {policy: set() for policy in ("a", "b", "base")}
    wrong = total = 0
    for policy, leaf in zip(policies, leaves, strict=True):
        trajectory = await harness.trajectory(leaf)
        spans = {owner for owner in owners(trajectory).values()}
        assert {name for name, _ in spans} == {policy}  # never another job's adapter
        seen[policy] |= spans
        bad, trained = misattributed(trajectory, keys)
        wrong, total = wrong + bad, total + trained
    assert wrong == 0 and total > 0
    assert seen == {"a": {("a", 1), ("a", 2)}, "b": {("b", 1)}, "base": {("base", 0)}}


async def test_the_teacher_pass_of_a_lora_session_scores_with_the_teachers_model(tokenizer_dir, adapter_dirs):
    """On-policy distillation of a LoRA session: the teacher is asked by its own model's name (no adapter), and
    its logprobs are the base weights' while the student's sampling logprobs are the adapter's."""
    teacher = FakeEngine(tokenizer_dir, model_name="fake-teacher")
    async with (
        FakeEngineServer(teacher) as teacher_url,
        fake_fleet(tokenizer_dir, 1, max_lora_rank=16) as fakes,
        ProxyHarness.running(engine_urls=fakes.urls, teachers=f"math={teacher_url}") as harness,
    ):
        await register(harness, "pol", adapter_dirs["a1"])
        session = await harness.create_session(QUESTION, policy="pol")
        [leaf] = await chat_turns(session, 1)
        status, body = await harness.request(
            "POST",
            f"/v1/admin/sessions/{session.session_id}/teacher_pass",
            json={"response_id": leaf, "teacher": "math"},
        )
        assert status == 200, body
        assert teacher.completions[-1]["model"] == "fake-teacher"
        trajectory = await harness.trajectory(leaf)
        keys: Keys = {("pol", 1): adapter_key(str(adapter_dirs["a1"]))}
        assert misattributed(trajectory, keys)[0] == 0  # sampled by the adapter
        ids, scored = trajectory["total_token_ids"], body["total_teacher_logprobs"]
        trained = [i for i, value in enumerate(scored) if value is not None]
        assert trained and all(sampled_by(i, ids[i], scored[i], None) for i in trained)  # the teacher's own weights


async def test_the_runners_admin_client_reads_a_lora_policys_version(served, adapter_dirs):
    """What ``max_staleness`` reads for a job on a LoRA policy: its adapter's version, not the fleet's."""
    harness, _ = served
    await register(harness, "a", adapter_dirs["a1"])
    async with AdminClient(harness.url, ADMIN_KEY) as admin:
        assert (await admin.policy_version("a"), await admin.policy_version()) == (1, 0)
        await publish(harness, "a", adapter_dirs["a2"])
        assert (await admin.policy_version("a"), await admin.policy_version()) == (2, 0)
