"""The fake engine answers like the real one: same requests, same JSON structure.

The unit tests trust the fake; this is what earns that trust. Token ids must be
identical too (same tokenizer, same chat template), not only the shapes.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from devtools.paths import model_dir
from tests.conftest import TEMPLATES
from tests.harness import WEATHER_TOOL
from tests.integration.conftest import VLLMServers

PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]},
    {"role": "user", "content": "Thanks!"},
]


def shape(value: Any, key: str = "") -> Any:
    """The structure of a JSON value: keys, nesting and value types."""
    if isinstance(value, dict):
        if key == "top_logprobs_entry":  # keyed by token text: only the value type matters
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


REQUESTS = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "Hello world, this is a test."}),
    ("POST", "/tokenize", {"messages": CONVERSATION, "tools": [WEATHER_TOOL], "add_generation_prompt": True}),
    ("POST", "/tokenize", {"messages": CONVERSATION[:1], "add_generation_prompt": False, "return_token_strs": True}),
    ("POST", "/detokenize", {"tokens": PROMPT}),
    (
        "POST",
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 5,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 0,
            "logprobs": 0,
            "return_token_ids": True,
            "n": 1,
            "stream": False,
        },
    ),
    ("POST", "/v1/completions", {"prompt": [999_999], "max_tokens": 2, "return_token_ids": True}),
]


async def call(http: aiohttp.ClientSession, base: str, method: str, path: str, body: Any, model: str):
    if body is not None:
        body = {"model": model, **body}
    async with http.request(method, base + path, json=body) as response:
        text = await response.text()
        return response.status, (await response.json(content_type=None)) if text else None


IGNORED_IN_IDENTITY = (
    "id",
    "created",
    "system_fingerprint",
    "root",
    "permission",
    "model",
    "text",
    "logprobs",
    "token_ids",
)


@pytest.mark.parametrize("index", range(len(REQUESTS)))
async def test_fake_answers_like_vllm(real_template: str, vllm_servers: VLLMServers, index: int):
    method, path, body = REQUESTS[index]
    real = vllm_servers.get(real_template)
    fake = FakeEngine(model_dir("dense"), chat_template=TEMPLATES[real_template], model_name=real.served_model_name)
    fake.queue("The capital")
    async with FakeEngineServer(fake) as fake_url, aiohttp.ClientSession() as http:
        real_status, real_body = await call(http, real.base_url, method, path, body, real.served_model_name)
        fake_status, fake_body = await call(http, fake_url, method, path, body, fake.model_name)
    assert fake_status == real_status, (real_body, fake_body)
    if real_status >= 400:
        assert shape(fake_body) == shape(real_body)
        return
    assert shape(fake_body) == shape(real_body)
    if path in ("/tokenize", "/detokenize"):
        assert fake_body == real_body  # same tokenizer, same template: same ids and text
    if path == "/v1/completions":
        real_choice, fake_choice = real_body["choices"][0], fake_body["choices"][0]
        assert fake_choice["prompt_token_ids"] == real_choice["prompt_token_ids"] == PROMPT
        assert len(fake_choice["logprobs"]["token_logprobs"]) == len(fake_choice["token_ids"])


async def test_both_echo_the_prompt_as_compact_json_so_the_proxy_matches_it_as_bytes(
    real_template: str, vllm_servers: VLLMServers
):
    """``PromptEcho`` finds vLLM's ``prompt_token_ids`` as the very bytes the proxy sent, so it never parses
    them; a vLLM that wrote its JSON otherwise would only be slower (the echo is parsed and compared then)."""
    import numpy as np

    from rollout_proxy.engines.vllm_http import PromptEcho

    real = vllm_servers.get(real_template)
    fake = FakeEngine(model_dir("dense"), chat_template=TEMPLATES[real_template], model_name=real.served_model_name)
    fake.queue("The capital")
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "logprobs": 0, "return_token_ids": True}
    echo = PromptEcho(np.asarray(PROMPT, dtype=np.int32))
    async with FakeEngineServer(fake) as fake_url, aiohttp.ClientSession() as http:
        for base, model in ((real.base_url, real.served_model_name), (fake_url, fake.model_name)):
            async with http.post(base + "/v1/completions", json={"model": model, **body}) as response:
                assert response.status == 200
                raw = await response.read()
            parsed, same = echo.parse(raw)
            assert same, raw[:300]
            assert parsed["choices"][0]["prompt_token_ids"] is None and parsed["choices"][0]["token_ids"]
