"""Engines for the client and pool tests: fake vLLM servers, and a server that answers what it is told."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.embedded import serve_app

MODELS_BODY = b'{"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": 64}]}'


@dataclass
class ScriptedServer:
    """Answers each path with the (status, raw body) set for it; /v1/models lists one model."""

    url: str = ""
    answers: dict[str, tuple[int, bytes]] = field(default_factory=lambda: {"/v1/models": (200, MODELS_BODY)})

    def answer(self, path: str, status: int, body: bytes | str) -> None:
        self.answers[path] = (status, body.encode() if isinstance(body, str) else body)

    async def handle(self, request: web.Request) -> web.Response:
        status, body = self.answers.get(request.path, (404, b'{"detail": "Not Found"}'))
        return web.Response(status=status, body=body, content_type="application/json")


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedServer]:
    server = ScriptedServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner, server.url = await serve_app(app)
    yield server
    await runner.cleanup()


@pytest.fixture
async def two_fakes(tokenizer_dir: Path) -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    """Two fake engines, each on its own port."""
    first, second = FakeEngine(tokenizer_dir), FakeEngine(tokenizer_dir)
    async with FakeEngineServer(first) as first_url, FakeEngineServer(second) as second_url:
        first.url, second.url = first_url, second_url  # type: ignore[attr-defined]
        yield first, second


@pytest.fixture
async def fake(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    """One fake engine with SmolLM2's own template."""
    engine = FakeEngine(tokenizer_dir)
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine
