"""Walk one chat turn through the proxy and count what it crosses.

Traces the second turn of a tool-calling chat (a bridge is rendered after the parent's
exact tokens) on the fake engine with the memory store, and reports:
  modules   distinct rollout_proxy modules whose functions run during the turn
  packages  distinct subpackages / top-level modules among them
  climbs    calls into a package that is already on the call stack below the caller
            (a layer calling back up into one it was called from)
Only the first entry into each frame counts (coroutine resumptions are not calls).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


async def main(template: str) -> None:
    from rollout_proxy.devtools.engine_env import ensure_checkpoints
    from rollout_proxy.devtools.fake_engine import FakeEngine, FakeEngineServer
    from tests.harness import WEATHER_TOOL, ProxyHarness

    tokenizer = ensure_checkpoints()["dense"]
    engine = FakeEngine(tokenizer, chat_template=template)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    async with FakeEngineServer(engine) as url, ProxyHarness.running(engine_urls=[url], fake=engine) as proxy:
        session = await proxy.create_session([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
        engine.queue(call)
        first = await session.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather in Paris?"}]
        )
        tool_call = first.choices[0].message.tool_calls[0]
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny, 21 C"},
        ]
        # warm once on another session so one-off caches do not count
        engine.queue(call, "It is sunny.")
        warm = await proxy.create_session([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
        w1 = await warm.client.chat.completions.create(model="m", messages=messages[:1])
        wc = w1.choices[0].message.tool_calls[0]
        await warm.client.chat.completions.create(
            model="m",
            messages=[
                messages[0],
                w1.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": wc.id, "content": "sunny, 21 C"},
            ],
        )

        engine.queue("Sunny again.")
        seen: set[int] = set()
        alive: list[object] = []  # frames kept alive so their ids are not reused during the trace
        events: list[tuple[str, str, str]] = []  # (callee module, function, caller-stack packages)

        def profile(frame, event, arg):
            if event != "call":
                return
            module = frame.f_globals.get("__name__", "")
            if not module.startswith("rollout_proxy") or module.startswith("rollout_proxy.devtools"):
                return
            if id(frame) in seen:
                return
            seen.add(id(frame))
            alive.append(frame)
            stack = []
            caller = frame.f_back
            while caller is not None:
                name = caller.f_globals.get("__name__", "")
                if name.startswith("rollout_proxy") and not name.startswith("rollout_proxy.devtools"):
                    stack.append(package_of(name))
                caller = caller.f_back
            events.append((module, frame.f_code.co_name, ",".join(stack)))

        # coroutine chains: walk awaiting coroutines is not possible via f_back; use the task's stack instead
        sys.setprofile(profile)
        try:
            await session.client.chat.completions.create(model="m", messages=messages)
        finally:
            sys.setprofile(None)

    modules = sorted({m for m, _, _ in events})
    packages = sorted({package_of(m) for m in modules})
    climbs = []
    for module, function, stack in events:
        below = stack.split(",") if stack else []
        if not below:
            continue
        caller_pkg, pkg = below[0], package_of(module)
        if pkg != caller_pkg and pkg in below[1:]:
            climbs.append(f"{below[0]} -> {module}.{function}")
    print(f"modules: {len(modules)}")
    for m in modules:
        print("   ", m)
    print(f"packages: {len(packages)} {packages}")
    print(f"climbs back: {len(climbs)}")
    for c in climbs:
        print("   ", c)


if __name__ == "__main__":
    asyncio.run(main((ROOT / "src/rollout_proxy/devtools/templates/qwen3_style.jinja").read_text()))
