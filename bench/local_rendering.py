"""Local rendering vs the engine's /tokenize: engine calls per turn, and time per bridge render.

  python bench/local_rendering.py                  # the fake engine (real SmolLM2 tokenizer)
  python bench/local_rendering.py --engine URL     # also a running vLLM (its model dir readable here)

Reports, for the Qwen3-style test template:
  calls     engine calls per chat turn through the proxy, rendering=engine vs rendering=auto
  bridge    time of one bridge render (ChatRenderer.bridge, anchors cached) at turn 2 and at
            turn 100 of a tool chat: local (encoded piece by piece, and whole), and through
            /tokenize (HTTP round trip included)
  root      time of a whole-conversation render of a long sample (what goes off the loop)
  turns     with --engine: wall and CPU time per chat turn through a proxy, both renderings
Times are medians (and p90) over repeated calls in this process; CPU time is process time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(call: Any, repeat: int) -> tuple[float, float, float]:
    """(median ms, p90 ms, CPU ms per call)."""
    await call()  # warm caches (anchors, compiled template)
    walls = []
    cpu = time.process_time()
    for _ in range(repeat):
        start = time.perf_counter()
        await call()
        walls.append((time.perf_counter() - start) * 1e3)
    cpu_ms = (time.process_time() - cpu) * 1e3 / repeat
    return statistics.median(walls), percentile(walls, 0.9), cpu_ms


def history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"What's the weather in city {i}? " * 3})
        messages.append({"role": "assistant", "content": f"It is sunny in city {i}, 20C, light wind. " * 3})
    return messages


async def calls_per_turn(tokenizer: Path, template: str, template_text: str) -> dict[str, Counter[str]]:
    from aiohttp import web

    from rollout_proxy.devtools.fake_engine import FakeEngine
    from rollout_proxy.embedded import serve_app
    from tests.harness import ProxyHarness

    results = {}
    for rendering in ("engine", "auto"):
        fake = FakeEngine(tokenizer, chat_template=template_text)
        calls: Counter[str] = Counter()

        @web.middleware
        async def count(request: web.Request, handler: Any, calls: Counter[str] = calls) -> web.StreamResponse:
            calls[request.path] += 1
            return await handler(request)

        app = fake.app()
        app.middlewares.append(count)
        runner, url = await serve_app(app)
        try:
            async with ProxyHarness.running(
                engine_urls=[url], rendering=rendering, chat_template=template, render_check_rate=0.0
            ) as proxy:
                messages = [{"role": "user", "content": "Weather in Paris?"}]
                session = await proxy.create_session(messages, tools=[TOOL])
                calls.clear()
                turns = 10
                for turn in range(turns):
                    answer = await session.client.chat.completions.create(model="m", messages=messages)
                    messages += [
                        answer.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": f"And tomorrow ({turn})?"},
                    ]
                results[rendering] = Counter({path: n / turns for path, n in calls.items()})
        finally:
            await runner.cleanup()
    return results


async def turn_costs(engine_url: str, template: str, turns: int = 40) -> dict[str, tuple[float, float]]:
    """Per chat turn through a proxy in this process against a running vLLM: (median wall ms, CPU ms
    of this process, i.e. proxy and client, vLLM's own CPU not in it). Every turn is a new follow-up
    to the same first answer (a branch), so prompts stay the same size and 1 token is generated."""
    from tests.harness import ProxyHarness

    costs = {}
    for rendering in ("engine", "auto", "engine", "auto"):  # the second run of each is kept (warm)
        async with ProxyHarness.running(
            engine_urls=[engine_url], rendering=rendering, chat_template=template, render_check_rate=0.0
        ) as proxy:
            messages = [{"role": "user", "content": "Weather in Paris?"}]
            session = await proxy.create_session(messages, tools=[TOOL], max_new_tokens=1, temperature=0.0)
            first = await session.client.chat.completions.create(model="m", messages=messages)
            history = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
            walls, cpu = [], time.process_time()
            for turn in range(turns):
                follow_up = {"role": "user", "content": f"And tomorrow, day {turn}?"}
                start = time.perf_counter()
                await session.client.chat.completions.create(model="m", messages=[*history, follow_up])
                walls.append((time.perf_counter() - start) * 1e3)
            costs[rendering] = (statistics.median(walls), (time.process_time() - cpu) * 1e3 / turns)
    return costs


async def growth(tokenizer: Path, template: str, template_text: str, turns: int = 100) -> dict[str, Any]:
    """One chat of ``turns`` turns through a proxy on the fake engine (all in this process), per
    rendering: median ms of the render step (``Renderers.delta``: the bridge) and of the whole
    turn (a plain HTTP client, the proxy, the fake engine: wall, and CPU time of this process, which
    shared cores disturb less), at turns 2-21 and at the last twenty.
    The request of a Chat Completions turn carries the whole history, so the whole turn grows
    with it (JSON, hashing the messages to find the parent, the prompt sent); the render step
    must not. (The openai SDK is not the client here: its request transform of 200 messages
    costs ~100 ms, more than everything else together.)"""
    from rollout_proxy.core.rendering import Renderers
    from rollout_proxy.devtools.fake_engine import FakeEngine, FakeEngineServer
    from tests.harness import ProxyHarness

    delta = Renderers.delta
    spent: list[float] = []

    async def timed_delta(self: Renderers, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await delta(self, *args, **kwargs)
        finally:
            spent.append((time.perf_counter() - start) * 1e3)

    Renderers.delta = timed_delta  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    try:
        for rendering in ("engine", "auto"):
            fake = FakeEngine(tokenizer, chat_template=template_text, max_model_len=32768)
            async with (
                FakeEngineServer(fake) as url,
                ProxyHarness.running(
                    engine_urls=[url], rendering=rendering, chat_template=template, render_check_rate=0.0
                ) as proxy,
            ):
                messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
                session = await proxy.create_session(messages, tools=[TOOL])
                fake.queue(*(f"It is sunny in city {turn}, 20C, light wind." for turn in range(turns)))
                renders, walls, cpus = [], [], []
                for turn in range(turns):
                    spent.clear()
                    start, cpu = time.perf_counter(), time.process_time()
                    status, answer = await proxy.request(
                        "POST", "/v1/chat/completions", json={"model": "m", "messages": messages}, token=session.api_key
                    )
                    walls.append((time.perf_counter() - start) * 1e3)
                    cpus.append((time.process_time() - cpu) * 1e3)
                    assert status == 200, answer
                    renders.append(sum(spent))
                    reply = {key: value for key, value in answer["choices"][0]["message"].items() if value is not None}
                    messages += [reply, {"role": "user", "content": f"And in city {turn}?"}]
            early, late = slice(1, 21), slice(turns - 20, turns)
            results[rendering] = {
                "render": (statistics.median(renders[early]), statistics.median(renders[late])),
                "turn": (statistics.median(walls[early]), statistics.median(walls[late])),
                "cpu": (statistics.median(cpus[early]), statistics.median(cpus[late])),
                "messages": len(messages),
            }
    finally:
        Renderers.delta = delta  # type: ignore[method-assign]
    return results


async def bridge_times(
    tokenizer: Path, template: str, template_text: str, engine_url: str | None, repeat: int
) -> list[tuple[str, Any]]:
    from rollout_proxy.devtools.fake_engine import FakeEngine, FakeEngineServer
    from rollout_proxy.engines.vllm_http import VLLMEngine
    from rollout_proxy.tokenization.local import LocalTemplate
    from rollout_proxy.tokenization.renderer import ChatRenderer

    local = LocalTemplate.load(tokenizer, template)
    # the same, encoding every text whole: what encoding piece by piece (tokenization.pieces) saves
    whole = LocalTemplate(local._tokenizer, template_text, origin="encoded whole", in_pieces=False)
    rows = []
    fake = FakeEngine(tokenizer, chat_template=template_text)
    async with FakeEngineServer(fake) as fake_url:
        sources: list[tuple[str, Any]] = [
            ("local", local),
            ("local, encoded whole", whole),
            ("fake /tokenize", VLLMEngine(fake_url)),
        ]
        if engine_url:
            sources.append(("vLLM /tokenize", VLLMEngine(engine_url)))
        for name, source in sources:
            renderer = ChatRenderer(source)
            for turn in (2, 100):
                # the bridge does not depend on the history: anchor + new messages only
                new = [{"role": "user", "content": f"And what about city {turn}? Answer briefly."}]

                async def bridge(renderer: ChatRenderer = renderer, new: list[dict[str, Any]] = new) -> Any:
                    return await renderer.bridge(
                        new,
                        after_role="assistant",
                        after_closed=True,
                        tools=[TOOL],
                        chat_template_kwargs=None,
                        add_generation_prompt=True,
                    )

                rows.append((f"bridge turn {turn:>3} {name}", await timed(bridge, repeat)))
            long = history(100)

            async def root(renderer: ChatRenderer = renderer, long: list[dict[str, Any]] = long) -> Any:
                return await renderer.render(long, tools=[TOOL], chat_template_kwargs=None, add_generation_prompt=True)

            rows.append((f"root render, 201 messages, {name}", await timed(root, max(3, repeat // 20))))
            if isinstance(source, VLLMEngine):
                await source.close()
    sync_ms = []
    for _ in range(max(3, repeat // 20)):
        start = time.perf_counter()
        local.render_ids(history(100), tools=[TOOL], add_generation_prompt=True, chat_template_kwargs=None)
        sync_ms.append((time.perf_counter() - start) * 1e3)
    rows.append(("root render, 201 messages, local, on the calling thread", (statistics.median(sync_ms), 0.0, 0.0)))
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", help="a running vLLM to time /tokenize against")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    from rollout_proxy.devtools.engine_env import ensure_checkpoints

    tokenizer = ensure_checkpoints()["dense"]
    template = str(ROOT / "src/rollout_proxy/devtools/templates/qwen3_style.jinja")
    template_text = Path(template).read_text()  # noqa: ASYNC240 (once, before anything runs)
    counts = await calls_per_turn(tokenizer, template, template_text)
    print("engine calls per chat turn (10 turns, after session create):")
    for rendering, calls in counts.items():
        print(f"  rendering={rendering:<6} " + ", ".join(f"{path} {n:g}" for path, n in sorted(calls.items())))
    if args.engine:
        print("\nchat turns through the proxy against --engine (1 generated token), the second run of each:")
        for rendering, (wall, cpu) in (await turn_costs(args.engine, template)).items():
            print(
                f"  rendering={rendering:<6} median {wall:.2f} ms per turn, CPU {cpu:.2f} ms per turn (proxy + client)"
            )
    print("\none chat of 100 turns on the fake engine, median ms at turns 2-21 / turns 81-100 (late/early):")
    for rendering, row in (await growth(tokenizer, template, template_text)).items():
        print(
            f"  rendering={rendering:<6} "
            + "; ".join(
                f"{what} {early:.2f} / {late:.2f} ({late / early:.2f}x)"
                for what, (early, late) in (
                    ("render step", row["render"]),
                    ("whole turn", row["turn"]),
                    ("its CPU", row["cpu"]),
                )
            )
            + f"; {row['messages']} messages at the end"
        )
    print("\nrender times (median ms / p90 ms / CPU ms in this process per call):")
    for name, (median, p90, cpu) in await bridge_times(tokenizer, template, template_text, args.engine, args.repeat):
        print(f"  {name:<58} {median:8.3f} {p90:8.3f} {cpu:8.3f}")


if __name__ == "__main__":
    asyncio.run(main())
