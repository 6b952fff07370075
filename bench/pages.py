"""The docs' benchmark pages, regenerated from the JSON the benchmarks wrote.

    python -m bench.pages                                   # rewrite the generated blocks of docs/benchmarks/*.md
    python -m bench.pages --check                           # exit 1, with a diff, where a page is not what its JSON gives
    python -m bench.pages --take out/bench/fleet_faults.json   # publish a new run: copy it to docs/bench/, rewrite
    python -m bench.pages --take out/bench/long/storage_footprint.json=storage_footprint_long_turns.json

A page is hand-written Markdown (what the bench does, how to read it) around generated blocks:

    <!-- bench: fleet_faults.json -->
    (the command, the machine and the table, written here)
    <!-- /bench -->

Each block is rebuilt from ``docs/bench/NAME`` with the bench's own table function, so a page shows what
the bench printed for that run, and the measured JSON beside it lets anyone check or redraw it. CI runs
``--check`` (tests/bench/test_pages.py): a page edited by hand inside a block, or a JSON replaced without
regenerating its page, fails.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    count_turn,
    fleet_faults,
    images,
    long_output,
    policy_update,
    profile_turn,
    proxy_overhead,
    resent_input,
    storage_footprint,
    streaming_ttft,
    workers,
)
from bench.harness import ROOT

DOCS = ROOT / "docs"
PAGES = DOCS / "benchmarks"
DATA = DOCS / "bench"

Report = dict[str, Any]
#: the published profiles (``bench.profile_turn``: SHAPE-STORE)
PROFILED = ("codex-memory", "short-redis")
#: the published counts (``bench.count_turn``: MEASURE-SHAPE-STORE)
COUNTED = ("instructions-short-memory", "instructions-short-redis", "calls-short-redis")


def _fleet(report: Report) -> str:
    return (
        fleet_faults.table(report)
        + "\n\n"
        + "\n".join(f"- {line}" for line in fleet_faults.outcome(report).splitlines())
    )


def _storage(report: Report) -> str:
    return storage_footprint.workload(report) + "\n\n" + storage_footprint.store_table(report)


def _storage_breakdown(report: Report) -> str:
    return storage_footprint.breakdown_table(report)


#: Which table each published JSON gets: the bench's own function.
TABLES: dict[str, Callable[[Report], str]] = {
    "proxy_overhead.json": proxy_overhead.table,
    "fleet_faults.json": _fleet,
    "streaming_ttft.json": streaming_ttft.table,
    "long_output.json": long_output.table,
    "storage_footprint.json": _storage,
    "storage_footprint.json#breakdown": _storage_breakdown,
    "storage_footprint_long_turns.json": _storage,
    "workers.json": workers.table,
    "resent_input.json": resent_input.table,
    "policy_update.json": policy_update.summary,
    "images.json": images.table,
    # issue 35: this tree against the pre-refactor main, and where a turn's CPU goes
    "proxy_overhead_vs_70c855b.json": proxy_overhead.table,
    "resent_input_vs_70c855b.json": resent_input.table,
    **{f"profile_turn-{shape}.json": profile_turn.table for shape in PROFILED},
    **{f"count_turn-{counted}.json": count_turn.table for counted in COUNTED},
}

#: Runs published before the benches recorded their own command line (``bench.harness.write_report``).
EARLIER_COMMANDS = {"proxy_overhead.json": "python -m bench.proxy_overhead --rounds 1"}

BLOCK = re.compile(r"<!-- bench: (?P<name>[\w.#-]+) -->\n(?P<body>.*?)<!-- /bench -->", re.DOTALL)


class PageError(ValueError):
    """A page names a JSON no table is known for, or a block is not closed."""


def machine_line(name: str, report: Report) -> str:
    """How and where the run was made, in one sentence."""
    command = report.get("command") or EARLIER_COMMANDS.get(name.split("#")[0], "")
    found = report.get("machine") or {}
    settings = report.get("settings") or {}
    cpus = found.get("cpus") or settings.get("cpus") or report.get("cpus")
    load = found.get("load_average") or settings.get("load_average")
    parts = [f"{cpus} CPUs" if cpus else "CPUs not recorded"]
    if found.get("cpu_model"):
        parts[0] += f" ({found['cpu_model']})"
    if found.get("memory_gib"):
        parts.append(f"{found['memory_gib']:g} GiB")
    if load:
        parts.append("load average " + " / ".join(f"{value:.1f}" for value in load) + " (1, 5, 15 min) at its end")
    if found.get("python"):
        parts.append(f"Python {found['python']}")
    shared = "everything the run starts shares that machine"
    return f"Measured with `{command}` on {', '.join(parts)}; {shared}."


def block(name: str, report: Report) -> str:
    if name not in TABLES:
        raise PageError(f"no table is known for {name!r} (known: {', '.join(sorted(TABLES))})")
    return f"<!-- bench: {name} -->\n{machine_line(name, report)}\n\n{TABLES[name](report)}\n<!-- /bench -->"


def load(name: str, data: Path = DATA) -> Report:
    path = data / name.split("#")[0]
    if not path.exists():
        raise PageError(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} does not exist")
    report: Report = json.loads(path.read_text())
    return report


def render(text: str, reports: Callable[[str], Report] = load) -> str:
    """``text`` with every block rebuilt from its JSON; the hand-written rest kept as it is."""
    opened = text.count("<!-- bench: ")
    if opened != len(BLOCK.findall(text)):
        raise PageError("a '<!-- bench: NAME -->' block is not closed by '<!-- /bench -->'")
    return BLOCK.sub(lambda match: block(match["name"], reports(match["name"])), text)


def pages(root: Path = PAGES) -> list[Path]:
    return sorted(path for path in root.rglob("*.md") if "<!-- bench: " in path.read_text())


def published(root: Path = PAGES) -> set[str]:
    """The JSON files the pages show."""
    return {match["name"].split("#")[0] for page in pages(root) for match in BLOCK.finditer(page.read_text())}


def check(root: Path = PAGES, data: Path = DATA) -> list[str]:
    """A unified diff for each page that is not what its JSON gives (none: all up to date)."""
    diffs = []
    for page in pages(root):
        text = page.read_text()
        wanted = render(text, lambda name: load(name, data))
        if wanted != text:
            name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
            diffs.append("".join(difflib.unified_diff(text.splitlines(True), wanted.splitlines(True), name, name)))
    return diffs


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except PageError as exc:
        print(f"bench.pages: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page is out of date")
    parser.add_argument(
        "--take",
        action="append",
        default=[],
        metavar="PATH[=NAME]",
        help="a bench's JSON to publish first, as NAME under docs/bench/ (default: its own name); repeatable",
    )
    args = parser.parse_args(argv)
    if args.check:
        diffs = check()
        sys.stdout.write("".join(diffs))
        if diffs:
            print(f"{len(diffs)} page(s) differ from their JSON: run python -m bench.pages", file=sys.stderr)
        return 1 if diffs else 0
    for taken in args.take:
        source, _, name = taken.partition("=")
        path = Path(source)
        name = name or path.name
        if name not in {known.split("#")[0] for known in TABLES}:
            parser.error(f"{name}: not a published bench's JSON ({', '.join(sorted(TABLES))})")
        if not path.exists():
            parser.error(f"{path}: no such file")
        shutil.copyfile(path, DATA / name)
    for page in pages():
        text = page.read_text()
        wanted = render(text)
        if wanted != text:
            page.write_text(wanted)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
