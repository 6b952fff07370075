"""Putting new weights on the fleet: pause through the proxy, reload every paused vLLM, resume at the next version;
or, for a LoRA policy, publish the adapter as the policy's next version with no pause (``PolicyPublisher``).

The proxy's admin API does the fleet's part (``POST /v1/admin/pause``: its gate closes and every
healthy engine is paused; ``POST /v1/admin/resume``: every paused engine gets the new version
and resumes); the engine client (``engines.vllm_http.VLLMEngine``) loads the checkpoint into each
paused engine in between with vLLM's own ``POST /collective_rpc`` ``reload_weights``
(``VLLM_SERVER_DEV_MODE=1``). If any reload fails the update stops with the fleet paused: an
engine still holding the old weights must not be resumed at the new version (reload it, or
remove it with ``DELETE /v1/admin/engines?url=``, then resume); the proxy's ``--pause-wait``
bounds the turns queued meanwhile.

A LoRA policy's version is the policy's own (``GET /v1/admin/policies/{name}``): ``PolicyPublisher``
registers the policy with its first adapter (``POST /v1/admin/policies {"name", "path"}``) and publishes each
next one (``POST /v1/admin/policies/{name}/versions {"path"}``); every engine loads it beside the version
before, which keeps the calls in flight, so nothing pauses. A publish no engine takes is the proxy's 4xx/5xx
(``ProxyRequestError``) and changes nothing. ``in_use`` says which versions an engine still has loaded or a
call still holds: their directories must stay (an engine re-reads an evicted adapter from its directory, and
dies if it is gone).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import ProxyError
from rollout_proxy.sdk.transport import ProxyClient, ProxyRequestError


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

    def timing(self) -> dict[str, float]:
        return {"pause_s": self.pause_s, "reload_s": self.reload_s, "resume_s": self.resume_s}

    def problems(self) -> list[str]:
        if not self.paused_failed:
            return []
        return [f"{len(self.paused_failed)} engine(s) did not pause (left out until re-admitted)"]


@dataclass(frozen=True, slots=True)
class AdapterPublish:
    """One adapter version published: the engines that loaded it, those drained for the policy (and why)."""

    previous: int
    version: int
    reloaded: list[str]  # the engines that loaded it
    publish_s: float
    failed: list[dict[str, Any]] = field(default_factory=list)  # {"url", "error"} of the engines that did not

    #: nothing pauses: calls in flight finish on the version before, new ones take this one
    paused_s: float = 0.0

    def timing(self) -> dict[str, float]:
        return {"pause_s": 0.0, "publish_s": self.publish_s, "resume_s": 0.0}

    def problems(self) -> list[str]:
        return [f"{engine['url']} did not load it, drained for the policy: {engine['error']}" for engine in self.failed]


class FleetDriver:
    """Drives the proxy's fleet through weight updates (the admin key's calls)."""

    #: the policy whose weights it updates (the base model's)
    policy = "base"

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

    async def in_use(self) -> set[int] | None:
        """The versions besides the fleet's that its engines still need the files of: none (a reload copies
        the weights into the engine)."""
        return set()


class PolicyPublisher:
    """Publishes a LoRA policy's versions through the proxy's policies API (the admin key's calls)."""

    def __init__(self, proxy: ProxyClient, policy: str, *, engine_timeout: float = 30.0) -> None:
        """``engine_timeout`` bounds each engine's answer when ``in_use`` asks which adapters it has."""
        self.proxy = proxy
        self.policy = policy
        self.engine_timeout = engine_timeout
        self._served = re.compile(rf"^{re.escape(policy)}@v(\d+)$")

    async def view(self) -> dict[str, Any] | None:
        """``GET /v1/admin/policies/{name}`` (None: the proxy has no such policy)."""
        try:
            return dict(
                await self.proxy.aget(f"/v1/admin/policies/{self.policy}", what=f"reading policy {self.policy}")
            )
        except ProxyRequestError as exc:
            if exc.status == 404:
                return None
            raise

    async def version(self) -> int:
        """The policy's version now (0: not registered, or no version published yet)."""
        view = await self.view()
        return int(view.get("version") or 0) if view is not None else 0

    async def current_path(self) -> str | None:
        """The directory of the policy's version now (None: it has none)."""
        view = await self.view()
        return view.get("path") if view is not None else None

    async def update(self, weights: Path | None) -> AdapterPublish:
        """Publish the adapter in ``weights`` as the policy's next version (the first registers the policy)."""
        if weights is None:
            raise ValueError("a LoRA policy's version changes only with an adapter")
        started = time.monotonic()
        previous = await self.version()
        if not weights.is_absolute():
            raise ValueError(f"an adapter is published by its absolute path (the engines read it): {weights}")
        path = str(weights)
        if previous == 0:
            view = await self.proxy.apost(
                "/v1/admin/policies", {"name": self.policy, "path": path}, what=f"registering policy {self.policy}"
            )
            version = int(view["version"])
            served = f"{self.policy}@v{version}"
            engines = [
                {"url": e["url"], "ok": e.get("served_name") == served, "error": e.get("drained")}
                for e in view["engines"]
            ]
        else:
            answer = await self.proxy.apost(
                f"/v1/admin/policies/{self.policy}/versions",
                {"path": path},
                what=f"publishing {path} as policy {self.policy}'s next version",
            )
            version, engines = int(answer["version"]), answer["engines"]
        return AdapterPublish(
            previous=previous,
            version=version,
            reloaded=[e["url"] for e in engines if e["ok"]],
            publish_s=time.monotonic() - started,
            failed=[{"url": e["url"], "error": e["error"]} for e in engines if not e["ok"]],
        )

    async def in_use(self) -> set[int] | None:
        """The policy's versions some engine still has loaded (its ``/v1/models``) or serves or a call of the
        proxy still holds (the policy's view); None when that cannot be known now (the proxy or an engine
        did not answer): then no version's files may go."""
        try:
            view = await self.view()
        except (ProxyError, ProxyRequestError, OSError):
            return None
        if view is None:
            return None
        names: set[str] = set()
        for engine in view["engines"]:
            names.update(filter(None, [engine.get("served_name"), *engine.get("in_use", {})]))
            client = VLLMEngine(engine["url"], request_timeout=self.engine_timeout)
            try:
                names.update(card.name for card in await client.adapters())
            except (ProxyError, OSError):
                return None  # down or hung: it may still have any version loaded
            finally:
                await client.close()
        return {int(found.group(1)) for name in names if (found := self._served.match(name))}
