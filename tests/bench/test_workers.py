"""``python -m bench.workers`` run tiny: both proxies answer every turn, and the ceiling is read from measured CPU.

Its own process, as the docs run it; redis-server, the engine double and the proxies are its children.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_answers_every_turn_and_bounds_the_ratio_by_the_cpu_it_measured(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.workers", "--sizes", "3", "--turns", "2", "--rounds", "1"]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "workers.json").read_text())
    row = report["3"]
    for workers, result in row["by_workers"].items():
        assert result["errors"] == 0, (workers, result)
        assert result["turns"] == 3 * 2, (workers, result)
        assert result["cpu_ms_per_turn"] > 0, (workers, result)
        assert result["rest_cpu_ms_per_turn"] > 0, (workers, result)  # the client, the engine, redis-server
    limit = row["ceiling"]
    assert 0 < limit["ratio"] <= 2  # two workers cannot give more than twice one
    assert limit["cores_for_goal"] > 0
    assert limit["one_busy"] > 0
    assert "at most" in run.stdout and "1.7x would take" in run.stdout
