"""MoE routing capture against a real vLLM (Model Runner V2 on Triton's interpreter: slow, so short)."""

from __future__ import annotations

import base64
import io

import numpy as np

from tests.harness import ProxyHarness
from tests.integration.conftest import RecordingRelay, TokenAudit, VLLMServers


def vllm_rows(response: dict) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(response["choices"][0]["routed_experts"])), allow_pickle=False)


async def test_recorded_routing_equals_vllms_arrays_row_for_row(vllm_servers: VLLMServers, audit: TokenAudit):
    server = vllm_servers.get("moe_routed")
    async with RecordingRelay.serving(server.base_url) as relay, ProxyHarness.running(engine_urls=[relay.url]) as proxy:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        session = await proxy.create_session(messages, max_new_tokens=4, temperature=0.0)
        first = await session.client.chat.completions.create(model="moe", messages=messages)
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "And of Italy?"}]
        second = await session.client.chat.completions.create(model="moe", messages=messages)
        trajectory = await proxy.trajectory(second.id)
    (request_1, response_1), (request_2, response_2) = relay.completions
    prompt_1, output_1 = response_1["choices"][0]["prompt_token_ids"], response_1["choices"][0]["token_ids"]
    prompt_2, output_2 = response_2["choices"][0]["prompt_token_ids"], response_2["choices"][0]["token_ids"]
    audit.compare(trajectory["total_token_ids"], prompt_2 + output_2)
    assert trajectory["total_token_ids"] == prompt_2 + output_2

    field = trajectory["routed_experts"]
    routing = np.frombuffer(base64.b64decode(field["data"]), dtype=np.int16).reshape(field["shape"])
    assert routing.shape == (len(prompt_2) + len(output_2), 30, 2)
    rows_1, rows_2 = vllm_rows(response_1), vllm_rows(response_2)
    # turn 1: every input position, the last sampled token has none
    assert len(rows_1) == len(prompt_1) + len(output_1) - 1
    assert np.array_equal(routing[: len(rows_1)], rows_1)
    # turn 2 was asked only for what the proxy did not hold: from turn 1's last token on
    boundary = len(prompt_1) + len(output_1) - 1
    assert "routed_experts_prompt_start" not in request_1  # nothing known about the engine yet
    assert request_2["routed_experts_prompt_start"] == boundary
    assert len(rows_2) == len(prompt_2) - boundary + len(output_2) - 1
    assert np.array_equal(routing[boundary : boundary + len(rows_2)], rows_2)
    assert (routing[-1] == -1).all() and (routing[:-1] >= 0).all()


async def test_the_generate_route_of_image_turns_returns_the_same_routing_rows(vllm_servers: VLLMServers):
    """Image turns go to ``/inference/v1/generate`` (``docs/images.md``): on the real MoE engine that route,
    asked with the proxy's own body (``generate_payload``, ``sampling_fields``: ``routed_experts_prompt_start``
    in ``sampling_params``) and read by the proxy's parser (``generated``), gives the rows ``/v1/completions``
    gives for the same prompt, from the same start. (No MoE vision model runs on vLLM's CPU build here:
    docs/images.md says why; the image positions' rows are tested on the fake engine.)"""
    import aiohttp

    from rollout_proxy.engines.base import PromptImages, SamplingParams
    from rollout_proxy.engines.vllm_http import generate_payload, generated, sampling_fields

    server = vllm_servers.get("moe_routed")
    prompt = [1, 4093, 198, 37964, 451, 4177, 30, 2, 198, 1, 520, 9531, 198]
    params = SamplingParams(max_tokens=5, temperature=0.0, top_p=1.0, top_k=0, routed_experts_prompt_start=4)
    sampling = {**sampling_fields(params), "logprobs": 0}
    body = generate_payload(
        server.served_model_name, np.asarray(prompt, dtype=np.int32), PromptImages(-1, (), ()), sampling
    )
    completions_body = {"model": server.served_model_name, "prompt": prompt, "return_token_ids": True, **sampling}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.base_url + "/inference/v1/generate", json=body) as response:
            assert response.status == 200, await response.text()
            generation = generated(await response.json())
        async with http.post(server.base_url + "/v1/completions", json=completions_body) as response:
            assert response.status == 200, await response.text()
            completion = await response.json()
    assert generation.output_ids.tolist() == completion["choices"][0]["token_ids"]  # greedy: the same answer
    assert generation.routed_experts is not None
    rows = np.load(io.BytesIO(base64.b64decode(generation.routed_experts)), allow_pickle=False)
    assert rows.shape == (len(prompt) + len(generation.output_ids) - 1 - 4, 30, 2)
    assert np.array_equal(rows, vllm_rows(completion))


