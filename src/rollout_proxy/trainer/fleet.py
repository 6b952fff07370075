"""Putting new weights on the fleet: pause through the proxy, reload every paused vLLM, resume at the next version.

The proxy's admin API does the fleet's part (``POST /v1/admin/pause``: its gate closes and every
healthy engine is paused; ``POST /v1/admin/resume``: every paused engine gets the new version
and resumes); the engine client (``engines.vllm_http.VLLMEngine``) loads the checkpoint into each
paused engine in between with vLLM's own ``POST /collective_rpc`` ``reload_weights``
(``VLLM_SERVER_DEV_MODE=1``). If any reload fails the update stops with the fleet paused: an
engine still holding the old weights must not be resumed at the new version (reload it, or
remove it with ``DELETE /v1/admin/engines?url=``, then resume); the proxy's ``--pause-wait``
bounds the turns queued meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.sdk.transport import ProxyClient


class FleetUpdateFailed(RuntimeError):
    """The new weights did not reach every paused engine; the fleet is left paused."""


@dataclass(frozen=True, slots=True)
class FleetUpdate:
    """One weight update: the version it made, the engines that reloaded, and how long each part took."""

    previous: int
    version: int
    reloaded: list[str]
    pause_s: float
    reload_s: float
    resume_s: float
    paused_failed: list[dict[str, Any]] = field(default_factory=list)  # engines the pause could not pause

    @property
    def paused_s(self) -> float:
        """How long the fleet served nothing."""
        return self.pause_s + self.reload_s + self.resume_s


class FleetDriver:
    """Drives the proxy's fleet through weight updates (the admin key's calls)."""

    def __init__(self, proxy: ProxyClient, *, pause_mode: str = "keep", reload_timeout: float = 600.0) -> None:
        """``reload_timeout`` bounds each engine's reload (~10 s for SmolLM2-135M on 2 busy cores)."""
        self.proxy = proxy
        self.pause_mode = pause_mode
        self.reload_timeout = reload_timeout

    async def version(self) -> int:
        """The fleet's policy version now (``GET /v1/admin/engines``)."""
        fleet = await self.proxy.aget("/v1/admin/engines", what="reading the fleet's policy version")
        return int(fleet["policy_version"])

    async def update(self, weights: Path | None) -> FleetUpdate:
        """Pause, load ``weights`` (an HF checkpoint directory; None: the version alone changes) into every
        paused engine (also those a pause before left paused), resume at the fleet's version + 1."""
        started = time.monotonic()
        paused = await self.proxy.apost("/v1/admin/pause", {"mode": self.pause_mode}, what="pausing the fleet")
        previous = int(paused["policy_version"])
        failed = [engine for engine in paused["engines"] if not engine["ok"]]
        # every engine the resume will resume: the pause answers for the engines it paused, not for those a
        # pause before it left paused (a trainer killed inside its update), which need the weights as much
        fleet = await self.proxy.aget("/v1/admin/engines", what="listing the paused engines")
        engines = [engine["url"] for engine in fleet["engines"] if engine["state"] == "paused"]
        reload_started = time.monotonic()
        if weights is not None:
            await self.reload(engines, weights)
        resume_started = time.monotonic()
        version = previous + 1
        await self.proxy.apost("/v1/admin/resume", {"policy_version": version}, what="resuming the fleet")
        return FleetUpdate(
            previous=previous,
            version=version,
            reloaded=engines if weights is not None else [],
            pause_s=reload_started - started,
            reload_s=resume_started - reload_started,
            resume_s=time.monotonic() - resume_started,
            paused_failed=failed,
        )

    async def reload(self, engine_urls: list[str], weights: Path) -> None:
        """vLLM's reload on every paused engine at once; FleetUpdateFailed (fleet still paused) if one fails."""

        async def reload_one(url: str) -> None:
            engine = VLLMEngine(url, request_timeout=self.reload_timeout + 30.0)
            try:
                await engine.reload_weights(str(weights), within=self.reload_timeout)
            finally:
                await engine.close()

        results = await asyncio.gather(*(reload_one(url) for url in engine_urls), return_exceptions=True)
        errors = {url: str(error) for url, error in zip(engine_urls, results, strict=True) if error is not None}
        if errors:
            raise FleetUpdateFailed(
                f"reloading {weights} failed on {len(errors)} of {len(engine_urls)} engine(s), so the fleet is left "
                f"paused (reload them or remove them with DELETE /v1/admin/engines?url=, then resume): {errors}"
            )
