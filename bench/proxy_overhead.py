"""Side by side in one run: the engine called directly, rollout-proxy (memory and Redis stores), LiteLLM's proxy.

    python -m bench.proxy_overhead                      # the README's run (a few minutes on 2 cores)
    python -m bench.proxy_overhead --quick              # 1 and 32 sessions, one round, 20-turn long run
    python -m bench.proxy_overhead --sizes 1,32 --delays 0 --no-litellm --out out/bench

Every target talks to the same engine process (``load_tests.engine``, fixed 16-token reply), one
with a 0 ms and one with a 50 ms completion; each proxy is its own process (``rollout-proxy
serve``), so its CPU time is read from its own counters (see ``cpu_seconds``). For each
number of concurrent sessions (1, 32, 256, 1,024 by default), each session a Chat Completions
conversation resending its history as the openai SDK does, the targets run in turn, interleaved
round by round (the order rotates: ``bench.harness.rotated``), and the run reports per target:

  p50 / p99 overhead per turn  the target's turn latency percentile minus the direct one's
  throughput ratio             turns per second over direct's, same sessions and turns
  CPU per turn                 the proxy process's CPU seconds over the turns (session creation
                               measured apart: CPU per session created)

and a long run (``--long-turns``, default 100, sessions in lock step; ``--long-rounds`` of them per
target, interleaved) comparing turn 100 with turn 2: latency and the proxy's CPU per turn over the
first and last five turns, and the least-squares line through the CPU of every turn (read at turn 2
and at the last). Where Linux has it, CPU is read from the scheduler's nanosecond count per thread
(``/proc/PID/task/*/schedstat``), not psutil's 10 ms ticks.

``--baseline CHECKOUT`` (a git worktree of another commit: ``git worktree add --detach /tmp/rp-base 70c855b``)
starts that checkout's proxy beside this tree's on each store (its ``src`` first on ``PYTHONPATH``, the same
interpreter, engine and redis-server), in the same rotated order: targets ``baseline (memory)`` and
``baseline (redis)``. On the Redis store the run also counts per turn the reads of its clients' sockets
redis-server made (round trips: a pipeline is one) and the commands it processed, a script's own included
(``INFO stats``; ``tests/state/test_round_trips.py`` holds a turn to two round trips).

Direct = the engine's vLLM-style ``/v1/chat/completions`` (it renders the whole history each
turn, as vLLM does); the proxies call its ``/v1/completions`` with token ids. LiteLLM runs
from its own venv (``--litellm``, default ``~/.cache/rollout-proxy/litellm-venv/bin/litellm``;
``pip install 'litellm[proxy]'`` there); when it is not installed its column is skipped, said so.
With ``--proxy-cpus`` (say ``1`` on two cores) the proxies, redis-server and LiteLLM are pinned to
those CPUs and the client and the engine to the others, for every target direct included: the same
client and engine with and without a proxy on cores of its own, as it is deployed, where by default
all of them share every core. Writes ``proxy_overhead.json`` and ``proxy_overhead.png`` under
``--out``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.harness import (
    OUT,
    ROOT,
    Services,
    baseline_env,
    cpu_line,
    cpu_seconds,
    free_port,
    percentile,
    pin,
    revision,
    rotated,
    start_engine,
    start_redis,
    write_report,
)

ADMIN_KEY = "bench-admin-key"
LITELLM_KEY = "sk-bench"
DEFAULT_LITELLM = Path(os.environ.get("ROLLOUT_PROXY_CACHE", Path.home() / ".cache/rollout-proxy"))
DEFAULT_LITELLM = DEFAULT_LITELLM / "litellm-venv" / "bin" / "litellm"
MAX_TOKENS = 16


@dataclass
class Target:
    name: str
    url: str  # the chat completions URL
    pid: int | None = None  # the process whose CPU is its own (None: direct)
    base: str | None = None  # a rollout-proxy's base URL (sessions are opened there)
    key: str | None = None  # bearer for every call (LiteLLM's master key)
    redis: str | None = None  # the Redis store's URL (its commands per turn are counted)


@dataclass
class Run:
    """One target's run of ``sessions`` × ``turns``."""

    latencies: list[float] = field(default_factory=list)  # seconds, every answered turn
    seconds: float = 0.0  # wall time of the turns (session creation not included)
    turns: int = 0
    errors: int = 0
    first_error: str = ""
    cpu_turns: float = 0.0  # CPU seconds of the target's process over the turns
    cpu_create: float = 0.0  # ... over creating the sessions
    engine_cpu: float = 0.0  # CPU seconds of the engine over the turns
    others_cpu: float = 0.0  # ... of this client (the bench's own process) and of ``measure``'s ``others``
    redis_commands: int = 0  # commands redis-server processed over the turns (a Redis-store proxy's)
    redis_reads: int = 0  # ... and reads of its clients' sockets: round trips


