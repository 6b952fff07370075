"""Zero-pause benchmark: the turn latency of sessions on other policies while a LoRA adapter is updated.

    python -m bench.policy_update [--duration 90] [--sessions 16] [--phase 6] [--every 0.5] [--reload 1.0]

Two fake vLLM engines with run-time LoRA loading (``devtools.fake_engine``, SmolLM2's real tokenizer, its
``max_lora_rank`` set as ``--enable-lora`` does), each its own process answering in ``--delay`` seconds; a
``rollout-proxy serve`` in front of them (its own process, default settings, memory store); two LoRA
policies registered on it, ``job-a`` and ``job-b`` (random adapters, ``devtools.lora_adapter``); and, in this
process, ``--sessions`` sessions on each of three policies at once (``job-a``, ``job-b``, the base model), each
a multi-turn chat over plain HTTP, one session after another, for ``--duration`` seconds.

The load runs through phases of ``--phase`` seconds, in a rotating order (``bench.harness.rotated``):

  quiet          nothing is updated
  adapter update ``job-a`` publishes a new version every ``--every`` seconds
                 (``POST /v1/admin/policies/job-a/versions``: every engine loads it beside the one before)
  full weights   the base policy's full-weight path, as a trainer runs it: pause (``keep``), ``--reload``
                 seconds standing for loading the weights, resume at the next version; once per phase, in
                 its middle (the fleet's gate holds the turns of every policy: the base changes under all)

A turn belongs to the phase it started and ended in (one that straddles two is counted apart); its latency is compared per policy across phases: p50, p99 and
max. The goal is the adapter-update column equal to the quiet one for ``job-b`` and the base (they never
wait) and for ``job-a`` too (its calls go on, on the version their engine has); the full-weight column shows
what the same sessions pay when the base's weights change instead. ``policy_update.json`` under ``--out``
holds the summary, ``policy_update_turns.json`` every turn (start, latency, ok, phase). A benchmark, not a
test: the published run is on docs/benchmarks/policy_update.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet_faults import Load, Turn, admin_call, session_loop, start_proxy, wait_for_line, wait_ready
from bench.harness import OUT, ROOT, child_env, free_port, markdown_table, percentile, rotated, write_report

POLICIES = ("job-a", "job-b", "base")  # job-a is the one updated
PHASES = ("quiet", "adapter update", "full weights")
MAX_LORA_RANK = 16


async def serve_engine(port: int, delay: float) -> None:
    """A fake engine serving LoRA adapters (loading and unloading at run time)."""
    from devtools.engine_env import ensure_checkpoints
    from devtools.fake_engine import FakeEngine, FakeEngineServer

    engine = FakeEngine(ensure_checkpoints()["dense"], delay=delay, max_lora_rank=MAX_LORA_RANK)
    async with FakeEngineServer(engine, port=port):
        print("ready", flush=True)
        while True:
            await asyncio.sleep(5)
            engine.completions.clear()  # the fake's logs, not what is measured here
            engine.generations.clear()


def start_engine(port: int, delay: float) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.policy_update", "--child-engine", str(port), "--delay", str(delay)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    return wait_for_line(process, "ready")


@dataclass
class Updates:
    """What the phases did, on the loads' clock: each phase's window, each adapter publish, each full-weight update."""

    started: float
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (phase, from, to) in seconds
    published: list[dict[str, Any]] = field(default_factory=list)
    full_weight_updates: list[dict[str, float]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started


async def run_phases(
    http: aiohttp.ClientSession, url: str, load: Updates, adapters: list[Path], args: argparse.Namespace, rounds: int
) -> None:
    """The phases in rotating order; ``adapters`` are the directories job-a's versions alternate between."""
    fleet_version = 0
    published = 0
    for round_index in range(rounds):
        for phase in rotated(PHASES, round_index):
            begins = load.now()
            ends = time.monotonic() + args.phase
            if phase == "adapter update":
                while time.monotonic() < ends:
                    t0 = time.monotonic()
                    path = adapters[published % len(adapters)]
                    answer = await admin_call(
                        http, url, "POST", "/v1/admin/policies/job-a/versions", {"path": str(path)}
                    )
                    published += 1
                    load.published.append(
                        {"at": load.now(), "seconds": time.monotonic() - t0, "version": answer.get("version")}
                    )
                    await asyncio.sleep(max(0.0, args.every - (time.monotonic() - t0)))
            elif phase == "full weights":
                # mid-phase, so the turns it holds start and end within the phase (a straddling one is set apart)
                await asyncio.sleep(max(0.0, (args.phase - args.reload) / 2))
                t0 = time.monotonic()
                await admin_call(http, url, "POST", "/v1/admin/pause", {"mode": "keep"})
                paused = time.monotonic()
                paused_at = load.now()
                await asyncio.sleep(args.reload)  # the trainer loads the new weights into the engines
                fleet_version += 1
                await admin_call(http, url, "POST", "/v1/admin/resume", {"policy_version": fleet_version})
                load.full_weight_updates.append(
                    {
                        "at": load.now(),
                        "paused_at": paused_at,  # every engine paused: from here to the resume nothing is sampled
                        "pause_seconds": paused - t0,
                        "paused_seconds": time.monotonic() - paused,
                    }
                )
            await asyncio.sleep(max(0.0, ends - time.monotonic()))
            load.phases.append((phase, begins, load.now()))


