"""Fault benchmark: a fleet of three engines, one killed and restarted every 20 s, under 64 sessions.

    python -m bench.fleet_faults [--duration 120] [--sessions 64] [--kill-every 20] [--down 5] [--turns 4]

Three fake vLLM engines (``devtools.fake_engine``, SmolLM2's real tokenizer), each its own
process on its own port, answering in 20, 35 and 50 ms; a ``rollout-proxy serve`` in front
of them (its own process, default fleet settings, memory store); and, in this process, 64
sessions at once, each a multi-turn chat (``--turns`` chat turns, then finish, then a new
session) over plain HTTP, for ``--duration`` seconds.

The fleet first moves to policy version 1 (pause, resume), as after a trainer's first step.
Then every ``--kill-every`` seconds one engine (in turn) is killed with SIGKILL (connections
reset, then refused), started again ``--down`` seconds later on the same port, where it
reports its weights as ``"default"`` (version 0, not the fleet's 1) and so is *stale*: it
gets no turn. The benchmark does what an operator (or a trainer) does after loading the
fleet's weights into it: ``POST /v1/admin/engines {"url", "policy_version": 1}``, which
re-admits it.

It reports failed turns (goal 0) and the latency of turns started around a kill (from 1 s
before to ``--window`` s after) against turns started far from any kill or restart (steady
state): p50, p99 and max, and the p99 that failover adds. The proxy's retry and failure
counters and each restarted engine's state before its re-admission are in ``fleet_faults.json`` under
``--out``. A benchmark, not a test: the published run is on docs/benchmarks/fleet_faults.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.harness import OUT, ROOT, child_env, free_port, markdown_table, write_report

ADMIN_KEY = "fleet-faults-admin-key"
DELAYS = (0.020, 0.035, 0.050)  # seconds per completion, one per engine
FLEET_VERSION = 1
COMPLETIONS = "/_bench/completions"  # how many completions an engine process was asked for


# -- the child processes ------------------------------------------------------------------


async def serve_engine(port: int, delay: float, standby: bool) -> None:
    """A fake engine; a ``standby`` one loads, says "loaded", and listens when told to (a line on
    stdin): a restart's downtime is the benchmark's ``--down``, not the time to import a tokenizer."""
    from aiohttp import web

    from devtools.engine_env import ensure_checkpoints
    from devtools.fake_engine import FakeEngine, FakeEngineServer

    engine = FakeEngine(ensure_checkpoints()["dense"], delay=delay)
    served = 0
    make_app = engine.app

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"completions": served + len(engine.completions)})

    def app() -> web.Application:
        application = make_app()
        application.router.add_get(COMPLETIONS, completions)
        return application

    engine.app = app  # type: ignore[method-assign]
    if standby:
        print("loaded", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    async with FakeEngineServer(engine, port=port):
        print("ready", flush=True)
        while True:
            await asyncio.sleep(5)
            served += len(engine.completions)
            engine.completions.clear()  # the fake's logs, not what is measured here
            engine.generations.clear()


def wait_for_line(process: subprocess.Popen[str], wanted: str) -> subprocess.Popen[str]:
    """Read the child's output up to the line ``wanted`` (blocking: run it in a thread)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == wanted:
            return process
    process.kill()
    raise RuntimeError(f"{process.args!r} did not say {wanted!r}")


def start_engine(port: int, delay: float, *, standby: bool = False) -> subprocess.Popen[str]:
    """An engine process, listening (or, ``standby``, loaded and waiting for ``listen``)."""
    argv = [sys.executable, "-m", "bench.fleet_faults", "--child-engine", str(port), "--delay", str(delay)]
    process = subprocess.Popen(
        [*argv, "--standby"] if standby else argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    return wait_for_line(process, "loaded" if standby else "ready")


def listen(process: subprocess.Popen[str]) -> subprocess.Popen[str]:
    assert process.stdin is not None
    process.stdin.write("listen\n")
    process.stdin.flush()
    return wait_for_line(process, "ready")


QUIET = ("--log-level", "error")


def start_proxy(port: int, engine_urls: list[str]) -> subprocess.Popen[bytes]:
    """``rollout-proxy serve`` with default fleet settings (ready when ``/readyz`` says so: ``wait_ready``)."""
    engines = [arg for url in engine_urls for arg in ("--engine", url)]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_proxy",
            "serve",
            *engines,
            "--admin-key",
            ADMIN_KEY,
            "--port",
            str(port),
            *QUIET,
        ],
        cwd=ROOT,
        env=child_env(),
    )
    return process


