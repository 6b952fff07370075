"""Memory soak: is a proxy's memory flat under a constant load, and given back once its sessions expire?

    python -m bench.memory_soak [--duration 600] [--sessions 32] [--turns 10] [--ttl 120] [--rate 55] [--out DIR]

One run starts, side by side, a proxy on the memory store and a proxy on Redis (each its own
process, started as ``rollout-proxy serve`` starts one: settings, app, event loop, collector; so
the RSS sampled is the proxy's own), the fake engine (``load_tests.engine``, its fixed policy: it
answers at once) and, unless ``--redis-url`` names one, a private redis-server. Each proxy first
serves one rollout (what a proxy loads once, its tokenizer and template, is not growth) and its RSS
then is the warm baseline. Then ``--sessions`` rollouts run at once on each: a rollout does
``--turns`` chat turns resending its history, appends a tool result (with an ``Idempotency-Key``)
and finishes, except every ``--leave-open``-th, left to expire; a new one starts in its place, until
``--duration`` seconds have passed. ``--rate`` paces each proxy's turns (at most that many a second): the
sessions a proxy holds, and so its plateau, grow with its throughput, which on shared cores moves with
everyone's load; paced, the load is the same from the first minute to the last. Then nothing is sent for
``--drain`` seconds (default: the TTL and 15 s, so every session has expired and the proxy has had the
time to give memory back), and each proxy is asked, by a route only this benchmark adds
(``/_soak/stats``), what it holds.

The table says, per store: turns answered (errors), RSS warm, at the end of the warm-up
(``--warmup``, default twice the TTL: from one TTL on, sessions expire as fast as they start), at the
end of the load and its growth since the warm-up, the slope after the warm-up with its noise (the
least-squares line through the per-minute medians of the RSS, sampled each second, and its 95%
confidence interval: "flat" is 0 inside it), the same slope of glibc's bytes in use (sampled each 10 s),
the sessions alive at the end, RSS once every session has expired, glibc's bytes in use (``mallinfo2``)
warm, at the end and after expiry, and the entries the proxy's per-session structures still hold after
expiry (the store's sessions and request bounds, remembered conversations, message and path-hash memos,
verified tokens, the open-session gauge, held paths: 0 is the goal). ``--out`` writes the whole run as
JSON (``memory_soak.json``: the RSS samples; every 10 s of the load, each structure's count, threads and
malloc arenas, CPython's small-object arenas; RSS after one more ``malloc_trim(0)``).

``--tracemalloc`` traces the proxies' Python allocations from the warm proxy on (much slower: choose a TTL
that outlasts a rollout) and adds, per store, the allocation sites (``--tracemalloc-frames`` callers each)
whose live bytes grew most from the warm-up to the end and over the second half of the load, and those
still held after expiry beyond the warm proxy's. Its snapshots go to files, so they are no RSS of the proxy.

``--variant STORE:KNOB`` changes one proxy, the other left as shipped, so both see the same load: ``fill-word-cache``
(its tokenizers' word caches, up to 10,000 words each in native memory, filled with new words before the warm
baseline), ``trim-every=S`` (``malloc_trim(0)`` each S seconds, in a thread; the detail says how long it took),
``arena-max=N`` (``MALLOC_ARENA_MAX=N`` in its environment).

``--slope-windows N`` adds a table of the time after the warm-up in N equal stretches, each one's RSS and slopes:
growth that slows from one stretch to the next is caches filling to their bounds, growth at one pace a leak.

A benchmark, not a test (tests/bench/test_memory_soak_smoke.py runs it tiny): its numbers are in
docs/operations/memory.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from load_tests.run import Services, child_env, free_port, start_engine, start_redis

ROOT = Path(__file__).resolve().parents[1]

ADMIN_KEY = "soak-admin-key"
STATS = "/_soak/stats"
SAMPLE = 50  # sessions measured for bytes per session
TOP_LINES = 12  # --tracemalloc: source lines reported
STATS_EVERY = 10.0  # seconds between two of a proxy's own reports (glibc's bytes in use, structures)
FILL_WORDS = 12_000  # new words that fill a tokenizer's word cache (10,000 words, the library's bound)
KNOBS = ("fill-word-cache", "trim-every", "arena-max")  # --variant STORE:KNOB[=VALUE]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- inside a proxy process ------------------------------------------------------------------


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def malloc_info(libc: Any) -> dict[str, float]:
    """glibc's heaps, in MiB: bytes handed out (``in_use``), free but kept (``free``), mmapped chunks."""
    info = libc.mallinfo2()
    mib = 1024 * 1024
    return {
        "in_use": info.uordblks / mib,
        "free": info.fordblks / mib,
        "heaps": info.arena / mib,
        "mmapped": info.hblkhd / mib,
    }


