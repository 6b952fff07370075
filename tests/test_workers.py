"""Several workers on one Redis: any turn of any session can land on any worker.

Two apps on two ports sharing one Redis stand in for two processes (each has its own store
client, fleet and metrics, exactly as a worker does); one test starts ``serve --workers 2``
for real and checks that both processes answer on the one port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.cli import main
from rollout_proxy.proxy import workers as supervision
from rollout_proxy.proxy.workers import WORKER_HEADER
from rollout_proxy.state.redis import RedisStore
from tests.conftest import TEMPLATES, free_port
from tests.harness import ADMIN_KEY, ProxyHarness

USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture
async def engine(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    async with FakeEngineServer(fake) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
async def workers(redis_url: str, engine: FakeEngine) -> AsyncIterator[list[ProxyHarness]]:
    """Two proxies sharing one Redis (a store client each)."""
    async with AsyncExitStack() as stack:
        harnesses = []
        for index in range(2):
            store = await RedisStore.connect(redis_url)
            if index == 0:
                await store._redis.flushdb()
            stack.push_async_callback(store.close)
            harnesses.append(
                await stack.enter_async_context(ProxyHarness.running(engine_urls=[engine.url], store=store))
            )
        yield harnesses


async def post(http: aiohttp.ClientSession, url: str, path: str, body: Any, token: str) -> Any:
    async with http.post(url + path, json=body, headers={"Authorization": f"Bearer {token}"}) as response:
        answer = await response.json()
        assert response.status in (200, 201), answer
        return answer


async def test_the_turns_of_one_conversation_alternate_between_workers_and_stay_exact(
    workers: list[ProxyHarness],
) -> None:
    first = workers[0]
    async with aiohttp.ClientSession() as http:
        created = await post(http, first.url, "/v1/sessions", {"sample": {"messages": USER}}, ADMIN_KEY)
        token, messages, sent = created["api_key"], list(USER), []
        for turn in range(6):
            worker = workers[turn % 2]
            answer = await post(http, worker.url, "/v1/chat/completions", {"messages": messages}, token)
            prompt, output = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
            if sent:  # the new prompt is the last turn's exact tokens, then the bridge
                assert prompt[: len(sent[-1])] == sent[-1]
            sent.append(prompt + output)
            reply = answer["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and then {turn}?"}]
        last_id = answer["id"]
    trajectories = [await worker.trajectory(last_id) for worker in workers]
    assert trajectories[0] == trajectories[1]
    assert trajectories[0]["total_token_ids"] == sent[-1]  # every token, in order, as the engine saw it
    assert trajectories[0]["forks"] == []


async def test_a_jobs_request_concurrency_holds_across_workers(workers: list[ProxyHarness], engine: FakeEngine) -> None:
    engine.delay = 0.3
    body = {"sample": {"messages": USER}, "concurrency": {"key": "job-a", "max_requests": 2}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tokens = [(await post(http, workers[0].url, "/v1/sessions", body, ADMIN_KEY))["api_key"] for _ in range(6)]
        await asyncio.gather(
            *(
                post(http, workers[index % 2].url, "/v1/chat/completions", {"messages": USER}, token)
                for index, token in enumerate(tokens)
            )
        )
    assert len(engine.completions) == 6
    assert engine.max_inflight == 2  # six turns, three on each worker, never more than two at the engine


def test_workers_need_a_redis_store(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--workers", "2", "--store", "memory", "--admin-key", "k"])
    assert exit_.value.code == 2
    assert "needs a Redis store" in capsys.readouterr().err


@pytest.mark.parametrize(("code", "status"), [(supervision.EXIT_CANNOT_SERVE, 1), (0, 0)])
def test_a_worker_that_could_not_start_is_not_restarted_however_long_it_tried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: int, status: int
) -> None:
    """A worker whose store did not answer gives up after ~16 s of retries, longer than ``MIN_UPTIME_S``: its
    exit status, not its uptime, tells the parent not to start it again (the parent stops, exit 1). Any other
    exit is a worker that died while serving: started again."""
    monkeypatch.setattr(supervision, "MIN_UPTIME_S", 0.0)  # every worker here "served" long enough
    started: list[int] = []
    supervisor = supervision.Supervisor(2, [], {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, grace_s=5)

    def start(index: int) -> tuple[subprocess.Popen[bytes], float]:
        started.append(index)
        if len(started) > 4:  # the workers were started again, thrice: end the run as a SIGTERM does
            os.kill(os.getpid(), signal.SIGTERM)
        exits = f"import sys, time; time.sleep(0.3); sys.exit({code})"
        return subprocess.Popen([sys.executable, "-c", exits]), time.monotonic()

    monkeypatch.setattr(supervisor, "_start", start)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert supervisor.run() == status
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert len(started) == (2 if code == supervision.EXIT_CANNOT_SERVE else 5)


async def test_serve_with_two_workers_answers_from_both_processes_on_one_port(
    redis_url: str, engine: FakeEngine, tmp_path: Path
) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rollout_proxy",
        "serve",
        "--workers",
        "2",
        "--port",
        str(port),
        "--store",
        redis_url,
        "--engine",
        engine.url,
        "--admin-key",
        ADMIN_KEY,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        parent = subprocess.Popen(command, env=env, stdout=out, stderr=out)  # noqa: ASYNC220
    url = f"http://127.0.0.1:{port}"
    try:
        pids: set[str] = set()
        deadline = time.monotonic() + 180  # two fresh Pythons importing the proxy, on busy shared cores
        while len(pids) < 2 and time.monotonic() < deadline and parent.poll() is None:
            # a fresh connection each time: the kernel spreads connections, not requests, over the workers
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                try:
                    async with http.get(url + "/healthz") as response:
                        if response.status == 200:
                            pids.add(response.headers[WORKER_HEADER])
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.2)
        assert len(pids) == 2, log.read_text()[-3000:]
        assert str(parent.pid) not in pids
        # a session made through one worker answers through the other
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            created = await post(http, url, "/v1/sessions", {"sample": {"messages": USER}}, ADMIN_KEY)
            answered_by: set[str] = set()
            for _ in range(20):
                async with http.get(
                    url + f"/v1/sessions/{created['session_id']}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
                ) as response:
                    assert response.status == 200, await response.text()
                    answered_by.add(response.headers[WORKER_HEADER])
                if len(answered_by) == 2:
                    break
            assert len(answered_by) == 2
    finally:
        parent.send_signal(signal.SIGTERM)
        try:
            returncode = await asyncio.to_thread(parent.wait, 30)
        except subprocess.TimeoutExpired:
            parent.kill()
            raise
    assert returncode == 0
