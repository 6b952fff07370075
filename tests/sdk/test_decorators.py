"""Decorators check plugins when they are declared, with errors that say what to fix."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pydantic import ValidationError

from rollout_proxy.sdk import (
    GroupGraderResult,
    PluginInstance,
    Runtime,
    SingleGraderResult,
    group_grader,
    group_rollout,
    rollout,
    single_grader,
    single_rollout,
)
from rollout_proxy.sdk.decorators import PluginKind


def test_rollout_is_an_alias_of_single_rollout_and_works_bare():
    @rollout
    def plain(context, proxy, sample):
        return None

    @single_rollout(name="named", description="says hi")
    def named(context, proxy, sample):
        return None

    assert plain.spec.kind is named.spec.kind is PluginKind.SINGLE_ROLLOUT
    assert plain.spec.name == "plain" and named.spec.name == "named" and named.spec.description == "says hi"


def test_defaults_follow_the_seed():
    @rollout
    def plain(context, proxy, sample):
        return None

    runtime = plain.spec.runtime
    assert runtime.instance is PluginInstance.CPU1MEM2
    assert runtime.max_concurrency == 10 and runtime.request_concurrency == 512 and runtime.timeout is None


@pytest.mark.parametrize(
    "decorator, signature, message",
    [
        (rollout, lambda context, proxy: None, "must take (context, proxy, sample)"),
        (group_rollout, lambda context, proxy, sample: None, "needs an 'n_sample' parameter"),
        (single_grader, lambda context, sample: None, "must take (context, sample, trajectory)"),
        (group_grader, lambda context, sample, trajectories, extra: None, "must take (context, sample, trajectories)"),
    ],
)
def test_signatures_are_checked(decorator, signature, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decorator(signature)


def test_group_rollout_accepts_the_seed_signature():
    @group_rollout
    async def group(context, proxy, sample, n_sample: int = 1):
        return None

    assert group.spec.kind is PluginKind.GROUP_ROLLOUT and group.spec.is_async


@pytest.mark.parametrize("instance", ["CPU4MEM8", "cpu16mem128", PluginInstance.CPU2MEM16])
def test_valid_instances(instance):
    assert Runtime(instance=instance).instance.value.startswith("CPU")


@pytest.mark.parametrize(
    "instance, message",
    [
        ("CPU4MEM12", "1:2, 1:4 or 1:8"),
        ("CPU32MEM64", "cores must be one of"),
        ("CPU3MEM6", "cores must be one of"),
        ("BIG", "CPU<cores>MEM<GB>"),
    ],
)
def test_invalid_instances_say_why(instance, message):
    with pytest.raises(ValidationError, match=message):
        rollout(runtime=Runtime(instance=instance))


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"timeout": 901}, "timeout"),
        ({"timeout": 0}, "timeout"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": 101}, "max_concurrency"),
        ({"min_replicas": 5, "max_replicas": 2}, "max_replicas"),
    ],
)
def test_runtime_bounds(settings, field):
    with pytest.raises(ValidationError, match=field):
        Runtime(**settings)


def test_runtime_as_a_dict_is_validated_at_declaration():
    with pytest.raises(ValidationError, match="timeout"):

        @rollout(runtime={"timeout": 1000})
        def plugin(context, proxy, sample):
            return None


async def test_sync_plugins_run_in_a_thread_pool_from_async_code():
    threads = []

    @single_grader
    def slow_grader(context, sample, trajectory):
        threads.append(threading.current_thread())
        time.sleep(0.3)
        return SingleGraderResult(reward=1.0)

    ticks = 0

    async def ticker():
        nonlocal ticks
        for _ in range(5):
            await asyncio.sleep(0.04)
            ticks += 1

    result, _ = await asyncio.gather(slow_grader.arun({}, {}, {"messages": []}), ticker())
    assert result.reward == 1.0
    assert ticks == 5  # the event loop kept running while the grader slept
    assert threads[0] is not threading.main_thread()


def test_decorated_plugins_still_return_their_result():
    @group_grader
    def grader(context, sample, trajectories):
        return {"rewards": [1.0 for _ in trajectories], "metrics": {}, "status": "success", "error": ""}

    result = grader({}, {}, [{"messages": []}])
    assert isinstance(result, GroupGraderResult) and result.rewards == [1.0]
