"""The real-vLLM integration suite: engines started once per test session.

Each engine runs from the engine venv (built by the dev tooling, cached) on a free
local port and is stopped when the session ends. Between the proxy and each engine a
recording relay keeps vLLM's own requests and answers, so tests compare the
trajectories with what vLLM itself reported, not with what the proxy says it did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from devtools.vllm_server import VLLMServer
from rollout_proxy.embedded import serve_app
from tests.conftest import TEMPLATES_DIR
from tests.harness import ProxyHarness

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)


SERVER_CONFIGS: dict[str, dict[str, Any]] = {
    # the hermes tool parser lets vLLM's own chat endpoint take tools (InferenceProxy talks to it)
    "qwen3_style": {"model": "dense", "chat_template": TEMPLATES_DIR / "qwen3_style.jinja", "tool_parser": "hermes"},
    "smollm2_default": {"model": "dense", "tool_parser": "hermes"},
    # --enable-scale-out: /inference/v1/generate (the route image turns take) answers routing rows too
    "moe_routed": {"model": "moe", "routed_experts": True, "extra_args": ["--enable-scale-out"]},
    # VLLM_SERVER_DEV_MODE=1: pause/resume, weight version, collective_rpc (weight reload)
    "dense_dev": {"model": "dense", "dev_mode": True},
    # --enable-lora --max-lora-rank 16 --max-loras 6, run-time adapter loading (LoRA policies): the zero
    # adapter and two policies each with two versions loaded side by side (an update) stay in one batch
    "dense_lora": {"model": "dense", "lora": True, "max_lora_rank": 16, "max_loras": 6},
    # the tiny Idefics3 model (its own template: one <image> per image part); --enable-scale-out serves
    # /inference/v1/generate, the route that takes token ids with images
    "vlm": {"model": "vlm", "extra_args": ["--enable-scale-out"]},
    # the MoE vision-language checkpoint (vLLM's Idefics3 over vLLM's Mixtral, registered by the tooling): routing
    # rows with images
    "vlm_moe": {"model": "vlm_moe", "routed_experts": True, "extra_args": ["--enable-scale-out"]},
}


@dataclass
class TokenAudit:
    """Tokens compared with vLLM's own reports over the whole suite."""

    checked: int = 0
    differing: int = 0

    def compare(self, ours: list[int], theirs: list[int]) -> None:
        self.checked += max(len(ours), len(theirs))
        self.differing += sum(a != b for a, b in zip(ours, theirs, strict=False)) + abs(len(ours) - len(theirs))


AUDIT = TokenAudit()


def pytest_terminal_summary(terminalreporter) -> None:
    if AUDIT.checked:
        terminalreporter.write_line(
            f"real vLLM token audit: {AUDIT.checked} tokens compared with vLLM's prompt_token_ids/token_ids, "
            f"{AUDIT.differing} differing"
        )


@pytest.fixture(scope="session")
def audit() -> TokenAudit:
    return AUDIT


class VLLMServers:
    """Start each configuration at most once per session; stop them all at the end."""

    def __init__(self) -> None:
        self._servers: dict[str, VLLMServer] = {}

    def get(self, name: str) -> VLLMServer:
        server = self._servers.get(name)
        if server is None:
            server = VLLMServer(die_with_parent=True, **SERVER_CONFIGS[name])
            server.start(timeout=600)
            self._servers[name] = server
        return server

    def stop(self, name: str) -> None:
        server = self._servers.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self._servers):
            self.stop(name)


@pytest.fixture(scope="session")
def vllm_servers() -> Iterator[VLLMServers]:
    servers = VLLMServers()
    yield servers
    servers.stop_all()


@pytest.fixture(scope="session", params=["qwen3_style", "smollm2_default"])
def real_template(request: pytest.FixtureRequest, vllm_servers: VLLMServers) -> Iterator[str]:
    """Each dense engine in turn (one runs at a time: they share two cores)."""
    vllm_servers.get(request.param)
    yield request.param
    vllm_servers.stop(request.param)


@dataclass
class RecordingRelay:
    """Forwards everything to vLLM and keeps its completions exchanges."""

    target: str
    completions: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    #: the /inference/v1/generate exchanges (prompts with images)
    generations: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, body) of every POST
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, self.target + request.path_qs, data=body or None, headers=headers) as answer,
        ):
            data = await answer.read()
            status, content_type = answer.status, answer.content_type
        if request.method == "POST" and body:
            self.requests.append((request.path, orjson.loads(body)))
        if request.path == "/v1/completions" and status == 200:
            self.completions.append((orjson.loads(body), orjson.loads(data)))
        if request.path == "/inference/v1/generate" and status == 200:
            self.generations.append((orjson.loads(body), orjson.loads(data)))
        return web.Response(body=data, status=status, content_type=content_type)

    @classmethod
    @asynccontextmanager
    async def serving(cls, target: str) -> AsyncIterator[RecordingRelay]:
        recorder = cls(target)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.handle)
        runner, recorder.url = await serve_app(app)
        try:
            yield recorder
        finally:
            await runner.cleanup()


@pytest.fixture
async def relay(real_template: str, vllm_servers: VLLMServers) -> AsyncIterator[RecordingRelay]:
    async with RecordingRelay.serving(vllm_servers.get(real_template).base_url) as recorder:
        yield recorder


@pytest.fixture
async def real_proxy(relay: RecordingRelay) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[relay.url]) as harness:
        yield harness
