"""The dev-mode client and the fixture recorder, driven against the fake engine (no vLLM needed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from devtools import paths
from devtools.fake_engine import FakeEngine, FakeEngineServer
from devtools.record_dev_mode import (
    Recording,
    completion,
    pause_errors,
    stream_tokens,
    weight_version,
    write_fixtures,
)
from devtools.vllm_dev import DevModeError, VLLMDevClient


@pytest.fixture
async def served(tokenizer_dir: Path) -> AsyncIterator[tuple[FakeEngine, VLLMDevClient]]:
    engine = FakeEngine(tokenizer_dir, model_name="smollm2")
    async with FakeEngineServer(engine) as url, aiohttp.ClientSession() as http:
        yield engine, VLLMDevClient(url, http, timeout=10)


async def test_client_drives_pause_resume_versions_and_rpc(served: tuple[FakeEngine, VLLMDevClient]) -> None:
    engine, client = served
    assert await client.weight_version() == "default"
    await client.update_weight_version(7)  # an int policy version goes as its string
    assert await client.weight_version() == "7" and engine.weight_version == "7"
    await client.pause("keep")
    assert await client.is_paused() and engine.pauses == ["keep"]
    await client.resume()
    assert not await client.is_paused()
    assert await client.collective_rpc("reload_weights", kwargs={"weights_path": "/m"}) == [None]
    assert await client.abort_requests() == 0


async def test_client_error_carries_the_exchange(served: tuple[FakeEngine, VLLMDevClient]) -> None:
    _, client = served
    with pytest.raises(DevModeError) as refused:
        await client.call("POST", "/pause?mode=bogus")
    exchange = refused.value.exchange
    assert exchange.status == 400 and exchange.json()["error"]["param"] == "query.mode"
    assert exchange.done >= exchange.sent


async def test_client_reads_counters_from_metrics() -> None:
    """Sums a counter over its label sets, as vLLM's /metrics writes them."""
    from aiohttp import web

    from rollout_proxy.embedded import serve_app

    text = (
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 28.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 2.0\n'
        'vllm:generation_tokens_created{engine="0",model_name="m"} 1.79e+09\n'
    )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, url = await serve_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            client = VLLMDevClient(url, http)
            assert await client.metric("vllm:generation_tokens_total") == 30.0
            assert await client.metric("vllm:num_requests_running") == 0.0
    finally:
        await runner.cleanup()


async def test_recorder_writes_fixtures_the_contract_test_reads(
    served: tuple[FakeEngine, VLLMDevClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, client = served
    monkeypatch.setenv("ROLLOUT_PROXY_CACHE", str(tmp_path / "cache"))
    recordings = []
    for name, scenario in (("weight_version", weight_version), ("pause_errors", pause_errors)):
        rec = Recording(name, "about " + name, client)
        await scenario(rec)
        recordings.append(rec)
    salted = Recording("salted", "a path to redact", client)
    await salted.call(
        "rpc",
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(paths.cache_dir() / "m")}},
    )
    recordings.append(salted)
    await asyncio.to_thread(write_fixtures, recordings, tmp_path / "out")

    written = json.loads((tmp_path / "out" / "weight_version.json").read_text())
    assert written["notes"] == {"before": "default", "after": "1"}
    assert [s["label"] for s in written["steps"]][:2] == ["weight_info_default", "update_weight_version_int"]
    first = written["steps"][0]
    assert first["request"] == {"method": "GET", "path": "/weight_info"}
    assert json.loads(first["response"]["text"]) == {"weight_version": "default"}
    redacted = json.loads((tmp_path / "out" / "salted.json").read_text())
    assert redacted["steps"][0]["request"]["body"]["kwargs"]["weights_path"] == "$ROLLOUT_PROXY_CACHE/m"
    transcript = (tmp_path / "out" / "transcript.txt").read_text()
    assert "### pause_bogus_mode: POST /pause?mode=bogus -> 400 application/json" in transcript
    assert str(tmp_path) not in transcript


def test_stream_tokens_reads_an_aborted_stream() -> None:
    chunk = {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": None}]}
    last = {"choices": [{"token_ids": [], "logprobs": {"token_logprobs": []}, "finish_reason": "abort"}]}
    events = [{"t": 0.1, "data": json.dumps(chunk)}, {"t": 0.2, "data": json.dumps(last)}, {"t": 0.2, "data": "[DONE]"}]
    assert stream_tokens(events) == ([5], [-0.5], "abort")
    assert completion([1, 2], 3, cache_salt="s")["cache_salt"] == "s"
