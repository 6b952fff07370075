"""The fleet's pause/resume and policy versions THROUGH THE PROXY, against a real vLLM in dev mode.

One dev-mode server for the module (vLLM 0.32 on CPU, ``VLLM_SERVER_DEV_MODE=1``); a plugin
chats through the proxy (official openai client, greedy), and the trainer's side drives
``/v1/admin/pause`` and ``/v1/admin/resume`` around a generation in flight, in each mode. The
last test changes the weights for real (vLLM's own reload path, ``collective_rpc
reload_weights``, a perturbed copy of the dense checkpoint) between the pause and the resume:
the logprobs of the same tokens differ under the two weights, and the trajectory's
``policy_versions`` say which tokens each weights sampled (each span's recorded logprobs are
what those weights give its tokens, scored again by vLLM with ``prompt_logprobs``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from devtools.engine_env import ensure_perturbed_checkpoint
from devtools.record_dev_mode import completion
from devtools.vllm_dev import VLLMDevClient
from devtools.vllm_server import VLLMServer
from rollout_proxy.engines.vllm_http import ENGINE_KEEPALIVE_S
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, Session
from tests.integration.conftest import VLLMServers

GENERATED = "vllm:generation_tokens_total"
ASK = [{"role": "user", "content": "Count from 1 to 200, separated by commas."}]  # a long greedy answer
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


@pytest.fixture(scope="module")
def dev_server(vllm_servers: VLLMServers) -> Iterator[VLLMServer]:
    started = time.monotonic()
    server = vllm_servers.get("dense_dev")
    yield server
    vllm_servers.stop("dense_dev")  # its weights and version are this module's: nobody inherits them
    print(f"\n[fleet real] server start + module: {time.monotonic() - started:.0f}s")


@pytest.fixture
async def engine(dev_server: VLLMServer) -> AsyncIterator[VLLMDevClient]:
    # connections kept idle no longer than vLLM keeps them (5 s), as the proxy's engine client does: a
    # reused one the server has just closed would reset the test's own call (seen after a keep pause)
    connector = aiohttp.TCPConnector(keepalive_timeout=ENGINE_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector) as http:
        yield VLLMDevClient(dev_server.base_url, http, timeout=300)


@pytest.fixture
async def proxy(dev_server: VLLMServer, engine: VLLMDevClient) -> AsyncIterator[ProxyHarness]:
    # probes get 5 s: vLLM's API server answers late while it generates on two shared CPU cores, and a
    # busy engine must not be taken for a dead one (that would fail over the very call under test)
    settings = {"abort_policy": "continue", "engine_health_timeout": 5.0}
    async with ProxyHarness.running(engine_urls=[dev_server.base_url], **settings) as harness:
        yield harness
        if harness.app[keys.ENGINES].paused:  # a failed test must not leave the next one a paused engine
            await harness.request("POST", "/v1/admin/resume", json={"policy_version": fleet_version(harness)})


def fleet_version(proxy: ProxyHarness) -> int:
    return int(proxy.app[keys.ENGINES].version)


async def until(condition: Callable[[], Any], within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, f"not within {within:.0f}s"
        await asyncio.sleep(0.05)


async def in_flight(proxy: ProxyHarness, engine: VLLMDevClient, tokens: int) -> tuple[Session, asyncio.Task[Any]]:
    """A plugin's turn through the proxy, once vLLM has generated ``tokens`` of it (still generating)."""
    session = await proxy.create_session(ASK, max_new_tokens=40, **GREEDY)
    baseline = await engine.metric(GENERATED)
    turn = asyncio.create_task(session.client.chat.completions.create(model="m", messages=ASK))

    async def started() -> bool:
        return await engine.metric(GENERATED) >= baseline + tokens

    await until(started)
    assert not turn.done()
    return session, turn


async def pause(proxy: ProxyHarness, mode: str) -> None:
    status, answer = await proxy.request("POST", "/v1/admin/pause", json={"mode": mode})
    assert status == 200 and answer["paused"] and answer["failed"] == 0, answer
    assert [entry["state"] for entry in answer["engines"]] == ["paused"]


async def resume(proxy: ProxyHarness, engine: VLLMDevClient, version: int) -> None:
    status, answer = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": version})
    assert status == 200 and answer["failed"] == 0 and not answer["paused"], answer
    assert await engine.weight_version() == str(version)  # the proxy set it on vLLM (a string there)
    assert not await engine.is_paused()


async def nothing_reaches_the_engine_while_paused(
    proxy: ProxyHarness, engine: VLLMDevClient, *, frozen: int = 0
) -> asyncio.Task[Any]:
    """A new turn during the pause waits in the proxy; vLLM queues nothing and runs only the ``frozen``
    calls a keep-mode pause holds."""
    session = await proxy.create_session(ASK, max_new_tokens=4, **GREEDY)
    queued = asyncio.create_task(session.client.chat.completions.create(model="m", messages=ASK))
    fleet = proxy.app[keys.ENGINES]

    async def waiting() -> bool:
        return fleet.gate.waiting == 1

    await until(waiting, 30)
    await asyncio.sleep(0.5)
    assert await engine.metric("vllm:num_requests_running") == frozen
    assert await engine.metric("vllm:num_requests_waiting") == 0
    assert not queued.done()
    return queued


