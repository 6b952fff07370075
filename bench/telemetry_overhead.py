"""What the proxy's metrics and traces cost per turn: the same turns with them off, on (no exporter, the
default) and recording every span (an in-memory exporter), interleaved round by round.

    python bench/telemetry_overhead.py                  # 3 rounds of 200 sequential turns per variant
    python bench/telemetry_overhead.py --rounds 5 --turns 500

In-process (the fake engine, the memory store, one session, a 4-token reply), so the turn is mostly
the proxy's own work and the telemetry's share shows. "off" replaces the telemetry middleware, the
store wrapper and the engine-call span with no-ops. Prints median and p90 turn latency per variant.
A benchmark, not a test: on a shared machine, compare the variants of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import rollout_proxy.app as app_module
from rollout_proxy import tracing
from rollout_proxy.devtools.engine_env import ensure_checkpoints
from rollout_proxy.devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.embedded import serve_app
from rollout_proxy.logs import configure_logging
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.settings import Settings

USER = [{"role": "user", "content": "Hi"}]
ADMIN_KEY = "bench-admin-key"


@web.middleware
async def passthrough(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    return await handler(request)


@contextlib.contextmanager
def telemetry_off() -> Any:
    saved = (app_module.telemetry_middleware, app_module.InstrumentedStore, tracing.engine_call)
    app_module.telemetry_middleware = passthrough  # type: ignore[assignment]
    app_module.InstrumentedStore = lambda store, metrics: store  # type: ignore[assignment,misc]
    tracing.engine_call = lambda *args: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        app_module.telemetry_middleware, app_module.InstrumentedStore, tracing.engine_call = saved


async def turns(engine: FakeEngine, url: str, variant: str, n: int) -> list[float]:
    import openai

    settings = Settings(engines=(url,), admin_key=ADMIN_KEY, rendering="engine")
    exporters = [InMemorySpanExporter()] if variant == "recording" else []
    with telemetry_off() if variant == "off" else contextlib.nullcontext():
        app = app_module.create_app(settings, span_exporters=exporters)
    runner, proxy_url = await serve_app(app)
    http = ProxyClient(proxy_url, ADMIN_KEY)
    try:
        body = {"sample": {"messages": USER}, "generation": {"max_new_tokens": 4}}
        status, session = await http.asend("POST", "/v1/sessions", json=body)
        assert status == 201, session
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        times = []
        for _ in range(n):
            engine.queue("Hello.")
            started = time.perf_counter()
            await client.chat.completions.create(model="m", messages=USER)
            times.append(time.perf_counter() - started)
        await client.close()
        return times
    finally:
        await http.aclose()
        await runner.cleanup()


async def main(rounds: int, n: int) -> None:
    engine = FakeEngine(ensure_checkpoints()["dense"])
    async with FakeEngineServer(engine) as url:
        results: dict[str, list[float]] = {"off": [], "on": [], "recording": []}
        for round_ in range(rounds):
            order = list(results)[round_ % 3 :] + list(results)[: round_ % 3]
            for variant in order:
                results[variant] += await turns(engine, url, variant, n)
    for variant, times in results.items():
        times.sort()
        print(
            f"{variant:>9}: median {statistics.median(times) * 1000:6.2f} ms"
            f"  p90 {times[int(len(times) * 0.9)] * 1000:6.2f} ms  ({len(times)} turns)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args()
    configure_logging("json", "warning")
    asyncio.run(main(args.rounds, args.turns))