def pymalloc_info() -> dict[str, float]:
    """CPython's small-object allocator (``sys._debugmallocstats``): its arenas, mapped apart from glibc's
    heaps (so ``mallinfo2`` does not count them), and the bytes its blocks hand out, in MiB."""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        try:
            os.dup2(captured.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines()
    found: dict[str, float] = {}
    for line in lines:
        name, _, value = line.partition("=")
        if name.startswith("# arenas allocated current"):
            found["arenas"] = int(value.replace(",", ""))
        elif "bytes/arena" in name:
            found["arenas_mib"] = int(value.replace(",", "")) / 2**20
        elif name.startswith("# bytes in allocated blocks"):
            found["in_blocks"] = int(value.replace(",", "")) / 2**20
    return found


def deep_size(value: Any, seen: set[int] | None = None) -> int:
    """Bytes held by ``value`` and what it references (numpy arrays by their buffers)."""
    import dataclasses

    import numpy as np

    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return sys.getsizeof(value) + (value.nbytes if value.base is not None else 0)
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, list | tuple | set):
        size += sum(deep_size(item, seen) for item in value)
    elif dataclasses.is_dataclass(value):
        size += sum(deep_size(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return size


async def stored_per_session(store: Any) -> dict[str, Any]:
    """Sessions alive and bytes per session (a sample): a deep size of the memory store's records, or
    Redis's ``MEMORY USAGE`` of a session's keys."""
    from rollout_proxy.state import keys
    from rollout_proxy.state.memory import MemoryStore

    if isinstance(store, MemoryStore):
        states = list(store._sessions.values())
        sample = states[:SAMPLE]
        per = sum(deep_size(state) for state in sample) / len(sample) if sample else 0
        return {"sessions": len(states), "bytes_per_session": per}
    ids = [
        key.decode().split("{")[1].split("}")[0]
        async for key in store._redis.scan_iter(match="rp:{*}:session", count=1000)
    ]
    per = 0.0
    for session_id in ids[:SAMPLE]:
        for key in keys.session_keys(session_id):
            per += await store._redis.memory_usage(key) or 0
    return {"sessions": len(ids), "bytes_per_session": per / min(len(ids), SAMPLE) if ids else 0}


def structures(app: Any) -> dict[str, int]:
    """Entries of every per-session structure of the proxy: after expiry each should be 0."""
    from rollout_proxy.proxy import keys
    from rollout_proxy.state.memory import MemoryStore

    store = app[keys.STORE]
    known = app[keys.RESENT_HISTORY].held()
    held: dict[str, int] = {
        "conversations": known["conversations"],
        "message_memo": known["messages"],
        "path_hash_memo": known["path_hashes"],
        "verified_tokens": len(app[keys.TOKENS]),
        "open_session_gauge": app[keys.METRICS].sessions.count(time.time()),
    }
    if isinstance(store, MemoryStore):
        held |= {"store_sessions": len(store._sessions), "request_bounds": len(store._limits)}
    else:
        held |= {"held_paths": len(store._paths)}
    return held


def threads_and_arenas(libc: Any) -> dict[str, int]:
    """Threads of the process, and glibc's malloc arenas (``malloc_info``: one ``<heap>`` per arena)."""
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    info = ctypes.string_at(buffer, size.value).decode()
    libc.free(buffer)
    return {"threads": len(os.listdir("/proc/self/task")), "arenas": info.count("<heap nr=")}


def word_caches() -> list[Any]:
    """Every ``tokenizers.Tokenizer`` the proxy holds (its model keeps a cache of the words it split: up to
    10,000, native memory that no Python object counts), found among the live objects."""
    from tokenizers import Tokenizer

    return [obj for obj in gc.get_objects() if isinstance(obj, Tokenizer)]


def novel_words(count: int, start: int = 0) -> str:
    """``count`` words of letters no load of this benchmark sends (a ByteLevel BPE caches each apart)."""
    words = []
    for n in range(start, start + count):
        letters = ""
        for _ in range(4):
            n, digit = divmod(n, 26)
            letters += chr(ord("a") + digit)
        words.append("zq" + letters)
    return " ".join(words)


def fill_word_caches(words: int) -> int:
    """Encode ``words`` new words with each of the proxy's tokenizers, so their word caches are full from the
    warm baseline on (a cache filled once, like the tokenizer loaded once, is not growth); tokenizers filled."""
    text = novel_words(words)
    caches = word_caches()
    for tokenizer in caches:
        tokenizer.encode(text, add_special_tokens=False)
    return len(caches)


async def trim_forever(libc: Any, every: float, took: list[float]) -> None:
    """``malloc_trim(0)`` each ``every`` seconds, in a thread; how long each took (ms) into ``took``."""

    def trim() -> float:
        started = time.perf_counter()
        libc.malloc_trim(0)
        return (time.perf_counter() - started) * 1000

    while True:
        await asyncio.sleep(every)
        took.append(await asyncio.to_thread(trim))


def serve_proxy(args: argparse.Namespace) -> None:
    """``rollout-proxy serve`` as it starts (settings, app, loop, collector), plus this benchmark's route."""
    from aiohttp import web

    from rollout_proxy.app import create_app
    from rollout_proxy.cli import _run_loop
    from rollout_proxy.logs import configure_logging
    from rollout_proxy.proxy import keys
    from rollout_proxy.proxy.server import serve_until_stopped
    from rollout_proxy.settings import Settings

    libc = _libc()
    settings = Settings.from_env(
        engines=(args.engine,),
        admin_key=ADMIN_KEY,
        store=args.store,
        session_ttl=args.ttl,
        port=args.port,
        log_format="json",
        log_level="warning",
    )
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings)
    # snapshots written to files, not held: a held one (25 MiB after a few minutes) would be RSS growth
    marks: dict[str, Path] = {}
    tokenizers_filled: list[int] = []
    trim_took: list[float] = []
    snapshots = Path(tempfile.mkdtemp(prefix="rp-soak-snapshots-"))

    async def stats(request: web.Request) -> web.Response:
        """What the proxy holds now; ``?trim=1``: after a full collection and ``malloc_trim(0)``;
        ``?mark=NAME``: a tracemalloc snapshot kept under NAME (tracing from the first: what the proxy loaded
        before, its tokenizer's imports, untraced); ``?since=NAME``: the lines grown since."""
        query = request.query
        trimmed_in = None
        if query.get("fill_words"):
            filled = await asyncio.to_thread(fill_word_caches, int(query["fill_words"]))
            tokenizers_filled.append(filled)
        if query.get("trim"):
            gc.collect()
            started = time.perf_counter()
            libc.malloc_trim(0)
            trimmed_in = (time.perf_counter() - started) * 1000
        answer: dict[str, Any] = {
            "trim_ms": trimmed_in,
            "rss": rss_mib(os.getpid()),
            "malloc": malloc_info(libc),
            "structures": structures(app),
            "python_blocks": sys.getallocatedblocks(),
            "pymalloc": pymalloc_info(),
            **threads_and_arenas(libc),
            "word_caches_filled": tokenizers_filled[-1] if tokenizers_filled else 0,
            "periodic_trims": len(trim_took),
            "periodic_trim_ms": {
                "median": statistics.median(trim_took) if trim_took else None,
                "max": max(trim_took, default=None),
            },
        }
        if query.get("stored"):
            answer |= await stored_per_session(app[keys.STORE])
        if args.tracemalloc:
            import tracemalloc

            if not tracemalloc.is_tracing():
                tracemalloc.start(args.tracemalloc_frames)
            answer["traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
            if "mark" in query:
                marks[query["mark"]] = snapshots / f"{len(marks)}.tracemalloc"
                tracemalloc.take_snapshot().dump(str(marks[query["mark"]]))
            if "since" in query and query["since"] in marks:
                group = "traceback" if args.tracemalloc_frames > 1 else "lineno"
                since = tracemalloc.Snapshot.load(str(marks[query["since"]]))
                grown = tracemalloc.take_snapshot().compare_to(since, group)
                del since
                answer["grown"] = [
                    f"{stat.size_diff / 2**20:+.2f} MiB {stat.count_diff:+d} blocks "
                    + " < ".join(
                        f"{frame.filename.split('site-packages/')[-1].split('src/')[-1]}:{frame.lineno}"
                        for frame in reversed(stat.traceback)
                    )
                    for stat in grown[:TOP_LINES]
                ]
        return web.json_response(answer)

    async def remove_snapshots(_: web.Application) -> None:
        shutil.rmtree(snapshots, ignore_errors=True)

    trimmer: list[asyncio.Task[None]] = []  # held: the loop keeps only a weak reference to a task

    async def start_trimming(_: web.Application) -> None:
        if args.trim_every:
            trimmer.append(asyncio.create_task(trim_forever(libc, args.trim_every, trim_took)))

    app.router.add_get(STATS, stats)
    app.on_startup.append(start_trimming)
    app.on_cleanup.append(remove_snapshots)
    _run_loop(
        serve_until_stopped(app, settings.host, settings.port, gc_threshold=settings.gc_threshold), settings.event_loop
    )


# -- the load -----------------------------------------------------------------------------------


@dataclass
class Proxy:
    name: str
    url: str
    pid: int
    ttl: float
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the load, RSS MiB)
    stats: list[dict[str, Any]] = field(default_factory=list)  # ``STATS`` each ``STATS_EVERY`` s, ``t`` added
    turns: int = 0
    errors: int = 0
    sessions: int = 0
    first_error: str | None = None
    rate: float = 0.0  # turns a second at most (0: as fast as it answers)
    next_turn: float = 0.0  # when the next turn may start (monotonic), paced at ``rate``

    async def paced(self) -> None:
        """Wait for the next turn's slot: turns start ``1 / rate`` apart, so a proxy's load, and with it the
        sessions it holds, does not move with the throughput the shared cores allow."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.next_turn = max(self.next_turn, now) + 1 / self.rate
        if self.next_turn - 1 / self.rate > now:
            await asyncio.sleep(self.next_turn - 1 / self.rate - now)

    def rss_at(self, t: float) -> float:
        return min(self.samples, key=lambda sample: abs(sample[0] - t))[1]

    def slope_after(self, t: float) -> Slope:
        """MiB per minute after ``t``: the least-squares line through the per-minute medians of the samples."""
        return slope_of_minutes([(x, y) for x, y in self.samples if x >= t])


@dataclass(frozen=True)
class Slope:
    """A least-squares slope (per minute) with its 95% confidence interval (``slope ± margin``)."""

    slope: float
    margin: float
    points: int

    @property
    def flat(self) -> bool:
        """0 lies within the interval: no growth that the noise of the points can tell."""
        return abs(self.slope) <= self.margin

    def __str__(self) -> str:
        return f"{self.slope:+.2f} ± {self.margin:.2f}"


def t_975(dof: int) -> float:
    """Student's t 97.5% quantile: the normal's, corrected for ``dof`` degrees of freedom (the Cornish-Fisher
    expansion, to its third term: within 1% from 3 degrees of freedom on, exact in the limit)."""
    z = 1.959964
    return (
        z
        + (z**3 + z) / (4 * dof)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
    )


def slope_of_minutes(samples: list[tuple[float, float]], every: float = 1.0) -> Slope:
    """The least-squares slope (per minute) of the median of each whole minute of ``samples`` (seconds, value),
    minutes counted from the first sample (one taken each ``every`` seconds; a minute with less than half its
    samples, the last one's rest, is left out), and its 95% confidence interval. Medians, not the samples: a
    second's RSS is much like the last one's, so a line through every sample would claim far more certainty
    than the run has; a minute's median also shrugs off a short spike."""
    if not samples:
        return Slope(0.0, math.inf, 0)
    start = samples[0][0]
    minutes: dict[int, list[float]] = {}
    for x, y in samples:
        minutes.setdefault(int((x - start) // 60), []).append(y)
    whole = [(minute, statistics.median(ys)) for minute, ys in sorted(minutes.items()) if len(ys) >= 30 / every]
    if len(whole) < 3:
        return Slope(0.0, math.inf, len(whole))
    fit = statistics.linear_regression([float(m) for m, _ in whole], [y for _, y in whole])
    mean_x = statistics.fmean(m for m, _ in whole)
    spread = sum((m - mean_x) ** 2 for m, _ in whole)
    residual = sum((y - fit.intercept - fit.slope * m) ** 2 for m, y in whole)
    error = math.sqrt(residual / (len(whole) - 2) / spread)
    return Slope(fit.slope, t_975(len(whole) - 2) * error, len(whole))


def in_use_slope(stats: list[dict[str, Any]], low: float, high: float = math.inf) -> Slope:
    """The slope of glibc's bytes in use (a proxy's reports, one each ``STATS_EVERY`` s) from ``low`` to ``high``."""
    return slope_of_minutes([(s["t"], s["malloc"]["in_use"]) for s in stats if low <= s["t"] <= high], STATS_EVERY)


async def rollout(http: aiohttp.ClientSession, proxy: Proxy, index: int, args: argparse.Namespace) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Rollout {index}: think of a word and a number."}]
    body = {"sample": {"messages": messages}, "generation": {"max_new_tokens": 64}}
    try:
        async with http.post(f"{proxy.url}/v1/sessions", json=body, headers=admin) as answer:
            assert answer.status == 201, await answer.text()
            session = await answer.json()
        plugin = {"Authorization": f"Bearer {session['api_key']}"}
        last_id = None
        for turn in range(args.turns):
            await proxy.paced()
            async with http.post(
                f"{session['base_url']}/chat/completions", json={"model": "m", "messages": messages}, headers=plugin
            ) as answer:
                assert answer.status == 200, await answer.text()
                reply = await answer.json()
            proxy.turns += 1
            last_id = reply["id"]
            question = {"role": "user", "content": f"Rollout {index}, turn {turn}: and then?"}
            messages = [*messages, reply["choices"][0]["message"], question]
        tool = [{"role": "user", "content": f"a tool said: {index}"}]
        async with http.post(
            f"{session['base_url']}/sessions/{session['session_id']}/messages",
            json={"messages": tool, "previous_response_id": last_id},
            headers={**plugin, "Idempotency-Key": str(uuid.uuid4())},
        ) as answer:
            assert answer.status == 201, await answer.text()
        if args.leave_open and index % args.leave_open == 0:
            proxy.sessions += 1  # left to expire
            return
        async with http.post(
            f"{proxy.url}/v1/sessions/{session['session_id']}/finish", json={"status": "success"}, headers=admin
        ) as answer:
            assert answer.status == 200, await answer.text()
        proxy.sessions += 1
    except Exception as exc:
        proxy.errors += 1
        proxy.first_error = proxy.first_error or f"{type(exc).__name__}: {exc}"[:500]


async def stats(http: aiohttp.ClientSession, proxy: Proxy, **query: str) -> dict[str, Any]:
    async with http.get(proxy.url + STATS, params=query) as answer:
        return await answer.json()


async def soak(proxies: list[Proxy], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {proxy.name: {} for proxy in proxies}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        # one rollout each first: what a proxy loads once (its tokenizer, the template) is not growth; under
        # --tracemalloc loading the tokenizer takes minutes, so no timeout, and the run stops if it failed
        warm = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=warm) as first:
            await asyncio.gather(*(rollout(first, proxy, -1, args) for proxy in proxies))
        for proxy in proxies:
            if proxy.errors:
                raise SystemExit(f"{proxy.name}: the warm-up rollout failed: {proxy.first_error}")
        for proxy in proxies:
            if "fill-word-cache" in args.variants.get(proxy.name, {}):
                await stats(http, proxy, fill_words=str(FILL_WORDS))
        await asyncio.sleep(2)
        for proxy in proxies:
            results[proxy.name]["at_idle"] = idle = await stats(http, proxy, mark="idle")
            results[proxy.name]["idle"] = idle["rss"]
            proxy.turns = proxy.sessions = 0
        started = time.monotonic()
        counter = iter(range(1 << 62))

        async def worker(proxy: Proxy) -> None:
            while time.monotonic() - started < args.duration:
                await rollout(http, proxy, next(counter), args)

        workers = [asyncio.create_task(worker(proxy)) for proxy in proxies for _ in range(args.sessions)]
        # tracemalloc snapshots: at the end of the warm-up and halfway from there to the end
        marks = {"warmup": args.warmup, "midway": (args.warmup + args.duration) / 2}
        next_sample, next_stats = 0.0, 0.0
        while not all(task.done() for task in workers):
            elapsed = time.monotonic() - started
            if elapsed >= next_sample:
                for proxy in proxies:
                    proxy.samples.append((elapsed, rss_mib(proxy.pid)))
                if next_sample % 30 == 0:
                    line = "  ".join(f"{p.name} {p.samples[-1][1]:6.1f} MiB {p.turns:7d} turns" for p in proxies)
                    print(f"{elapsed:5.0f}s {line}", flush=True)
                next_sample += 1.0
            due = [name for name, at in marks.items() if elapsed >= at]
            if elapsed >= next_stats or due:
                for name in due:
                    del marks[name]
                for proxy in proxies:
                    for query in [{"mark": name} for name in due] or [{}]:
                        report = await stats(http, proxy, **query)
                    proxy.stats.append({"t": elapsed, "turns": proxy.turns, **report})
                next_stats += STATS_EVERY if elapsed >= next_stats else 0
            await asyncio.sleep(0.05)
        loaded = time.monotonic() - started
        for proxy in proxies:
            result = results[proxy.name]
            at_end = await stats(http, proxy, stored="1", since="warmup")
            if args.tracemalloc:
                at_end["grown_since_midway"] = (await stats(http, proxy, since="midway")).get("grown", [])
            slope = proxy.slope_after(args.warmup)
            in_use = in_use_slope(proxy.stats, args.warmup)
            result |= {
                "ttl": proxy.ttl,
                "warmup_rss": proxy.rss_at(args.warmup),
                "end": at_end["rss"],
                "peak_after_warmup": max(rss for t, rss in proxy.samples if t >= args.warmup),
                "slope": slope.slope,
                "slope_margin": slope.margin,
                "slope_minutes": slope.points,
                "malloc_in_use_slope": in_use.slope,
                "malloc_in_use_slope_margin": in_use.margin,
                "at_end": at_end,
                "turns": proxy.turns,
                "turns_per_s": proxy.turns / loaded,
                "sessions": proxy.sessions,
                "errors": proxy.errors,
                "first_error": proxy.first_error,
                "samples": proxy.samples,
                "stats": proxy.stats,
            }
        print(f"draining {args.drain:.0f}s (no traffic: every session expires)...", flush=True)
        await asyncio.sleep(args.drain)
        for proxy in proxies:
            result = results[proxy.name]
            result["drained"] = await stats(http, proxy, stored="1", since="idle")
            result["trimmed"] = await stats(http, proxy, trim="1")
    return results


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        "| store | TTL | turns (errors) | turns/s | RSS warm | RSS at warm-up | RSS at end | growth warm-up→end "
        "| RSS slope after warm-up (95% CI) | malloc in use: slope after warm-up | sessions alive at end "
        "| RSS after expiry | malloc in use: warm / end / after expiry | entries left |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, r in results.items():
        growth = (r["end"] - r["warmup_rss"]) / r["warmup_rss"] * 100
        left = sum(r["drained"]["structures"].values())
        in_use = " / ".join(f"{r[moment]['malloc']['in_use']:.1f}" for moment in ("at_idle", "at_end", "drained"))
        variant = "".join(
            f" +{knob}{'=' + value if value else ''}" for knob, value in args.variants.get(name, {}).items()
        )
        lines.append(
            f"| {name}{variant} | {r['ttl']:g} s | {r['turns']} ({r['errors']}) | {r['turns_per_s']:.0f} | {r['idle']:.1f} MiB "
            f"| {r['warmup_rss']:.1f} MiB | {r['end']:.1f} MiB | {growth:+.1f}% "
            f"| {r['slope']:+.2f} ± {r['slope_margin']:.2f} MiB/min "
            f"| {r['malloc_in_use_slope']:+.2f} ± {r['malloc_in_use_slope_margin']:.2f} MiB/min "
            f"| {r['at_end']['sessions']} | {r['drained']['rss']:.1f} MiB | {in_use} MiB | {left} |"
        )
    settings = (
        f"{args.sessions} sessions at once per store, {args.turns} turns each"
        + (f", at most {args.rate:g} turns/s per store" if args.rate else "")
        + f", {args.duration:g} s of load, "
        f"warm-up {args.warmup:g} s, then {args.drain:g} s without traffic"
    )
    return "\n".join([settings, "", *lines])


def stretches(results: dict[str, dict[str, Any]], warmup: float, count: int) -> str:
    """The time after the warm-up in ``count`` equal stretches, each one's RSS (first and last minute's
    median) and slopes: growth that slows from one to the next is caches filling to their bounds; growth at
    the same pace is a leak."""
    head = "| store | minutes | RSS | RSS slope (95% CI) | malloc in use: slope |"
    lines = [head, "|---|---|---|---|---|"]
    for name, r in results.items():
        end = r["samples"][-1][0]
        step = (end - warmup) / count
        for index in range(count):
            low, high = warmup + index * step, warmup + (index + 1) * step
            samples = [(t, rss) for t, rss in r["samples"] if low <= t <= high]
            rss = slope_of_minutes(samples)
            in_use = in_use_slope(r["stats"], low, high)
            first = statistics.median(value for t, value in samples if t < low + 60)
            last = statistics.median(value for t, value in samples if t > high - 60)
            lines.append(
                f"| {name} | {low / 60:.0f}-{high / 60:.0f} | {first:.1f} → {last:.1f} MiB "
                f"| {rss.slope * 1024:+.1f} ± {rss.margin * 1024:.1f} KiB/min "
                f"| {in_use.slope * 1024:+.1f} ± {in_use.margin * 1024:.1f} KiB/min |"
            )
    return "\n".join(lines)


def detail(results: dict[str, dict[str, Any]]) -> str:
    """What each proxy held, at the end of the load and once every session had expired."""
    out = []
    for name, r in results.items():
        for moment in ("at_idle", "at_end", "drained", "trimmed"):
            m = r[moment]
            heap = m["malloc"]
            held = " ".join(f"{k}={v}" for k, v in m["structures"].items())
            traced = f" python-traced {m['traced_mib']:.1f} MiB" if "traced_mib" in m else ""
            out.append(
                f"{name:6} {moment:8} RSS {m['rss']:6.1f} MiB  malloc in use {heap['in_use']:6.1f} free "
                f"{heap['free']:6.1f} mmapped {heap['mmapped']:5.1f}{traced}  threads {m['threads']} arenas "
                f"{m['arenas']}  {held}"
            )
        trims = r["at_end"]["periodic_trims"]
        if trims:
            took = r["at_end"]["periodic_trim_ms"]
            out.append(
                f"{name:6} periodic malloc_trim: {trims} by the end, {took['median']:.1f} ms median, {took['max']:.1f} max"
            )
        if r["at_idle"]["word_caches_filled"]:
            out.append(f"{name:6} word caches filled before the warm baseline: {r['at_idle']['word_caches_filled']}")
        if r.get("first_error"):
            out.append(f"{name:6} first error: {r['first_error']}")
        for line in r["at_end"].get("grown", []):
            out.append(f"{name:6} grown since warm-up: {line}")
        for line in r["at_end"].get("grown_since_midway", []):
            out.append(f"{name:6} grown in the second half: {line}")
        for line in r["drained"].get("grown", []):
            out.append(f"{name:6} held after expiry, beyond the idle proxy's: {line}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--sessions", type=int, default=32, help="rollouts at once, per store (default 32)")
    parser.add_argument("--turns", type=int, default=10, help="chat turns per rollout (default 10)")
    parser.add_argument("--ttl", type=float, default=120.0, help="session TTL in seconds (default 120)")
    parser.add_argument("--redis-ttl", type=float, help="the Redis proxy's session TTL (default: --ttl)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="turns a second per proxy at most (default 0: as fast as answered)"
    )
    parser.add_argument("--leave-open", type=int, default=2, help="every Nth rollout is not finished (default 2)")
    parser.add_argument("--warmup", type=float, help="seconds before growth is measured (default 2x the TTL)")
    parser.add_argument("--drain", type=float, help="seconds without traffic after the load (default TTL + 15)")
    parser.add_argument("--redis-url", help="an empty Redis to use (default: a private redis-server)")
    parser.add_argument("--tracemalloc", action="store_true", help="trace the proxies' Python allocations")
    parser.add_argument(
        "--tracemalloc-frames", type=int, default=1, help="frames kept per allocation (more: grouped by traceback)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="STORE:KNOB[=VALUE]",
        help="one proxy's variant (repeatable): fill-word-cache (its tokenizers' word caches filled before the "
        "warm baseline), trim-every=S (malloc_trim(0) each S seconds, in a thread), arena-max=N "
        "(MALLOC_ARENA_MAX=N)",
    )
    parser.add_argument(
        "--slope-windows",
        type=int,
        default=1,
        metavar="N",
        help="the time after the warm-up in N equal stretches, each one's slopes (default 1: none apart)",
    )
    parser.add_argument("--out", type=Path, help="write memory_soak.json there")
    args = parser.parse_args()
    args.variants = parse_variants(args.variant)
    longest = max(args.ttl, args.redis_ttl or 0)
    args.warmup = 2 * longest if args.warmup is None else args.warmup
    args.drain = longest + 15 if args.drain is None else args.drain
    if args.warmup >= args.duration:
        raise SystemExit(f"--warmup ({args.warmup:g} s) must be shorter than --duration ({args.duration:g} s)")

    workdir = Path(tempfile.mkdtemp(prefix="rp-soak-"))
    services = Services(workdir)
    try:
        redis_url = args.redis_url or start_redis(services)
        _, engine_url = start_engine(services, policy="fixed")
        proxies = []
        for name, store, ttl in (("memory", "memory", args.ttl), ("redis", redis_url, args.redis_ttl or args.ttl)):
            port = free_port()
            argv = [sys.executable, "-m", "bench.memory_soak", "proxy", "--store", store, "--engine", engine_url]
            argv += ["--port", str(port)]
            argv += ["--ttl", str(ttl), *(["--tracemalloc"] if args.tracemalloc else [])]
            argv += ["--tracemalloc-frames", str(args.tracemalloc_frames)]
            variant = args.variants.get(name, {})
            argv += ["--trim-every", variant.get("trim-every", "0")]
            env = child_env() | ({"MALLOC_ARENA_MAX": variant["arena-max"]} if "arena-max" in variant else {})
            process = services.start(f"proxy-{name}", argv, env=env)
            proxies.append(Proxy(name, f"http://127.0.0.1:{port}", process.pid, ttl, rate=args.rate))
        for proxy in proxies:  # started together, waited for in turn
            services.wait_http(f"proxy-{proxy.name}", f"{proxy.url}/readyz")
        results = asyncio.run(soak(proxies, args))
    finally:
        services.stop()
    print(table(results, args))
    if args.slope_windows > 1:
        print()
        print(stretches(results, args.warmup, args.slope_windows))
    print()
    print(detail(results))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        (args.out / "memory_soak.json").write_text(json.dumps({**report, "results": results}, indent=1))


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``STORE:KNOB[=VALUE]`` each: {store: {knob: value}}."""
    variants: dict[str, dict[str, str]] = {}
    for spec in specs:
        store, _, knob = spec.partition(":")
        name, _, value = knob.partition("=")
        if store not in ("memory", "redis") or name not in KNOBS or (name != "fill-word-cache") != bool(value):
            raise SystemExit(f"--variant {spec!r}: STORE is memory or redis, KNOB one of {', '.join(KNOBS)}")
        variants.setdefault(store, {})[name] = value
    return variants


def proxy_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="memory_soak.py proxy")
    parser.add_argument("--store", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--tracemalloc-frames", type=int, default=1)
    parser.add_argument("--trim-every", type=float, default=0.0)
    serve_proxy(parser.parse_args(argv))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "proxy":
        proxy_main(sys.argv[2:])
    else:
        main()
