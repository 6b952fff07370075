"""The runner on a local two-node Ray cluster (a head and a second node process, started here).

The same job runs in-process and on Ray against the fake engine, whose replies are a
function of the prompt: the published groups must be the same (samples, messages, tokens,
logprobs, rewards, advantages), and so must what retries and drops did. Then what only
Ray can do: a sync plugin hung past its timeout is stopped (its worker killed), a worker
that dies mid-call is one failed attempt, and ``rollout-proxy run --ray`` joins the
cluster itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from structlog.testing import capture_logs

from rollout_proxy.runner import JobConfig, JobError, JobFailed, run_job
from rollout_proxy.runner.ray_executor import RayExecutor
from rollout_proxy.state.feed import JsonlFeed
from tests.runner import ray_plugins
from tests.runner.conftest import write_dataset
from tests.runner.ray_cluster import ENVIRON as ray_cluster_environ
from tests.runner.ray_cluster import LocalRayCluster, free_port

REPO = Path(__file__).resolve().parents[2]

BEHAVIOURS = [
    "ok",
    "discard",
    "retry_once",
    "raise_once",
    "crash_once",
    "fail_once",
    "ok",  # its judge runs past its timeout once
    "ok",
    "ok",
    "ok",  # its judge says 'retry' once
]
#: what the judge does once per sample (``ray_plugins.judge``), by sample index
JUDGE_BEHAVIOURS = {6: "slow_once", 9: "retry_once"}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    """The cluster, and this process joined to it (as a trainer that is a Ray driver would be)."""
    saved = {key: os.environ.get(key) for key in ray_cluster_environ}
    os.environ.update(ray_cluster_environ)  # this process and the CLI it starts are drivers too
    cluster = LocalRayCluster(head_cpus=1, node_cpus=2)
    try:
        cluster.start()
        print(f"\nlocal Ray cluster (2 nodes) started in {cluster.started_in:.1f}s at {cluster.address}")
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.stop()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every job file of the module: the same job directory and plugin envs
    make the same runtime env, so the tests share warm Ray workers (a worker start costs seconds)."""
    return tmp_path_factory.mktemp("ray-jobs")


def job_file(
    directory: Path,
    name: str,
    behaviours: list[str],
    *,
    engine_url: str,
    ray_section: dict[str, Any] | None,
    output_dir: Path,
    generations: int = 2,
    batch_size: int = 5,
    extra: Any = None,
) -> Path:
    """``directory/<name>.yaml`` (and its dataset): the status rollout and three graders."""
    dataset = write_dataset(directory / f"{name}.jsonl", behaviours, extra=extra)
    envs = {"RP_RAY_TEST_DIR": str(directory / "state")}
    job: dict[str, Any] = {
        "name": "ray-e2e",
        "custom_rl_pipeline": {
            "rollout": {"plugin": {"python_func": "tests.runner.ray_plugins:status_rollout", "envs": envs}},
            "graders": [
                {"plugin": {"python_func": "tests.runner.runner_plugins:quality_grader"}, "weight": 0.7},
                {"plugin": {"python_func": "tests.runner.runner_plugins:position_grader"}, "weight": 0.3},
                {"plugin": {"python_func": "tests.runner.ray_plugins:judge", "envs": envs}, "weight": 1.0},
            ],
        },
        "data": {"training_set": {"local_files": [dataset.name]}},
        "hyperparameters": {"num_generations": generations, "max_new_tokens": 128, "batch_size": batch_size},
        "proxy": {"engines": [engine_url], "output_dir": str(output_dir)},
    }
    if ray_section is not None:
        job["ray"] = ray_section
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def on_ray(address: str, **more: Any) -> dict[str, Any]:
    return {
        "address": address,
        "scheduling_strategy": "SPREAD",
        "runtime_env": {"env_vars": {"RP_ON_RAY": "1"}},
        **more,
    }


async def published(summary) -> dict[int, dict[str, Any]]:
    """The feed's groups by sample index, without what names the run (ids, sessions)."""
    entries = await JsonlFeed(summary.feed.removeprefix("jsonl:")).read(limit=1000)
    groups = {}
    for entry in entries:
        group = entry.group.model_dump(mode="json")
        keep = ("messages", "total_token_ids", "total_loss_weight", "total_token_logprobs", "finish_reason", "turns")
        groups[group["sample_index"]] = {
            "step": group["step"],
            "trajectories": [{key: t[key] for key in keep} for t in group["trajectories"]],
            "rewards": group["rewards"],
            "grader_rewards": group["grader_rewards"],
            "advantages": group["advantages"],
            "advantage_kind": group["advantage_kind"],
        }
    return groups


def retried(logged: list[dict[str, Any]]) -> list[str]:
    """The attempts the runner retried, as ``what: error`` (from its ``plugin_retry`` log events)."""
    return sorted(f"{event['what']}: {event['error']}" for event in logged if event["event"] == "plugin_retry")


def where(state: Path, job_id: str) -> list[tuple[int, str]]:
    lines = (state / f"where-{job_id}.txt").read_text().split("\n")
    return [(int(pid), node) for pid, _, node in (line.partition(" ") for line in lines if line)]


