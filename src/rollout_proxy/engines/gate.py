"""The fleet's pause gate: while paused, new turns wait here, in a bounded queue, for a bounded time.

It also keeps the fleet's *active* clock: seconds that pass while the fleet is paused do not
count against a call's deadline, so a call frozen by a keep-mode pause is not killed by the
proxy's own timeouts (it is bounded by the pause wait instead).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from rollout_proxy.errors import FleetPaused


class PauseGate:
    def __init__(
        self,
        *,
        max_waiting: int,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``on_change`` is called when it opens, closes, or its queue grows or shrinks (the fleet's gauges)."""
        self._clock = clock
        self._on_change = on_change or (lambda: None)
        self.max_waiting = max_waiting
        self.max_wait = max_wait
        self._open = asyncio.Event()
        self._open.set()
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self.waiting = 0  # turns queued now

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def close(self) -> None:
        if self._paused_at is None:
            self._paused_at = self._clock()
            self._open.clear()
            self._on_change()

    def open(self) -> float:
        """Reopen; answers how long the gate was closed."""
        if self._paused_at is None:
            return 0.0
        closed_for = self._clock() - self._paused_at
        self._paused_total += closed_for
        self._paused_at = None
        self._open.set()
        self._on_change()
        return closed_for

    def paused_for(self) -> float:
        return 0.0 if self._paused_at is None else self._clock() - self._paused_at

    def active(self) -> float:
        """Seconds since an arbitrary origin, not counting those spent paused."""
        return self._clock() - self._paused_total - self.paused_for()

    def _refuse(self, why: str) -> FleetPaused:
        return FleetPaused(
            f"the engines are paused for a weight update and {why}; try again shortly",
            retry_after=max(1.0, min(30.0, math.ceil(self.max_wait / 10))),
        )

    async def wait(self, *, queued: bool = True) -> None:
        """Return at once when open; else wait for the resume, at most ``max_wait`` seconds.

        ``queued=False`` is for a turn already in flight (one a pause aborted): it waits, but
        never counts against the queue's bound, so a pause cannot turn work in hand into 503s."""
        if self._paused_at is None:
            return
        if queued and self.waiting >= self.max_waiting:
            raise self._refuse(f"{self.waiting} turns are already waiting (the most the queue holds)")
        started = self._clock()
        if queued:
            self.waiting += 1
            self._on_change()
        try:
            while self._paused_at is not None:
                left = self.max_wait - (self._clock() - started)
                if left <= 0:
                    raise self._refuse(f"this turn waited {self.max_wait:g}s for the resume")
                try:
                    async with asyncio.timeout(left):
                        await self._open.wait()
                except TimeoutError:
                    continue
        finally:
            if queued:
                self.waiting -= 1
                self._on_change()


class Deadline:
    """A budget of active seconds (paused time does not count), started now."""

    def __init__(self, gate: PauseGate, budget: float) -> None:
        self._gate = gate
        self.budget = budget
        self._start = gate.active()

    def remaining(self) -> float:
        return self.budget - (self._gate.active() - self._start)

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0
