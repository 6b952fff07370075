"""``rollout-proxy serve`` with different options, side by side: the proxy's CPU per turn.

    python bench/serve_options.py                                  # the GC setting: tuned (default) vs Python's
    python bench/serve_options.py --variant "uvloop=--event-loop uvloop" --variant "asyncio=--event-loop asyncio"
    python bench/serve_options.py --store redis --rounds 2 --long-turns 0

Each variant is its own ``rollout-proxy serve`` process (memory store, or a redis-server started
here for ``--store redis``) in front of the same engine process (``load_tests.engine``, 0 ms, fixed
16-token reply), so its CPU time comes from its own counters (utime + stime). Runs alternate
between the variants round by round (the order flips), and report per variant:

  CPU per turn    the proxy's CPU seconds over ``--sessions`` × ``--turns`` turns (sessions at once)
  turns/s, p50    the same runs' throughput and median turn latency (client, engine and proxies share
                  the machine's cores: read them with the CPU)
  long run        ``--long-sessions`` conversations in lock step for ``--long-turns`` turns: the CPU
                  per turn over turns 2-6 and over the last five, and their ratio (issue 14's goal:
                  turn 100 ≤ 1.2× turn 2)

Writes ``serve_options.json`` under ``--out``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from proxy_overhead import ADMIN_KEY, Run, Target, cpu_line, lockstep, measure  # noqa: E402
from workers import summary as workers_summary  # noqa: E402

from load_tests.run import Services, free_port, start_engine, start_redis  # noqa: E402

DEFAULT_VARIANTS = ("gc tuned (the default)=", "Python's gc=--gc-threshold 0")


def start(services: Services, name: str, extra: list[str], engine_url: str, store: str) -> Target:
    port = free_port()
    argv = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
    argv += ["--store", store, "--admin-key", ADMIN_KEY, "--log-level", "warning", "--log-format", "json"]
    argv += ["--session-ttl", "3600", *extra]
    label = f"proxy-{len(services.processes)}"
    process = services.start(label, argv)
    base = f"http://127.0.0.1:{port}"
    services.wait_http(label, f"{base}/readyz", timeout=300)
    return Target(name, f"{base}/v1/chat/completions", process.pid, base)


def summary(runs: list[Run]) -> dict[str, Any]:
    """``bench/workers.py``'s summary, and the CPU per turn of each round (how steady it is)."""
    by_round = [run.cpu_turns / run.turns * 1000 if run.turns else None for run in runs]
    return workers_summary(runs) | {"cpu_ms_per_turn_by_round": by_round}


def long_summary(cpu: list[float]) -> dict[str, float]:
    early = statistics.mean(cpu[1:6]) * 1000
    late = statistics.mean(cpu[-5:]) * 1000
    line_turn2, line_last = cpu_line(cpu)
    return {
        "turn2_cpu_ms": early,
        "last_cpu_ms": late,
        "ratio": late / early if early else float("nan"),
        "line_ratio": line_last / line_turn2 if line_turn2 > 0 else float("nan"),
    }


async def interleaved(
    http: aiohttp.ClientSession, args: argparse.Namespace, targets: list[Target], engine_pid: int
) -> dict[str, list[Run]]:
    """A few warm-up turns each, then ``args.rounds`` rounds of ``args.sessions`` × ``args.turns`` per target,
    the order flipped every other round so that a slow spell of the machine falls on all of them."""
    runs: dict[str, list[Run]] = {target.name: [] for target in targets}
    for target in targets:  # warm: tokenizers load, connections open, outside the measurement
        await measure(http, target, engine_pid, 4, 3)
    for round_index in range(args.rounds):
        for target in targets if round_index % 2 == 0 else targets[::-1]:
            result = await measure(http, target, engine_pid, args.sessions, args.turns)
            runs[target.name].append(result)
            print(
                f"  round {round_index + 1}, {target.name:<24} {result.cpu_turns / max(result.turns, 1) * 1000:5.2f} "
                f"ms CPU per turn, {result.turns / result.seconds:7.1f} turns/s, errors {result.errors}",
                flush=True,
            )
    return runs


