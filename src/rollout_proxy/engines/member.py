"""One engine of the fleet: its client, health, version, and the calls it has in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.engines.base import Engine
from rollout_proxy.engines.health import Breaker, EngineState


@dataclass(eq=False)
class Member:
    client: Engine
    breaker: Breaker
    limit: asyncio.Semaphore  # calls in flight on this engine (beyond it, calls queue here)
    owned: bool = True  # the fleet made the client, so the fleet closes it
    state: EngineState = EngineState.STARTING
    draining: bool = False
    #: the policy version of the weights it serves (None: not known yet)
    version: int | None = None
    #: whether it serves ``/weight_info`` (else its version is what the fleet last set on it)
    reports_version: bool = False
    in_flight: int = 0
    last_error: str | None = None
    #: bumped when its weights change (a resume, a readmit): a call that saw it change cannot say which tokens
    #: came before, and a probe that saw it change may have heard the old version (it asks again)
    epoch: int = 0
    #: set (and replaced) when it is declared down: calls on it stop waiting and fail over
    down: asyncio.Event = field(default_factory=asyncio.Event)
    #: calls past the gate whose request has not left yet (a pause waits for them, briefly)
    unsent: set[asyncio.Event] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # probe now
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # nothing in flight
    prober: asyncio.Task[None] | None = None
    #: the probe running now (the prober's, or one a turn asked for): others wait for it, not start one
    probing: asyncio.Future[None] | None = None
    #: loop time anything last came from it: a call answered, a probe answered, a streamed token
    heard_at: float = -float("inf")

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def routable(self) -> bool:
        """Gets new turns: healthy (at the fleet's version, by construction) and not leaving."""
        return self.state is EngineState.HEALTHY and not self.draining

    @property
    def shown_state(self) -> EngineState:
        return EngineState.DRAINING if self.draining else self.state

    @contextlib.asynccontextmanager
    async def occupied(self) -> AsyncIterator[None]:
        """Count one call in flight (from before it waits for a slot until it is done)."""
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def heard(self) -> None:
        """Something came from the engine now (it is not hung, however slow its probes are)."""
        self.heard_at = asyncio.get_running_loop().time()

    def silent_for(self) -> float:
        """Seconds since anything came from the engine (``heard``)."""
        return asyncio.get_running_loop().time() - self.heard_at

    def declare_down(self) -> None:
        """Wake every call waiting on this engine; later calls get a fresh event."""
        self.down.set()
        self.down = asyncio.Event()

    def view(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.shown_state.value,
            "policy_version": self.version,
            "in_flight": self.in_flight,
            "last_error": self.last_error,
        }
