"""What a turn costs the proxy, counted instead of timed: the instructions its process runs (valgrind's
callgrind) or the calls into its own Python code (``devtools.call_count``), per turn, over windows of turns
early and late in the conversations; for this tree and, with ``--baseline``, another checkout, one after the
other on the same load.

    python -m bench.count_turn --measure instructions --at 2,100 --baseline /tmp/rp-base-70c855b
    python -m bench.count_turn --measure calls --shape codex --at 5,30

CPU seconds on shared cores move by tens of percent between runs; these counts move by a percent or two (what
the collector and the background tasks do inside a window), so a turn 100 against a turn 2, or one tree against
another, can be compared where the timed benchmarks cannot.
Counts are not time: a call or an instruction costs what it costs (an instruction that misses the cache
costs more, and callgrind counts a copy's ``rep movsb`` once per byte: a share of ``memcpy`` says bytes
copied), and the kernel's work is in neither. Read them beside ``bench.proxy_overhead``, not instead.

The shapes are ``bench.profile_turn``'s (``short``: a short chat turn; ``codex``, ``codex-chat``, ``claude``:
the harness conversations). ``--sessions`` sessions take their turns in lock step; before each window of
``--window`` turns starting after turn N (``--at``), the proxy is told to count (``callgrind_control``, or a
signal to ``devtools/call_count.py``, which ``--measure calls`` runs it under), and the count is read when the
window ends. The instructions mode adds, per tree, the functions whose instructions grew most from the first
window to the last. valgrind must be installed for it (``apt install valgrind``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench import profile_turn, resent_input
from bench.harness import OUT, ROOT, Services, markdown_table, revision, start_engine, start_redis, write_report

MEASURES = ("instructions", "calls")
#: callgrind_annotate's line for one function: its instructions, their share, and the function
_ANNOTATED = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*)$")
_BUILD_PATH = re.compile(r"^(?:/tmp/python-build[^ ]*?/Python-[\d.]+/|\./)")


class Gauge:
    """Counts what the proxy does between ``start`` and ``stop``."""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> tuple[int, dict[str, int]]:
        """The count, and (instructions) each function's share of it."""
        raise NotImplementedError


class Callgrind(Gauge):
    """The proxy runs under ``valgrind --tool=callgrind --instr-atstart=no``: instrumentation on for a window,
    then its counts dumped to a file of their own."""

    def __init__(self, pid: int, workdir: Path) -> None:
        self.pid, self.workdir, self.dumps = pid, workdir, 0

    @staticmethod
    def launcher(workdir: Path) -> list[str]:
        if shutil.which("valgrind") is None:
            raise SystemExit("--measure instructions needs valgrind (apt install valgrind)")
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={workdir}/callgrind.%p"]

    async def _control(self, *args: str) -> None:
        process = await asyncio.create_subprocess_exec(
            "callgrind_control",
            *args,
            str(self.pid),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        if await process.wait() != 0:
            raise SystemExit(f"callgrind_control {' '.join(args)} {self.pid} failed")

    async def start(self) -> None:
        await self._control("-z")
        await self._control("-i", "on")

    async def stop(self) -> tuple[int, dict[str, int]]:
        await self._control("-d")
        await self._control("-i", "off")
        self.dumps += 1
        return read_callgrind(self.workdir / f"callgrind.{self.pid}.{self.dumps}")


def read_callgrind(dump: Path) -> tuple[int, dict[str, int]]:
    """A dump's total instructions and each function's own (``callgrind_annotate``), the build paths cut."""
    text = dump.read_text(errors="replace")
    totals = re.search(r"^totals:\s*(\d+)", text, re.MULTILINE)
    if totals is None:
        raise SystemExit(f"{dump}: no totals line")
    annotated = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(dump)], capture_output=True, text=True, check=True
    ).stdout
    functions: dict[str, int] = {}
    for line in annotated.splitlines():
        found = _ANNOTATED.match(line)
        if found and ":" in found.group(2) and "PROGRAM TOTALS" not in line:
            name = short_function(found.group(2))
            functions[name] = functions.get(name, 0) + int(found.group(1).replace(",", ""))
    return int(totals.group(1)), functions