async def redis_counts(url: str | None) -> tuple[int, int]:
    """How many commands redis-server has processed, and how many reads of its clients' sockets (``INFO
    stats``: a pipelined round trip is one read); zeros without one."""
    if url is None:
        return 0, 0
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    try:
        stats = await client.info("stats")
    finally:
        await client.aclose()
    return int(stats["total_commands_processed"]), int(stats["total_reads_processed"])


async def redis_counted(url: str | None) -> tuple[int, int]:
    """``redis_counts`` less what reading them costs (a connection's setup, the INFO)."""
    first = await redis_counts(url)
    second = await redis_counts(url)
    own = (second[0] - first[0], second[1] - first[1])
    return first[0] - own[0], first[1] - own[1]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], token: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with http.post(url, data=orjson.dumps(body), headers=headers) as answer:
        return answer.status, await answer.read()


async def open_sessions(http: aiohttp.ClientSession, target: Target, count: int) -> tuple[list[str | None], list[str]]:
    """Each session's bearer token (a proxy's session key; LiteLLM's key; "" where opening one failed), and errors."""
    if target.base is None:
        return [target.key] * count, []
    limit = asyncio.Semaphore(256)
    errors: list[str] = []

    async def one(index: int) -> str | None:
        body = {"sample": {"messages": first_messages(index)}, "generation": {"max_new_tokens": MAX_TOKENS}}
        async with limit:
            try:
                status, raw = await post(http, f"{target.base}/v1/sessions", body, ADMIN_KEY)
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"opening a session: {exc!r}")
                return ""
        if status != 201:
            errors.append(f"opening a session: {status}: {raw[:200]!r}")
            return ""
        return str(orjson.loads(raw)["api_key"])

    return list(await asyncio.gather(*(one(index) for index in range(count)))), errors


def first_messages(index: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Conversation {index}: tell me something."}]


class Conversation:
    """One session's chat: its history grows by the reply and a user message each turn."""

    def __init__(self, target: Target, index: int, token: str | None) -> None:
        self.target, self.token, self.messages = target, token, first_messages(index)
        self.failed = ""

    async def turn(self, http: aiohttp.ClientSession, k: int) -> float | None:
        if self.failed:
            return None
        body: dict[str, Any] = {"model": "policy", "messages": self.messages}
        if self.target.base is None:
            body["max_tokens"] = MAX_TOKENS  # the proxies pin it per session
        started = time.perf_counter()
        try:
            status, raw = await post(http, self.target.url, body, self.token)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.failed = repr(exc)
            return None
        elapsed = time.perf_counter() - started
        if status != 200:
            self.failed = f"{status}: {raw[:200]!r}"
            return None
        content = orjson.loads(raw)["choices"][0]["message"]["content"]
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"Turn {k}: and then?"},
        ]
        return elapsed


