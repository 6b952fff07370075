"""A real vLLM in dev mode (VLLM_SERVER_DEV_MODE=1): what the proxy's pause/resume and policy
versions will rely on, checked on the engine alone.

One server for the whole module (a start costs ~1 min on 2 cores); the tests run in file
order and each leaves it unpaused with the dense weights loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.engine_env import ensure_perturbed_checkpoint
from devtools.record_dev_mode import LONG_TEXT, MODEL, PROMPT, completion
from devtools.vllm_dev import DevModeError, VLLMDevClient
from devtools.vllm_server import VLLMServer
from tests.integration.conftest import VLLMServers

GENERATED = "vllm:generation_tokens_total"
#: the pause-keep test's answer length
KEEP_TOKENS = 160


@pytest.fixture(scope="module")
def dev_server(vllm_servers: VLLMServers) -> Iterator[VLLMServer]:
    started = time.monotonic()
    server = vllm_servers.get("dense_dev")
    yield server
    vllm_servers.stop("dense_dev")
    print(f"\n[dev mode] server start + module: {time.monotonic() - started:.0f}s")


@pytest.fixture(scope="module")
def perturbed_dir() -> Path:
    return ensure_perturbed_checkpoint()


@pytest.fixture
async def client(dev_server: VLLMServer) -> AsyncIterator[VLLMDevClient]:
    async with aiohttp.ClientSession() as http:
        dev = VLLMDevClient(dev_server.base_url, http, timeout=300)
        yield dev
        if await dev.is_paused():  # a failed test must not leave the next one a paused engine
            await dev.resume()


async def generated_at_least(client: VLLMDevClient, baseline: float, tokens: int, within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    while await client.metric(GENERATED) < baseline + tokens:
        assert time.monotonic() < deadline, f"fewer than {tokens} tokens generated in {within:.0f}s"
        await asyncio.sleep(0.1)


async def complete(client: VLLMDevClient, body: dict[str, Any]) -> dict[str, Any]:
    return (await client.call("POST", "/v1/completions", body))["choices"][0]


def prompt_logprobs(answer: dict[str, Any], prompt: list[int], start: int) -> list[float]:
    return [answer["prompt_logprobs"][i][str(prompt[i])]["logprob"] for i in range(start, len(prompt))]


async def test_update_weight_version_then_weight_info(client: VLLMDevClient) -> None:
    assert await client.weight_version() == "default"  # before any update: the proxy maps it to --policy-version
    with pytest.raises(DevModeError) as refused:
        await client.call("POST", "/update_weight_version", {"new_version": 3})
    assert refused.value.exchange.status == 400  # a bare int is refused: versions go as strings
    assert await client.weight_version() == "default"
    await client.update_weight_version(3)
    assert await client.weight_version() == "3"


async def test_pause_abort_cuts_inflight_with_tokens_so_far(client: VLLMDevClient) -> None:
    baseline = await client.metric(GENERATED)
    inflight = asyncio.create_task(complete(client, completion(PROMPT, 256, ignore_eos=True)))
    await generated_at_least(client, baseline, 4)
    await client.pause("abort")
    cut = await asyncio.wait_for(inflight, 30)
    assert cut["finish_reason"] == "abort"
    sampled = cut["token_ids"]
    assert 4 <= len(sampled) < 256
    assert len(cut["logprobs"]["token_logprobs"]) == len(sampled)
    assert await client.is_paused()

    waiting = asyncio.create_task(complete(client, completion(PROMPT, 4)))
    await asyncio.sleep(1.5)
    assert not waiting.done()  # sent while paused: it waits, no error
    await client.resume()
    queued = await asyncio.wait_for(waiting, 120)
    assert queued["finish_reason"] == "length" and not await client.is_paused()
    # the tokens so far are real samples: greedy from the same prompt gives the same prefix
    again = await complete(client, completion(PROMPT, len(sampled), ignore_eos=True))
    assert again["token_ids"] == sampled


async def test_pause_wait_returns_when_inflight_finished(client: VLLMDevClient) -> None:
    baseline = await client.metric(GENERATED)
    inflight = asyncio.create_task(complete(client, completion(PROMPT, 12, ignore_eos=True)))
    await generated_at_least(client, baseline, 2)
    await client.pause("wait")
    assert await client.metric("vllm:num_requests_running") == 0
    finished = await asyncio.wait_for(inflight, 30)
    assert finished["finish_reason"] == "length" and len(finished["token_ids"]) == 12
    assert await client.is_paused()
    await client.resume()


async def test_pause_keep_freezes_and_resumes_with_the_same_tokens(client: VLLMDevClient) -> None:
    # long enough that the rest cannot finish between the poll that saw 6 tokens and the pause's answer
    # (24 did on a fast machine: CI)
    reference = await complete(client, completion(PROMPT, KEEP_TOKENS, ignore_eos=True))
    baseline = await client.metric(GENERATED)
    inflight = asyncio.create_task(complete(client, completion(PROMPT, KEEP_TOKENS, ignore_eos=True)))
    await generated_at_least(client, baseline, 6)
    await client.pause("keep")
    await asyncio.sleep(1.0)  # outputs sampled before the pause may still be counted just after it answers
    frozen_at = await client.metric(GENERATED)
    await asyncio.sleep(2.0)
    assert await client.metric(GENERATED) == frozen_at  # nothing generated while paused
    assert not inflight.done()
    await client.resume()
    kept = await asyncio.wait_for(inflight, 120)
    assert kept["finish_reason"] == "length"
    assert kept["token_ids"] == reference["token_ids"]


async def test_reload_of_perturbed_weights_changes_logprobs_of_the_same_tokens(
    client: VLLMDevClient, dev_server: VLLMServer, perturbed_dir: Path
) -> None:
    assert dev_server.model_dir is not None
    greedy = await complete(client, completion(PROMPT, 16))
    sequence = PROMPT + greedy["token_ids"]
    score = completion(sequence, 1, prompt_logprobs=0)  # prompt_logprobs never read the prefix cache
    before = prompt_logprobs(await complete(client, score), sequence, len(PROMPT))
    rendered = await client.call(
        "POST", "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}]}
    )
    long_gen = completion(rendered["tokens"], 8)
    await complete(client, long_gen)  # leaves the long prompt's first block in the prefix cache
    version = await client.weight_version()
    try:
        await client.reload_weights(str(perturbed_dir))
        after = prompt_logprobs(await complete(client, score), sequence, len(PROMPT))
        shifts = [abs(a - b) for a, b in zip(before, after, strict=True)]
        assert sum(shifts) / len(shifts) > 0.05, shifts  # measured ~0.17 nats
        assert await client.weight_version() == version  # a reload does not set the version

        # KV computed under the old weights is reused unless the request carries a new salt
        stale = await complete(client, long_gen)
        fresh = await complete(client, {**long_gen, "cache_salt": "policy-after-reload"})
        truth_prompt = rendered["tokens"] + fresh["token_ids"]
        truth = await complete(client, completion(truth_prompt, 1, prompt_logprobs=0))
        expected = prompt_logprobs(truth, truth_prompt, len(rendered["tokens"]))
        salted = fresh["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(salted, expected, strict=True)) < 1e-3
        unsalted = stale["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(unsalted, expected, strict=False)) > 1e-3
    finally:
        await client.reload_weights(str(dev_server.model_dir))
    restored = prompt_logprobs(await complete(client, score), sequence, len(PROMPT))
    assert max(abs(a - b) for a, b in zip(restored, before, strict=True)) < 1e-4
