"""Plugins for the runner's Ray tests, whose state lives in files: on Ray the calls of one
job run in several worker processes on two nodes, so "fail the first call only", the count
of calls running at once and where each call ran are kept under ``$RP_RAY_TEST_DIR``
(set through the plugins' ``envs`` in the job file, which reach the workers).

``$RP_ON_RAY`` (set only in the job's ``ray.runtime_env``) tells a plugin it runs on a
Ray worker: ``crash_once`` then kills its worker process, where in-process it raises, and the
judge's ``slow_once`` hangs (in-process it sleeps just past its timeout: a thread cannot be
stopped).

The call that runs past its timeout is the judge's, whose call is instant otherwise, so its
timeout can be short; the rollout's timeout is generous, so that a rollout slowed by a loaded
machine (its turns, a cold worker) is never a timeout the in-process run did not have.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollout_proxy.examples.weather_rollout import demo_rollout as weather
from rollout_proxy.sdk import (
    PluginStatus,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    rollout,
    single_grader,
)

MAX_CONCURRENCY = 3
ROLLOUT_TIMEOUT = 120  # only a cap: no rollout here is meant to reach it
JUDGE_TIMEOUT = 4  # the judge's slow_once runs past it; any other judge call takes milliseconds


def state_dir() -> Path:
    path = Path(os.environ["RP_RAY_TEST_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def first_call(key: str) -> bool:
    """True for the first call with ``key`` in any process (an exclusive create)."""
    marker = state_dir() / f"once-{key.replace('/', '_')}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


@contextmanager
def counted(job_id: str) -> Iterator[None]:
    """Count this call among the job's running ones (``running-<job>.json``: now, max), across processes."""
    path = state_dir() / f"running-{job_id}.json"

    def change(delta: int) -> None:
        with open(path, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.seek(0)
            state = json.loads(handle.read() or '{"now": 0, "max": 0}')
            state["now"] += delta
            state["max"] = max(state["max"], state["now"])
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(state))

    change(+1)
    try:
        yield
    finally:
        change(-1)


def record_where(job_id: str) -> None:
    """Append this process's pid and Ray node (where Ray runs in it) to ``where-<job>.txt``."""
    node = ""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        node = ray.get_runtime_context().get_node_id()
    with open(state_dir() / f"where-{job_id}.txt", "a") as out:
        out.write(f"{os.getpid()} {node}\n")


@rollout(name="status_rollout", runtime=Runtime(timeout=ROLLOUT_TIMEOUT, max_concurrency=MAX_CONCURRENCY))
def status_rollout(context, proxy, sample):
    """The weather agent, except when the sample asks for another outcome."""
    job = context.model_customization_job_id
    behaviour = (sample.extra or {}).get("behaviour", "ok")
    key = f"{job}-{(sample.extra or {}).get('id', '')}"
    record_where(job)
    if behaviour == "crash_once" and first_call(key):
        if os.environ.get("RP_ON_RAY"):
            os._exit(1)  # the worker process dies mid-call
        raise ConnectionError("the worker would have died here")
    with counted(job):
        if behaviour == "discard":
            return RolloutResult(status=PluginStatus.DISCARD, error="not a weather question")
        if behaviour == "retry_always":
            return RolloutResult(status=PluginStatus.RETRY, error="tool server busy")
        if behaviour == "fail_always":
            return RolloutResult(status=PluginStatus.FAILURE, error="the weather API key is invalid")
        if behaviour == "retry_once" and first_call(key):
            return RolloutResult(status=PluginStatus.RETRY, error="tool server busy, once")
        if behaviour == "fail_once" and first_call(key):
            return RolloutResult(status=PluginStatus.FAILURE, error="flaky failure, once")
        if behaviour == "raise_once" and first_call(key):
            raise ConnectionError("the weather service hung up")
        result = weather.function(context, proxy, sample)
        result.extra["id"] = sample.extra["id"]
        return result


@single_grader(name="judge", runtime=Runtime(timeout=JUDGE_TIMEOUT))
def judge(context, sample, trajectory):
    """Reward 1; once per sample, says 'retry' or runs past its timeout where the sample asks
    (``extra.grader``: ``retry_once``, ``slow_once``)."""
    job = context.model_customization_job_id
    key = f"{job}-grader-{sample.extra['id']}"
    behaviour = sample.extra.get("grader", "ok")
    if behaviour == "retry_once" and first_call(key):
        return SingleGraderResult(reward=0.0, status=PluginStatus.RETRY, error="judge busy")
    if behaviour == "slow_once" and first_call(key):
        # past Runtime.timeout: a failure, retried. On Ray it hangs: only a killed worker stops it
        if os.environ.get("RP_ON_RAY"):
            (state_dir() / f"hung-{job}.pid").write_text(str(os.getpid()))
            time.sleep(600)
        time.sleep(JUDGE_TIMEOUT + 2)
    return SingleGraderResult(reward=1.0, metrics={"messages": float(len(trajectory.messages))})


@single_grader(name="sleeper", runtime=Runtime(timeout=1))
def sleeper(context, sample, trajectory):
    """Sleeps ``sample`` seconds (a number here, not a sample): past its 1 s timeout when asked."""
    time.sleep(sample)
    return SingleGraderResult(reward=1.0)
