"""Shared fixtures: a real Redis server, the fake engine, and a running proxy.

The tests start what they need themselves: a ``redis-server`` on a free local port
(installed by ``scripts/test.sh`` when missing) and the fake engine with the real
SmolLM2 tokenizer (built once into the cache by the dev tooling).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollout_proxy.devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.state.memory import MemoryStore
from tests.harness import ProxyHarness

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "src" / "rollout_proxy" / "devtools" / "templates"
#: The two chat templates every flow test runs with: Qwen3-style (tools, strips earlier
#: <think>) and SmolLM2's own (injects a default system prompt, no tool support).
TEMPLATES = {
    "qwen3_style": (TEMPLATES_DIR / "qwen3_style.jinja").read_text(),
    "smollm2_default": None,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """SmolLM2's real tokenizer, as the engine's checkpoint has it."""
    override = os.environ.get("ROLLOUT_PROXY_TOKENIZER_DIR")
    if override:
        return Path(override)
    from rollout_proxy.devtools.engine_env import ensure_checkpoints

    return ensure_checkpoints()["dense"]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private redis-server for the test session, stopped at the end."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed; run scripts/test.sh (it installs it) or apt-get install redis-server"
        )
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="rp-redis-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        process.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    """Each store implementation, empty."""
    if request.param == "memory":
        yield MemoryStore()
        return
    from rollout_proxy.state.redis import RedisStore

    redis_store = await RedisStore.connect(request.getfixturevalue("redis_url"))
    await redis_store._redis.flushdb()
    yield redis_store
    await redis_store.close()


@pytest.fixture(params=list(TEMPLATES))
def template_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def fake_engine(tokenizer_dir: Path, template_name: str) -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES[template_name])
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine


@pytest.fixture
async def proxy(fake_engine: FakeEngine, store) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[fake_engine.url], store=store, fake=fake_engine) as harness:
        yield harness
