"""``python -m bench.memory_soak`` run tiny: every turn answered on both stores, and once every session has expired,
nothing left in the proxy's per-session structures.

Its own process, as the docs run it: a fake engine, both proxies and a private redis-server it starts itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_soak_answers_every_turn_and_leaves_nothing_after_expiry(tmp_path: Path) -> None:
    sessions, turns = 4, 3
    command = [sys.executable, "-m", "bench.memory_soak", "--duration", "5", "--sessions", str(sessions)]
    # a TTL that outlasts a rollout on busy shared cores; the drain, every session's expiry and a sweep
    command += ["--turns", str(turns), "--ttl", "10", "--warmup", "3", "--drain", "13", "--out", str(tmp_path)]
    command += ["--rate", "50", "--tracemalloc", "--tracemalloc-frames", "3"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| memory | 10 s |" in run.stdout and "| redis | 10 s |" in run.stdout  # the table
    results = json.loads((tmp_path / "memory_soak.json").read_text())["results"]
    assert set(results) == {"memory", "redis"}
    for name, result in results.items():
        assert result["errors"] == 0, (name, result["first_error"])
        assert result["sessions"] >= sessions and result["turns"] == result["sessions"] * turns, name
        assert result["at_end"]["structures"]["verified_tokens"] > 0, name  # it did hold sessions
        assert result["drained"]["structures"] == dict.fromkeys(result["drained"]["structures"], 0), name
        assert result["samples"] and result["drained"]["rss"] > 0
        assert result["stats"] and all(report["malloc"]["in_use"] > 0 for report in result["stats"]), name
        # traced from the warm proxy on: the lines grown since the warm-up, each with its callers
        assert result["at_end"]["grown"] and " < " in result["at_end"]["grown"][0], name
