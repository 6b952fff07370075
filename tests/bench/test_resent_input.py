"""``python -m bench.resent_input`` run tiny: each API answers every harness-shaped turn, alone and interleaved
with a subagent and side calls, the proxy's CPU measured; with ``--baseline``, a second proxy from another
checkout runs beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_measures_each_api_alone_and_interleaved_against_a_baseline(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.resent_input", "--turns", "7", "--sessions", "1", "--rounds", "1"]
    command += ["--baseline", str(ROOT)]  # this checkout again: a second proxy process, started from its src/
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "resent_input.json").read_text())
    assert list(report["proxies"]) == ["this", "baseline"]
    measured = {(each["proxy"], each["api"], each["case"]) for each in report["runs"]}
    assert measured == {
        (proxy, api, case)
        for proxy in ("this", "baseline")
        for api in ("responses", "chat", "messages")
        for case in ("main", "interleaved")
    }
    for each in report["runs"]:
        assert len(each["cpu_per_turn"]) == 7 and all(cpu > 0 for cpu in each["cpu_per_turn"])
        assert each["ratio"] > 0
    assert all(f"| {api} | interleaved | baseline (" in run.stdout for api in ("responses", "chat", "messages"))


def test_a_baseline_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.resent_input", "--turns", "7", "--baseline", str(tmp_path)]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "rollout_proxy imports from" in run.stderr
