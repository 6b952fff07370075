"""The pieces of engine health as units: the circuit breaker, failure kinds, versions, the pause gate."""

from __future__ import annotations

import asyncio

import pytest

from rollout_proxy.engines.gate import Deadline, PauseGate
from rollout_proxy.engines.health import Breaker, counts_against, is_definite, parse_version
from rollout_proxy.engines.vllm_http import EngineRejected, EngineUnreachable
from rollout_proxy.errors import EngineError, EngineTimeout, EngineUnavailable, FleetPaused


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_definite_failure_opens_the_breaker_at_once_others_at_the_threshold():
    breaker = Breaker(threshold=3, base_delay=1.0, max_delay=10.0)
    assert not breaker.failed(definite=False) and not breaker.failed(definite=False)
    assert breaker.failed(definite=False) and breaker.is_open  # the third in a row
    assert not breaker.failed(definite=False)  # already open: opening is said once
    breaker.succeeded()
    assert not breaker.is_open and breaker.failures == 0
    assert not breaker.failed(definite=False)
    breaker.succeeded()  # a success between failures resets the count
    assert not breaker.failed(definite=False) and not breaker.failed(definite=False)
    assert breaker.failed(definite=True)


def test_an_open_breaker_is_probed_with_growing_delays_up_to_the_cap():
    breaker = Breaker(threshold=1, base_delay=0.5, max_delay=3.0)
    breaker.trip()
    assert [breaker.backoff() for _ in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    breaker.succeeded()
    breaker.trip()
    assert breaker.backoff() == 0.5  # closed and opened again: from the start


@pytest.mark.parametrize(
    ("error", "counts", "definite"),
    [
        (EngineUnreachable("refused"), True, True),
        (EngineUnavailable("503"), True, False),
        (EngineTimeout("slow"), True, False),
        (EngineRejected("500", engine_status=500), True, False),
        (EngineRejected("400", engine_status=400), False, False),  # the request's fault, on any engine
        (EngineError("not JSON"), False, False),
        (ValueError("a bug"), False, False),
    ],
)
def test_which_failures_count_against_an_engine(error, counts, definite):
    assert counts_against(error) is counts
    assert is_definite(error) is definite


@pytest.mark.parametrize(("reported", "version"), [(None, 4), ("default", 4), ("0", 0), ("12", 12), (" 7 ", 7)])
def test_versions_are_integers_and_default_is_the_setting(reported, version):
    assert parse_version(reported, default=4) == version


@pytest.mark.parametrize("reported", ["v2", "1.5", "", "step-3", "1e3"])
def test_any_other_version_is_an_engine_error(reported):
    with pytest.raises(EngineError, match="not an integer"):
        parse_version(reported, default=0)


async def test_an_open_gate_lets_turns_through_and_a_closed_one_holds_them_until_it_opens():
    gate = PauseGate(max_waiting=10, max_wait=30.0)
    await gate.wait()
    gate.close()
    waiting = [asyncio.create_task(gate.wait()) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert gate.waiting == 3 and not any(task.done() for task in waiting)
    gate.open()
    await asyncio.gather(*waiting)
    assert gate.waiting == 0


async def test_a_full_queue_refuses_with_retry_after_and_work_in_hand_is_not_counted():
    gate = PauseGate(max_waiting=2, max_wait=30.0)
    gate.close()
    queued = [asyncio.create_task(gate.wait()) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(FleetPaused) as raised:
        await gate.wait()
    assert raised.value.status == 503 and raised.value.retry_after >= 1 and "2 turns" in raised.value.message
    in_hand = asyncio.create_task(gate.wait(queued=False))  # an aborted turn: waits, never refused
    await asyncio.sleep(0.01)
    assert not in_hand.done()
    gate.open()
    await asyncio.gather(*queued, in_hand)


async def test_a_turn_waits_at_most_the_pause_wait():
    gate = PauseGate(max_waiting=10, max_wait=0.1)
    gate.close()
    with pytest.raises(FleetPaused, match=r"waited 0\.1s"):
        await gate.wait()
    assert gate.waiting == 0


def test_paused_time_does_not_count_against_a_deadline():
    clock = Clock()
    gate = PauseGate(max_waiting=1, max_wait=1.0, clock=clock)
    deadline = Deadline(gate, 10.0)
    clock.now += 4
    assert deadline.remaining() == 6
    gate.close()
    clock.now += 100  # paused: the deadline stands still
    assert deadline.remaining() == 6 and gate.paused_for() == 100
    assert gate.open() == 100
    clock.now += 5
    assert deadline.remaining() == 1 and not deadline.expired
    clock.now += 1
    assert deadline.expired


def test_a_breaker_calls_opened_is_only_half_opened_by_a_good_probe():
    """/health answers while completions fail: one more failed call opens it again, the delays keep growing."""
    breaker = Breaker(threshold=3, base_delay=1.0, max_delay=60.0)
    for _ in range(2):
        assert not breaker.failed(definite=False, by_call=True)
    assert breaker.failed(definite=False, by_call=True)
    assert breaker.backoff() == 1.0
    breaker.probe_succeeded()
    assert not breaker.is_open
    assert breaker.failed(definite=False, by_call=True)  # the very next failure
    assert breaker.backoff() == 2.0  # not back to the start
    breaker.probe_succeeded()
    breaker.succeeded()  # a call worked: closed for good
    assert breaker.failures == 0 and not breaker.failed(definite=False, by_call=True)


def test_a_breaker_probes_opened_is_closed_by_a_good_probe():
    breaker = Breaker(threshold=1, base_delay=1.0, max_delay=60.0)
    assert breaker.failed(definite=False)
    breaker.probe_succeeded()
    assert not breaker.is_open and breaker.failures == 0
