"""Calling plugins once (``sdk.execution``): every outcome is a status, both kinds of each plugin alike."""

from __future__ import annotations

import asyncio
import math

import pytest

from rollout_proxy.sdk import (
    ChatCompletionSample,
    GroupGraderResult,
    GroupRolloutResult,
    InferenceProxy,
    Mode,
    PluginContext,
    PluginStatus,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    SingleResponse,
    Trajectory,
    group_grader,
    group_rollout,
    rollout,
    single_grader,
)
from rollout_proxy.sdk.execution import Attempt, attempt, attempt_rollout, grade

SAMPLE = ChatCompletionSample.model_validate({"messages": [{"role": "user", "content": "2 + 2?"}]})
CONTEXT = PluginContext(phase="test", is_mock=True)
TRAJECTORIES = [Trajectory(messages=[{"role": "assistant", "content": str(n)}], extra={"n": n}) for n in range(3)]


def local_proxy(*, group: bool = False) -> InferenceProxy:
    return InferenceProxy(SAMPLE, url="http://127.0.0.1:9/v1", jwt_token="unused", mode=Mode.Inference, group=group)


@rollout(runtime=Runtime(timeout=1))
async def sleepy(context, proxy, sample):
    await asyncio.sleep(30)


@rollout
def crashing(context, proxy, sample):
    raise ConnectionError("the tool server hung up")


@single_grader
def nan_grader(context, sample, trajectory):
    return SingleGraderResult(reward=math.nan)


@rollout
def nothing(context, proxy, sample):
    return None


@rollout
def retrying(context, proxy, sample):
    return RolloutResult(status=PluginStatus.RETRY, error="busy", extra={"k": 1})


async def test_a_timeout_is_a_failure():
    outcome = await attempt(sleepy, CONTEXT, local_proxy(), SAMPLE)
    assert outcome == Attempt(PluginStatus.FAILURE, "timed out after 1s")


async def test_an_exception_is_a_failure_with_its_message():
    outcome = await attempt(crashing, CONTEXT, local_proxy(), SAMPLE)
    assert outcome == Attempt(PluginStatus.FAILURE, "ConnectionError: the tool server hung up")


async def test_an_invalid_result_is_a_failure():
    outcome = await attempt(nan_grader, CONTEXT, SAMPLE, TRAJECTORIES[0])
    assert outcome.status is PluginStatus.FAILURE and outcome.result is None
    assert outcome.error is not None and outcome.error.startswith("invalid result: reward[0] is nan")


async def test_no_result_is_a_success_and_a_status_is_passed_on_with_its_error():
    assert await attempt(nothing, CONTEXT, local_proxy(), SAMPLE) == Attempt(PluginStatus.SUCCESS)
    outcome = await attempt(retrying, CONTEXT, local_proxy(), SAMPLE)
    assert outcome.status is PluginStatus.RETRY and outcome.error == "busy" and outcome.result.extra == {"k": 1}
    assert not outcome.succeeded


async def test_a_rollout_of_either_kind_gets_its_own_arguments():
    seen = []

    @rollout
    def single(context, proxy, sample):
        seen.append(("single", proxy.group))

    @group_rollout
    def group(context, proxy, sample, n_sample=1):
        seen.append(("group", n_sample))
        return GroupRolloutResult(responses=[SingleResponse(id=f"r{i}") for i in range(n_sample)])

    assert (await attempt_rollout(single, CONTEXT, local_proxy(), SAMPLE, 3)).succeeded
    outcome = await attempt_rollout(group, CONTEXT, local_proxy(group=True), SAMPLE, 3)
    assert outcome.succeeded and [r.id for r in outcome.result.responses] == ["r0", "r1", "r2"]
    assert seen == [("single", False), ("group", 3)]


@single_grader(name="exact")
def exact(context, sample, trajectory):
    return SingleGraderResult(reward=float(trajectory.extra["n"] == 2), metrics={"len": 1.0})


@group_grader(name="rank")
def rank(context, sample, trajectories):
    n = len(trajectories)
    return GroupGraderResult(rewards=[i / n for i in range(n)], metrics={"n": float(n)}, seq_advantages=[0.0] * n)


async def test_a_single_grader_scores_each_trajectory_in_order():
    grades = await grade(exact, CONTEXT, SAMPLE, TRAJECTORIES)
    assert grades.grader == "exact" and grades.complete and grades.group_result is None
    assert grades.rewards == [0.0, 0.0, 1.0] and grades.metrics == [{"exact/len": 1.0}] * 3


async def test_a_group_grader_is_called_once_and_its_result_kept():
    grades = await grade(rank, CONTEXT, SAMPLE, TRAJECTORIES)
    assert grades.rewards == pytest.approx([0, 1 / 3, 2 / 3]) and grades.metrics == [{"rank/n": 3.0}]
    assert grades.complete and grades.group_result is not None and grades.group_result.seq_advantages == [0.0] * 3


async def test_calls_go_through_the_given_call_and_what_fails_stays_unscored():
    calls = []

    async def every_other(plugin, *args):
        calls.append(args[-1])
        if len(calls) % 2 == 0:
            return Attempt(PluginStatus.RETRY, "judge busy")
        return await attempt(plugin, *args)

    grades = await grade(exact, CONTEXT, SAMPLE, TRAJECTORIES, call=every_other)
    assert calls == TRAJECTORIES and grades.rewards == [0.0, 1.0] and not grades.complete

    @group_grader
    def wrong_count(context, sample, trajectories):
        return GroupGraderResult(rewards=[1.0])

    failed = await grade(wrong_count, CONTEXT, SAMPLE, TRAJECTORIES)
    assert failed.rewards == [] and failed.metrics == [] and not failed.complete


ACTIVE = {"now": 0, "max": 0}


@rollout(runtime=Runtime(timeout=1, max_concurrency=1))
def stuck_then_done(context, proxy, sample):
    """A sync rollout that outlives its timeout: Python cannot stop its thread."""
    import time

    ACTIVE["now"] += 1
    ACTIVE["max"] = max(ACTIVE["max"], ACTIVE["now"])
    try:
        time.sleep(1.5)
    finally:
        ACTIVE["now"] -= 1


async def test_a_timed_out_sync_call_keeps_its_concurrency_slot_until_its_thread_ends():
    ACTIVE.update(now=0, max=0)
    limit = asyncio.Semaphore(stuck_then_done.spec.runtime.max_concurrency)
    first = await attempt(stuck_then_done, CONTEXT, local_proxy(), SAMPLE, limit=limit)
    assert first.status is PluginStatus.FAILURE and "timed out" in (first.error or "")
    assert limit.locked()  # the first thread still runs: its slot is still taken
    second = await attempt(stuck_then_done, CONTEXT, local_proxy(), SAMPLE, limit=limit)
    assert second.status is PluginStatus.FAILURE
    assert ACTIVE["max"] == 1  # never two threads of a max_concurrency=1 plugin at once
    await asyncio.sleep(0.7)  # the second thread ends too
    assert not limit.locked() and ACTIVE["now"] == 0


async def test_a_finished_call_gives_its_slot_back_at_once():
    limit = asyncio.Semaphore(1)
    outcome = await attempt(sleepy, CONTEXT, local_proxy(), SAMPLE, limit=limit)
    assert outcome.status is PluginStatus.FAILURE  # sleepy times out, but it is async: cancelled, slot free
    assert not limit.locked()