def short_function(annotated: str) -> str:
    """``file:function [object]`` as ``function (object)``: the build's paths and recursion marks cut."""
    where, _, obj = annotated.partition(" [")
    function = re.sub(r"'\d+$", "", where.rsplit(":", 1)[-1])
    source = _BUILD_PATH.sub("", where.rsplit(":", 1)[0])
    obj = Path(obj.rstrip("]")).name.split(".cpython")[0] if obj else Path(source).name
    return f"{function} ({obj})"


class Calls(Gauge):
    """The proxy runs under ``devtools/call_count.py``: SIGUSR1 starts its counter, SIGUSR2 writes the count."""

    def __init__(self, pid: int, counts: Path) -> None:
        self.pid, self.counts = pid, counts

    @staticmethod
    def launcher() -> list[str]:
        return [sys.executable, str(ROOT / "devtools" / "call_count.py")]

    def _written(self) -> list[str]:
        return self.counts.read_text().split() if self.counts.exists() else []

    async def start(self) -> None:
        os.kill(self.pid, signal.SIGUSR1)
        await asyncio.sleep(0.2)  # the handler runs on the proxy's next bytecode; it is idle until the turns

    async def stop(self) -> tuple[int, dict[str, int]]:
        before = len(self._written())
        os.kill(self.pid, signal.SIGUSR2)
        for _ in range(200):
            written = self._written()
            if len(written) > before:
                return int(written[-1]), {}
            await asyncio.sleep(0.05)
        raise SystemExit("the proxy did not write its count")