async def test_an_image_conversation_on_a_moe_vlm_keeps_vllms_routing_row_for_every_token(
    vllm_servers: VLLMServers, audit: TokenAudit
):
    """Routing rows hold with images on a real engine: a two-turn chat with a picture per turn on the MoE
    vision-language checkpoint (vLLM's Idefics3 over vLLM's Mixtral) is vLLM's last prompt and output token for
    token, and its routing is vLLM's arrays row for row, image spans included: turn 2 asked only for the rows past
    turn 1's. The rows at an image's span are the picture's: the same prompt with the pictures swapped routes
    those positions otherwise, and the text before them alike."""
    import aiohttp

    from tests.integration.test_images_real import RED, SKY, a_picture_a_turn, check

    server = vllm_servers.get("vlm_moe")
    try:
        async with (
            RecordingRelay.serving(server.base_url) as relay,
            ProxyHarness.running(engine_urls=[relay.url]) as proxy,
        ):
            session = await proxy.create_session([], max_new_tokens=4, temperature=0.0)
            second_id = await a_picture_a_turn(session.client)
            trajectory = await proxy.trajectory(second_id)
        check(relay, trajectory, [RED, SKY], audit)
        (_, response_1), (request_2, response_2) = relay.generations
        # the same second prompt with the pictures swapped, one token
        swapped = {
            **request_2,
            "content_parts": request_2["content_parts"][::-1],
            "sampling_params": {**request_2["sampling_params"], "max_tokens": 1, "routed_experts_prompt_start": 0},
        }
        async with (
            aiohttp.ClientSession() as http,
            http.post(server.base_url + "/inference/v1/generate", json=swapped) as response,
        ):
            assert response.status == 200, await response.text()
            swapped_rows = vllm_rows(await response.json())
    finally:
        vllm_servers.stop("vlm_moe")
    field = trajectory["routed_experts"]
    routing = np.frombuffer(base64.b64decode(field["data"]), dtype=np.int16).reshape(field["shape"])
    total = trajectory["total_token_ids"]
    assert routing.shape == (len(total), 30, 2)
    prompt_1, output_1 = response_1["prompt_token_ids"], response_1["choices"][0]["token_ids"]
    rows_1, rows_2 = vllm_rows(response_1), vllm_rows(response_2)
    assert len(rows_1) == len(prompt_1) + len(output_1) - 1
    assert np.array_equal(routing[: len(rows_1)], rows_1)
    boundary = len(prompt_1) + len(output_1) - 1
    assert request_2["sampling_params"]["routed_experts_prompt_start"] == boundary
    assert len(rows_2) == len(total) - 1 - boundary
    assert np.array_equal(routing[boundary : boundary + len(rows_2)], rows_2)
    assert (routing[-1] == -1).all() and (routing[:-1] >= 0).all()
    first_image = trajectory["images"][0]
    span = slice(first_image["start"], first_image["start"] + first_image["length"])
    assert np.array_equal(swapped_rows[: span.start], routing[: span.start])
    assert not np.array_equal(swapped_rows[span], routing[span])
