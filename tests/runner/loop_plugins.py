"""Plugins for the training-loop tests: a two-turn chat that notes when each step's rollouts start,
and graders (one of which plays an impatient trainer that bumps the fleet's version mid-step)."""

from __future__ import annotations

import threading
import time
from typing import Any

from rollout_proxy.sdk import (
    PluginInstance,
    PluginStatus,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    rollout,
    single_grader,
)
from rollout_proxy.sdk.transport import ProxyClient

#: (training step, time.monotonic()) of every rollout call's start
STARTS: list[tuple[int, float]] = []
#: set by a test: {"url", "admin_key", "version"} for ``bumping_grader``
BUMP: dict[str, Any] = {}
_LOCK = threading.Lock()


@rollout(name="two_turns", runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=120, max_concurrency=16))
async def two_turns(context, proxy, sample):
    STARTS.append((context.current_training_step, time.monotonic()))
    client = proxy.async_rollout_client()
    messages = [m.model_dump(exclude_none=True) for m in sample.messages]
    for follow_up in ("And then?", None):
        completion = await client.chat.completions.create(model="fake", messages=messages)
        messages.append(completion.choices[0].message.model_dump(exclude_none=True))
        if follow_up is None:
            break
        messages.append({"role": "user", "content": follow_up})
    return RolloutResult(status=PluginStatus.SUCCESS, error="")


@single_grader(name="length")
def length_grader(context, sample, trajectory):
    """Reward: the generated tokens' share of the trajectory (anything that differs between rollouts)."""
    weights = trajectory.total_loss_weight or [0.0]
    return SingleGraderResult(reward=sum(weights) / len(weights))


@single_grader(name="bumping")
def bumping_grader(context, sample, trajectory):
    """On its first call of step 0, pause and resume the fleet at ``BUMP["version"]``: every token
    of step 0 (all sampled before grading) is then older than the fleet when the step is published."""
    with _LOCK:
        if context.current_training_step == 0 and not BUMP.get("done"):
            with ProxyClient(BUMP["url"], BUMP["admin_key"]) as admin:
                admin.post("/v1/admin/pause", {"mode": "keep"})
                admin.post("/v1/admin/resume", {"policy_version": BUMP["version"]})
            BUMP["done"] = True
    return SingleGraderResult(reward=1.0)
