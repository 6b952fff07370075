"""Where a turn's proxy CPU goes: ``py-spy`` sampling one ``rollout-proxy serve`` process under load on the
engine double, as a flame graph (SVG) and a table of the top cumulative costs per turn.

    python -m bench.profile_turn --shape short --store redis       # bench.proxy_overhead's short chat turns
    python -m bench.profile_turn --shape codex --turns 30          # Codex-shaped Responses turns (50+ items)
    python -m bench.profile_turn --shape claude --tree /tmp/rp-base   # Claude Code's Messages turns, another checkout

Shapes: ``short``, ``bench.proxy_overhead``'s Chat Completions conversation (a short user message a turn);
``codex``, ``bench.resent_input``'s Codex conversation over the Responses API (its 27 KB first request, its 13
tools, streamed, the whole history resent; 2 items more a turn); ``codex-chat``, the same over Chat Completions;
``claude``, the same as Claude Code sends the Messages API. ``--sessions`` sessions take ``--turns`` turns in
lock step; the first ``--turns`` minus ``--profiled`` turns are not profiled (the history grows first: the
Codex conversation has 50+ items by turn 25), then ``py-spy record --nonblocking`` (it reads the process, does
not stop it, so the proxy's own CPU counters are its own) samples the last ``--profiled`` turns.

Writes under ``--out``: ``profile_turn-SHAPE-STORE.svg`` (a flame graph of the samples, drawn here from
py-spy's collapsed stacks, each frame's title its share and ms per turn), ``...txt`` (the collapsed stacks),
and ``...json`` (the table). The table: for the functions most often on the stack, the share of the samples
they are in and that share of the proxy's CPU per turn over the profiled turns (read from the scheduler's
counters, ``bench.harness.cpu_seconds``). A profile, not a benchmark: read its CPU per turn from
``bench.proxy_overhead``, which does not sample.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench import proxy_overhead, resent_input
from bench.harness import (
    OUT,
    ROOT,
    Services,
    baseline_env,
    child_env,
    cpu_seconds,
    free_port,
    markdown_table,
    revision,
    start_engine,
    start_redis,
    write_report,
)

SHAPES = {"short": None, "codex": "responses", "codex-chat": "chat", "claude": "messages"}
ADMIN_KEY = resent_input.ADMIN_KEY


def py_spy() -> str:
    """py-spy beside this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    return found


