"""``python -m bench.profile_turn``: the flame graph and the table of top costs are py-spy's samples, read right.

The reading is held on collapsed stacks written here (shares, ms per turn, what the SVG draws); a tiny run
samples a real ``serve`` process with py-spy (installed with the dev dependencies) and writes all three files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import profile_turn

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "serve_turn (/x/src/rollout_proxy/proxy/handlers/turn.py)"
RENDER = "render_text (/x/src/rollout_proxy/tokenization/local.py)"
STORE = "put_node (/x/src/rollout_proxy/state/redis.py)"
LOOP = "Runner.run (/usr/lib/python3.11/asyncio/runners.py)"


def test_the_table_counts_a_function_once_per_sample_and_scales_it_to_the_cpu_per_turn(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        f"process 1:python;thread (0x1);{LOOP};{HANDLER};{RENDER} 6\n"
        f"process 1:python;thread (0x1);{LOOP};{HANDLER};{STORE};{HANDLER} 3\n"  # recursion: counted once
        f"process 1:python;thread (0x1);{LOOP} 1\n"
    )
    counts = profile_turn.read_stacks(stacks)
    assert sum(counts.values()) == 10
    rows = {row["function"]: row for row in profile_turn.top(counts, cpu_ms=2.0, limit=10)}
    handler = rows["serve_turn (rollout_proxy/proxy/handlers/turn.py)"]
    assert handler["share"] == pytest.approx(0.9) and handler["ms_per_turn"] == pytest.approx(1.8)
    render = rows["render_text (rollout_proxy/tokenization/local.py)"]
    assert render["share"] == pytest.approx(0.6) and render["self_share"] == pytest.approx(0.6)
    assert rows["Runner.run (asyncio/runners.py)"]["self_share"] == pytest.approx(0.1)
    assert not any(name.startswith(("process", "thread")) for name in rows)

    svg = tmp_path / "flame.svg"
    profile_turn.write_svg(counts, svg, "test", cpu_ms=2.0)
    drawn = svg.read_text()
    assert drawn.startswith("<svg") and drawn.rstrip().endswith("</svg>")
    assert "render_text (rollout_proxy/tokenization/local.py): 60.0%, 1.200 ms/turn" in drawn
    # the loop, the handler, the render under it, the store under it and the handler again under that
    assert drawn.count("<rect") == 5


HAS_PY_SPY = shutil.which("py-spy") is not None or Path(sys.executable).with_name("py-spy").exists()


@pytest.mark.skipif(not HAS_PY_SPY, reason="py-spy is not installed (a dev dependency)")
def test_a_tiny_run_samples_the_proxy_and_writes_the_graph_the_stacks_and_the_table(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.profile_turn", "--shape", "short", "--sessions", "2", "--turns", "3"]
    command += ["--profiled", "2", "--rate", "500", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "profile_turn-short-memory.json").read_text())
    assert report["cpu_ms_per_turn"] > 0 and report["samples"] > 0 and report["top"]
    assert (tmp_path / "profile_turn-short-memory.svg").read_text().startswith("<svg")
    assert "rollout_proxy" in (tmp_path / "profile_turn-short-memory.txt").read_text()
    assert "| function (cumulative) |" in run.stdout
