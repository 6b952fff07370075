"""``python -m bench.resent_input`` run tiny: each API answers every harness-shaped turn, the proxy's CPU measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_measures_each_api(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.resent_input", "--turns", "7", "--sessions", "1", "--rounds", "1"]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "resent_input.json").read_text())
    assert list(report["apis"]) == ["responses", "chat", "messages"]
    for data in report["apis"].values():
        assert len(data["cpu_per_turn"]) == 7 and all(cpu > 0 for cpu in data["cpu_per_turn"])
        assert data["ratio"] > 0
    assert all(f"| {api} |" in run.stdout for api in report["apis"])