async def measure(
    http: aiohttp.ClientSession, target: Target, engine_pid: int, sessions: int, turns: int, others: Sequence[int] = ()
) -> Run:
    """``sessions`` conversations of ``turns`` turns each, all at once. ``others``: processes (redis-server)
    whose CPU over the turns is counted with the client's in ``others_cpu``."""
    run = Run()
    cpu_before = cpu_seconds(target.pid)
    tokens, refused = await open_sessions(http, target, sessions)
    cpu_created = cpu_seconds(target.pid)
    run.cpu_create = (cpu_created - cpu_before) / sessions
    conversations = [Conversation(target, index, token) for index, token in enumerate(tokens) if token != ""]
    run.errors = sessions - len(conversations)
    per_turn: list[list[float]] = [[] for _ in range(turns)]
    commands_before, reads_before = await redis_counted(target.redis)
    engine_before, started = cpu_seconds(engine_pid), time.perf_counter()
    others_before = time.process_time() + sum(cpu_seconds(pid) for pid in others)

    async def whole(conversation: Conversation) -> None:
        for k in range(turns):
            latency = await conversation.turn(http, k)
            if latency is None:
                return
            per_turn[k].append(latency)

    await asyncio.gather(*(whole(conversation) for conversation in conversations))
    run.seconds = time.perf_counter() - started
    run.cpu_turns = cpu_seconds(target.pid) - cpu_created
    run.engine_cpu = cpu_seconds(engine_pid) - engine_before
    run.others_cpu = time.process_time() + sum(cpu_seconds(pid) for pid in others) - others_before
    if target.redis is not None:
        commands_after, reads_after = await redis_counted(target.redis)
        run.redis_commands, run.redis_reads = commands_after - commands_before, reads_after - reads_before
    run.latencies = [latency for latencies in per_turn for latency in latencies]
    run.turns = len(run.latencies)
    failures = refused[:1] + [conversation.failed for conversation in conversations if conversation.failed]
    run.errors += len(failures) - len(refused[:1])
    run.first_error = failures[0] if failures else ""
    return run


async def lockstep(
    http: aiohttp.ClientSession, target: Target, sessions: int, turns: int
) -> tuple[list[list[float]], list[float]]:
    """All sessions take turn k together: each turn index's latencies and the target's CPU over it."""
    tokens, _ = await open_sessions(http, target, sessions)
    conversations = [Conversation(target, index, token) for index, token in enumerate(tokens) if token != ""]
    latencies: list[list[float]] = []
    cpu: list[float] = []
    for k in range(turns):
        before = cpu_seconds(target.pid)
        answered = await asyncio.gather(*(conversation.turn(http, k) for conversation in conversations))
        cpu.append((cpu_seconds(target.pid) - before) / sessions)
        latencies.append([latency for latency in answered if latency is not None])
    return latencies, cpu


# -- the processes -------------------------------------------------------------------------------------