async def run(args: argparse.Namespace, targets: list[Target], engine_pid: int) -> dict[str, Any]:
    long: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        runs = await interleaved(http, args, targets, engine_pid)
        if args.long_turns:
            order = targets if args.rounds % 2 == 0 else list(reversed(targets))
            for target in order:
                _, cpu = await lockstep(http, target, args.long_sessions, args.long_turns)
                long[target.name] = long_summary(cpu) | {"cpu_ms_by_turn": [value * 1000 for value in cpu]}
                print(f"  long run: {target.name} done", flush=True)
    return {name: {"runs": summary(each), "long": long.get(name)} for name, each in runs.items()}


def table(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"{s['sessions']} sessions x {s['turns']} turns, {s['rounds']} rounds, store {s['store']}; long run "
        f"{s['long_sessions']} sessions x {s['long_turns']} turns; {s['cpus']} CPUs, load {s['load_average'][0]:.1f}",
        "",
        "| variant | serve options | CPU per turn | by round | turns/s | p50 | long run: turn 2 | last turns | ratio "
        "| line ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in report["results"].items():
        r, long = result["runs"], result["long"] or {}
        rounds = ", ".join(f"{value:.2f}" for value in r["cpu_ms_per_turn_by_round"] if value is not None)
        long_cells = (
            f"{long['turn2_cpu_ms']:.2f} ms | {long['last_cpu_ms']:.2f} ms | {long['ratio']:.2f}× "
            f"| {long.get('line_ratio', float('nan')):.2f}×"
            if long
            else "– | – | – | –"
        )
        lines.append(
            f"| {name} | `{report['variants'][name] or '(none)'}` | {r['cpu_ms_per_turn']:.2f} ms | {rounds} "
            f"| {r['turns_per_s']:.0f} | {r['p50_ms']:.1f} ms | {long_cells} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variant",
        action="append",
        metavar="NAME=OPTIONS",
        help="a proxy to run: its name and its serve options (repeat; default: " + "; ".join(DEFAULT_VARIANTS) + ")",
    )
    parser.add_argument("--store", choices=("memory", "redis"), default="memory", help="(default memory)")
    parser.add_argument("--sessions", type=int, default=32, help="concurrent sessions per run (default 32)")
    parser.add_argument("--turns", type=int, default=20, help="turns per session (default 20)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--long-turns", type=int, default=100, help="turns of the long run (0: none; default 100)")
    parser.add_argument("--long-sessions", type=int, default=16, help="sessions of the long run (default 16)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench", help="JSON (default out/bench)")
    args = parser.parse_args(argv)
    variants: dict[str, str] = {}
    for spec in args.variant or DEFAULT_VARIANTS:
        name, separator, options = spec.partition("=")
        if not separator or not name.strip():
            parser.error(f"--variant {spec!r}: expected NAME=OPTIONS")
        variants[name.strip()] = options.strip()
    if len(variants) < 2:
        parser.error("give at least two variants to compare")
    if args.long_turns and args.long_turns < 7:
        parser.error("--long-turns: 0 or at least 7 (turns 2-6 against the last five)")
    args.variants = variants
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-", dir=args.out)))
    try:
        engine, engine_url = start_engine(services)
        store = start_redis(services) if args.store == "redis" else "memory"
        targets = [
            start(services, name, shlex.split(options), engine_url, store) for name, options in args.variants.items()
        ]
        results = asyncio.run(run(args, targets, engine.pid))
    finally:
        services.stop()
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "variant", "variants")}
    report = {
        "settings": settings | {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "variants": args.variants,
        "results": results,
    }
    (args.out / "serve_options.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(report))
    print(f"wrote {args.out / 'serve_options.json'}")
    return report


if __name__ == "__main__":
    main()
