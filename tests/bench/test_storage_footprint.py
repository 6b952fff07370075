"""``python -m bench.storage_footprint`` run tiny: it writes through both stores and reports consistent numbers.

Its own process, as the docs run it, on a private redis-server it starts itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_reports_both_stores_and_the_what_ifs(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "bench.storage_footprint",
        "--tokens",
        "6000",
        "--turns",
        "3",
        "--out",
        str(tmp_path),
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "goal: Redis bytes <= 1.2x raw" in run.stdout
    report = json.loads((tmp_path / "storage_footprint.json").read_text())
    # what a docs page needs to say how and where it ran: the command without this machine's --out path
    assert report["command"] == "python -m bench.storage_footprint --tokens 6000 --turns 3"
    assert report["machine"]["cpus"] >= 1 and len(report["machine"]["load_average"]) == 3
    stores = [result["store"] for result in report["results"]]
    assert stores == [
        "redis (zstd level 3, the default)",
        "redis plain",
        "redis level-1",
        "redis level-9",
        "redis no-text",
        "memory",
    ]
    redis, plain = report["results"][:2]
    assert redis["stored_tokens"] >= 6000
    assert redis["raw_bytes"] == 4 * redis["stored_tokens"] + 4 * redis["generated_tokens"]
    assert redis["blob"]["arrays"] == redis["raw_bytes"]  # the codec stores exactly the raw arrays
    assert plain["blob"]["written"] > plain["raw_bytes"]  # plain blobs hold the raw arrays and more
    assert plain["bytes"] > plain["raw_bytes"]
    assert redis["blob"]["written"] < plain["blob"]["written"]  # compressed, by default
    assert redis["bytes"] < plain["bytes"]
    assert len(redis["per_session_after_turns"]) == 3 + 1
    assert redis["per_session_after_turns"] == sorted(redis["per_session_after_turns"])
    assert {"nodes", "parents", "paths", "session", "latest"} <= set(redis["keys"])
    assert redis["keys"]["nodes"]["keys"] == redis["sessions"]
    memory = report["results"][-1]
    assert memory["stored_tokens"] == redis["stored_tokens"]
    assert memory["bytes"] > memory["raw_bytes"]
