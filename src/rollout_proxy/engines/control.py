"""Pause and resume the fleet around a weight update (vLLM dev mode's ``/pause`` and ``/resume``).

pause(mode): close the gate (new turns queue in the proxy), let calls already past it leave,
then ``POST /pause?mode=...`` to every healthy engine at once. It answers when every one is
paused, or says which failed and why and marks those unhealthy; each step is bounded
(``control_timeout``; a ``wait`` pause: ``call_timeout``, as it waits for calls in flight).

resume(version): ``POST /update_weight_version`` on every paused engine (where served), the
version in the proxy, ``POST /resume`` on each, then the queue is released. Only engines this
pause paused are resumed at the new version: the trainer loads the new weights into the
engines ``GET /v1/admin/engines`` lists as paused. Any other engine that is not at the new
version is stale until its version is set (see ``Fleet.readmit``).

With a shared store (several workers), both are written there before anything else changes (a
store failure refuses the call) and waited out (``shared.settle``) before the engines are paused
or their version changes, so every worker's gate is closed by then; the resume's outcome is
written before its answer (see ``engines.shared``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from rollout_proxy.engines import shared
from rollout_proxy.engines.base import PauseMode
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.health import EngineState, describe
from rollout_proxy.engines.member import Member
from rollout_proxy.errors import Conflict, EngineUnavailable, StoreUnavailable

log = structlog.get_logger(__name__)

#: How long a pause waits for calls already past the gate to leave (they were admitted before it).
DISPATCH_WAIT = 1.0


#: A refused or reset control call is sent again this many times in all, this far apart.
CONTROL_ATTEMPTS = 3
CONTROL_RETRY_S = 0.5


async def pause(fleet: Fleet, mode: PauseMode) -> dict[str, Any]:
    async with fleet.control_lock:
        if not fleet.gate.paused:
            await shared.publish(fleet, paused=True, mode=mode, next_version=None)
            fleet.gate.close()
            fleet.metrics.inc("pauses_total", mode=mode)
            log.info("fleet_pausing", mode=mode, policy_version=fleet.version)
            await shared.settle(fleet)  # every other worker's gate closes meanwhile
        fleet.publish()
        await _until_sent(fleet)
        within = fleet.settings.call_timeout if mode == "wait" else fleet.settings.control_timeout
        targets = [member for member in fleet.members.values() if member.state is EngineState.HEALTHY]
        results = await asyncio.gather(*(_pause_one(fleet, member, mode, within) for member in targets))
        fleet.publish()
        failed = sum(1 for result in results if not result["ok"])
        log.info("fleet_paused", mode=mode, engines=len(results), failed=failed)
        return _answer(fleet, results)


async def resume(fleet: Fleet, version: int) -> dict[str, Any]:
    async with fleet.control_lock:
        if not fleet.gate.paused:
            if version == fleet.version:
                await shared.publish(fleet, paused=False, mode=None, version=version, next_version=None)
                return _answer(fleet, [])  # a retried resume: already done (and shared again)
            raise Conflict(
                f"the engines are not paused (policy version {fleet.version}): pause them before a weight update",
                param="policy_version",
            )
        if version != fleet.version:
            if fleet.shared is not None:
                await shared.publish(fleet, next_version=version)
            # a probe meeting an engine already set to the new version before its member is has not met an engine
            # restarted during the pause (this worker's probes here; every other worker's through the publish)
            fleet.next_version = version
            if fleet.shared is not None:
                await shared.settle(fleet)  # every other worker expects the new version before an engine reports it
        within = fleet.settings.control_timeout
        targets = [member for member in fleet.members.values() if member.state is EngineState.PAUSED]
        errors = dict(
            zip(
                targets,
                await asyncio.gather(
                    *(
                        _step(
                            fleet,
                            member,
                            "update_weight_version",
                            within,
                            lambda member=member: member.client.update_weight_version(str(version), within=within),
                        )
                        for member in targets
                    )
                ),
                strict=True,
            )
        )
        previous, fleet.version = fleet.version, version
        ready = [member for member in targets if member.state is EngineState.PAUSED]  # not marked down meanwhile
        for member in ready:
            member.version = version
            if version != previous:
                member.epoch += 1  # calls frozen across this resume straddle two versions
        resumed = await asyncio.gather(
            *(
                _step(fleet, member, "resume", within, lambda member=member: member.client.resume(within=within))
                for member in ready
            )
        )
        for member, error in zip(ready, resumed, strict=True):
            errors[member] = error
            if error is None:
                fleet.set_state(member, EngineState.HEALTHY)
        for member in fleet.members.values():
            if member.state is EngineState.HEALTHY and member.version != version:
                reason = f"not paused for the update to {version}: its weights are {member.version}"
                fleet.set_state(member, EngineState.STALE, reason)
        unshared: StoreUnavailable | None = None
        try:
            await shared.publish(fleet, paused=False, mode=None, version=version, next_version=None)
        except StoreUnavailable as exc:  # the engines run: this worker goes on; a retried resume shares it
            unshared = exc
        fleet.next_version = None
        paused_for = fleet.gate.open()
        fleet.metrics.inc("pause_seconds_total", paused_for)
        fleet.metrics.inc("resumes_total")
        fleet.publish()
        log.info("fleet_resumed", policy_version=version, was=previous, paused_s=round(paused_for, 3))
        if unshared is not None:
            raise unshared
        return _answer(fleet, [_result(member, errors[member]) for member in targets])


async def _until_sent(fleet: Fleet) -> None:
    """Let calls admitted before the gate closed reach their engine first (bounded)."""
    waiting = [
        asyncio.ensure_future(sent.wait())
        for member in fleet.members.values()
        for sent in member.unsent
        if not sent.is_set()
    ]
    if waiting:
        await asyncio.wait(waiting, timeout=DISPATCH_WAIT)
        for future in waiting:
            future.cancel()


def _result(member: Member, error: str | None = None) -> dict[str, Any]:
    return {**member.view(), "ok": error is None, "error": error}


async def _step(fleet: Fleet, member: Member, what: str, within: float, call: Any) -> str | None:
    """Run one control call (``call()`` makes it), bounded; on failure mark the engine down and say why.

    The calls are idempotent, so a refused or reset one is sent again (a vLLM under a pause has been
    seen to reset a connection once), within the same bound."""
    try:
        async with asyncio.timeout(within + 1.0):
            for attempt in range(CONTROL_ATTEMPTS):
                try:
                    await call()
                    break
                except EngineUnavailable:
                    if attempt == CONTROL_ATTEMPTS - 1:
                        raise
                    await asyncio.sleep(CONTROL_RETRY_S)
    except Exception as exc:  # whatever the engine did, the step failed for this engine alone
        reason = f"{what} failed: {describe(exc)}"
        fleet.mark_down(member, reason)
        return reason
    return None


async def _pause_one(fleet: Fleet, member: Member, mode: PauseMode, within: float) -> dict[str, Any]:
    error = await _step(fleet, member, f"pause ({mode})", within, lambda: member.client.pause(mode, within=within))
    if error is None:
        fleet.set_state(member, EngineState.PAUSED)
    return _result(member, error)


def _answer(fleet: Fleet, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "policy_version": fleet.version,
        "paused": fleet.paused,
        "failed": sum(1 for result in results if not result["ok"]),
        "engines": results,
    }
