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