def generated(trajectory: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The positions the policy generated and their recorded logprobs."""
    weights, logprobs = trajectory["total_loss_weight"], trajectory["total_token_logprobs"]
    positions = [i for i, weight in enumerate(weights) if weight == 1.0]
    return positions, [logprobs[i] for i in positions]


async def scored(engine: VLLMDevClient, ids: list[int], positions: list[int]) -> list[float]:
    """The logprob the engine's current weights give each of ``positions`` after the tokens before it."""
    answer = (await engine.call("POST", "/v1/completions", completion(ids, 1, prompt_logprobs=0)))["choices"][0]
    return [answer["prompt_logprobs"][i][str(ids[i])]["logprob"] for i in positions]


async def test_keep_pause_freezes_a_turn_and_the_resume_at_a_new_version_samples_it_again(
    proxy: ProxyHarness, engine: VLLMDevClient
) -> None:
    start = fleet_version(proxy)
    _, turn = await in_flight(proxy, engine, 4)
    await pause(proxy, "keep")
    queued = await nothing_reaches_the_engine_while_paused(proxy, engine, frozen=1)
    assert not turn.done()  # frozen on vLLM, not cut
    await resume(proxy, engine, start + 1)
    reply, _ = await asyncio.gather(turn, queued)
    trajectory = await proxy.trajectory(reply.id)
    positions, _ = generated(trajectory)
    # vLLM does not say where the new version took over in a frozen call: the proxy sampled it again
    assert trajectory["policy_versions"] == [{"version": start + 1, "start": positions[0], "end": positions[-1] + 1}]
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("abort_resubmissions_total", policy="regenerate", reason="weights_changed") == 1


async def test_wait_pause_answers_once_the_turn_in_flight_is_done(proxy: ProxyHarness, engine: VLLMDevClient) -> None:
    start = fleet_version(proxy)
    _, turn = await in_flight(proxy, engine, 2)
    await pause(proxy, "wait")
    assert turn.done() or await asyncio.wait_for(turn, 5)  # finished before the pause answered
    reply = turn.result()
    assert reply.choices[0].finish_reason in ("stop", "length")
    queued = await nothing_reaches_the_engine_while_paused(proxy, engine)
    await resume(proxy, engine, start + 1)
    after = await queued
    for response, version in ((reply, start), (after, start + 1)):
        trajectory = await proxy.trajectory(response.id)
        assert {span["version"] for span in trajectory["policy_versions"]} == {version}


async def test_abort_pause_a_real_weight_reload_and_the_versions_of_every_token(
    proxy: ProxyHarness, engine: VLLMDevClient, dev_server: VLLMServer
) -> None:
    perturbed = ensure_perturbed_checkpoint()
    start = fleet_version(proxy)
    warm = await proxy.create_session(ASK, max_new_tokens=2, **GREEDY)
    await warm.client.chat.completions.create(model="m", messages=ASK)  # the proxy learns the engine is dense
    _, turn = await in_flight(proxy, engine, 6)
    await pause(proxy, "abort")  # vLLM cuts the call: finish_reason "abort" with the tokens so far
    queued = await nothing_reaches_the_engine_while_paused(proxy, engine)
    await engine.reload_weights(str(perturbed))  # the weight update, while paused (vLLM's reload path)
    await resume(proxy, engine, start + 1)
    reply, _ = await asyncio.gather(turn, queued)
    trajectory = await proxy.trajectory(reply.id)
    positions, recorded = generated(trajectory)
    spans = trajectory["policy_versions"]
    # continued after the resume (--abort-policy continue): the old weights' tokens, then the new ones'
    assert [span["version"] for span in spans] == [start, start + 1], spans
    assert spans[0]["start"] == positions[0] and spans[1]["end"] == positions[-1] + 1
    assert spans[0]["end"] == spans[1]["start"] and spans[0]["end"] - spans[0]["start"] >= 6
    old = [i for i, p in enumerate(positions) if p < spans[0]["end"]]
    new = [i for i, p in enumerate(positions) if p >= spans[1]["start"]]

    ids = trajectory["total_token_ids"][: positions[-1] + 1]
    now = await scored(engine, ids, positions)  # the perturbed weights, on the very same tokens
    # the tokens of the new version's span are what the new weights give them ...
    assert max(abs(recorded[i] - now[i]) for i in new) < 1e-3
    # ... and the old span's were sampled by other weights: the same tokens score differently now
    shifts = [abs(recorded[i] - now[i]) for i in old]
    assert sum(shifts) / len(shifts) > 0.02, shifts
    assert dev_server.model_dir is not None
    await engine.reload_weights(str(dev_server.model_dir))  # the module's last test: the server stops after it
    before = await scored(engine, ids, positions)  # the original weights again
    assert max(abs(recorded[i] - before[i]) for i in old) < 1e-3
