"""The policy admin routes over HTTP: list, register, publish; bad input is a 4xx in words and changes nothing.

The registry behind them is tested in tests/engines/test_policies.py; here the edge: the admin key, the bodies,
the status codes, the error shapes, and the ``/metrics`` lines a publish leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from devtools.lora_adapter import build_adapter
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ProxyHarness


@pytest.fixture(scope="module")
def adapter_dirs(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "v1": build_adapter(tokenizer_dir, root / "v1", targets=("q_proj",), seed=1),
        "v2": build_adapter(tokenizer_dir, root / "v2", targets=("q_proj",), seed=2),
        "r32": build_adapter(tokenizer_dir, root / "r32", rank=32, targets=("q_proj",), seed=3),
    }
    (root / "empty").mkdir()
    made["empty"] = root / "empty"
    dora = root / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((made["v1"] / "adapter_model.safetensors").read_bytes())
    config = json.loads((made["v1"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    made["dora"] = dora
    return made


@pytest.fixture
async def served(tokenizer_dir: Path) -> AsyncIterator[tuple[ProxyHarness, FakeFleet]]:
    async with (
        fake_fleet(tokenizer_dir, 2, max_lora_rank=16) as fakes,
        ProxyHarness.running(engine_urls=fakes.urls) as harness,
    ):
        yield harness, fakes


def error_of(status: int, body: Any, expected: int, param: str | None) -> str:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == param
    return body["error"]["message"]


async def test_register_publish_and_list(served, adapter_dirs):
    harness, fakes = served
    status, listed = await harness.request("GET", "/v1/admin/policies")
    assert status == 200 and [p["name"] for p in listed["policies"]] == ["base"]
    assert [e["served_name"] for e in listed["policies"][0]["engines"]] == [fakes.engines[0].model_name] * 2
    status, entry = await harness.request(
        "POST", "/v1/admin/policies", json={"name": "pol", "path": str(adapter_dirs["v1"])}
    )
    assert status == 200 and (entry["name"], entry["kind"], entry["version"]) == ("pol", "lora", 1)
    assert [e["served_name"] for e in entry["engines"]] == ["pol@v1", "pol@v1"]
    status, published = await harness.request(
        "POST", "/v1/admin/policies/pol/versions", json={"path": str(adapter_dirs["v2"])}
    )
    assert status == 200 and (published["version"], published["served_name"], published["failed"]) == (2, "pol@v2", 0)
    assert [e["ok"] for e in published["engines"]] == [True, True]
    status, one = await harness.request("GET", "/v1/admin/policies/pol")
    assert status == 200 and one["version"] == 2 and one["path"] == str(adapter_dirs["v2"])
    status, base = await harness.request("GET", "/v1/admin/policies/base")
    assert [e["served_name"] for e in base["engines"]] == ["base@zero", "base@zero"]
    status, metrics = await harness.request("GET", "/metrics", token=None)
    assert 'rollout_proxy_policy_publishes_total{outcome="published",policy="pol"} 2.0' in metrics
    assert 'rollout_proxy_policy_current_version{policy="pol"} 2.0' in metrics
    assert "rollout_proxy_policy_publish_seconds_count" in metrics


async def test_bad_input_is_a_4xx_in_words_and_changes_nothing(served, adapter_dirs, tmp_path):
    harness, fakes = served
    await harness.request("POST", "/v1/admin/policies", json={"name": "pol", "path": str(adapter_dirs["v1"])})
    _, before = await harness.request("GET", "/v1/admin/policies")
    calls = [len(fake.adapter_calls) for fake in fakes.engines]
    cases = [
        ("/v1/admin/policies/pol/versions", {"path": str(tmp_path / "missing")}, 400, "path", "no such directory"),
        ("/v1/admin/policies/pol/versions", {"path": str(adapter_dirs["empty"])}, 400, "path", "adapter_config.json"),
        ("/v1/admin/policies/pol/versions", {"path": "relative/v3"}, 400, "path", "absolute"),
        ("/v1/admin/policies/pol/versions", {"path": str(adapter_dirs["dora"])}, 400, "path", "DoRA"),
        ("/v1/admin/policies/pol/versions", {"path": 7}, 400, "path", ""),
        ("/v1/admin/policies/pol/versions", {}, 400, "path", ""),
        ("/v1/admin/policies/pol/versions", {"path": "/x", "extra": 1}, 400, "extra", ""),
        ("/v1/admin/policies/nope/versions", {"path": str(adapter_dirs["v2"])}, 404, "policy", "no policy 'nope'"),
        ("/v1/admin/policies/base/versions", {"path": str(adapter_dirs["v2"])}, 400, "policy", "weight update"),
        ("/v1/admin/policies", {"name": "base"}, 400, "name", "not 'base'"),
        ("/v1/admin/policies", {"name": "a b"}, 400, "name", "letters, digits"),
        ("/v1/admin/policies", {"name": "new", "path": str(tmp_path / "missing")}, 400, "path", "no such directory"),
    ]
    for path, body, expected, param, words in cases:
        status, answer = await harness.request("POST", path, json=body)
        assert words in error_of(status, answer, expected, param), (path, body)
    assert [len(fake.adapter_calls) for fake in fakes.engines] == calls  # no engine was asked
    # the engines refuse a rank above their --max-lora-rank: 400 in vLLM's words, still nothing changed
    status, answer = await harness.request(
        "POST", "/v1/admin/policies/pol/versions", json={"path": str(adapter_dirs["r32"])}
    )
    message = error_of(status, answer, 400, "path")
    assert "LoRA rank 32 is greater than max_lora_rank 16" in message and "nothing changed" in message
    status, after = await harness.request("GET", "/v1/admin/policies")
    assert after == before
    status, answer = await harness.request("GET", "/v1/admin/policies/nope")
    assert "no policy 'nope'" in error_of(status, answer, 404, "policy")


async def test_the_policy_routes_take_the_admin_key_only(served, adapter_dirs):
    harness, _ = served
    for method, path, body in (
        ("GET", "/v1/admin/policies", None),
        ("POST", "/v1/admin/policies", {"name": "pol"}),
        ("POST", "/v1/admin/policies/pol/versions", {"path": str(adapter_dirs["v1"])}),
    ):
        status, _ = await harness.request(method, path, json=body, token=None)
        assert status == 401
        status, _ = await harness.request(method, path, json=body, token="not-the-key")
        assert status == 401
    _, listed = await harness.request("GET", "/v1/admin/policies")
    assert [p["name"] for p in listed["policies"]] == ["base"]


async def test_retiring_a_policy_refuses_its_sessions_in_words_and_drops_its_series(served, adapter_dirs):
    harness, fakes = served
    question = [{"role": "user", "content": "What is two plus two?"}]
    for name, path in (("pol", adapter_dirs["v1"]), ("other", adapter_dirs["v2"])):
        status, _ = await harness.request("POST", "/v1/admin/policies", json={"name": name, "path": str(path)})
        assert status == 200
    session = await harness.create_session(question, policy="pol")
    await session.client.chat.completions.create(model="m", messages=question)
    _, before = await harness.request("GET", "/v1/admin/policies")
    for path, expected, param, words in (
        ("/v1/admin/policies/base", 400, None, "base policy cannot be retired"),
        ("/v1/admin/policies/nope", 404, "policy", "no policy 'nope'"),
    ):
        status, answer = await harness.request("DELETE", path)
        assert words in error_of(status, answer, expected, param)
    for token in (None, "not-the-key", session.api_key):
        status, _ = await harness.request("DELETE", "/v1/admin/policies/pol", token=token)
        assert status == 401
    _, after = await harness.request("GET", "/v1/admin/policies")
    assert after == before  # refused: nothing changed
    status, retired = await harness.request("DELETE", "/v1/admin/policies/pol")
    assert status == 200 and (retired["policy"], retired["retired"], retired["version"]) == ("pol", True, 1)
    assert sorted(e["served_name"] for e in retired["unloading"]) == ["pol@v1", "pol@v1"]
    _, listed = await harness.request("GET", "/v1/admin/policies")
    assert [p["name"] for p in listed["policies"]] == ["base", "other"]
    for stream in (False, True):  # a turn of the session open on it: a 409 in words
        with pytest.raises(openai.ConflictError) as raised:
            await session.client.chat.completions.create(model="m", messages=question, stream=stream)
        assert raised.value.code == "policy_retired" and "'pol' was retired" in raised.value.message
    status, body = await harness.request(
        "POST", "/v1/sessions", json={"sample": {"messages": question}, "policy": "pol"}
    )
    assert "it was retired" in error_of(status, body, 400, "policy")  # a new session on it: unknown
    status, answer = await harness.request("DELETE", "/v1/admin/policies/pol")
    assert "no policy 'pol'" in error_of(status, answer, 404, "policy")  # retired twice: the second is unknown
    async with asyncio.timeout(10):  # unloaded once no call holds it; the zero adapter and the other stay
        while any(set(fake.adapters) != {"base@zero", "other@v1"} for fake in fakes.engines):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    status, metrics = await harness.request("GET", "/metrics", token=None)
    assert 'policy="pol"' not in metrics and 'rollout_proxy_policy_current_version{policy="other"} 1.0' in metrics
