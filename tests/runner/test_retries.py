"""The seed's status semantics, alone: how many calls each status gets and how it ends."""

from __future__ import annotations

import asyncio

import pytest

from rollout_proxy.runner.retries import MAX_RETRIES, JobFailed, SampleDropped, gather_first_error, with_retries
from rollout_proxy.sdk.execution import Attempt
from rollout_proxy.sdk.types import PluginStatus

SUCCESS, FAILURE, RETRY, DISCARD = PluginStatus.SUCCESS, PluginStatus.FAILURE, PluginStatus.RETRY, PluginStatus.DISCARD


class Scripted:
    """A plugin call answering the given statuses in turn (the last one repeated), counting its calls."""

    def __init__(self, *statuses: PluginStatus) -> None:
        self.statuses = statuses
        self.calls = 0
        self.failed_attempts = 0

    async def __call__(self) -> Attempt:
        status = self.statuses[min(self.calls, len(self.statuses) - 1)]
        self.calls += 1
        return Attempt(status, None if status is SUCCESS else f"{status.value} #{self.calls}", result=self.calls)

    def failed(self) -> None:
        self.failed_attempts += 1

    async def run(self) -> Attempt:
        return await with_retries("sample 7: rollout r", self, on_failed_attempt=self.failed)


def test_three_retries_as_the_seed_says():
    assert MAX_RETRIES == 3


async def test_success_is_called_once():
    call = Scripted(SUCCESS)
    attempt = await call.run()
    assert attempt.succeeded and attempt.result == 1 and call.calls == 1 and call.failed_attempts == 0


@pytest.mark.parametrize("status", [FAILURE, RETRY])
async def test_a_failure_or_retry_then_success_is_called_again(status):
    call = Scripted(status, status, SUCCESS)
    attempt = await call.run()
    assert attempt.result == 3 and call.calls == 3 and call.failed_attempts == 2


async def test_failure_four_times_fails_the_job_with_the_last_error():
    call = Scripted(FAILURE)
    with pytest.raises(JobFailed, match=r"^sample 7: rollout r failed 4 times; last error: failure #4$"):
        await call.run()
    assert call.calls == 1 + MAX_RETRIES and call.failed_attempts == 4


async def test_retry_four_times_drops_the_sample():
    call = Scripted(RETRY)
    with pytest.raises(SampleDropped, match="still 'retry' after 3 retries: retry #4"):
        await call.run()
    assert call.calls == 4 and call.failed_attempts == 4


async def test_discard_drops_at_once_without_counting_a_failed_attempt():
    call = Scripted(DISCARD)
    with pytest.raises(SampleDropped, match="discarded: discard #1"):
        await call.run()
    assert call.calls == 1 and call.failed_attempts == 0


async def test_a_discard_after_failures_still_drops():
    call = Scripted(FAILURE, FAILURE, DISCARD)
    with pytest.raises(SampleDropped, match="discarded"):
        await call.run()
    assert call.calls == 3 and call.failed_attempts == 2


@pytest.mark.parametrize("last, error", [(RETRY, SampleDropped), (FAILURE, JobFailed)])
async def test_the_last_status_decides_when_statuses_mix(last, error):
    call = Scripted(FAILURE, RETRY, FAILURE, last)
    with pytest.raises(error):
        await call.run()
    assert call.calls == 4


async def test_gather_returns_results_in_order():
    async def value(n: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return n

    assert await gather_first_error([value(1, 0.02), value(2, 0.0), value(3, 0.01)]) == [1, 2, 3]


async def test_gather_raises_a_job_failure_before_other_errors_and_cancels_the_rest():
    cancelled = asyncio.Event()

    async def dropped() -> None:
        raise SampleDropped("dropped")

    async def failed() -> None:
        raise JobFailed("failed")

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(JobFailed, match="failed"):
        await gather_first_error([dropped(), failed(), slow()])
    assert cancelled.is_set()
