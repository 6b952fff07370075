"""What the benchmarks share: the processes they start, the CPU counters they read, the order they run
targets side by side in, and the report they write.

The processes (a private redis-server, the engine double, anything started with ``Services``) come from
``load_tests.run``, which the load tests run the same way; this module adds what only benchmarks need.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil

from load_tests.run import Services, child_env, free_port, start_engine, start_redis

__all__ = [
    "OUT",
    "ROOT",
    "Services",
    "baseline_env",
    "child_env",
    "command_line",
    "cpu_line",
    "cpu_seconds",
    "free_port",
    "machine",
    "markdown_table",
    "percentile",
    "pin",
    "revision",
    "rotated",
    "start_engine",
    "start_redis",
    "usable_cpus",
    "write_report",
]

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "bench"  # where a run writes its JSON unless --out says otherwise

T = TypeVar("T")


# -- CPU ------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process and its children (LiteLLM and ``serve --workers`` fork).

    Read from the scheduler's own nanosecond count of each live thread (``/proc/PID/task/*/schedstat``)
    where Linux has it: ``utime``/``stime`` (psutil's ``cpu_times``) move in 10 ms ticks, which is
    ±40% of one turn of 16 sessions. Elsewhere, psutil's ticks. A thread that exits between two
    readings takes its time with it (the proxies' threads live as long as they do)."""
    if pid is None:
        return 0.0
    process = psutil.Process(pid)
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            nanoseconds = _threads_cpu_ns(each.pid)
            if nanoseconds is None:
                times = each.cpu_times()
                total += times.user + times.system
            else:
                total += nanoseconds / 1e9
        except psutil.NoSuchProcess:
            continue
    return total


def _threads_cpu_ns(pid: int) -> int | None:
    """Nanoseconds on a CPU of every live thread of ``pid``; None where ``/proc`` does not say."""
    if not Path("/proc/self/schedstat").exists():  # not Linux, or a kernel without it
        return None
    tasks = Path(f"/proc/{pid}/task")
    try:
        threads = os.listdir(tasks)
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    total = 0
    for thread in threads:
        try:
            total += int((tasks / thread / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended since the listing
            continue
        except (OSError, ValueError, IndexError):
            return None
    return total


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of ``pid`` (and its children) onto ``cpus``; threads started later inherit it.
    Nothing where ``cpus`` is None."""
    if not cpus:
        return
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for thread in process.threads():
            try:
                os.sched_setaffinity(thread.id, cpus)
            except ProcessLookupError:  # the thread ended since the listing
                continue


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# -- side by side ---------------------------------------------------------------------------------------


def revision(tree: Path) -> str:
    """The tree's commit (short), ``+changes`` where its tracked files differ from it."""
    git = ["git", "-C", str(tree)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return (commit or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def baseline_env(checkout: Path) -> dict[str, str]:
    """The environment a proxy from ``checkout`` runs in: its ``src`` first, checked to be what imports."""
    env = {**child_env(), "PYTHONPATH": os.pathsep.join([str(checkout / "src"), str(checkout)])}
    where = subprocess.run(
        [sys.executable, "-c", "import rollout_proxy; print(rollout_proxy.__file__)"],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to((checkout / "src").resolve()):
        raise SystemExit(f"--baseline {checkout}: rollout_proxy imports from {where or 'nowhere'}, not its src/")
    return env


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index``: shifted by one each round, so that a slow spell of a shared
    machine falls on every target in turn (with two targets: alternating)."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_line(cpu: Sequence[float]) -> tuple[float, float]:
    """The least-squares line through the CPU per turn of turns 2 to N, read at turn 2 and at turn N
    (ms): the trend of every turn, where the means of five turns move with the machine's noise."""
    if len(cpu) < 3:
        return float("nan"), float("nan")
    slope, intercept = statistics.linear_regression(range(2, len(cpu) + 1), cpu[1:])
    return (intercept + 2 * slope) * 1000, (intercept + len(cpu) * slope) * 1000


# -- the report -----------------------------------------------------------------------------------------


def comma_choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated choice among ``allowed`` (at least one), as a list."""

    def parse(value: str) -> list[str]:
        chosen = [name for name in value.split(",") if name]
        unknown = [name for name in chosen if name not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated)")
        return chosen

    return parse


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: the pages under docs/benchmarks/ show exactly what the bench prints."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, their model, memory, load average (1, 5, 15 min), Python."""
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
    return {
        "cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": model or platform.processor(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.machine()}",
    }


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """``python -m MODULE ARGS`` as the run was started, ``--out`` left out (a path of this machine)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        if arg.startswith("--out="):
            continue
        kept.append(arg)
    return " ".join(["python", "-m", module, *map(shlex.quote, kept)])


def write_report(path: Path, report: dict[str, Any], module: str, argv: Sequence[str] | None = None) -> Path:
    """``report`` as JSON at ``path``, with the command that made it and the machine it ran on: what
    ``python -m bench.pages`` needs to put it on a docs page."""
    report = {**report, "command": command_line(module, argv), "machine": machine()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return path
