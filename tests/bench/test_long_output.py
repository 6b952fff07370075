"""``python -m bench.long_output``: a tiny run of both trees measures every output through every API's framing
and prints the table its page shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import long_output

ROOT = Path(__file__).resolve().parents[2]


def test_a_delta_goes_through_the_parser_and_the_framing_of_each_api() -> None:
    for output in long_output.OUTPUTS:
        for api in long_output.APIS:
            assert long_output.measure(output, api, 20) > 0


def test_a_tiny_run_against_a_baseline_writes_every_cell_and_its_table(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.long_output", "--sizes", "5,20", "--rounds", "2", "--repeats", "1"]
    command += ["--baseline", str(ROOT), "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "long_output.json").read_text())
    assert report["sizes"] == [5, 20] and report["rounds"] == 2
    cells = {(row["output"], row["api"], row["tree"]) for row in report["rows"]}
    assert cells == {
        (output, api, tree)
        for output in long_output.OUTPUTS
        for api in long_output.APIS
        for tree in ("this tree", "baseline")
    }
    assert all(value > 0 for row in report["rows"] for value in row["us_per_token"].values())
    printed = long_output.table(report)
    assert printed in run.stdout
    assert printed.count("\n| tool call | messages |") == 2 and "20 / 5" in printed


def test_sizes_are_counts_of_at_least_one() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.long_output", "--sizes", "0,10"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 2 and "at least 1" in run.stderr
