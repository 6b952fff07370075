"""One engine's health: its state, its circuit breaker, and what a probe or a call outcome does to them.

    starting ──probe ok──> healthy <──resume── paused
        │                   │  ▲  │ ──pause──────^
        │          breaker  │  │  └─ version differs ──> stale ──version set──> healthy
        └──probe fails──> unhealthy ──probe ok (backoff)──┘
    (draining: a flag over any state; the engine gets no new turn and leaves when idle)

Only a *healthy* engine gets turns. A call that fails because the engine is gone (refused,
reset) opens the breaker at once; 5xx answers and timeouts open it after ``threshold`` in a
row. Probes that time out say nothing while the engine was heard from lately (a call or a probe
answered, a streamed token came: a busy CPU engine's API server answers late); once nothing at
all came for ``hang_timeout``, the next probe that times out takes the engine out at once (hung,
or stopped: a GPU or NCCL hang looks exactly so), and its calls in flight end. An open breaker is re-probed with growing delays and closes on the first good probe,
except when calls opened it (an engine whose ``/health`` answers while its completions fail
or hang): then a good probe only half-opens it, and the next call decides (one more failure
opens it again, the delays still growing; a success closes it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rollout_proxy.engines.vllm_http import EngineRejected, EngineUnreachable
from rollout_proxy.errors import EngineError, EngineTimeout, EngineUnavailable, ProxyError


class EngineState(str, enum.Enum):
    STARTING = "starting"  # added, not probed yet
    HEALTHY = "healthy"  # answers, at the fleet's policy version: gets turns
    DRAINING = "draining"  # being removed: no new turns, in-flight ones finish
    PAUSED = "paused"  # paused for a weight update
    UNHEALTHY = "unhealthy"  # breaker open: re-probed with backoff
    STALE = "stale"  # answers, but its weights are not the fleet's version (restarted, or not updated)


@dataclass(slots=True)
class Breaker:
    """Consecutive failures, and the growing delay between probes while open."""

    threshold: int
    base_delay: float
    max_delay: float
    failures: int = 0
    is_open: bool = False
    opened_by_calls: bool = False
    _next_delay: float = field(default=0.0)

    def succeeded(self) -> None:
        """A call succeeded (or a probe, when probes opened it): closed, delays from the start."""
        self.failures = 0
        self.is_open = False
        self.opened_by_calls = False
        self._next_delay = self.base_delay

    def probe_succeeded(self) -> None:
        if not (self.is_open and self.opened_by_calls):
            self.succeeded()
            return
        self.is_open = False  # half-open: the next call failure opens it again, the delays keep growing
        self.failures = max(self.threshold - 1, 0)

    def failed(self, *, definite: bool, by_call: bool = False) -> bool:
        """Count a failure; True when this one opens the breaker."""
        self.failures += 1
        if self.is_open or not (definite or self.failures >= self.threshold):
            return False
        self.is_open = True
        self.opened_by_calls = by_call
        return True

    def trip(self) -> None:
        """Open now, whatever the count (an engine that never answered, a failed pause)."""
        self.is_open = True
        self._next_delay = max(self._next_delay, self.base_delay)

    def backoff(self) -> float:
        """The delay before the next probe of an open breaker (doubling, capped)."""
        delay = max(self._next_delay, self.base_delay)
        self._next_delay = min(delay * 2, self.max_delay)
        return min(delay, self.max_delay)


def counts_against(error: BaseException) -> bool:
    """Whether a failed call says something about the engine (not about the request)."""
    if isinstance(error, EngineRejected):
        return error.engine_status >= 500
    return isinstance(error, EngineUnavailable | EngineTimeout | TimeoutError)


def is_definite(error: BaseException) -> bool:
    """Refused or reset: the engine is down, not slow (one such failure opens the breaker)."""
    return isinstance(error, EngineUnreachable)


def is_timeout(error: BaseException) -> bool:
    """Nothing came back in time (a probe or a call timed out): slow, or hung."""
    return isinstance(error, EngineTimeout | TimeoutError)


def describe(error: BaseException) -> str:
    """A failure in words for ``last_error`` (the operator's view: the URL is beside it anyway)."""
    if isinstance(error, ProxyError):
        return error.message
    if isinstance(error, TimeoutError):
        return "no answer within the time allowed"
    return f"{type(error).__name__}: {error}"


def parse_version(reported: str | None, *, default: int) -> int:
    """An engine's ``weight_version`` as the fleet's integer version ("default" is ``default``).

    Raises ``EngineError`` for anything else: versions are the trainer's integer steps."""
    if reported is None or reported == "default":
        return default
    text = reported.strip()
    if not text.lstrip("-").isdigit():
        raise EngineError(f"the engine reports weight_version {reported[:64]!r}, which is not an integer")
    return int(text)
