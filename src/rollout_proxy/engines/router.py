"""What a turn needs of the engines, and nothing more: where to render, where to sample, when to wait.

``core`` sees the engines through ``EngineRouter`` (the pause gate, routing with exclusions, failure
reports, the retry budget, the failing-over call), not the concrete ``Fleet`` that implements it with
health probes, breakers, membership and the shared fleet state; a test or another fleet can stand in.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from rollout_proxy.engines.base import GenerationEngine, PieceSink, PromptImages, SamplingParams
from rollout_proxy.engines.sampling import Sampled


class Gate(Protocol):
    """The pause gate of a weight update (``engines.gate.PauseGate``)."""

    @property
    def paused(self) -> bool: ...

    async def wait(self, *, queued: bool = True) -> None:
        """Return once the engines take turns (at once while they do); bounded (``FleetPaused``)."""
        ...


class EngineRouter(Protocol):
    @property
    def gate(self) -> Gate: ...

    @property
    def retries(self) -> int:
        """How many engines a step may fail on before its failure is the client's."""
        ...

    def route(self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()) -> GenerationEngine:
        """An engine to render with: ``sticky`` while it serves, else another (not in ``exclude``)."""
        ...

    async def route_now(
        self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()
    ) -> GenerationEngine:
        """``route``, probing now the engines that are down when none can render."""
        ...

    def pick(self) -> GenerationEngine | None:
        """The engine for a new session (None when none answers)."""
        ...

    def report_failure(self, engine: GenerationEngine, error: BaseException, *, what: str = "call") -> None:
        """A step on ``engine`` failed: counted against it if the failure says something about it."""
        ...

    async def sample(
        self,
        engine: GenerationEngine,
        prompt: np.ndarray,
        params: SamplingParams,
        *,
        sink: PieceSink | None = None,
        policy: str | None = None,
        images: PromptImages | None = None,
    ) -> Sampled:
        """One turn's engine call, ``engine`` first, failing over (``engines.sampling``); ``policy``: the
        session's (``engines.policies``; None: the base); ``images``: the prompt's, if it holds any."""
        ...

    def check_policy(self, policy: str) -> None:
        """A new session's policy: ``UnknownPolicy`` when no registry knows it, ``PolicyUnavailable`` when no
        engine serves it now (both in words)."""
        ...