def start_proxy(
    services: Services,
    engine_url: str,
    store: str,
    tree: Path | None,
    extra: list[str],
    *,
    launcher: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_within: float = 120.0,
) -> tuple[int, str]:
    """``rollout-proxy serve`` (from ``tree``'s checkout, else this one's) on the engine double; ``launcher``:
    what runs the interpreter (``valgrind ...``), ``env``: added to its environment."""
    port = free_port()
    argv = [*launcher, sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
    argv += ["--store", store, "--admin-key", ADMIN_KEY, "--chat-template", str(resent_input.TEMPLATE)]
    argv += ["--log-level", "warning", "--log-format", "json", "--session-ttl", "3600", *extra]
    process = services.start(
        "proxy", argv, env={**(child_env() if tree is None else baseline_env(tree)), **(env or {})}
    )
    base = f"http://127.0.0.1:{port}"
    services.wait_http("proxy", f"{base}/readyz", timeout=ready_within)
    return process.pid, base


class Driver:
    """``sessions`` conversations of one shape, taking turns in lock step."""

    def __init__(self, http: aiohttp.ClientSession, base: str, shape: str) -> None:
        self.http, self.base, self.api = http, base, SHAPES[shape]
        self.conversations: list[Any] = []
        self.k = 0

    async def open(self, sessions: int) -> None:
        """The short conversation's sessions as ``bench.proxy_overhead`` opens them (a sample the first turn
        resends), the harness shapes' as ``bench.resent_input`` does (no sample: the harness sends it all)."""
        target = proxy_overhead.Target("proxy", f"{self.base}/v1/chat/completions", base=self.base)
        if self.api is None:
            tokens, errors = await proxy_overhead.open_sessions(self.http, target, sessions)
            if errors:
                raise SystemExit(errors[0])
            self.conversations += [proxy_overhead.Conversation(target, i, token) for i, token in enumerate(tokens)]
            return
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for index in range(sessions):
            body = {"generation": {"max_new_tokens": 16}}
            async with self.http.post(f"{self.base}/v1/sessions", json=body, headers=headers) as answer:
                token = (await answer.json())["api_key"]
            self.conversations.append(resent_input.Conversation(self.api, index, token, self.base))

    async def turns(self, count: int) -> None:
        for _ in range(count):
            if self.api is None:
                answered = await asyncio.gather(*(each.turn(self.http, self.k) for each in self.conversations))
                if None in answered:
                    failed = next(each.failed for each in self.conversations if each.failed)
                    raise SystemExit(f"turn {self.k}: {failed}")
            else:
                await asyncio.gather(*(resent_input.turn(self.http, each, self.k) for each in self.conversations))
            self.k += 1


def items(driver: Driver) -> int:
    """The items (messages) the first conversation sends on its next turn."""
    conversation = driver.conversations[0]
    if driver.api is None or driver.api == "chat":
        return len(conversation.messages)
    return len(conversation.input) if driver.api == "responses" else len(conversation.anthropic) + 1


async def otlp_sink() -> tuple[web.AppRunner, str, list[int]]:
    """A collector that takes OTLP/HTTP trace exports and answers 200 (what it was sent: counted in bytes)."""
    received: list[int] = []

    async def traces(request: web.Request) -> web.Response:
        received.append(len(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", received


async def profile(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    services = Services(Path(tempfile.mkdtemp(prefix="rp-profile-")))
    sink = await otlp_sink() if args.tracing else None
    try:
        store = start_redis(services) if args.store == "redis" else "memory"
        _, engine_url = start_engine(services, extra=["--chat-template", str(resent_input.TEMPLATE)])
        extra = [*args.proxy_arg] + (["--otlp-endpoint", sink[1]] if sink else [])
        pid, base = start_proxy(services, engine_url, store, args.tree, extra)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            warm = Driver(http, base, args.shape)  # tokenizer, rendering decided, connections
            await warm.open(2)
            await warm.turns(3)
            driver = Driver(http, base, args.shape)
            await driver.open(args.sessions)
            await driver.turns(args.turns - args.profiled)
            sent_items = items(driver)
            stacks = out.with_suffix(".txt")
            record = [py_spy(), "record", "--pid", str(pid), "--format", "raw", "--nolineno", "--nonblocking"]
            sampler = await asyncio.create_subprocess_exec(*record, "--rate", str(args.rate), "--output", str(stacks))
            await asyncio.sleep(1.0)  # py-spy attached
            before = cpu_seconds(pid)
            started = time.perf_counter()
            await driver.turns(args.profiled)
            seconds = time.perf_counter() - started
            cpu = cpu_seconds(pid) - before
            sampler.send_signal(signal.SIGINT)
            await asyncio.wait_for(sampler.wait(), 60)
    finally:
        services.stop()
        if sink is not None:
            await sink[0].cleanup()
    turns = args.sessions * args.profiled
    counts = read_stacks(stacks)
    cpu_ms = cpu / turns * 1000
    write_svg(counts, out.with_suffix(".svg"), f"{args.shape} turns, {args.store} store", cpu_ms)
    return {
        "shape": args.shape,
        "store": args.store,
        "tracing": args.tracing,
        "trace_bytes_exported": sum(sink[2]) if sink else 0,
        "tree": str(args.tree) if args.tree else None,
        "revision": revision(args.tree or ROOT),
        "sessions": args.sessions,
        "profiled_turns": args.profiled,
        "items_at_first_profiled_turn": sent_items,
        "cpu_ms_per_turn": cpu_ms,
        "turns_per_s": turns / seconds,
        "samples": sum(counts.values()),
        "top": top(counts, cpu_ms, args.top),
    }


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    """py-spy's raw output: ``frame;frame;... count`` a line (root first)."""
    counts: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[tuple(stack.split(";"))] += int(count)
    return counts


#: where a frame's path starts to say something: the package, an installed one, the standard library
_PATH_HEAD = re.compile(r"^.*?/(?:src|site-packages|lib/python3\.\d+)/")


def short(frame: str) -> str:
    """``function (path/to/module.py)`` with the path from the package (or site-packages, or the standard
    library) on."""
    name, _, where = frame.partition(" (")
    where = _PATH_HEAD.sub("", where.rstrip(")"))
    return f"{name} ({where})" if where else name


def top(counts: Counter[tuple[str, ...]], cpu_ms: float, limit: int) -> list[dict[str, Any]]:
    """The functions most often on the stack (once per sample however deep), their share and ms per turn,
    and the share of the samples that end in them (self)."""
    total = sum(counts.values()) or 1
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, count in counts.items():
        frames = [
            short(frame) for frame in stack if not frame.startswith("process ") and not frame.startswith("thread ")
        ]
        for frame in set(frames):
            inclusive[frame] += count
        if frames:
            own[frames[-1]] += count
    return [
        {
            "function": frame,
            "share": count / total,
            "ms_per_turn": count / total * cpu_ms,
            "self_share": own[frame] / total,
        }
        for frame, count in inclusive.most_common(limit)
    ]


def write_svg(counts: Counter[tuple[str, ...]], path: Path, title: str, cpu_ms: float) -> None:
    """An icicle flame graph (root at the top) of collapsed stacks: each frame as wide as its samples."""
    tree: dict[str, Any] = {"count": 0, "children": {}}
    for stack, count in counts.items():
        node = tree
        node["count"] += count
        for frame in stack:
            if frame.startswith("process ") or frame.startswith("thread "):
                continue
            node = node["children"].setdefault(short(frame), {"count": 0, "children": {}})
            node["count"] += count
    width, row, total = 1600.0, 17, tree["count"] or 1
    rects: list[str] = []
    depth_max = 0

    def draw(node: dict[str, Any], x: float, depth: int) -> None:
        nonlocal depth_max
        depth_max = max(depth_max, depth)
        for name, child in sorted(node["children"].items()):
            w = child["count"] / total * width
            if w >= 0.3:
                share = child["count"] / total
                label = html.escape(name)
                hue = 10 + (hash(name.split(" (")[-1]) % 50)
                rects.append(
                    f"<g><title>{label}: {share:.1%}, {share * cpu_ms:.3f} ms/turn</title>"
                    f'<rect x="{x:.1f}" y="{30 + depth * row}" width="{w:.1f}" height="{row - 1}" '
                    f'fill="hsl({hue},80%,60%)"/>'
                    + (
                        f'<text x="{x + 2:.1f}" y="{30 + depth * row + 12}" font-size="11">'
                        f"{html.escape(name[: int(w / 6.5)])}</text>"
                        if w > 40
                        else ""
                    )
                    + "</g>"
                )
                draw(child, x, depth + 1)
            x += w

    draw(tree, 0.0, 0)
    height = 40 + (depth_max + 1) * row
    heading = html.escape(f"{title}: {total} samples, {cpu_ms:.2f} ms proxy CPU per turn (hover a frame)")
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" font-family="monospace">'
        f'<text x="4" y="18" font-size="13">{heading}</text>' + "".join(rects) + "</svg>\n"
    )


#: frames every sample is in (the interpreter's start, the CLI, a thread's start): they say nothing
_ROOTS = ("<frozen runpy>", "rollout_proxy/cli.py", "rollout_proxy/__main__.py", "threading.py", "concurrent/futures")


def table(report: dict[str, Any], rows: int = 20) -> str:
    """The top cumulative costs per turn, the frames every sample shares left out."""
    kept = [entry for entry in report["top"] if not any(root in entry["function"] for root in _ROOTS)]
    lines = [
        [entry["function"], f"{entry['share']:.1%}", f"{entry['ms_per_turn']:.3f} ms", f"{entry['self_share']:.1%}"]
        for entry in kept[:rows]
    ]
    head = (
        f"{report['shape']} turns, {report['store']} store{', traced' if report.get('tracing') else ''} "
        f"({report['revision']}): {report['cpu_ms_per_turn']:.2f} ms proxy CPU per turn over {report['sessions']} "
        f"sessions x {report['profiled_turns']} turns from {report['items_at_first_profiled_turn']} items, "
        f"{report['samples']} samples\n\n"
    )
    return head + markdown_table(["function (cumulative)", "share of samples", "ms per turn", "self"], lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="short")
    parser.add_argument("--store", choices=("memory", "redis"), default="memory")
    parser.add_argument("--sessions", type=int, default=16, help="sessions in lock step (default 16)")
    parser.add_argument("--turns", type=int, default=30, help="turns per session (default 30)")
    parser.add_argument("--profiled", type=int, default=10, help="the last turns, sampled (default 10)")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second (default 500)")
    parser.add_argument("--top", type=int, default=40, help="functions kept in the JSON (default 40)")
    parser.add_argument("--tree", type=Path, help="run the proxy from another checkout (its src/ first)")
    parser.add_argument("--proxy-arg", action="append", default=[], help="passed to rollout-proxy serve")
    parser.add_argument(
        "--tracing", action="store_true", help="traces on: exported over OTLP/HTTP to a collector this run holds"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not 0 < args.profiled <= args.turns:
        parser.error("--profiled: between 1 and --turns")
    args.out.mkdir(parents=True, exist_ok=True)
    name = (
        f"profile_turn-{args.shape}-{args.store}"
        + ("-tracing" if args.tracing else "")
        + ("-tree" if args.tree else "")
    )
    report = asyncio.run(profile(args, args.out / name))
    write_report(args.out / f"{name}.json", report, "bench.profile_turn", argv)
    print(table(report))
    print(f"wrote {args.out / name}.svg, .txt, .json")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
