"""The old name of the engine fleet (``engines.fleet.Fleet``), for code not moved yet."""

from __future__ import annotations

from rollout_proxy.engines.fleet import Fleet as EnginePool

__all__ = ["EnginePool"]
