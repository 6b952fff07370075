"""Running plugins once, the same way in a job and in ``test_with_dataset``.

A plugin call ends in a status, never an exception: a plugin's bug, a timeout
(``Runtime.timeout``) or a result that fails validation is a ``failure`` (with a
message saying which), so the caller decides what a status means: the runner
retries or drops, ``test_with_dataset`` skips. Rollouts of either kind and graders
of either kind are called through one function each, so nobody repeats the
single-versus-group argument lists.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollout_proxy.sdk.decorators import Plugin, PluginKind
from rollout_proxy.sdk.proxy import RolloutInferenceProxy
from rollout_proxy.sdk.types import ChatCompletionSample, GroupGraderResult, PluginContext, PluginStatus, Trajectory
from rollout_proxy.sdk.validation import PluginValidationError

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Attempt:
    """One call's outcome: its status, the plugin's error message, its (validated) result."""

    status: PluginStatus
    error: str | None = None
    result: Any = None

    @property
    def succeeded(self) -> bool:
        return self.status is PluginStatus.SUCCESS


#: how a grader call is made: ``attempt`` itself, or a wrapper (the runner's retries and limits)
PluginCall = Callable[..., Awaitable[Attempt]]


class _PluginCall:
    """One call of a plugin; a sync plugin runs in a thread that may outlive a timeout.

    Python cannot stop a thread, so a sync call that timed out still occupies one of the
    plugin's ``max_concurrency`` slots until it really returns: ``release_when_done``
    gives the slot back then (or at once when the call is over or never started).
    """

    def __init__(self, plugin: Plugin, args: tuple[Any, ...]) -> None:
        self._plugin, self._args = plugin, args
        self._lock = threading.Lock()
        self._state = "pending"  # pending → running → ended, or pending → abandoned
        self._on_end: Callable[[], Any] | None = None

    async def run(self) -> Any:
        if self._plugin.spec.is_async:
            self._state = "ended"
            return await self._plugin(*self._args)
        loop = asyncio.get_running_loop()

        def in_thread() -> Any:
            with self._lock:
                if self._state == "abandoned":
                    return None
                self._state = "running"
            try:
                return self._plugin(*self._args)
            finally:
                loop.call_soon_threadsafe(self._ended)

        return await asyncio.to_thread(in_thread)

    def _ended(self) -> None:
        with self._lock:
            self._state = "ended"
            on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    def release_when_done(self, limit: asyncio.Semaphore) -> None:
        with self._lock:
            if self._state == "running":
                self._on_end = limit.release
                return
            if self._state == "pending":
                self._state = "abandoned"
        limit.release()


async def attempt(plugin: Plugin, *args: Any, limit: asyncio.Semaphore | None = None) -> Attempt:
    """Call ``plugin`` once within its runtime timeout; the outcome as a status.

    ``limit`` (the plugin's ``max_concurrency``) is held for the call, and by a sync call
    that timed out until its thread ends.
    """
    timeout = plugin.spec.runtime.timeout
    if limit is not None:
        await limit.acquire()
    call = _PluginCall(plugin, args)
    try:
        result = await asyncio.wait_for(call.run(), timeout)
    except TimeoutError:
        return Attempt(PluginStatus.FAILURE, f"timed out after {timeout}s")
    except PluginValidationError as exc:
        return Attempt(PluginStatus.FAILURE, f"invalid result: {exc}")
    except Exception as exc:  # a plugin's bug must not take its caller down
        log.warning("plugin_raised", plugin=plugin.spec.name, exc_info=True)
        return Attempt(PluginStatus.FAILURE, f"{type(exc).__name__}: {exc}")
    finally:
        if limit is not None:
            call.release_when_done(limit)
    if result is None:  # a single rollout may return nothing: a success without extras
        return Attempt(PluginStatus.SUCCESS)
    return Attempt(PluginStatus(result.status), getattr(result, "error", None) or None, result)


async def attempt_rollout(
    rollout: Plugin,
    context: PluginContext,
    proxy: RolloutInferenceProxy,
    sample: ChatCompletionSample,
    n_sample: int,
    *,
    limit: asyncio.Semaphore | None = None,
) -> Attempt:
    """Call a rollout of either kind: ``n_sample`` goes to a group rollout only."""
    if rollout.spec.kind is PluginKind.GROUP_ROLLOUT:
        return await attempt(rollout, context, proxy, sample, n_sample, limit=limit)
    return await attempt(rollout, context, proxy, sample, limit=limit)


@dataclass(slots=True)
class Grades:
    """One grader's verdict on a group of trajectories.

    ``rewards`` and ``metrics`` hold what the grader scored (every trajectory when
    ``complete``); metric names are prefixed with the grader's name. A group grader's
    result is kept whole (``group_result``): it may carry custom advantages.
    """

    grader: str
    rewards: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    group_result: GroupGraderResult | None = None
    complete: bool = True


def _named(grader: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{grader}/{key}": value for key, value in metrics.items()}


async def grade(
    grader: Plugin,
    context: PluginContext,
    sample: ChatCompletionSample,
    trajectories: Sequence[Trajectory],
    *,
    call: PluginCall = attempt,
) -> Grades:
    """Grade a group with a grader of either kind: a single grader once per trajectory
    (in order), a group grader once. A call that does not succeed leaves its
    trajectories unscored (``complete`` is then false)."""
    name = grader.spec.name
    if grader.spec.kind is PluginKind.GROUP_GRADER:
        outcome = await call(grader, context, sample, list(trajectories))
        if not outcome.succeeded:
            return Grades(name, complete=False)
        result: GroupGraderResult = outcome.result
        return Grades(name, list(result.rewards), [_named(name, result.metrics)], group_result=result)
    grades = Grades(name)
    for trajectory in trajectories:
        outcome = await call(grader, context, sample, trajectory)
        if not outcome.succeeded:
            grades.complete = False
            continue
        grades.rewards.append(outcome.result.reward)
        grades.metrics.append(_named(name, outcome.result.metrics))
    return grades
