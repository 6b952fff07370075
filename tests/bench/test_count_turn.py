"""``python -m bench.count_turn``: a tiny run counts a real ``serve`` process's own Python calls per turn, window
by window; the table reads callgrind's function names short; windows that overlap are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import count_turn

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_counts_the_proxys_own_calls_in_each_window(tmp_path: Path) -> None:
    # 12 turns a window: a background task of the proxy's (a sweep, an engine probe: ~250 own calls) that runs
    # inside one adds ~20 calls a turn, where it added ~60 to the 4 turns of a 2 x 2 window (16%, past the bound)
    command = [sys.executable, "-m", "bench.count_turn", "--measure", "calls", "--sessions", "4", "--window", "3"]
    command += ["--at", "1,4", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "count_turn-calls-short-memory.json").read_text())
    (target,) = report["targets"]
    assert [window["turns"] for window in target["windows"]] == [[2, 4], [5, 7]]
    assert [window["items"] for window in target["windows"]] == [3, 9]  # 2 messages a turn, after the first 1
    early, late = (window["per_turn"] for window in target["windows"])
    assert early > 100 and abs(late - early) < 0.15 * early  # about the same at turn 5 (background tasks add a few)
    assert "| own Python calls / turn |" in run.stdout


def test_windows_that_overlap_are_refused() -> None:
    command = [sys.executable, "-m", "bench.count_turn", "--measure", "calls", "--window", "5", "--at", "2,4"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--at" in run.stderr


def test_callgrinds_names_are_read_short() -> None:
    assert (
        count_turn.short_function(
            "./string/../sysdeps/x86_64/multiarch/memmove-vec-unaligned-erms.S:__memcpy_avx_unaligned_erms "
            "[/usr/lib/x86_64-linux-gnu/libc.so.6]"
        )
        == "__memcpy_avx_unaligned_erms (libc.so.6)"
    )
    assert (
        count_turn.short_function(
            "/tmp/python-build.2026/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2 "
            "[/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0]"
        )
        == "_PyEval_EvalFrameDefault (libpython3.11.so.1.0)"
    )
    assert (
        count_turn.short_function("???:0x0000000000026970 [/venv/site-packages/orjson/orjson.cpython-311-x86_64.so]")
        == "0x0000000000026970 (orjson)"
    )
