"""Run the locust users of ``load_tests/locustfile.py`` headless, and write locust's CSV and HTML report.

    python -m load_tests                                  # a proxy on the fake engine, 60 s, 32 users
    python -m load_tests --users 8 --duration 15s --out out/load-smoke
    python -m load_tests --url http://proxy:8080 --admin-key KEY [--feed redis://...]

Without ``--url`` it starts, each in its own process, a fake vLLM engine (tool-calling policy,
``--engine-delay`` per completion) and ``rollout-proxy serve`` in front of it, on a private
redis-server when one is installed (store and feed; ``--store memory`` or no redis-server: the
in-process store and a JSONL feed), runs locust against it and stops everything it started.
It writes ``locust_stats.csv``, ``locust_failures.csv``, ``locust_exceptions.csv``,
``locust_stats_history.csv`` and ``report.html`` under ``--out``, prints the summary, and exits
non-zero when any request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from load_tests.engine import TOOL_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
ADMIN_KEY = "load-test-admin-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env() -> dict[str, str]:
    """The children import this tree's ``rollout_proxy`` and ``load_tests``, whatever is installed."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


class Services:
    """The processes a run starts, stopped (in reverse order) when it ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``argv`` with its output in the work directory's ``NAME.log``; ``env``: else ``child_env()``."""
        log = (self.workdir / f"{name}.log").open("wb")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or child_env(), cwd=ROOT)
        self.processes.append((name, process))
        return process

    def wait_http(self, name: str, url: str, timeout: float = 120.0) -> None:
        """Until ``url`` answers 200 (or the process died, or ``timeout`` passed: its log is shown)."""
        process = dict(self.processes)[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
            time.sleep(0.2)
        tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name} did not start ({url}); its log:\n{tail}")

    def stop(self) -> None:
        for _, process in reversed(self.processes):
            process.terminate()
        for name, _ in reversed(self.processes):
            self.stop_one(name)

    def stop_one(self, name: str) -> None:
        """Terminate one service (killed after 10 s) and forget it."""
        process = dict(self.processes)[name]
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self.processes = [(other, each) for other, each in self.processes if other != name]


