"""``python -m bench.proxy_overhead`` run tiny: direct and both stores answer every turn, measured side by side.

Its own process, as the docs run it; redis-server, the engine double and the proxies are its children.
LiteLLM is left out (its own venv, not installed by the tests).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_measures_direct_and_both_stores_and_writes_json_and_plot(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.proxy_overhead", "--sizes", "1,3", "--turns", "3,2", "--delays", "0"]
    command += ["--rounds", "1", "--long-turns", "4", "--long-sessions", "2", "--long-rounds", "1", "--no-litellm"]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "proxy_overhead.json").read_text())
    sizes = report["phases"]["0"]["sizes"]
    for size, turns in (("1", 3), ("3", 2)):
        targets = sizes[size]["targets"]
        assert list(targets) == ["direct", "rollout-proxy (memory)", "rollout-proxy (redis)"]
        for name, result in targets.items():
            assert result["errors"] == 0, (name, result)
            assert result["turns"] == int(size) * turns, (name, result)
            assert result["engine_cpu_ms_per_turn"] > 0, (name, result)
            assert result["client_cpu_ms_per_turn"] > 0, (name, result)
            assert result["throughput_ratio"] > 0, (name, result)
            if name != "direct":  # a proxy's own process, read from its own counters
                assert result["cpu_ms_per_turn"] > 0, (name, result)
    assert report["long_summary"], report["long_summary"]
    assert (tmp_path / "proxy_overhead.png").stat().st_size > 0
    assert "| rollout-proxy (redis) |" in run.stdout