async def wait_ready(http: aiohttp.ClientSession, url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            async with http.get(url + "/readyz") as answer:
                if answer.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the proxy at {url} was not ready in {within:g}s")


# -- the load -----------------------------------------------------------------------------


@dataclass
class Turn:
    started: float  # seconds into the load
    latency: float
    ok: bool
    error: str = ""


@dataclass
class Load:
    url: str
    turns_per_session: int
    started: float = field(default_factory=time.monotonic)
    turns: list[Turn] = field(default_factory=list)
    session_errors: list[str] = field(default_factory=list)
    sessions: int = 0

    def now(self) -> float:
        return time.monotonic() - self.started


async def admin_call(http: aiohttp.ClientSession, url: str, method: str, path: str, body: Any = None) -> Any:
    async with http.request(method, url + path, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as answer:
        payload = await answer.json()
        if answer.status >= 400:
            raise RuntimeError(f"{method} {path} -> {answer.status}: {payload}")
        return payload


async def session_loop(
    http: aiohttp.ClientSession, load: Load, worker: int, until: float, *, policy: str | None = None
) -> None:
    """Sessions one after the other: create, ``turns`` chat turns, finish; on ``policy`` if one is named."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    index = 0
    while load.now() < until:
        index += 1
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Chat {worker}-{index}: name a colour."}]
        body: dict[str, Any] = {"sample": {"messages": messages}, "generation": {"max_new_tokens": 32}}
        if policy is not None:
            body["policy"] = policy
        try:
            async with http.post(f"{load.url}/v1/sessions", json=body, headers=admin) as answer:
                session = await answer.json()
                if answer.status >= 300:
                    raise RuntimeError(f"create {answer.status}: {session}")
        except Exception as exc:
            load.session_errors.append(f"create: {exc!r}"[:300])
            await asyncio.sleep(0.1)
            continue
        plugin = {"Authorization": f"Bearer {session['api_key']}"}
        for turn in range(load.turns_per_session):
            started = load.now()
            t0 = time.monotonic()
            try:
                async with http.post(
                    f"{session['base_url']}/chat/completions",
                    json={"model": "m", "messages": messages},
                    headers=plugin,
                ) as answer:
                    reply = await answer.json()
                    if answer.status >= 300:
                        raise RuntimeError(f"{answer.status}: {json.dumps(reply)[:200]}")
                load.turns.append(Turn(started, time.monotonic() - t0, True))
            except Exception as exc:
                load.turns.append(Turn(started, time.monotonic() - t0, False, repr(exc)[:300]))
                break  # the plugin would give up this rollout
            messages = [*messages, reply["choices"][0]["message"], {"role": "user", "content": f"And {turn}?"}]
        try:
            async with http.post(
                f"{load.url}/v1/sessions/{session['session_id']}/finish", json={"status": "success"}, headers=admin
            ) as answer:
                if answer.status >= 300:
                    raise RuntimeError(f"finish {answer.status}: {(await answer.text())[:200]}")
            load.sessions += 1
        except Exception as exc:
            load.session_errors.append(f"finish: {exc!r}"[:300])


@dataclass
class Fault:
    engine: str
    killed_at: float
    restarted_at: float = 0.0
    state_before_readmit: str = ""
    turns_before_readmit: int = 0  # completions the restarted engine was asked for while stale: goal 0
    readmitted_at: float = 0.0
    state_after_readmit: str = ""


def kill_times(args: argparse.Namespace) -> list[float]:
    """Seconds into the load of each kill: every ``kill_every``, while the restart fits in the load."""
    times, at = [], args.kill_every
    while at + args.down + args.probe_wait < args.duration:
        times.append(at)
        at += args.kill_every
    return times


async def faults(
    http: aiohttp.ClientSession,
    load: Load,
    engines: list[dict[str, Any]],
    standbys: list[subprocess.Popen[str]],
    args: argparse.Namespace,
) -> list[Fault]:
    """At each kill time: SIGKILL the next engine, its standby listens ``down`` s later, re-admit it."""
    done: list[Fault] = []
    for victim, (at, standby) in enumerate(zip(kill_times(args), standbys, strict=True)):
        engine = engines[victim % len(engines)]
        await asyncio.sleep(max(at - load.now(), 0))
        fault = Fault(engine["url"], load.now())
        engine["process"].send_signal(signal.SIGKILL)
        await asyncio.to_thread(engine["process"].wait)
        await asyncio.sleep(args.down)
        engine["process"] = await asyncio.to_thread(listen, standby)
        fault.restarted_at = load.now()
        await asyncio.sleep(args.probe_wait)  # the proxy's probe finds it back, at the wrong version
        fault.state_before_readmit = await engine_state(http, load.url, engine["url"])
        async with http.get(engine["url"] + COMPLETIONS) as answer:
            fault.turns_before_readmit = int((await answer.json())["completions"])
        answer = await admin_call(
            http, load.url, "POST", "/v1/admin/engines", {"url": engine["url"], "policy_version": FLEET_VERSION}
        )
        fault.readmitted_at, fault.state_after_readmit = load.now(), answer["state"]
        done.append(fault)
    return done


async def engine_state(http: aiohttp.ClientSession, url: str, engine_url: str) -> str:
    fleet = await admin_call(http, url, "GET", "/v1/admin/engines")
    return next(str(e["state"]) for e in fleet["engines"] if e["url"] == engine_url)


# -- the numbers ----------------------------------------------------------------------------


def stats(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"turns": 0}
    values = np.asarray(latencies) * 1000.0
    return {
        "turns": len(latencies),
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
        "max_ms": float(values.max()),
    }


def analyse(load: Load, done: list[Fault], args: argparse.Namespace) -> dict[str, Any]:
    kills = [fault.killed_at for fault in done]
    events = kills + [fault.restarted_at for fault in done] + [fault.readmitted_at for fault in done]
    ok = [turn for turn in load.turns if turn.ok]
    around = [t.latency for t in ok if any(-1.0 <= t.started - kill <= args.window for kill in kills)]
    steady = [  # far from any kill, restart or re-admission, and from the load's start
        t.latency
        for t in ok
        if t.started > args.window and all(abs(t.started - event) > args.window for event in events)
    ]
    # in flight at a kill: a third of them were on the killed engine, reset and sent to another one
    hit = [t.latency for t in ok if any(t.started < kill < t.started + t.latency for kill in kills)]
    failed = [turn for turn in load.turns if not turn.ok]
    around_stats, steady_stats = stats(around), stats(steady)
    return {
        "turns": len(load.turns),
        "failed_turns": len(failed),
        "failures": [turn.error for turn in failed][:20],
        "sessions_finished": load.sessions,
        "session_errors": len(load.session_errors),
        "session_error_samples": load.session_errors[:10],
        "turns_per_second": len(load.turns) / args.duration,
        "all": stats([t.latency for t in ok]),
        "around_kills": around_stats,
        "in_flight_at_kill": stats(hit),
        "steady": steady_stats,
        "p99_added_by_failover_ms": (around_stats.get("p99_ms", 0.0) - steady_stats.get("p99_ms", 0.0)),
        "faults": [fault.__dict__ for fault in done],
        "slowest": [[round(t.started, 2), round(t.latency, 3)] for t in sorted(ok, key=lambda t: -t.latency)[:20]],
    }


def table(result: dict[str, Any]) -> str:
    """Turn latency far from any fault, around a kill, in flight at one, and over all turns."""
    rows = []
    for name, key in (
        ("steady state", "steady"),
        ("started around a kill", "around_kills"),
        ("in flight at a kill", "in_flight_at_kill"),
        ("all", "all"),
    ):
        s = result[key]
        if s.get("turns"):
            rows.append(
                [f"{name} ({s['turns']})", f"{s['p50_ms']:.0f} ms", f"{s['p99_ms']:.0f} ms", f"{s['max_ms']:.0f} ms"]
            )
    return markdown_table(["turns", "p50", "p99", "max"], rows)


def outcome(result: dict[str, Any]) -> str:
    """Failed turns, failover's cost and each fault's story, in words."""
    lines = [
        f"failed turns: {result['failed_turns']} of {result['turns']} ({result['turns_per_second']:.0f} turns/s); "
        f"p99 added by failover: {result['p99_added_by_failover_ms']:.0f} ms; "
        f"{len(result['faults'])} kill(s); session errors: {result['session_errors']}"
    ]
    for fault in result["faults"]:
        lines.append(
            f"killed an engine at {fault['killed_at']:.1f}s, restarted at {fault['restarted_at']:.1f}s: "
            f"{fault['state_before_readmit']} ({fault['turns_before_readmit']} turns) until re-admitted at "
            f"{fault['readmitted_at']:.1f}s -> {fault['state_after_readmit']}"
        )
    retries = {k: v for k, v in result["counters"].items() if "retr" in k or "fail" in k}
    lines.append(f"retries and failures: {retries}")
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    ports = [free_port() for _ in DELAYS]
    engines: list[dict[str, Any]] = []
    standbys: list[subprocess.Popen[str]] = []
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for port, delay in zip(ports, DELAYS, strict=True):
            process = await asyncio.to_thread(start_engine, port, delay)
            engines.append({"port": port, "delay": delay, "url": f"http://127.0.0.1:{port}", "process": process})
        # every restart's process, loaded before the load starts (loading competes for the CPUs)
        for victim in range(len(kill_times(args))):
            engine = engines[victim % len(engines)]
            standbys.append(await asyncio.to_thread(start_engine, engine["port"], engine["delay"], standby=True))
        await asyncio.sleep(args.settle)  # let the machine's load from those starts pass
        proxy_url = f"http://127.0.0.1:{free_port()}"
        proxy = start_proxy(int(proxy_url.rsplit(":", 1)[1]), [e["url"] for e in engines])
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
            await wait_ready(http, proxy_url)
            await admin_call(http, proxy_url, "POST", "/v1/admin/pause", {"mode": "keep"})
            await admin_call(http, proxy_url, "POST", "/v1/admin/resume", {"policy_version": FLEET_VERSION})
            load = Load(proxy_url, args.turns)
            workers = [session_loop(http, load, worker, args.duration) for worker in range(args.sessions)]
            fault_task = asyncio.ensure_future(faults(http, load, engines, standbys, args))
            await asyncio.gather(*workers)
            done = await fault_task
            result = analyse(load, done, args)
            result["counters"] = await admin_call(http, proxy_url, "GET", "/v1/admin/counters")
            result["engines_at_end"] = (await admin_call(http, proxy_url, "GET", "/v1/admin/engines"))["engines"]
        result["settings"] = {
            k: v for k, v in vars(args).items() if k not in ("child_engine", "delay", "standby", "out")
        }
        result["engine_delays_ms"] = [d * 1000 for d in DELAYS]
        result["cpus"] = os.cpu_count()
        result["load_average"] = os.getloadavg()
        return result
    finally:
        for process in [*(engine["process"] for engine in engines), *standbys]:
            process.kill()
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions (default 64)")
    parser.add_argument("--turns", type=int, default=4, help="chat turns per session (default 4)")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (default 20)")
    parser.add_argument("--down", type=float, default=5.0, help="seconds a killed engine stays down (default 5)")
    parser.add_argument("--probe-wait", type=float, default=3.0, help="seconds before re-admitting (default 3)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds after a kill counted as failover")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between set-up and load (default 5)")
    parser.add_argument("--out", type=Path, default=OUT, help="where fleet_faults.json goes (default out/bench)")
    parser.add_argument("--child-engine", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.02, help=argparse.SUPPRESS)
    parser.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_engine is not None:
        asyncio.run(serve_engine(args.child_engine, args.delay, args.standby))
        return
    result = asyncio.run(bench(args))
    out = write_report(args.out / "fleet_faults.json", result, "bench.fleet_faults", argv)
    print(table(result))
    print(outcome(result))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