def start_redis(services: Services) -> str:
    binary = shutil.which("redis-server")
    assert binary is not None
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    services.start("redis", [*argv, "--dir", str(services.workdir)])
    for _ in range(200):
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def start_engine(
    services: Services, *, name: str = "engine", policy: str = "fixed", delay: float = 0.0, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """The engine double as a process of its own (``python -m load_tests.engine``), once it answers; and its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "load_tests.engine", "--port", str(port), "--policy", policy, "--delay", str(delay)]
    process = services.start(name, [*argv, *extra])
    url = f"http://127.0.0.1:{port}"
    services.wait_http(name, f"{url}/health")
    return process, url


@contextlib.contextmanager
def local_proxy(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, str]]:
    """A fake engine and a proxy (and redis-server when used); yields (proxy URL, feed URL)."""
    services = Services(workdir)
    try:
        use_redis = args.store == "redis" or (args.store == "auto" and shutil.which("redis-server"))
        if args.store == "redis" and not shutil.which("redis-server"):
            raise SystemExit("--store redis needs redis-server (apt-get install redis-server)")
        store = start_redis(services) if use_redis else "memory"
        feed = store if use_redis else f"jsonl:{workdir / 'feed.jsonl'}"
        _, engine_url = start_engine(
            services, policy="tools", delay=args.engine_delay, extra=["--chat-template", str(TOOL_TEMPLATE)]
        )
        proxy_port = free_port()
        proxy = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(proxy_port), "--admin-key", ADMIN_KEY]
        proxy += ["--engine", engine_url, "--store", store, "--feed", feed]
        proxy += ["--chat-template", str(TOOL_TEMPLATE), "--log-level", "warning", "--log-format", "json"]
        services.start("proxy", proxy)
        services.wait_http("proxy", f"http://127.0.0.1:{proxy_port}/readyz")
        warm_up(f"http://127.0.0.1:{proxy_port}")
        print(f"proxy on http://127.0.0.1:{proxy_port} (store {store}, feed {feed}); logs in {workdir}", flush=True)
        yield f"http://127.0.0.1:{proxy_port}", feed
    finally:
        services.stop()


def post(url: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as answer:
        return dict(json.load(answer))


def warm_up(url: str) -> None:
    """One session and turn before the load: the proxy loads its tokenizer on first use, not at /readyz."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    session = post(f"{url}/v1/sessions", {"sample": {"messages": messages}}, ADMIN_KEY)
    post(f"{url}/v1/chat/completions", {"model": "policy", "messages": messages}, session["api_key"])


def proxy_counters(url: str, admin_key: str, out: Path) -> None:
    """The proxy's counters after the load (``GET /v1/admin/counters``), saved; forks and drift printed."""
    request = urllib.request.Request(f"{url}/v1/admin/counters", headers={"Authorization": f"Bearer {admin_key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            counters = json.load(answer)
    except OSError as exc:
        print(f"the proxy's counters could not be read: {exc}")
        return
    (out / "proxy_counters.json").write_text(json.dumps(counters, indent=2))
    wanted = ("turns_total", "forks_total", "prompt_drift_total", "render_fallbacks_total", "errors_total")
    print("proxy counters: " + ", ".join(f"{name} {counters.get(name, 0)}" for name in wanted))


def summary(out: Path) -> tuple[int, int]:
    """(requests, failures) of the aggregated row of locust's stats CSV, with the per-name table printed."""
    with (out / "locust_stats.csv").open() as stats:
        rows = list(csv.DictReader(stats))
    total = (0, 0)
    print(f"{'request':<36} {'count':>7} {'fail':>5} {'p50 ms':>7} {'p99 ms':>7} {'req/s':>7}")
    for row in rows:
        count, failures = int(row["Request Count"]), int(row["Failure Count"])
        print(
            f"{row['Name'] or row['Type']:<36} {count:>7} {failures:>5} {row['50%']:>7} {row['99%']:>7} "
            f"{float(row['Requests/s']):>7.1f}"
        )
        if row["Name"] == "Aggregated":
            total = (count, failures)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load_tests", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running proxy to load (default: start one on the fake engine)")
    parser.add_argument("--admin-key", default=None, help="its admin key (with --url)")
    parser.add_argument("--feed", default="", help="with --url: the feed to publish groups to (redis://, jsonl:)")
    parser.add_argument("--store", choices=("auto", "redis", "memory"), default="auto", help="(default auto: redis)")
    parser.add_argument("--engine-delay", type=float, default=0.0, help="seconds per fake completion (default 0)")
    parser.add_argument("--users", type=int, default=32, help="concurrent locust users (default 32)")
    parser.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all in 1 s)")
    parser.add_argument("--duration", default="60s", help="locust --run-time (default 60s)")
    parser.add_argument("--turns", type=int, default=3, help="questions per chat rollout (default 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "load", help="report directory (default out/load)")
    parser.add_argument("--locust-arg", action="append", default=[], help="passed on to locust (repeatable)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="rp-load-", dir=args.out))
    with contextlib.ExitStack() as stack:
        if args.url:
            url, feed, admin_key = args.url.rstrip("/"), args.feed, args.admin_key or os.environ.get("LOAD_ADMIN_KEY")
            if not admin_key:
                raise SystemExit("--url needs --admin-key (or LOAD_ADMIN_KEY)")
        else:
            (url, feed), admin_key = stack.enter_context(local_proxy(args, workdir)), ADMIN_KEY
        command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url]
        command += ["--users", str(args.users), "--spawn-rate", str(args.spawn_rate or args.users)]
        command += ["--run-time", args.duration, "--only-summary"]
        command += ["--csv", str(args.out / "locust"), "--csv-full-history", "--html", str(args.out / "report.html")]
        env = {**child_env(), "LOAD_ADMIN_KEY": admin_key, "LOAD_FEED": feed, "LOAD_TURNS": str(args.turns)}
        code = subprocess.run([*command, *args.locust_arg], env=env, cwd=ROOT).returncode
        proxy_counters(url, admin_key, args.out)
    if code == 0:
        shutil.rmtree(workdir, ignore_errors=True)  # the services' logs stay when something failed
    requests, failures = summary(args.out)
    print(f"{requests} requests, {failures} failed; report: {args.out / 'report.html'}, CSV: {args.out}/locust_*.csv")
    return code if code else int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