async def count(args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    """One tree's proxy on its own engine double (and redis-server): the count per turn of each window."""
    services = Services(Path(tempfile.mkdtemp(prefix="rp-count-")))
    windows: list[dict[str, Any]] = []
    try:
        store = start_redis(services) if args.store == "redis" else "memory"
        _, engine_url = start_engine(services, extra=["--chat-template", str(resent_input.TEMPLATE)])
        counts = services.workdir / "calls.txt"
        launcher = Callgrind.launcher(services.workdir) if args.measure == "instructions" else Calls.launcher()
        env = {"COUNT_OUT": str(counts)} if args.measure == "calls" else {}
        pid, base = profile_turn.start_proxy(
            services, engine_url, store, tree, [], launcher=launcher, env=env, ready_within=900
        )
        gauge: Gauge = Callgrind(pid, services.workdir) if args.measure == "instructions" else Calls(pid, counts)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            warm = profile_turn.Driver(http, base, args.shape)  # tokenizer, rendering decided, connections
            await warm.open(2)
            await warm.turns(3)
            driver = profile_turn.Driver(http, base, args.shape)
            await driver.open(args.sessions)
            for at in args.at:
                await driver.turns(at - driver.k)
                items = profile_turn.items(driver)
                await gauge.start()
                await driver.turns(args.window)
                total, functions = await gauge.stop()
                turns = args.sessions * args.window
                windows.append(
                    {
                        "turns": [at + 1, at + args.window],
                        "items": items,
                        "per_turn": total / turns,
                        "functions": {name: value / turns for name, value in functions.items()},
                    }
                )
    finally:
        services.stop()
    kept = notable(windows)
    for window in windows:
        window["functions"] = {name: value for name, value in window["functions"].items() if name in kept}
    return {"tree": str(tree) if tree else None, "revision": revision(tree or ROOT), "windows": windows}


def notable(windows: list[dict[str, Any]], limit: int = 30) -> set[str]:
    """The functions worth keeping in the JSON: the costliest in any window and those that grew most from
    the first window to the last (callgrind names a few thousand)."""
    names: set[str] = set()
    for window in windows:
        functions = window["functions"]
        names |= set(sorted(functions, key=functions.__getitem__, reverse=True)[:limit])
    if len(windows) > 1:
        names |= {name for name, _, _ in grew({"windows": windows}, limit)}
    return names


def grew(target: dict[str, Any], limit: int = 8) -> list[tuple[str, float, float]]:
    """The functions whose count per turn grew most from the first window to the last."""
    first, last = target["windows"][0]["functions"], target["windows"][-1]["functions"]
    names = sorted(set(first) | set(last), key=lambda name: last.get(name, 0) - first.get(name, 0), reverse=True)
    return [(name, first.get(name, 0.0), last.get(name, 0.0)) for name in names[:limit]]


def _count(value: float, measure: str) -> str:
    return f"{value / 1e6:.2f}M" if measure == "instructions" else f"{value:.0f}"


def table(report: dict[str, Any]) -> str:
    measure = report["measure"]
    unit = "instructions / turn" if measure == "instructions" else "own Python calls / turn"
    rows = []
    for target in report["targets"]:
        name = f"{'baseline' if target['tree'] else 'this tree'} ({target['revision']})"
        first = target["windows"][0]["per_turn"]
        for window in target["windows"]:
            turns = f"{window['turns'][0]}-{window['turns'][1]}"
            ratio = f"{window['per_turn'] / first:.3f}×"
            rows.append([name, turns, window["items"], _count(window["per_turn"], measure), ratio])
    head = (
        f"{report['shape']} turns, {report['store']} store, {report['sessions']} sessions in lock step, "
        f"{report['window']} turns a window\n\n"
    )
    text = head + markdown_table(["proxy", "turns", "items sent", unit, "against the first window"], rows)
    if measure == "instructions" and len(report["targets"][0]["windows"]) > 1:
        for target in report["targets"]:
            lines = [
                [name, f"{before / 1e3:.0f}K", f"{after / 1e3:.0f}K", f"{(after - before) / 1e3:+.0f}K"]
                for name, before, after in grew(target)
            ]
            text += f"\n\nWhat grew most, {'baseline' if target['tree'] else 'this tree'} ({target['revision']}):\n\n"
            text += markdown_table(["function (object)", "first window", "last window", "growth"], lines)
    return text


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", choices=MEASURES, default="instructions")
    parser.add_argument("--shape", choices=list(profile_turn.SHAPES), default="short")
    parser.add_argument("--store", choices=("memory", "redis"), default="memory")
    parser.add_argument("--sessions", type=int, default=4, help="sessions in lock step (default 4)")
    parser.add_argument("--window", type=int, default=5, help="turns counted a window (default 5)")
    parser.add_argument("--at", type=_turns, default=[2, 100], help="windows start after these turns (default 2,100)")
    parser.add_argument("--baseline", type=Path, help="a checkout counted the same way, after this tree")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(arguments)
    if any(later < earlier + args.window for earlier, later in zip(args.at, args.at[1:], strict=False)):
        parser.error("--at: each window starts after the one before has ended (at least --window turns apart)")
    targets = [None] + ([args.baseline.resolve()] if args.baseline else [])
    report = {
        "measure": args.measure,
        "shape": args.shape,
        "store": args.store,
        "sessions": args.sessions,
        "window": args.window,
        "targets": [asyncio.run(count(args, tree)) for tree in targets],
    }
    name = f"count_turn-{args.measure}-{args.shape}-{args.store}.json"
    write_report(args.out / name, report, "bench.count_turn", arguments)
    print(table(report))
    print(f"wrote {args.out / name}")


def _turns(value: str) -> list[int]:
    turns = [int(part) for part in value.split(",") if part.strip()]
    if not turns or min(turns) < 0:
        raise argparse.ArgumentTypeError("turns after which a window starts, e.g. 2,100")
    return turns


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
