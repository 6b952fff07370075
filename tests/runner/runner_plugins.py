"""Plugins for the runner's end-to-end tests: the weather rollout, made to return every status."""

from __future__ import annotations

import threading
import time
from collections import Counter

from rollout_proxy.examples.weather_rollout import demo_rollout as weather
from rollout_proxy.sdk import (
    GroupGraderResult,
    PluginInstance,
    PluginStatus,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    group_grader,
    rollout,
    single_grader,
)

CALLS: Counter[str] = Counter()
ACTIVE = {"now": 0, "max": 0}
_LOCK = threading.Lock()


def first_call(key: str) -> bool:
    with _LOCK:
        CALLS[key] += 1
        return CALLS[key] == 1


@rollout(
    name="status_rollout",
    runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=2, max_concurrency=3, request_concurrency=2),
)
def status_rollout(context, proxy, sample):
    """The weather agent, except when the sample asks for another outcome."""
    behaviour = (sample.extra or {}).get("behaviour", "ok")
    key = (sample.extra or {}).get("id", "")
    with _LOCK:
        ACTIVE["now"] += 1
        ACTIVE["max"] = max(ACTIVE["max"], ACTIVE["now"])
    try:
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
        if behaviour == "slow_once" and first_call(key):
            time.sleep(3)  # longer than Runtime.timeout: a failure, retried
        result = weather.function(context, proxy, sample)
        result.extra["id"] = key
        return result
    finally:
        with _LOCK:
            ACTIVE["now"] -= 1


@single_grader(name="quality")
def quality_grader(context, sample, trajectory):
    """The dataset's quality label, if the agent used the tool."""
    used_tool = any(m.get("role") == "tool" for m in trajectory.messages)
    return SingleGraderResult(
        reward=float(sample.extra["quality"]) if used_tool else 0.0,
        metrics={"turns": float(trajectory.turns or 0)},
    )


@group_grader(name="position")
def position_grader(context, sample, trajectories):
    """A reward rising with the position in the group: i / (n - 1)."""
    n = len(trajectories)
    rewards = [i / (n - 1) if n > 1 else 0.0 for i in range(n)]
    return GroupGraderResult(rewards=rewards, metrics={"group_size": float(n)}, status=PluginStatus.SUCCESS, error="")


@group_grader(name="custom")
def custom_grader(context, sample, trajectories):
    """Custom advantages for samples that ask for them (to break the batch rule)."""
    rewards = [1.0 for _ in trajectories]
    custom = [0.5 for _ in trajectories] if sample.extra.get("custom") else None
    return GroupGraderResult(rewards=rewards, metrics={}, status=PluginStatus.SUCCESS, error="", seq_advantages=custom)


@single_grader(name="moody")
def moody_grader(context, sample, trajectory):
    """Returns the status the sample asks for (sample.extra['grader'])."""
    wanted = sample.extra.get("grader", "ok")
    if wanted == "discard":
        return SingleGraderResult(reward=0.0, status=PluginStatus.DISCARD, error="off-topic answer")
    if wanted == "fail":
        return SingleGraderResult(reward=0.0, status=PluginStatus.FAILURE, error="the judge model is down")
    if wanted == "retry_once" and first_call("grader-" + sample.extra["id"]):
        return SingleGraderResult(reward=0.0, status=PluginStatus.RETRY, error="judge busy")
    if wanted == "raise":
        raise ValueError("grader bug")
    return SingleGraderResult(reward=1.0)