def process_gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` (on this machine) is gone, waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def max_running(state: Path, job_id: str) -> int:
    return json.loads((state / f"running-{job_id}.json").read_text())["max"]


async def test_a_job_on_ray_publishes_the_same_groups_as_in_process(ray_cluster, jobs_dir, engine, tmp_path):
    def job(ray_section: dict[str, Any] | None) -> JobConfig:
        return JobConfig.load(
            job_file(
                jobs_dir,
                "same-ray" if ray_section else "same-local",
                BEHAVIOURS,
                engine_url=engine.url,
                ray_section=ray_section,
                output_dir=tmp_path / "out",
                extra=lambda i: {"grader": JUDGE_BEHAVIOURS.get(i, "ok")},
            )
        )

    with capture_logs() as logged:
        local = await run_job(job(None), job_id="in-process", progress=False)
    local_retries = retried(logged)
    started = time.monotonic()
    with capture_logs() as logged:
        remote = await run_job(job(on_ray(ray_cluster.address)), job_id="on-ray", progress=False)
    remote_retries = retried(logged)
    print(f"\nthe job on Ray: {time.monotonic() - started:.1f}s (in-process: {local.elapsed:.1f}s)")

    counts = ("samples_done", "samples_dropped", "failed_attempts", "groups_published", "trajectories", "turns")
    assert {key: getattr(remote, key) for key in counts} == {key: getattr(local, key) for key in counts}, (
        f"retried on Ray: {remote_retries}; in-process: {local_retries}"
    )
    assert remote.samples_done == 9 and remote.samples_dropped == 1  # discard
    # retry_once, raise_once, crash_once, fail_once, and the judge's slow_once and retry_once: one failed attempt each
    assert remote.failed_attempts == 6, f"retried on Ray: {remote_retries}"
    assert remote.tokens == local.tokens and remote.trained_tokens == local.trained_tokens
    assert remote.drift == 0
    groups = await published(remote)
    assert sorted(groups) == [0, 2, 3, 4, 5, 6, 7, 8, 9]
    assert groups == await published(local)

    state = jobs_dir / "state"
    calls = where(state, "on-ray")
    assert len({node for _, node in calls}) == 2, f"every call ran on one node: {calls}"
    assert all(pid != os.getpid() for pid, _ in calls)
    assert max_running(state, "on-ray") <= ray_plugins.MAX_CONCURRENCY
    assert engine.max_inflight <= ray_plugins.MAX_CONCURRENCY  # one model call at a time per plugin call

    # the sync call that hung past its timeout was stopped: its worker was killed
    hung = int((state / "hung-on-ray.pid").read_text())
    assert await asyncio.to_thread(process_gone, hung, 30.0), "the hung plugin's worker still runs"


async def test_a_plugin_failing_four_times_fails_the_job_on_ray(ray_cluster, jobs_dir, engine, tmp_path):
    path = job_file(
        jobs_dir,
        "fails",
        ["ok", "fail_always"],
        engine_url=engine.url,
        ray_section=on_ray(ray_cluster.address),
        output_dir=tmp_path / "out",
        generations=1,
        batch_size=2,
    )
    with pytest.raises(JobFailed, match="failed 4 times; last error: the weather API key is invalid"):
        await run_job(JobConfig.load(path), job_id="fails", progress=False)
    # the feed was opened (its file made, so a path that cannot be written fails first), nothing published in it
    assert (tmp_path / "out" / "ray-e2e" / "feed.jsonl").read_bytes() == b""


async def test_a_call_no_node_can_hold_is_refused_before_the_job_runs(ray_cluster, jobs_dir, engine, tmp_path):
    path = job_file(
        jobs_dir,
        "cpus",
        ["ok"],
        engine_url=engine.url,
        ray_section=on_ray(ray_cluster.address, num_cpus=3),
        output_dir=tmp_path / "out",
    )
    with pytest.raises(
        JobError, match=r"ray.num_cpus 3: no node of the cluster has that many CPUs \(alive nodes' CPUs: "
    ):
        await RayExecutor.open(JobConfig.load(path))
    assert not engine.completions


def test_rollout_proxy_run_with_ray_joins_the_cluster_itself(ray_cluster, jobs_dir, engine, tmp_path):
    """The CLI as its own Ray driver: a 'retry' four times drops the sample, as in-process."""
    path = job_file(
        jobs_dir,
        "cli",
        ["retry_always", "ok"],
        engine_url=engine.url,
        ray_section=None,
        output_dir=tmp_path / "out",
        generations=1,
        batch_size=2,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    command = [sys.executable, "-m", "rollout_proxy", "run", str(path), "--no-progress", "--job-id", "cli"]
    summary_path = tmp_path / "summary.json"

    closed = f"127.0.0.1:{free_port()}"
    refused = subprocess.run([*command, "--ray", closed], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2
    assert f"ray.address {closed}: cannot reach the Ray head" in refused.stderr

    with subprocess.Popen(
        [*command, "--ray", ray_cluster.address, "--summary-json", str(summary_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as run:
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["samples_done"] == 1 and summary["samples_dropped"] == 1 and summary["groups_published"] == 1
    assert summary["failed_attempts"] == 4  # 'retry' four times, then dropped
    calls = where(jobs_dir / "state", "cli")
    assert len(calls) == 5 and all(node and pid != run.pid for pid, node in calls)  # on Ray workers
