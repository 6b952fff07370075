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
from typing import Any

import pytest
import structlog

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.state.memory import MemoryStore
from tests.harness import ProxyHarness

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "devtools" / "templates"
#: The two chat templates every flow test runs with: Qwen3-style (tools, strips earlier
#: <think>) and SmolLM2's own (injects a default system prompt, no tool support).
TEMPLATES = {
    "qwen3_style": (TEMPLATES_DIR / "qwen3_style.jinja").read_text(),
    "smollm2_default": None,
}


@pytest.fixture(autouse=True)
def structlog_as_pytest_started() -> Iterator[None]:
    """Every test starts with structlog's defaults, printing to the stdout of the moment.

    ``cli.main`` and the demo's ``main``, run in-process by a test, configure structlog for good: onto
    the ``sys.stderr`` of their moment (a capture stream pytest closes afterwards) and with a level
    filter (the demo's: warning), which drops lower events before ``capture_logs`` can see them."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def settings_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment without any ``ROLLOUT_PROXY_*`` variable (what ``from_env`` reads), to set with
    ``settings_environ.setenv``; restored after the test."""
    for name in list(os.environ):
        if name.upper().startswith("ROLLOUT_PROXY_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def redis_gives_up_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening Redis (a store, a feed) tries 3 times 10 ms apart, not 6 times over ~16 s: a start-up against
    no server fails in a test's time."""
    from rollout_proxy.state import connection, redis, redis_feed

    real = connection.connect_redis

    async def connect(url: str, **options: Any) -> Any:
        return await real(url, **{**options, "retries": 2, "delay": 0.01})

    for module in (redis, redis_feed):
        monkeypatch.setattr(module, "connect_redis", connect)


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
    from devtools.engine_env import ensure_checkpoints

    return ensure_checkpoints()["dense"]


@pytest.fixture(scope="session")
def vlm_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Idefics3 model's files but its weights (``build_checkpoints.write_vlm_files``: SmolLM2's tokenizer
    with the image tokens, the processor config with splitting off, 16 ``<image>`` per image, the template that
    renders one ``<image>`` per image part): what the proxy and the fake engine read for image turns."""
    from devtools.build_checkpoints import write_vlm_files

    out = tmp_path_factory.mktemp("vlm-files")
    write_vlm_files(tokenizer_dir, out)
    return out


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


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A private three-master Redis Cluster (no replicas) for the test session: ``redis+cluster://`` of one node."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        pytest.fail("redis-server/redis-cli are not installed; run scripts/test.sh or apt-get install redis-server")
    workdir = tempfile.mkdtemp(prefix="rp-redis-cluster-")
    ports = [free_port() for _ in range(3)]
    bus_ports = [free_port() for _ in range(3)]  # not port + 10000, which may be taken or out of range
    processes = []
    for port, bus_port in zip(ports, bus_ports, strict=True):
        node_dir = Path(workdir) / str(port)
        node_dir.mkdir()
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(node_dir)]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus_port)]
        processes.append(subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for port in ports:
            _wait_for_port(port)
        nodes = [f"127.0.0.1:{port}" for port in ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [
                subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True).stdout
                for port in ports
            ]
            if all("cluster_state:ok" in state for state in states):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the Redis Cluster did not become ready")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"redis-server on port {port} did not start")


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
async def vlm_engine(vlm_dir: Path) -> AsyncIterator[FakeEngine]:
    """The fake vLLM serving the tiny Idefics3 model's files (it takes images), at its ``url``."""
    engine = FakeEngine(vlm_dir)
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine


@pytest.fixture
async def proxy(fake_engine: FakeEngine, store, template_name: str) -> AsyncIterator[ProxyHarness]:
    # the proxy is given the template file the engine runs, as an operator would: local rendering is on
    template = TEMPLATES_DIR / f"{template_name}.jinja" if TEMPLATES[template_name] is not None else None
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url], store=store, fake=fake_engine, chat_template=str(template or "")
    ) as harness:
        yield harness
