"""The load tests' one command (``python -m load_tests``), run short: CI's smoke of ``load_tests/``.

Locust runs in its own process (it monkey-patches the standard library with gevent), against
a proxy and a fake engine the command starts, each in its own process, on a private
redis-server when one is installed.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# not imported here: importing locust monkey-patches this process with gevent
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is a test dependency (pip install -e '.[dev]')", allow_module_level=True)


def load(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "load_tests", "--out", str(out), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def stats(out: Path) -> dict[str, dict[str, str]]:
    with (out / "locust_stats.csv").open() as rows:
        return {row["Name"]: row for row in csv.DictReader(rows)}


def test_a_short_headless_run_has_no_failures_and_writes_the_reports(tmp_path: Path) -> None:
    run = load(tmp_path, "--users", "6", "--duration", "12s", "--turns", "2")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "report.html").stat().st_size > 0
    assert (tmp_path / "locust_failures.csv").exists()
    rows = stats(tmp_path)
    assert rows["Aggregated"]["Failure Count"] == "0"
    for name in ("POST /v1/sessions", "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/feed?after="):
        assert int(rows[name]["Request Count"]) > 0, name
    # many conversations at once, each turn's parent found and its prompt exactly the recorded tokens
    counters = json.loads((tmp_path / "proxy_counters.json").read_text())
    assert counters["turns_total"] > 0
    assert counters.get("forks_total", 0) == 0
    assert counters.get("prompt_drift_total", 0) == 0


def test_a_proxy_that_does_not_answer_fails_the_run(tmp_path: Path) -> None:
    """Nothing listens at the URL: every request fails, locust's CSV counts them and the command exits non-zero."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the run: connections are refused
    run = load(tmp_path, "--url", f"http://127.0.0.1:{port}", "--admin-key", "k", "--users", "3", "--duration", "3s")
    assert run.returncode != 0
    rows = stats(tmp_path)
    assert int(rows["Aggregated"]["Failure Count"]) > 0
    assert rows["Aggregated"]["Failure Count"] == rows["Aggregated"]["Request Count"]
