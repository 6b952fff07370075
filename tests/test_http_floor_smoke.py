"""``bench/http_floor.py`` run tiny: every server answers every turn, and each is measured from its own CPU.

Its own process, as the README runs it; the engine double, the floor servers and the proxy are its children.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_tiny_run_answers_every_turn_on_every_server(tmp_path: Path) -> None:
    command = [sys.executable, "bench/http_floor.py", "--sessions", "3", "--turns", "2", "--rounds", "1"]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "http_floor.json").read_text())["results"]
    assert list(results) == ["server only", "forwarder", "raw forwarder", "rollout-proxy"]
    for name, result in results.items():
        assert result["errors"] == 0, (name, result)
        assert result["turns"] == 3 * 2, (name, result)
        assert result["cpu_ms_per_turn"] > 0, (name, result)
    assert "| rollout-proxy |" in run.stdout
