"""The fleet's shared state, for several workers (``serve --workers N``) or proxies on one Redis.

Each worker keeps its own fleet (probes, breakers, calls in flight); what an admin call decides
is shared through the store (``get_fleet_state``/``put_fleet_state``, one key): paused (and the
mode), the policy version, a resume's coming version, and the engines added or removed by URL.
The worker that answers the admin call writes it before it answers; every worker reads it every
``follow_interval`` seconds (one GET, in the fleet's background) and follows:

- paused: its gate closes (new turns queue there), its healthy engines are shown paused;
- a resume to version v announced (``next_version``): its engines' epochs move (a call in flight
  now is regenerated rather than credited to the old weights), and an engine that reports v at
  ``/weight_info`` is not stale;
- resumed at v: v is its version and its paused engines', its gate opens (its queue goes), and
  every engine is probed at once;
- an engine added (probed in the background) or removed (drained);
- the LoRA policies (``engines.policies``): each policy's version, which engines serve the base
  through the zero adapter, which are drained for a policy.

The windows, made safe by waiting them out (``settle``: two poll intervals and a margin): a pause
writes ``paused``, then waits, so every worker's gate is closed before the engines are paused; a
resume to a new version writes its intent, then waits, before the engines' version changes. A
worker whose read fails keeps what it has (logged) and reads again at the next poll. Two admin
calls on two workers at once: the last write wins (a trainer pauses and resumes one at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from rollout_proxy.engines.health import EngineState
from rollout_proxy.errors import ProxyError, StoreUnavailable

if TYPE_CHECKING:
    from rollout_proxy.engines.fleet import Fleet

log = structlog.get_logger(__name__)

#: Added to two poll intervals: a worker's read time and its event loop's lag, on a busy host.
SETTLE_MARGIN = 0.5


class FleetStateStore(Protocol):
    async def get_fleet_state(self) -> dict[str, Any] | None: ...

    async def put_fleet_state(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class SharedState:
    version: int
    paused: bool = False
    mode: str | None = None
    next_version: int | None = None  # a resume to this version is under way
    added: tuple[str, ...] = ()  # engines added by URL (admin API), beyond each worker's own list
    removed: tuple[str, ...] = ()  # engines removed (admin API)
    #: the LoRA policies (``engines.policies.Policies.shared``): versions, zero adapters, drained engines
    policies: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "added": list(self.added), "removed": list(self.removed)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SharedState:
        """Raises ``ValueError`` for a record this version cannot read (another writer's, or a broken one)."""
        try:
            version, next_version = raw["version"], raw.get("next_version")
            state = cls(
                version=version,
                paused=raw.get("paused", False),
                mode=raw.get("mode"),
                next_version=next_version,
                added=tuple(raw.get("added", ())),
                removed=tuple(raw.get("removed", ())),
                policies=raw.get("policies"),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"unreadable fleet state: {exc}") from None
        if not isinstance(version, int) or not (next_version is None or isinstance(next_version, int)):
            raise ValueError("unreadable fleet state: its versions are not integers")
        if not isinstance(state.paused, bool) or not all(isinstance(url, str) for url in state.added + state.removed):
            raise ValueError("unreadable fleet state: wrong types")
        if state.policies is not None and not isinstance(state.policies, Mapping):
            raise ValueError("unreadable fleet state: its policies are not a mapping")
        return state


def settle_time(fleet: Fleet) -> float:
    """How long until every worker has read what was just written."""
    return 2 * fleet.settings.follow_interval + SETTLE_MARGIN


async def settle(fleet: Fleet) -> None:
    if fleet.shared is not None:
        await asyncio.sleep(settle_time(fleet))


async def read(fleet: Fleet) -> SharedState | None:
    """The shared state (None: none is shared, or never written). Store failures raise."""
    if fleet.shared is None:
        return None
    try:
        async with asyncio.timeout(max(1.0, fleet.settings.health_timeout)):
            raw = await fleet.shared.get_fleet_state()
    except TimeoutError:
        raise StoreUnavailable("the store did not answer for the fleet state in time") from None
    return None if raw is None else SharedState.from_json(raw)


async def publish(fleet: Fleet, **changes: Any) -> None:
    """Write the shared state with ``changes`` (to what it holds, else to this worker's view); a no-op when
    nothing is shared. Store failures raise (``StoreUnavailable``): the caller has changed nothing yet."""
    if fleet.shared is None:
        return
    try:
        current = await read(fleet)
    except ValueError:
        current = None  # overwritten below with a readable one
    if current is None:
        current = SharedState(version=fleet.version, paused=fleet.paused)
    await fleet.shared.put_fleet_state(dataclasses.replace(current, **changes).to_json())


async def follow_forever(fleet: Fleet) -> None:
    """Poll the shared state and follow it (the fleet's background task while a store is shared)."""
    failing = False
    while True:
        await asyncio.sleep(fleet.settings.follow_interval)
        try:
            await follow(fleet)
        except (ProxyError, ValueError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a cancel that surfaced as the store call's error
                raise asyncio.CancelledError from exc
            if not failing:
                log.warning("fleet_state_unreadable", error=str(exc))
            failing = True
            continue
        if failing:
            log.info("fleet_state_readable")
        failing = False


async def follow(fleet: Fleet, state: SharedState | None = None) -> None:
    """Make this worker's fleet agree with ``state`` (read now when not given). Between this worker's own
    pauses and resumes, never during one, and read under the same lock: a state read before one of them
    ended would undo it."""
    async with fleet.control_lock:
        if state is None:
            state = await read(fleet)
        if state is not None:
            _follow_version(fleet, state)
            await _follow_engines(fleet, state)
            if state.policies is not None and fleet.policies is not None:
                fleet.policies.follow(state.policies)


def _follow_version(fleet: Fleet, state: SharedState) -> None:
    members = list(fleet.members.values())
    if state.paused:
        if state.next_version is not None and state.next_version != fleet.next_version:
            for member in members:
                member.epoch += 1  # a call in flight now may end under the new weights
        fleet.next_version = state.next_version
        if not fleet.gate.paused:
            fleet.gate.close()
            for member in members:
                if member.state is EngineState.HEALTHY:
                    fleet.set_state(member, EngineState.PAUSED)
            log.info("fleet_followed_pause", mode=state.mode, policy_version=fleet.version)
        return
    fleet.next_version = None
    if not fleet.gate.paused and state.version == fleet.version:
        return
    previous, fleet.version = fleet.version, state.version
    for member in members:
        if member.state is EngineState.PAUSED:
            if member.version != state.version:
                member.version = state.version
                member.epoch += 1
            fleet.set_state(member, EngineState.HEALTHY)
        elif member.state is EngineState.HEALTHY and member.version != state.version:
            fleet.set_state(member, EngineState.STALE, f"its weights are {member.version}, the fleet's {state.version}")
        member.wake.set()  # probed now: one that reports the new version is healthy at once
    paused_for = fleet.gate.open()
    fleet.publish()
    log.info("fleet_followed_resume", policy_version=state.version, was=previous, paused_s=round(paused_for, 3))


async def _follow_engines(fleet: Fleet, state: SharedState) -> None:
    for url in state.added:
        if url not in fleet.members and url not in state.removed:
            with contextlib.suppress(ProxyError):  # this worker cannot add by URL: logged by ``add``
                await fleet.add(url, wait=False)
    for url in state.removed:
        member = fleet.members.get(url)
        if member is not None and not member.draining:
            await fleet.drain(member)