def start_targets(services: Any, args: argparse.Namespace, delay: float, redis_url: str | None) -> tuple[Any, list]:
    """The engine of this delay, and in front of it each proxy (its own process) and LiteLLM."""
    engine, engine_url = start_engine(services, name=f"engine-{delay:g}", delay=delay)
    pin(engine.pid, args.client_cpus)
    targets = [Target("direct", f"{engine_url}/v1/chat/completions")]
    stores = [("memory", "memory")] + ([("redis", redis_url)] if redis_url else [])
    trees = [("rollout-proxy", None)] + ([("baseline", baseline_env(args.baseline))] if args.baseline else [])
    for name, store in stores:
        for tree, env in trees:
            port = free_port()
            argv = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
            argv += ["--store", store, "--admin-key", ADMIN_KEY, "--log-level", "warning", "--log-format", "json"]
            argv += ["--session-ttl", "3600", *args.proxy_arg]
            process = services.start(f"{tree}-{name}-{delay:g}", argv, env=env)
            base = f"http://127.0.0.1:{port}"
            services.wait_http(f"{tree}-{name}-{delay:g}", f"{base}/readyz")
            pin(process.pid, args.proxy_cpus)
            url = f"{base}/v1/chat/completions"
            targets.append(
                Target(f"{tree} ({name})", url, process.pid, base, redis=redis_url if name == "redis" else None)
            )
    if args.litellm:
        port = free_port()
        config = services.workdir / f"litellm-{delay:g}.yaml"
        config.write_text(
            "model_list:\n  - model_name: policy\n    litellm_params:\n      model: openai/fake-smollm2\n"
            f"      api_base: {engine_url}/v1\n      api_key: none\n"
            f"general_settings:\n  master_key: {LITELLM_KEY}\nlitellm_settings:\n  telemetry: false\n"
        )
        os.environ.update(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
        argv = [str(args.litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
        process = services.start(f"litellm-{delay:g}", argv)
        services.wait_http(f"litellm-{delay:g}", f"http://127.0.0.1:{port}/health/liveliness", timeout=300)
        pin(process.pid, args.proxy_cpus)
        targets.append(Target("LiteLLM", f"http://127.0.0.1:{port}/v1/chat/completions", process.pid, key=LITELLM_KEY))
    return engine, targets


async def warm(http: aiohttp.ClientSession, targets: list[Target], engine_pid: int) -> None:
    """A few turns each first: tokenizers load and connections open outside the measurement."""
    for target in targets:
        run = await measure(http, target, engine_pid, 4, 3)
        if run.errors:
            raise SystemExit(f"{target.name} does not answer: {run.first_error}")


async def phase(args: argparse.Namespace, delay: float, targets: list[Target], engine_pid: int) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": {}, "long": {}}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await warm(http, targets, engine_pid)
        for size in args.sizes:
            turns = args.turns[size]
            runs: dict[str, list[Run]] = {target.name: [] for target in targets}
            for round_index in range(args.rounds):
                for target in rotated(targets, round_index):
                    run = await measure(http, target, engine_pid, size, turns)
                    runs[target.name].append(run)
                    print(
                        f"  delay {delay * 1000:g} ms, {size:>5} sessions x {turns:>3} turns, {target.name:<22} "
                        f"p50 {percentile(run.latencies, 50) * 1000:7.1f} ms, {run.turns / run.seconds:7.1f} turns/s, "
                        f"errors {run.errors}" + (f" (first: {run.first_error})" if run.errors else ""),
                        flush=True,
                    )
            results["sizes"][size] = summarize(runs, size, turns)
        if delay == 0 and args.long_turns:
            results["long"] = await long_runs(
                http, args, [t for t in targets if t.name != "LiteLLM" or args.long_litellm]
            )
    return results


async def long_runs(http: aiohttp.ClientSession, args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    """``--long-rounds`` lock-step runs per target, the order rotating round by round: each turn's latencies
    of every round, and each turn's CPU as the median over the rounds (a burst of the machine's noise in
    one round does not bend the line)."""
    long: dict[str, Any] = {}
    for round_index in range(args.long_rounds):
        for target in rotated(targets, round_index):
            latencies, cpu = await lockstep(http, target, args.long_sessions, args.long_turns)
            entry = long.setdefault(target.name, {"latencies": [[] for _ in latencies], "cpu_by_round": []})
            for turn, values in zip(entry["latencies"], latencies, strict=True):
                turn.extend(values)
            entry["cpu_by_round"].append(cpu)
            print(f"  long run {round_index + 1}/{args.long_rounds}: {target.name} done", flush=True)
    for entry in long.values():
        entry["cpu"] = [statistics.median(values) for values in zip(*entry["cpu_by_round"], strict=True)]
    return long


def summarize(runs: dict[str, list[Run]], sessions: int, turns: int) -> dict[str, Any]:
    merged: dict[str, dict[str, Any]] = {}
    for name, each in runs.items():
        latencies = [latency for run in each for latency in run.latencies]
        done, seconds = sum(run.turns for run in each), sum(run.seconds for run in each)
        merged[name] = {
            "turns": done,
            "errors": sum(run.errors for run in each),
            "first_error": next((run.first_error for run in each if run.first_error), ""),
            "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000,
            "turns_per_s": done / seconds if seconds else 0.0,
            "cpu_ms_per_turn": sum(run.cpu_turns for run in each) / done * 1000 if done else float("nan"),
            "cpu_ms_per_session_created": statistics.mean(run.cpu_create for run in each) * 1000,
            "engine_cpu_ms_per_turn": sum(run.engine_cpu for run in each) / done * 1000 if done else float("nan"),
            "client_cpu_ms_per_turn": sum(run.others_cpu for run in each) / done * 1000 if done else float("nan"),
            "redis_commands_per_turn": sum(run.redis_commands for run in each) / done if done else float("nan"),
            "redis_round_trips_per_turn": sum(run.redis_reads for run in each) / done if done else float("nan"),
        }
    direct = merged["direct"]
    for values in merged.values():
        values["p50_overhead_ms"] = values["p50_ms"] - direct["p50_ms"]
        values["p99_overhead_ms"] = values["p99_ms"] - direct["p99_ms"]
        values["throughput_ratio"] = values["turns_per_s"] / direct["turns_per_s"] if direct["turns_per_s"] else 0
    return {"sessions": sessions, "turns": turns, "targets": merged}


def long_summary(long: dict[str, Any], turns: int) -> dict[str, Any]:
    """Turn 2 against the last turn: latency medians and CPU means over the first and last five turns
    (past the first), and the CPU line through all of them (``cpu_line``)."""
    if not long:
        return {}
    early, late = range(1, min(6, turns)), range(max(1, turns - 5), turns)
    out: dict[str, Any] = {}
    for name, data in long.items():

        def window(indices: range, data: dict[str, Any] = data) -> tuple[float, float]:
            latencies = [latency for k in indices for latency in data["latencies"][k]]
            cpu = statistics.mean(data["cpu"][k] for k in indices)
            return statistics.median(latencies) * 1000 if latencies else float("nan"), cpu * 1000

        (early_ms, early_cpu), (late_ms, late_cpu) = window(early), window(late)
        line_turn2, line_last = cpu_line(data["cpu"])
        by_round = [cpu_line(cpu) for cpu in data.get("cpu_by_round", [])]
        out[name] = {
            "turn2_ms": early_ms,
            "last_ms": late_ms,
            "turn2_cpu_ms": early_cpu,
            "last_cpu_ms": late_cpu,
            "line_turn2_cpu_ms": line_turn2,
            "line_last_cpu_ms": line_last,
            "line_cpu_ratio": line_last / line_turn2 if line_turn2 > 0 else None,
            "line_cpu_ratio_by_round": [last / turn2 if turn2 > 0 else None for turn2, last in by_round],
        }
    direct = out.get("direct")
    for values in out.values():
        if direct:
            values["turn2_overhead_ms"] = values["turn2_ms"] - direct["turn2_ms"]
            values["last_overhead_ms"] = values["last_ms"] - direct["last_ms"]
        values["latency_ratio"] = values["last_ms"] / values["turn2_ms"]
        values["cpu_ratio"] = values["last_cpu_ms"] / values["turn2_cpu_ms"] if values["turn2_cpu_ms"] else None
    return out


# -- report -------------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    lines = [
        "| engine | sessions × turns | target | p50 overhead / turn | p99 overhead / turn | throughput vs direct "
        "| CPU / turn (process) | CPU / session created | Redis round trips (commands) / turn | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for delay, phase_result in report["phases"].items():
        for result in phase_result["sizes"].values():
            for name, values in result["targets"].items():
                if name == "direct":
                    what = f"p50 {values['p50_ms']:.1f} ms, p99 {values['p99_ms']:.1f} ms"
                    lines.append(
                        f"| {delay} ms | {result['sessions']} × {result['turns']} | direct (engine) | {what} | | "
                        f"{values['turns_per_s']:.0f} turns/s | engine {values['engine_cpu_ms_per_turn']:.2f} ms | | | "
                        f"{values['errors']} |"
                    )
                    continue
                # LiteLLM has no sessions; one session's creation is below the counters' 10 ms tick
                few = name == "LiteLLM" or result["sessions"] < 16
                create = "-" if few else f"{values['cpu_ms_per_session_created']:.2f} ms"
                commands = values.get("redis_commands_per_turn") or 0
                trips = values.get("redis_round_trips_per_turn") or 0
                commands_cell = f"{trips:.1f} ({commands:.1f})" if commands else "-"
                lines.append(
                    f"| {delay} ms | {result['sessions']} × {result['turns']} | {name} "
                    f"| {values['p50_overhead_ms']:+.1f} ms | {values['p99_overhead_ms']:+.1f} ms "
                    f"| {values['throughput_ratio']:.2f}× | {values['cpu_ms_per_turn']:.2f} ms "
                    f"| {create} | {commands_cell} | {values['errors']} |"
                )
    revisions = report["settings"].get("revisions") or {}
    if len(revisions) > 1:
        lines += ["", "Revisions: " + ", ".join(f"{name} = {commit}" for name, commit in revisions.items())]
    long = report.get("long_summary") or {}
    if long:
        turns = report["settings"]["long_turns"]
        lines += [
            "",
            f"Long conversations ({report['settings']['long_sessions']} sessions in lock step, engine 0 ms, "
            f"{report['settings'].get('long_rounds', 1)} rounds; each turn's CPU the median over the rounds): "
            f"turns 2-6 against turns {turns - 4}-{turns} (latency: medians; CPU: means), and the least-squares "
            f"line through the CPU per turn of turns 2-{turns} (in brackets: each round's own line)",
            "",
            "| target | latency turn 2 | latency last | last / turn 2 | CPU / turn at 2 | CPU / turn last | last / turn 2 "
            "| CPU line at 2 → last | line: last / turn 2 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, values in long.items():
            cpu_ratio = f"{values['cpu_ratio']:.2f}×" if values["cpu_ratio"] else "-"
            line_ratio = f"{values['line_cpu_ratio']:.2f}×" if values.get("line_cpu_ratio") else "-"
            rounds = [f"{ratio:.2f}" for ratio in values.get("line_cpu_ratio_by_round", []) if ratio]
            if len(rounds) > 1:
                line_ratio += f" ({', '.join(rounds)})"
            early_cpu, late_cpu = (
                ("-", "-") if name == "direct" else (f"{values[k]:.2f} ms" for k in ("turn2_cpu_ms", "last_cpu_ms"))
            )
            line = (
                f"{values['line_turn2_cpu_ms']:.2f} → {values['line_last_cpu_ms']:.2f} ms"
                if values.get("line_cpu_ratio")
                else "-"
            )
            lines.append(
                f"| {name} | {values['turn2_ms']:.1f} ms | {values['last_ms']:.1f} ms | {values['latency_ratio']:.2f}× "
                f"| {early_cpu} | {late_cpu} | {cpu_ratio} | {line} | {line_ratio} |"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delays = list(report["phases"])
    figure, axes = plt.subplots(2, len(delays) + 1, figsize=(5 * (len(delays) + 1), 8), squeeze=False)
    for column, delay in enumerate(delays):
        sizes = report["phases"][delay]["sizes"]
        names = [name for name in next(iter(sizes.values()))["targets"] if name != "direct"]
        for name in names:
            xs = [int(size) for size in sizes]
            overhead = [sizes[size]["targets"][name]["p50_overhead_ms"] for size in sizes]
            ratio = [sizes[size]["targets"][name]["throughput_ratio"] for size in sizes]
            axes[0][column].plot(xs, overhead, marker="o", label=name)
            axes[1][column].plot(xs, ratio, marker="o", label=name)
        axes[0][column].set_title(f"p50 overhead per turn, engine {delay} ms")
        axes[0][column].set_ylabel("ms over direct")
        axes[0][column].set_yscale("symlog", linthresh=10)
        axes[1][column].set_title(f"throughput vs direct, engine {delay} ms")
        axes[1][column].axhline(1.0, color="grey", linewidth=0.8)
        for row in (0, 1):
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].set_xlabel("concurrent sessions")
            axes[row][column].legend(fontsize=8)
    long = report.get("long_raw") or {}
    ax = axes[0][-1]
    for name, data in long.items():
        ax.plot(
            range(1, len(data["latencies"]) + 1), [statistics.median(x) * 1000 for x in data["latencies"]], label=name
        )
    ax.set_title("long conversation: median turn latency")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax = axes[1][-1]
    for name, data in long.items():
        if name != "direct":
            ax.plot(range(1, len(data["cpu"]) + 1), [cpu * 1000 for cpu in data["cpu"]], label=name)
    ax.set_title("long conversation: process CPU per turn")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    figure.suptitle(report["title"], fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,32,256,1024", help="concurrent sessions (default 1,32,256,1024)")
    parser.add_argument(
        "--turns", default="40,6,3,2", help="turns per session, one per size or one for all (default 40,6,3,2)"
    )
    parser.add_argument("--delays", default="0,50", help="engine milliseconds per completion (default 0,50)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per size (default 2)")
    parser.add_argument("--long-turns", type=int, default=100, help="turns of the long run (0: none; default 100)")
    parser.add_argument("--long-sessions", type=int, default=16, help="sessions of the long run (default 16)")
    parser.add_argument("--long-rounds", type=int, default=3, help="long runs per target, interleaved (default 3)")
    parser.add_argument("--long-litellm", action="store_true", help="LiteLLM in the long run too")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis-store proxy")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (a git worktree of another commit): its proxies run beside this tree's, on both "
        "stores, in the same rotated order",
    )
    parser.add_argument("--litellm", type=Path, default=DEFAULT_LITELLM, help="LiteLLM's CLI (its own venv)")
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=None,
        help="passed to rollout-proxy serve, repeatable (default: --engine-max-inflight 4096, so the proxy "
        "does not queue what direct sends at once)",
    )
    parser.add_argument(
        "--proxy-cpus",
        help="pin the proxies, redis-server and LiteLLM to these CPUs (comma-separated) and the client and the "
        "engine to the others (default: all share every CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="1 and 32 sessions, 1 round, 20-turn long run")
    parser.add_argument("--replot", type=Path, help="only print the table and draw the plot of a saved JSON report")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON and PNG (default out/bench)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.turns, args.rounds, args.long_turns, args.long_rounds = "1,32", "10,4", 1, 20, 1
    args.sizes = [int(size) for size in args.sizes.split(",")]
    turns = [int(turn) for turn in args.turns.split(",")]
    args.turns = dict(
        zip(args.sizes, turns if len(turns) == len(args.sizes) else turns[:1] * len(args.sizes), strict=True)
    )
    args.delays = [float(delay) / 1000 for delay in args.delays.split(",")]
    args.proxy_arg = args.proxy_arg if args.proxy_arg is not None else ["--engine-max-inflight", "4096"]
    args.client_cpus = None
    if args.proxy_cpus:
        if not hasattr(os, "sched_setaffinity"):
            parser.error("--proxy-cpus needs a system that pins threads to CPUs (os.sched_setaffinity: Linux)")
        everything = os.sched_getaffinity(0)
        try:
            args.proxy_cpus = {int(cpu) for cpu in args.proxy_cpus.split(",")}
        except ValueError:
            parser.error(f"--proxy-cpus {args.proxy_cpus!r}: expected CPU numbers, comma-separated")
        args.client_cpus = everything - args.proxy_cpus
        if not args.proxy_cpus <= everything or not args.client_cpus:
            parser.error(f"--proxy-cpus: give some, not all, of this process's CPUs {sorted(everything)}")
    if args.no_litellm:
        args.litellm = None
    elif not args.litellm.exists():
        print(f"LiteLLM is not installed at {args.litellm}: its column is skipped (pip install 'litellm[proxy]')")
        args.litellm = None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot(saved, args.out / "proxy_overhead.png")
        print(table(saved))
        return
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-", dir=args.out)))
    report: dict[str, Any] = {"phases": {}, "settings": {}}
    if args.client_cpus:
        pin(os.getpid(), args.client_cpus)  # the client: this process
    try:
        redis_url = None if args.no_redis or not shutil.which("redis-server") else start_redis(services)
        if redis_url is not None:
            pin(dict(services.processes)["redis"].pid, args.proxy_cpus)
        for delay in args.delays:
            print(f"engine {delay * 1000:g} ms: starting the engine and the targets", flush=True)
            engine, targets = start_targets(services, args, delay, redis_url)
            result = asyncio.run(phase(args, delay, targets, engine.pid))
            report["phases"][f"{delay * 1000:g}"] = result
            for name, _ in list(services.processes):
                if name.endswith(f"-{delay:g}"):
                    services.stop_one(name)
    finally:
        services.stop()
    long: dict[str, Any] = next((result.pop("long") for result in report["phases"].values() if result.get("long")), {})
    for result in report["phases"].values():
        result.pop("long", None)
    report["long_raw"] = long
    report["long_summary"] = long_summary(long, args.long_turns)
    report["settings"] = {
        "sizes": args.sizes,
        "turns": args.turns,
        "rounds": args.rounds,
        "long_turns": args.long_turns,
        "long_sessions": args.long_sessions,
        "long_rounds": args.long_rounds,
        "proxy_args": args.proxy_arg,
        "litellm": str(args.litellm) if args.litellm else None,
        "revisions": {"rollout-proxy": revision(ROOT)}
        | ({"baseline": revision(args.baseline)} if args.baseline else {}),
        "proxy_cpus": sorted(args.proxy_cpus) if args.proxy_cpus else None,
        "client_cpus": sorted(args.client_cpus) if args.client_cpus else None,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    pinned = f", proxies on CPUs {sorted(args.proxy_cpus)}" if args.proxy_cpus else ""
    report["title"] = (
        f"rollout-proxy overhead vs direct (and LiteLLM), {os.cpu_count()} CPUs{pinned}, load {os.getloadavg()[0]:.1f}"
    )
    write_report(args.out / "proxy_overhead.json", report, "bench.proxy_overhead", argv)
    plot(report, args.out / "proxy_overhead.png")
    print(table(report))
    print(f"wrote {args.out / 'proxy_overhead.json'} and {args.out / 'proxy_overhead.png'}")
    shutil.rmtree(services.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
