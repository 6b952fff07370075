"""``serve --workers 2`` against one worker, where the proxy is the bottleneck (an engine that answers at once).

    python -m bench.workers                          # 64 and 256 sessions x 4 turns, 3 interleaved rounds
    python -m bench.workers --sizes 256 --rounds 1 --turns 3

Both proxies run on the Redis store in front of the same engine process (``load_tests.engine``,
0 ms, fixed 16-token reply); the runs alternate round by round. Reported per number of workers:
turns per second, p50/p99 turn latency, the proxy's CPU per turn (supervisor and workers
together, from their own counters) and the rest's: this client, the engine and redis-server. The
goal (issue 14): two workers ≥ 1.7× one worker's throughput where the proxy is the bottleneck.

On a machine whose cores are shared with the client and the engine (this one: 2 cores for all),
the rest takes a share the workers cannot have. So the bench also prints the ceiling these cores
put on the ratio, from the CPU it measured: with ``p1``, ``p`` the proxy's CPU per turn with one
and with N workers, ``c`` the rest's, and ``cores`` the CPUs this process may run on, one worker
does at most ``1/p1`` turns a second and N workers at most ``min(N/p, cores/(p + c))``, so

    ratio ≤ min(N · p1/p, cores · p1/(p + c))      cores to show R: R · (p + c)/p1

(the first term: N workers each as busy as one; the second: every core busy). Writes
``workers.json`` under ``--out``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (
    OUT,
    Services,
    cpu_seconds,
    free_port,
    markdown_table,
    percentile,
    rotated,
    start_engine,
    start_redis,
    usable_cpus,
    write_report,
)
from bench.proxy_overhead import ADMIN_KEY, Run, Target, measure

GOAL = 1.7  # issue 14: two workers' throughput over one's


def start(services: Services, workers: int, engine_url: str, redis_url: str) -> Target:
    port = free_port()
    argv = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
    argv += ["--store", redis_url, "--admin-key", ADMIN_KEY, "--log-level", "warning", "--log-format", "json"]
    argv += ["--workers", str(workers)]
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # one process: its own registry; several: the supervisor's
    process = services.start(f"proxy-{workers}", argv)
    base = f"http://127.0.0.1:{port}"
    services.wait_http(f"proxy-{workers}", f"{base}/readyz", timeout=300)
    return Target(f"{workers} worker(s)", f"{base}/v1/chat/completions", process.pid, base)


def summary(runs: list[Run]) -> dict[str, Any]:
    latencies = [latency for run in runs for latency in run.latencies]
    turns, seconds = sum(run.turns for run in runs), sum(run.seconds for run in runs)
    return {
        "turns": turns,
        "errors": sum(run.errors for run in runs),
        "turns_per_s": turns / seconds if seconds else 0.0,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "cpu_ms_per_turn": sum(run.cpu_turns for run in runs) / turns * 1000 if turns else float("nan"),
        "rest_cpu_ms_per_turn": sum(run.engine_cpu + run.others_cpu for run in runs) / turns * 1000
        if turns
        else float("nan"),
    }


def ceiling(one: dict[str, Any], many: dict[str, Any], workers: int, cores: int, goal: float) -> dict[str, float]:
    """The most ``workers`` can give over one on ``cores`` CPUs at the CPU per turn measured, and the
    CPUs it would take to show ``goal`` (see the module's docstring); ``one_busy``: the share of a core
    the single worker used, 1.0 where it was the bottleneck as the bound assumes."""
    p1, p, c = one["cpu_ms_per_turn"], many["cpu_ms_per_turn"], many["rest_cpu_ms_per_turn"]
    return {
        "ratio": min(workers * p1 / p, cores * p1 / (p + c)),
        "cores_for_goal": goal * (p + c) / p1,
        "one_busy": one["turns_per_s"] * p1 / 1000,
    }


async def run(args: argparse.Namespace, targets: dict[int, Target], engine_pid: int, redis_pid: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        for target in targets.values():  # warm: tokenizers load, connections open, outside the measurement
            await measure(http, target, engine_pid, 8, 2)
        for size in args.sizes:
            runs: dict[int, list[Run]] = {workers: [] for workers in targets}
            for round_index in range(args.rounds):
                for workers in rotated(list(targets), round_index):
                    result = await measure(http, targets[workers], engine_pid, size, args.turns, others=[redis_pid])
                    runs[workers].append(result)
                    print(
                        f"  {size:>5} sessions x {args.turns} turns, {workers} worker(s): "
                        f"{result.turns / result.seconds:7.1f} turns/s, errors {result.errors}",
                        flush=True,
                    )
            sizes = {workers: summary(each) for workers, each in runs.items()}
            one, two = sizes[1]["turns_per_s"], sizes[max(sizes)]["turns_per_s"]
            report[str(size)] = {
                "by_workers": sizes,
                "ratio": two / one if one else float("nan"),
                "ceiling": ceiling(sizes[1], sizes[max(sizes)], max(sizes), usable_cpus(), GOAL),
            }
    return report


def sizes_of(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The report's rows, one per number of sessions (the other keys say how it ran)."""
    return [(size, row) for size, row in report.items() if isinstance(row, dict) and "by_workers" in row]


def table(report: dict[str, Any]) -> str:
    """Per number of sessions: each proxy's throughput and CPU per turn (its own, and the rest's: client,
    engine, redis-server), the ratio, the ceiling these cores put on it and the cores the goal would take."""
    rows, many = [], "N"
    for size, row in sizes_of(report):
        cells = [
            f"{each['turns_per_s']:.0f} turns/s; proxy {each['cpu_ms_per_turn']:.2f} ms/turn, the rest "
            f"{each['rest_cpu_ms_per_turn']:.2f}; {each['errors']} errors"
            for each in row["by_workers"].values()
        ]
        many = max(row["by_workers"], key=int)
        limit = row["ceiling"]
        ratio, busy = f"{row['ratio']:.2f}x", f"{limit['one_busy']:.0%}"
        rows.append([size, *cells, ratio, busy, f"{limit['ratio']:.2f}x", f"{limit['cores_for_goal']:.1f}"])
    cpus = report.get("cpus", "?")
    header = ["sessions", "1 worker", f"{many} workers", "ratio", "1 worker busy", f"ceiling on {cpus} cores"]
    header.append(f"cores for {GOAL:g}x")
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256", help="concurrent sessions (default 64,256)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the many-worker proxy (default 2)")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON (default out/bench)")
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="rp-bench-workers-"))
    services = Services(workdir)
    try:
        redis_url = start_redis(services)
        engine, engine_url = start_engine(services)
        targets = {workers: start(services, workers, engine_url, redis_url) for workers in (1, args.workers)}
        report = asyncio.run(run(args, targets, engine.pid, dict(services.processes)["redis"].pid))
        report["cpus"] = usable_cpus()
        report["engine_cpu_s"] = cpu_seconds(engine.pid)
    finally:
        services.stop()
    write_report(args.out / "workers.json", report, "bench.workers", argv)
    print(table(report))
    for size, row in sizes_of(report):
        limit = row["ceiling"]
        print(
            f"{size} sessions: ratio {row['ratio']:.2f}x (one worker {limit['one_busy']:.0%} busy); "
            f"at most {limit['ratio']:.2f}x on {report['cpus']} CPU(s) at this CPU per turn, "
            f"{GOAL:g}x would take {limit['cores_for_goal']:.1f}"
        )


if __name__ == "__main__":
    main()