def stats(turns: list[Turn]) -> dict[str, Any]:
    ok = [t.latency * 1000 for t in turns if t.ok]
    if not ok:
        return {"turns": 0, "failed": len(turns)}
    return {
        "turns": len(ok),
        "failed": len(turns) - len(ok),
        "p50_ms": percentile(ok, 50),
        "p99_ms": percentile(ok, 99),
        "max_ms": max(ok),
    }


def phase_of(turn: Turn, phases: list[tuple[str, float, float]]) -> str | None:
    """The phase a turn ran in from its start to its end; None for one that straddles two."""
    for phase, begins, ends in phases:
        if begins <= turn.started and turn.started + turn.latency <= ends:
            return phase
    return None


def analyse(loads: dict[str, Load], updates: Updates) -> dict[str, Any]:
    phase = {id(turn): phase_of(turn, updates.phases) for load in loads.values() for turn in load.turns}
    turns = [turn for load in loads.values() for turn in load.turns]
    by = {
        policy: {name: stats([t for t in load.turns if phase[id(t)] == name]) for name in PHASES}
        for policy, load in loads.items()
    }
    seconds = [p["seconds"] for p in updates.published]
    return {
        "by_policy": by,
        "turns": len(turns),
        "failed_turns": sum(1 for t in turns if not t.ok),
        "straddling_turns": sum(1 for t in turns if phase[id(t)] is None),
        "errors": sorted({t.error for t in turns if not t.ok})[:10],
        "session_errors": [error for load in loads.values() for error in load.session_errors][:10],
        "adapter_versions_published": len(updates.published),
        "published": updates.published,
        "publish_ms": {"p50": percentile(seconds, 50) * 1000, "max": max(seconds) * 1000} if seconds else {},
        "full_weight_updates": updates.full_weight_updates,
        "phases": updates.phases,
    }


def turn_rows(loads: dict[str, Load], updates: Updates) -> dict[str, list[list[Any]]]:
    """Every turn per policy: [start, latency, ok, phase] (seconds on the loads' clock; phase None: straddling)."""
    return {
        policy: [[t.started, t.latency, t.ok, phase_of(t, updates.phases)] for t in load.turns]
        for policy, load in loads.items()
    }


def table(result: dict[str, Any]) -> str:
    """Per policy and phase: p50 / p99 / max turn latency (turns)."""
    rows = []
    for policy in POLICIES:
        row: list[object] = [policy if policy != "job-a" else "job-a (updated)"]
        for phase in PHASES:
            s = result["by_policy"][policy][phase]
            cell = f"{s['p50_ms']:.0f} / {s['p99_ms']:.0f} / {s['max_ms']:.0f} ms ({s['turns']})" if s["turns"] else "-"
            row.append(cell + (f", {s['failed']} failed" if s.get("failed") else ""))
        rows.append(row)
    return markdown_table(["sessions on", *(f"{p}: p50 / p99 / max" for p in PHASES)], rows)


