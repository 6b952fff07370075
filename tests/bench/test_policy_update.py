"""``python -m bench.policy_update`` run tiny: every phase has turns of every policy, none fails, the adapter
is published many times with no pause, and the full-weight phase is the one whose turns wait.

Its own process, as the docs run it; the fake engines (with run-time LoRA loading) and the proxy are its
children.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.policy_update import PHASES, POLICIES

ROOT = Path(__file__).resolve().parents[2]
RELOAD = 0.8  # seconds the full-weight phase holds the fleet paused


def test_a_tiny_run_updates_the_adapter_with_no_pause_and_measures_every_policy_in_every_phase(tmp_path: Path):
    command = [sys.executable, "-m", "bench.policy_update", "--duration", "9", "--phase", "1.5", "--sessions", "2"]
    command += ["--every", "0.3", "--reload", str(RELOAD), "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "policy_update.json").read_text())
    assert report["failed_turns"] == 0 and report["session_errors"] == [], report["errors"]
    for policy in POLICIES:
        for phase in PHASES:
            assert report["by_policy"][policy][phase]["turns"] > 0, (policy, phase)
    # job-a got a version per publish, each loaded on both engines, the old ones gone once unused
    assert report["adapter_versions_published"] >= 4
    policies = {entry["name"]: entry for entry in report["policies_at_end"]["policies"]}
    job_a = policies["job-a"]
    assert job_a["version"] == 1 + report["adapter_versions_published"]
    assert {engine["served_name"] for engine in job_a["engines"]} == {f"job-a@v{job_a['version']}"}
    assert policies["job-b"]["version"] == 1
    # the full-weight path paused the fleet once per phase: turns that began in its pause waited for the
    # resume; publishing adapters paused nothing
    assert len(report["full_weight_updates"]) == report["rounds"] == 2
    assert policies["base"]["version"] == len(report["full_weight_updates"])  # the fleet started at 0
    by_policy = json.loads((tmp_path / "policy_update_turns.json").read_text())
    turns = [turn for rows in by_policy.values() for turn in rows]
    ends = [started + latency for started, latency, _, _ in turns]
    for update in report["full_weight_updates"]:  # frozen from the pause to the resume, then held turns end
        frozen_from, frozen_to = update["paused_at"] + 0.2, update["paused_at"] + RELOAD
        assert not [end for end in ends if frozen_from < end < frozen_to], update
        assert [t for t, end in zip(turns, ends, strict=True) if t[0] < frozen_from and end >= frozen_to], update
    # while a version was being published, turns went on ending
    publishing = [(p["at"] - p["seconds"], p["at"]) for p in report["published"]]
    assert [end for end in ends if any(begins < end < done for begins, done in publishing)]
    assert "adapter update: p50 / p99 / max" in run.stdout
