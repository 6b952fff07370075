"""Memory soak: does a proxy give its memory back once sessions pass their TTL?

    python bench/memory_soak.py [--duration 180] [--ttl 30] [--rate 10] [--turns 3]

One run starts, side by side, a proxy on the memory store and a proxy on Redis (each
its own process, so the RSS sampled is the proxy's own), a fake engine (a third
process) and, unless ``--redis-url`` names one, a private redis-server. Every second
``--rate`` sessions start on each proxy; each does ``--turns`` chat turns, appends a
tool result (with an ``Idempotency-Key``) and finishes. Then nothing is sent for the
``--drain`` seconds (default: TTL + 5), and the table says, per store:

  RSS at the TTL mark (the first sessions start expiring), at the end of the load,
  growth between the two, RSS after the drain, sessions alive at the end and after
  the drain, RSS per open session (RSS delta over the idle baseline / sessions alive
  at the end) and bytes stored per session (memory: a deep size of the store's
  records; Redis: MEMORY USAGE of a session's keys).

A benchmark, not a test: the numbers go in the README's "Memory" section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
ADMIN_KEY = "soak-admin-key"
STATS = "/_soak/stats"
SAMPLE = 50  # sessions measured for bytes per session


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- the child processes -----------------------------------------------------------------


def deep_size(value: Any, seen: set[int] | None = None) -> int:
    """Bytes held by ``value`` and what it references (numpy arrays by their buffers)."""
    import dataclasses

    import numpy as np

    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return sys.getsizeof(value) + (value.nbytes if value.base is not None else 0)
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, list | tuple | set):
        size += sum(deep_size(item, seen) for item in value)
    elif dataclasses.is_dataclass(value):
        size += sum(deep_size(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return size


async def store_stats(store: Any) -> dict[str, Any]:
    """Sessions alive and bytes per session (a sample), read from inside the proxy process."""
    from rollout_proxy.state import keys
    from rollout_proxy.state.memory import MemoryStore

    if isinstance(store, MemoryStore):
        states = list(store._sessions.values())
        sample = states[:SAMPLE]
        per = sum(deep_size(state) for state in sample) / len(sample) if sample else 0
        return {"sessions": len(states), "bytes_per_session": per}
    ids = [
        key.decode().split("{")[1].split("}")[0]
        async for key in store._redis.scan_iter(match="rp:{*}:session", count=1000)
    ]
    per = 0.0
    for session_id in ids[:SAMPLE]:
        for key in keys.session_keys(session_id):
            per += await store._redis.memory_usage(key) or 0
    return {"sessions": len(ids), "bytes_per_session": per / min(len(ids), SAMPLE) if ids else 0}


async def serve_proxy(store_url: str, engine_url: str, port: int, ttl: float) -> None:
    from aiohttp import web

    from rollout_proxy.app import create_app, open_store
    from rollout_proxy.embedded import serve_app
    from rollout_proxy.logs import configure_logging
    from rollout_proxy.settings import Settings

    configure_logging("json", "warning")
    store = await open_store(store_url)
    settings = Settings(engines=(engine_url,), admin_key=ADMIN_KEY, store=store_url, session_ttl=ttl)
    app = create_app(settings, store=store)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(await store_stats(store))

    app.router.add_get(STATS, stats)
    await serve_app(app, port=port)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def serve_engine(port: int) -> None:
    from rollout_proxy.devtools.engine_env import ensure_checkpoints
    from rollout_proxy.devtools.fake_engine import FakeEngine, FakeEngineServer

    engine = FakeEngine(ensure_checkpoints()["dense"])
    async with FakeEngineServer(engine, port=port):
        print("ready", flush=True)
        while True:
            await asyncio.sleep(5)
            engine.completions.clear()  # the fake keeps a log; not what is measured here


# -- the load -----------------------------------------------------------------------------


@dataclass
class Proxy:
    name: str
    url: str
    process: subprocess.Popen
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the load, RSS MiB)
    errors: int = 0
    sessions: int = 0

    def rss_at(self, t: float) -> float:
        return min(self.samples, key=lambda sample: abs(sample[0] - t))[1]


async def rollout(http: aiohttp.ClientSession, proxy: Proxy, index: int, turns: int) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Rollout {index}: think of a word and a number."}]
    body = {"sample": {"messages": messages}, "generation": {"max_new_tokens": 64}}
    try:
        async with http.post(f"{proxy.url}/v1/sessions", json=body, headers=admin) as answer:
            session = await answer.json()
        plugin = {"Authorization": f"Bearer {session['api_key']}"}
        last_id = None
        for turn in range(turns):
            async with http.post(
                f"{session['base_url']}/chat/completions", json={"model": "m", "messages": messages}, headers=plugin
            ) as answer:
                reply = await answer.json()
            last_id = reply["id"]
            messages = [*messages, reply["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
        tool = [{"role": "user", "content": "a tool said: 42"}]
        async with http.post(
            f"{session['base_url']}/sessions/{session['session_id']}/messages",
            json={"messages": tool, "previous_response_id": last_id},
            headers={**plugin, "Idempotency-Key": str(uuid.uuid4())},
        ) as answer:
            assert answer.status == 201, await answer.text()
        async with http.post(
            f"{proxy.url}/v1/sessions/{session['session_id']}/finish", json={"status": "success"}, headers=admin
        ) as answer:
            assert answer.status == 200, await answer.text()
        proxy.sessions += 1
    except Exception:
        proxy.errors += 1


async def stats(http: aiohttp.ClientSession, proxy: Proxy) -> dict[str, Any]:
    async with http.get(proxy.url + STATS) as answer:
        return await answer.json()


async def soak(proxies: list[Proxy], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {proxy.name: {} for proxy in proxies}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.sleep(2)
        for proxy in proxies:
            results[proxy.name]["idle"] = rss_mib(proxy.process.pid)
        tasks: set[asyncio.Task] = set()
        started = time.monotonic()
        next_sample, index = 0.0, 0
        while (elapsed := time.monotonic() - started) < args.duration:
            if elapsed >= next_sample:
                for proxy in proxies:
                    proxy.samples.append((elapsed, rss_mib(proxy.process.pid)))
                if next_sample % 10 == 0:
                    print(f"{elapsed:5.0f}s " + "  ".join(f"{p.name} {p.samples[-1][1]:6.1f} MiB" for p in proxies))
                next_sample += 1.0
            while index < elapsed * args.rate:
                for proxy in proxies:
                    task = asyncio.create_task(rollout(http, proxy, index, args.turns))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                index += 1
            await asyncio.sleep(0.01)
        if tasks:
            await asyncio.wait(tasks)
        for proxy in proxies:
            result = results[proxy.name]
            result["ttl_mark"], result["end"] = proxy.rss_at(args.ttl), rss_mib(proxy.process.pid)
            result.update({f"end_{k}": v for k, v in (await stats(http, proxy)).items()})
        print(f"draining {args.drain:.0f}s (no traffic)...")
        await asyncio.sleep(args.drain)
        for proxy in proxies:
            result = results[proxy.name]
            result["drained"] = rss_mib(proxy.process.pid)
            result["drained_sessions"] = (await stats(http, proxy))["sessions"]
            result["done"], result["errors"] = proxy.sessions, proxy.errors
    return results


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        "| store | RSS idle | RSS at TTL mark | RSS at end | growth TTL→end | sessions alive at end "
        "| RSS after drain | alive after drain | RSS / open session | bytes stored / session | rollouts (errors) |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, r in results.items():
        growth = (r["end"] - r["ttl_mark"]) / r["ttl_mark"] * 100
        per_open = (r["end"] - r["idle"]) * 1024 / r["end_sessions"] if r["end_sessions"] else 0.0
        lines.append(
            f"| {name} | {r['idle']:.1f} MiB | {r['ttl_mark']:.1f} MiB | {r['end']:.1f} MiB | {growth:+.1f}% "
            f"| {r['end_sessions']} | {r['drained']:.1f} MiB | {r['drained_sessions']} | {per_open:.1f} KiB "
            f"| {r['end_bytes_per_session'] / 1024:.1f} KiB | {r['done']} ({r['errors']}) |"
        )
    settings = f"{args.rate:g} sessions/s per store, {args.turns} turns each, TTL {args.ttl:g} s, {args.duration:g} s"
    return "\n".join([settings, "", *lines])


# -- processes ------------------------------------------------------------------------------


def child(*argv: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert process.stdout is not None
    for line in process.stdout:  # set-up may print first
        if line.strip() == "ready":
            return process
    process.kill()
    raise RuntimeError(f"{argv[0]} did not start")


def start_redis() -> tuple[subprocess.Popen, str, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    port, workdir = free_port(), tempfile.mkdtemp(prefix="rp-soak-redis-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0", workdir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--ttl", type=float, default=30.0, help="session TTL in seconds (default 30)")
    parser.add_argument("--rate", type=float, default=10.0, help="sessions started per second, per store (default 10)")
    parser.add_argument("--turns", type=int, default=3, help="chat turns per session (default 3)")
    parser.add_argument("--drain", type=float, help="seconds without traffic after the load (default TTL + 5)")
    parser.add_argument("--redis-url", help="an empty Redis to use (default: a private redis-server)")
    args = parser.parse_args()
    args.drain = args.ttl + 5 if args.drain is None else args.drain

    processes: list[subprocess.Popen] = []
    redis_workdir = None
    try:
        redis_url = args.redis_url
        if redis_url is None:
            redis, redis_url, redis_workdir = start_redis()
            processes.append(redis)
        engine_port = free_port()
        processes.append(child("engine", str(engine_port)))
        engine_url = f"http://127.0.0.1:{engine_port}"
        proxies = []
        for name, store in (("memory", "memory"), ("redis", redis_url)):
            port = free_port()
            process = child("proxy", store, engine_url, str(port), str(args.ttl))
            processes.append(process)
            proxies.append(Proxy(name, f"http://127.0.0.1:{port}", process))
        print(table(asyncio.run(soak(proxies, args)), args))
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=10)
        if redis_workdir:
            shutil.rmtree(redis_workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        asyncio.run(serve_engine(int(sys.argv[2])))
    elif len(sys.argv) > 1 and sys.argv[1] == "proxy":
        store_url, engine_url, port, ttl = sys.argv[2:6]
        asyncio.run(serve_proxy(store_url, engine_url, int(port), float(ttl)))
    else:
        main()
