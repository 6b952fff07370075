"""The executor choice and the Ray settings, without a cluster (test_ray_runner.py runs one)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from ray.exceptions import TaskCancelledError, WorkerCrashedError

import rollout_proxy
from rollout_proxy.runner import JobConfig, JobError, ray_executor
from rollout_proxy.runner.executor import InProcessExecutor, open_executor, with_ray_address
from rollout_proxy.runner.job import RaySection
from rollout_proxy.runner.plugins import load_graders, load_rollout
from rollout_proxy.runner.ray_executor import (
    LINGERING,
    STARTED,
    connect,
    head_endpoint,
    run_plugin_call,
    worker_runtime_env,
)
from rollout_proxy.sdk.types import PluginStatus
from tests.runner.conftest import write_dataset
from tests.runner.ray_cluster import free_port
from tests.runner.ray_plugins import sleeper

REPO = Path(__file__).resolve().parents[2]


def job_yaml(tmp_path: Path, **more) -> Path:
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"])
    job = {
        "custom_rl_pipeline": {
            "rollout": {
                "plugin": {"python_func": "tests.runner.ray_plugins:status_rollout", "envs": {"RP_ROLLOUT": "1"}}
            },
            "graders": [{"plugin": {"python_func": "tests.runner.runner_plugins:quality_grader"}}],
        },
        "data": {"training_set": {"local_files": [dataset.name]}},
        **more,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


async def test_without_a_ray_section_plugin_calls_stay_in_process(tmp_path):
    job = JobConfig.load(job_yaml(tmp_path))
    assert job.ray is None and with_ray_address(job, None) is job
    assert isinstance(await open_executor(job), InProcessExecutor)


def test_the_ray_section_and_the_flag(tmp_path):
    job = JobConfig.load(
        job_yaml(tmp_path, ray={"address": "10.0.0.1:6379", "num_cpus": 0.5, "runtime_env": {"pip": ["x"]}})
    )
    assert job.ray == RaySection(address="10.0.0.1:6379", num_cpus=0.5, runtime_env={"pip": ["x"]})
    flagged = with_ray_address(job, "ray://head:10001")
    assert flagged.ray is not None and flagged.ray.address == "ray://head:10001" and flagged.ray.num_cpus == 0.5
    assert job.ray.address == "10.0.0.1:6379"  # the loaded job is not changed
    assert with_ray_address(JobConfig.load(job_yaml(tmp_path)), "auto").ray == RaySection(address="auto")


def test_a_bad_ray_section_is_reported_with_its_path(tmp_path):
    with pytest.raises(JobError) as raised:
        JobConfig.load(job_yaml(tmp_path, ray={"adress": "h:1", "num_cpus": -1, "scheduling_strategy": "PACK"}))
    message = str(raised.value)
    assert "ray.adress: unknown field" in message and "ray.address: Field required" in message
    assert "ray.num_cpus" in message and "ray.scheduling_strategy" in message


@pytest.mark.parametrize(
    "address, endpoint",
    [("auto", None), ("10.0.0.1:6379", ("10.0.0.1", 6379)), ("ray://head:10001", ("head", 10001))],
)
def test_head_endpoints(address, endpoint):
    assert head_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["head", "head:port", ":6379", "local"])
def test_a_malformed_address_is_refused(address):
    with pytest.raises(JobError, match="expected 'auto', HOST:PORT or ray://HOST:PORT"):
        head_endpoint(address)


def test_an_unreachable_head_fails_fast_instead_of_rays_minutes_of_retries():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(JobError, match=f"ray.address {address}: cannot reach the Ray head"):
        connect(RaySection(address=address, connect_timeout=5))
    assert time.monotonic() - started < 30  # bounded by connect_timeout (Ray's own retries take minutes)


def test_the_workers_import_the_plugins_as_the_driver_did(tmp_path):
    job = JobConfig.load(job_yaml(tmp_path))
    pipeline = job.custom_rl_pipeline
    plugins = [(load_rollout(job), pipeline.rollout.plugin), (load_graders(job)[0][0], pipeline.graders[0].plugin)]
    user = {"pip": ["requests"], "env_vars": {"PYTHONPATH": "/opt/extra", "USER_VAR": "u"}}
    env = worker_runtime_env(job, plugins, user)
    assert env["pip"] == ["requests"]  # the rest of the job's runtime_env is passed on
    entries = env["env_vars"]["PYTHONPATH"].split(os.pathsep)
    src = str(Path(rollout_proxy.__file__).resolve().parents[1])
    # the job's directory, where `tests.runner...` was imported from, this package, then the job's own entries
    assert entries == [str(tmp_path.resolve()), str(REPO), src, "/opt/extra"]
    assert env["env_vars"]["RP_ROLLOUT"] == "1" and env["env_vars"]["USER_VAR"] == "u"


async def test_without_ray_installed_the_job_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    monkeypatch.delitem(sys.modules, "rollout_proxy.runner.ray_executor", raising=False)
    job = JobConfig.load(job_yaml(tmp_path, ray={"address": "auto"}))
    with pytest.raises(JobError, match=r"pip install 'rollout-proxy\[ray\]'"):
        await open_executor(job)


def test_run_help_lists_ray():
    result = subprocess.run(
        [sys.executable, "-m", "rollout_proxy", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])},
    )
    assert "--ray ADDRESS" in result.stdout


def test_a_ray_task_that_answered_ends_without_a_kill_request():
    """The task yields STARTED, the outcome, and ends: nothing asks the driver to kill its worker, however
    long the driver then takes to see the end (a loaded cluster must not get a healthy worker killed)."""
    task = run_plugin_call("tests.runner.ray_plugins:sleeper", str(REPO), (None, 0.0, None))
    assert next(task) == STARTED
    outcome = next(task)
    assert outcome.status is PluginStatus.SUCCESS and outcome.result.reward == 1.0
    assert list(task) == []


def test_a_ray_task_whose_plugin_runs_past_its_timeout_says_it_lingers(monkeypatch):
    """A sync plugin past its timeout keeps its thread: the worker answers 'timed out', then says LINGERING
    once the thread still runs END_GRACE later, so the driver kills that worker and no other."""
    monkeypatch.setattr(ray_executor, "END_GRACE", 0.3)
    task = run_plugin_call("tests.runner.ray_plugins:sleeper", str(REPO), (None, 2.0, None))
    assert next(task) == STARTED
    started = time.monotonic()
    outcome = next(task)
    assert (outcome.status, outcome.error) == (PluginStatus.FAILURE, "timed out after 1s")
    assert next(task) == LINGERING
    assert time.monotonic() - started < 1.9  # said while the plugin's thread still ran
    task.close()  # what the kill is to the worker


class ScriptedTask:
    """What ``ray.remote(...).remote()`` gives a streaming task, driven by the test: each ``__anext__``
    hands back the next value once the test releases it; a cancel makes the stream fail as Ray's does."""

    def __init__(self) -> None:
        self.values: asyncio.Queue[object] = asyncio.Queue()
        self.forced: list[bool] = []

    def __aiter__(self) -> ScriptedTask:
        return self

    async def __anext__(self) -> asyncio.Future[object]:
        value = await self.values.get()
        if value is StopAsyncIteration:
            raise StopAsyncIteration
        future = asyncio.get_running_loop().create_future()
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
        return future


