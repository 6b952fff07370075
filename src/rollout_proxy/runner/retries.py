"""What a plugin's status means for the job: the seed's retry rules, in one place.

For rollouts and graders alike: ``failure`` (or an exception, or a timeout: see
``sdk.execution.attempt``) is retried up to ``MAX_RETRIES`` times, then the job
fails with the plugin's error (``JobFailed``); ``retry`` is retried up to
``MAX_RETRIES`` times, then the sample is dropped (``SampleDropped``); ``discard``
drops the sample at once. When calls run together, the first error wins and the
rest are cancelled, a ``JobFailed`` before anything else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

from rollout_proxy.sdk.execution import Attempt
from rollout_proxy.sdk.types import PluginStatus

log = structlog.get_logger(__name__)

MAX_RETRIES = 3

T = TypeVar("T")


class JobFailed(RuntimeError):
    """A plugin kept failing (``failure`` 1 + 3 times); the job stops with its error."""


class SampleDropped(Exception):
    """The sample is dropped (``discard``, or ``retry`` 1 + 3 times)."""


def _no_op() -> None:
    return None


async def with_retries(
    what: str, call: Callable[[], Awaitable[Attempt]], *, on_failed_attempt: Callable[[], None] = _no_op
) -> Attempt:
    """Run ``call()`` until it succeeds; the successful attempt.

    ``on_failed_attempt`` is told of every ``failure`` / ``retry`` (the progress bar counts them).
    Raises ``SampleDropped`` (discard, or retry 4x) or ``JobFailed`` (failure 4x).
    """
    for attempt_number in range(1, 2 + MAX_RETRIES):
        attempt = await call()
        if attempt.succeeded:
            return attempt
        if attempt.status is PluginStatus.DISCARD:
            log.info("sample_discarded", what=what, error=attempt.error)
            raise SampleDropped(f"{what}: discarded: {attempt.error}")
        on_failed_attempt()
        log.warning("plugin_retry", what=what, status=attempt.status.value, attempt=attempt_number, error=attempt.error)
    if attempt.status is PluginStatus.FAILURE:
        raise JobFailed(f"{what} failed {1 + MAX_RETRIES} times; last error: {attempt.error}")
    log.info("sample_discarded", what=what, error=attempt.error, reason="retries exhausted")
    raise SampleDropped(f"{what}: still 'retry' after {MAX_RETRIES} retries: {attempt.error}")


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


async def gather_first_error(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run together; on an error cancel the rest and raise it (a JobFailed first), not a group."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coroutine) for coroutine in coroutines]
    except BaseExceptionGroup as errors:
        leaves = _leaves(errors)
        raise next((e for e in leaves if isinstance(e, JobFailed)), leaves[0]) from None
    return [task.result() for task in tasks]