def summary(result: dict[str, Any]) -> str:
    """The table, then what the phases did and whether anything failed (the page's generated block)."""
    publish = result["publish_ms"]
    updates = result["full_weight_updates"]
    held = max((u["paused_seconds"] for u in updates), default=0.0)
    lines = [
        f"{result['turns']} turns, {result['failed_turns']} failed ({result['straddling_turns']} straddling two "
        f"phases, counted apart); {len(result['session_errors'])} sessions refused",
        f"job-a: {result['adapter_versions_published']} versions published, each loaded by every engine in "
        f"{publish.get('p50', 0):.0f} ms at the median (max {publish.get('max', 0):.0f} ms)",
        f"full weights: {len(updates)} pauses (`keep`), the fleet held up to {held:.2f} s each",
    ]
    return table(result) + "\n\n" + "\n".join(f"- {line}" for line in lines)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from devtools.engine_env import ensure_checkpoints
    from devtools.lora_adapter import build_adapter

    dense = ensure_checkpoints()["dense"]
    engines: list[subprocess.Popen[str]] = []
    proxy: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="policy-update-") as tmp:
        adapters = [build_adapter(dense, Path(tmp) / f"a{seed}", rank=8, seed=seed) for seed in range(2)]
        other = build_adapter(dense, Path(tmp) / "b", rank=8, seed=7)
        try:
            urls = []
            for _ in range(args.engines):
                port = free_port()
                engines.append(await asyncio.to_thread(start_engine, port, args.delay))
                urls.append(f"http://127.0.0.1:{port}")
            proxy_port = free_port()
            proxy = start_proxy(proxy_port, urls)
            url = f"http://127.0.0.1:{proxy_port}"
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
                await wait_ready(http, url)
                await admin_call(http, url, "POST", "/v1/admin/policies", {"name": "job-a", "path": str(adapters[0])})
                await admin_call(http, url, "POST", "/v1/admin/policies", {"name": "job-b", "path": str(other)})
                # warm-up, not measured: each engine's first render waits for the proxy's start-up check of its
                # template (core.rendering), seconds on a busy machine
                warm = Load(url, 1)
                await asyncio.gather(
                    *(
                        session_loop(http, warm, worker, 1.0, policy=None if policy == "base" else policy)
                        for policy in POLICIES
                        for worker in range(args.engines)
                    )
                )
                updates = Updates(time.monotonic())
                loads = {policy: Load(url, args.turns, started=updates.started) for policy in POLICIES}
                rounds = max(1, int(args.duration // (args.phase * len(PHASES))))
                until = rounds * args.phase * len(PHASES)
                workers = [
                    session_loop(http, load, worker, until, policy=None if policy == "base" else policy)
                    for policy, load in loads.items()
                    for worker in range(args.sessions)
                ]
                await asyncio.gather(run_phases(http, url, updates, adapters, args, rounds), *workers)
                result = analyse(loads, updates)
                result["warm_up"] = {"turns": len(warm.turns), "failed": sum(1 for t in warm.turns if not t.ok)}
                result["turns_by_policy"] = turn_rows(loads, updates)
                result["policies_at_end"] = await admin_call(http, url, "GET", "/v1/admin/policies")
        finally:
            for engine in engines:
                engine.kill()
            if proxy is not None:
                proxy.terminate()
                proxy.wait(timeout=10)
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("child_engine", "out")}
    result["rounds"] = rounds
    result["cpus"] = os.cpu_count()
    result["load_average"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load (default 90)")
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions per policy (default 16)")
    parser.add_argument("--turns", type=int, default=4, help="chat turns per session (default 4)")
    parser.add_argument("--phase", type=float, default=6.0, help="seconds per phase (default 6)")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between adapter versions (default 0.5)")
    parser.add_argument("--reload", type=float, default=1.0, help="seconds a full-weight load takes (default 1)")
    parser.add_argument("--engines", type=int, default=2, help="engine processes (default 2)")
    parser.add_argument("--delay", type=float, default=0.05, help="engine seconds per completion (default 0.05)")
    parser.add_argument("--out", type=Path, default=OUT, help="where policy_update.json goes (default out/bench)")
    parser.add_argument("--child-engine", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_engine is not None:
        asyncio.run(serve_engine(args.child_engine, args.delay))
        return
    result = asyncio.run(bench(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_update_turns.json").write_text(json.dumps(result.pop("turns_by_policy")))
    out = write_report(args.out / "policy_update.json", result, "bench.policy_update", argv)
    print(table(result))
    print(
        f"turns: {result['turns']} ({result['failed_turns']} failed); adapter versions published: "
        f"{result['adapter_versions_published']} (publish p50 {result['publish_ms'].get('p50', 0):.0f} ms); "
        f"full-weight updates: {len(result['full_weight_updates'])}; session errors: {result['session_errors']}"
    )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