def scripted_executor(monkeypatch, task: ScriptedTask) -> ray_executor.RayExecutor:
    executor = ray_executor.RayExecutor(
        RaySection(address="127.0.0.1:1"),
        base_dir=REPO,
        python_funcs={id(sleeper): "tests.runner.ray_plugins:sleeper"},
        runtime_env={},
        owns_connection=False,
    )
    monkeypatch.setattr(executor, "_remote", SimpleNamespace(remote=lambda *args: task))
    monkeypatch.setattr(ray_executor.ray, "cancel", lambda cancelled, force: cancelled.forced.append(force))
    return executor


async def cancelled_in_flight(executor: ray_executor.RayExecutor, limit: asyncio.Semaphore, seconds: float) -> None:
    """A call of ``sleeper`` (``seconds``) cancelled while it waits on its task, as a sibling's failure does."""
    call = asyncio.create_task(executor.attempt(sleeper, None, seconds, None, limit=limit))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_call_cancelled_before_its_task_started_is_not_force_killed_and_holds_its_slot_until_gone(
    monkeypatch,
):
    """A sibling's failure cancels a call whose task is still queued: a forced cancel would kill the worker
    it was pushed to, and the call that worker is finishing with it. Its slot is the plugin's until the
    task is gone, so max_concurrency holds across the cancel."""
    task = ScriptedTask()
    executor = scripted_executor(monkeypatch, task)
    limit = asyncio.Semaphore(1)
    await cancelled_in_flight(executor, limit, 0.0)
    assert task.forced == [False]
    assert limit.locked()  # the task has not ended yet
    task.values.put_nowait(TaskCancelledError())
    await executor.aclose()
    assert not limit.locked()


async def test_a_started_call_that_is_cancelled_is_killed_and_gives_its_slot_back_once_gone(monkeypatch):
    task = ScriptedTask()
    executor = scripted_executor(monkeypatch, task)
    limit = asyncio.Semaphore(1)
    task.values.put_nowait(STARTED)
    await cancelled_in_flight(executor, limit, 5.0)
    assert task.forced == [True] and limit.locked()
    task.values.put_nowait(WorkerCrashedError())  # what the killed worker's stream says
    await executor.aclose()
    assert not limit.locked()


async def test_a_task_that_fails_before_it_starts_is_a_failed_attempt_and_its_slot_comes_back(monkeypatch):
    task = ScriptedTask()
    executor = scripted_executor(monkeypatch, task)
    limit = asyncio.Semaphore(1)
    task.values.put_nowait(WorkerCrashedError())
    outcome = await executor.attempt(sleeper, None, 0.0, None, limit=limit)
    assert outcome.status is PluginStatus.FAILURE and "WorkerCrashedError" in (outcome.error or "")
    assert not limit.locked() and task.forced == []


async def test_a_call_that_cannot_be_submitted_gives_its_slot_back(monkeypatch):
    executor = scripted_executor(monkeypatch, ScriptedTask())

    def unserializable(*args: object) -> None:
        raise TypeError("cannot pickle '_thread.lock' object")

    monkeypatch.setattr(executor, "_remote", SimpleNamespace(remote=unserializable))
    limit = asyncio.Semaphore(1)
    with pytest.raises(TypeError, match="pickle"):
        await executor.attempt(sleeper, None, 0.0, None, limit=limit)
    assert not limit.locked()
