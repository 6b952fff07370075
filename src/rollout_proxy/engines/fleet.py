"""The engine fleet: who is healthy, at which policy version, and where a turn goes.

Every engine is probed in the background (``GET /health``, ``GET /weight_info``, short
timeouts) and judged by its calls (refused, reset, 5xx, timeouts: see ``health``). Routing
is sticky-least-loaded: a session stays on its engine while that engine is healthy (prefix
cache, ``routed_experts_prompt_start``), else it goes to the least-loaded healthy engine;
health comes first, so an engine with nothing in flight because it is dead gets nothing.
When no engine is healthy, a turn probes the starting and unhealthy ones at once (``available``)
rather than fail while one that is back waits for its next probe.

Versions: the fleet has one policy version (the trainer's integer step). At start it is
the highest integer the engines report in ``/weight_info``, else ``--policy-version``;
vLLM's ``"default"`` (no update yet) means ``--policy-version``. After that only a resume
(``control.resume``) changes it. An engine at another version is *stale*: it gets no turn
until its version is the fleet's (it reports it, or an operator re-admits it with
``readmit(url, policy_version)`` after loading the weights). An engine without
``/weight_info`` is taken at the version the fleet last set on it, and, once it was
unreachable, at ``--policy-version`` (it may have restarted).

A turn's call, with failover and pause handling, is ``sampling.sample``; pause and resume
are ``control``. With a shared store (Redis: several workers or proxies), paused, the version and
the engines added or removed are shared by every fleet on it (``shared``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from rollout_proxy.engines import sampling
from rollout_proxy.engines import shared as sharing
from rollout_proxy.engines.base import Engine, EngineInfo, GenerationEngine, PieceSink, PromptImages, SamplingParams
from rollout_proxy.engines.gate import PauseGate
from rollout_proxy.engines.health import (
    Breaker,
    EngineState,
    counts_against,
    describe,
    is_definite,
    is_timeout,
    parse_version,
)
from rollout_proxy.engines.member import Member
from rollout_proxy.errors import EngineError, EngineUnavailable, InvalidRequest, NotFound, ProxyError, UnknownPolicy
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import BASE_POLICY
from rollout_proxy.settings import from_setting

if TYPE_CHECKING:
    from rollout_proxy.engines.policies import Policies

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """The fleet's part of the server's settings (``app.fleet_settings``), their defaults the settings' own."""

    policy_version: int = from_setting("policy_version")
    probe_interval: float = from_setting("engine_probe_interval")
    health_timeout: float = from_setting("engine_health_timeout")
    hang_timeout: float = from_setting(
        "engine_hang_timeout"
    )  # ``_judge``: nothing heard this long while probes time out
    failure_threshold: int = from_setting("engine_failure_threshold")
    backoff_max: float = from_setting("engine_backoff_max")
    max_inflight: int = from_setting("engine_max_inflight")
    call_timeout: float = from_setting("engine_timeout")  # one engine call, not counting time paused
    retries: int = from_setting("engine_retries")
    turn_deadline: float = from_setting("turn_deadline")
    pause_queue: int = from_setting("pause_queue")
    pause_wait: float = from_setting("pause_wait")
    control_timeout: float = from_setting("engine_control_timeout")  # a wait-mode pause: call_timeout
    abort_policy: str = from_setting("abort_policy")
    follow_interval: float = 0.25  # seconds between reads of the shared fleet state (a shared store only)


ABORT_POLICIES = ("continue", "regenerate")
#: How long a turn that finds no healthy engine waits for the probes it started (``Fleet.available``).
ON_DEMAND_PROBE_WAIT = 0.25


class Fleet:
    def __init__(
        self,
        engines: Sequence[Engine],
        settings: FleetSettings | None = None,
        *,
        metrics: Metrics | None = None,
        connect: Callable[[str], Engine] | None = None,
        owned: bool = True,
        shared: sharing.FleetStateStore | None = None,
    ) -> None:
        """``connect`` makes a client for an engine added by URL; ``owned``: whether ``close`` closes ``engines``;
        ``shared``: the store whose fleet state this fleet writes and follows (other workers share it)."""
        self.settings = settings or FleetSettings()
        if self.settings.abort_policy not in ABORT_POLICIES:
            raise ValueError(f"abort policy must be one of {ABORT_POLICIES}, not {self.settings.abort_policy!r}")
        self.metrics = metrics or Metrics()
        self._connect = connect
        self.members: dict[str, Member] = {}
        for engine in engines:
            if engine.url in self.members:
                raise ValueError(f"engine {engine.url} is listed twice")
            self.members[engine.url] = self._member(engine, owned=owned)
        self.version = self.settings.policy_version
        self.shared = shared
        self.next_version: int | None = None  # a resume to this version is under way (``shared``)
        self.gate = PauseGate(
            max_waiting=self.settings.pause_queue, max_wait=self.settings.pause_wait, on_change=self.publish
        )
        self.control_lock = asyncio.Lock()  # one pause, resume or admission at a time
        #: called as ``listener(member, was, now)`` at each change of an engine's state (``engines.policies``)
        self.state_listeners: list[Callable[[Member, EngineState, EngineState], None]] = []
        #: the LoRA policies served on this fleet, once a registry attached itself (``engines.policies``)
        self.policies: Policies | None = None
        self._rotation = itertools.count()
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.publish()

    def _member(self, engine: Engine, *, owned: bool) -> Member:
        s = self.settings
        breaker = Breaker(threshold=s.failure_threshold, base_delay=s.probe_interval, max_delay=s.backoff_max)
        return Member(client=engine, breaker=breaker, limit=asyncio.Semaphore(s.max_inflight), owned=owned)

    # -- life -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe every engine once (bounded by the probe timeouts), set the fleet's version, start probing."""
        members = list(self.members.values())
        reports = await asyncio.gather(*(self._fetch(member) for member in members))
        explicit = []
        for report in reports:
            if isinstance(report, str) and report != "default":
                with contextlib.suppress(
                    EngineError
                ):  # a non-integer is that engine's problem (stale), not the fleet's
                    explicit.append(parse_version(report, default=self.settings.policy_version))
        self.version = max(explicit) if explicit else self.settings.policy_version
        state = await self._shared_state()
        if state is not None:
            self.version = state.version  # the last admin decision, shared by every worker
        for member, report in zip(members, reports, strict=True):
            self._judge(member, report)
            self._start_prober(member)
        self._started = True
        if state is not None:
            await sharing.follow(self, state)
        if self.shared is not None:
            task = asyncio.get_running_loop().create_task(sharing.follow_forever(self), name="follow fleet state")
            self._tasks.add(task)
        self.publish()
        log.info("fleet_started", policy_version=self.version, engines={m.url: m.state.value for m in members})

    async def _shared_state(self) -> sharing.SharedState | None:
        """The shared state at start; an unreadable one is logged and followed later (``follow_forever``)."""
        try:
            return await sharing.read(self)
        except (ProxyError, ValueError) as exc:  # the store's failure must not stop the start
            log.warning("fleet_state_unreadable", error=str(exc))
        return None

    async def close(self) -> None:
        tasks = list(self._tasks)  # first: the follower may add engines
        for task in tasks:
            task.cancel()
        await _bounded_wait(tasks)
        for member in self.members.values():
            await self._stop_prober(member)
        for member in self.members.values():
            if member.owned:
                await member.client.close()

    # -- views ------------------------------------------------------------------------------------

    @property
    def engines(self) -> list[Engine]:
        return [member.client for member in self.members.values()]

    @property
    def paused(self) -> bool:
        return self.gate.paused

    @property
    def retries(self) -> int:
        return self.settings.retries

    def view(self) -> dict[str, object]:
        return {
            "policy_version": self.version,
            "paused": self.paused,
            "engines": [member.view() for member in self.members.values()],
        }

    def count(self, state: EngineState) -> int:
        return sum(1 for member in self.members.values() if member.state is state and not member.draining)

    def ready(self) -> bool:
        """Turns can be answered: an engine is healthy, or paused for a weight update (turns queue)."""
        return self.count(EngineState.HEALTHY) > 0 or (self.paused and self.count(EngineState.PAUSED) > 0)

    async def models(self) -> list[EngineInfo]:
        """The model cards of the engines that answer (one per engine; an engine that fails is left out)."""
        infos = []
        for member in self.members.values():
            if member.state in (EngineState.STARTING, EngineState.UNHEALTHY):
                continue
            with contextlib.suppress(EngineError, EngineUnavailable, TimeoutError):
                async with asyncio.timeout(self.settings.health_timeout * 4):
                    infos.append(await member.client.info())
        return infos

    # -- routing ----------------------------------------------------------------------------------

    def choose(self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()) -> Member | None:
        """Sticky-least-loaded among the routable engines: ``sticky`` while it is routable, else the one with
        the fewest calls in flight (ties taken in turn, so a burst of new sessions spreads)."""
        candidates = [member for member in self.members.values() if member.routable and member.url not in exclude]
        if not candidates:
            return None
        for member in candidates:
            if member.url == sticky:
                return member
        shift = next(self._rotation)
        order = {member.url: (index - shift) % len(candidates) for index, member in enumerate(candidates)}
        return min(candidates, key=lambda member: (member.in_flight, order[member.url]))

    async def available(self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()) -> Member:
        """``choose``, and when no engine is routable, probe now each one that is starting or unhealthy
        (``probe_unanswered``, ≤ ``ON_DEMAND_PROBE_WAIT``) and choose again: an engine whose last probe timed
        out on a busy host, or that just came back, takes the turn at once instead of after its backoff."""
        member = self.choose(sticky, exclude=exclude)
        if member is None:
            await self.probe_unanswered(exclude=exclude)
            member = self.choose(sticky, exclude=exclude)
        if member is None:
            raise self.unavailable()
        return member

    async def probe_unanswered(self, *, exclude: frozenset[str] | set[str] = frozenset()) -> None:
        """Probe now every engine that is starting or unhealthy (one probe each, shared by whoever asks),
        waiting at most ``ON_DEMAND_PROBE_WAIT``: an engine that is up answers in milliseconds, and one that
        hangs must not hold the turn (its probe goes on in the background and is judged as usual)."""
        waiting = [
            member
            for member in self.members.values()
            if member.state in (EngineState.STARTING, EngineState.UNHEALTHY)
            and not member.draining
            and member.url not in exclude
        ]
        if waiting:
            await asyncio.wait([self._probe_task(member) for member in waiting], timeout=ON_DEMAND_PROBE_WAIT)

    def any_routable(self, *, exclude: frozenset[str] | set[str] = frozenset()) -> bool:
        return any(member.routable and member.url not in exclude for member in self.members.values())

    def route(self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()) -> Engine:
        """An engine to render with (``/tokenize``): routable, or paused (rendering is no generation)."""
        member = self.choose(sticky, exclude=exclude)
        if member is None:
            paused = [
                m
                for m in self.members.values()
                if m.state is EngineState.PAUSED and not m.draining and m.url not in exclude
            ]
            member = next((m for m in paused if m.url == sticky), paused[0] if paused else None)
        if member is None:
            raise self.unavailable()
        return member.client

    async def route_now(self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()) -> Engine:
        """``route``, probing now the engines that are starting or unhealthy when none can render."""
        try:
            return self.route(sticky, exclude=exclude)
        except EngineUnavailable:
            await self.probe_unanswered(exclude=exclude)
        return self.route(sticky, exclude=exclude)

    async def sample(
        self,
        engine: GenerationEngine,
        prompt: np.ndarray,
        params: SamplingParams,
        *,
        sink: PieceSink | None = None,
        policy: str | None = None,
        images: PromptImages | None = None,
    ) -> sampling.Sampled:
        """One turn's engine call through this fleet (``engines.sampling``: failover, pauses, aborted turns,
        the ``policy`` that samples, the prompt's ``images``)."""
        return await sampling.sample(self, engine, prompt, params, sink=sink, policy=policy, images=images)

    def check_policy(self, policy: str) -> None:
        registry = self.policies
        if registry is None:  # no registry: the base alone
            if policy != BASE_POLICY:
                raise UnknownPolicy(f"no policy {policy!r} on this proxy (its policies: {BASE_POLICY})", param="policy")
            return
        registry.require(policy)
        if policy != BASE_POLICY and registry.unserved(policy) >= set(self.members):
            raise registry.unavailable(policy)

    def get(self, sticky: str | None) -> Engine:
        """The session's engine while it serves, else another (``route``)."""
        return self.route(sticky)

    def pick(self) -> Engine | None:
        """The engine for a new session (None when none answers: its first turn routes again)."""
        try:
            return self.route(None)
        except EngineUnavailable:
            return None

    def unavailable(self) -> EngineUnavailable:
        states = ", ".join(
            f"{count} {state.value}"
            for state in EngineState
            if (count := sum(1 for m in self.members.values() if m.shown_state is state))
        )
        return EngineUnavailable(
            f"no engine can take this turn now ({states or 'no engines'})",
            retry_after=max(1.0, self.settings.probe_interval),
        )

    # -- outcomes ---------------------------------------------------------------------------------

    def member_of(self, engine: GenerationEngine) -> Member | None:
        member = self.members.get(engine.url)
        return member if member is not None and member.client is engine else None

    def report_failure(self, engine: GenerationEngine, error: BaseException, *, what: str = "call") -> None:
        """A call failed: count it against the engine if it says something about the engine."""
        member = self.member_of(engine)
        if member is None or not counts_against(error):
            return
        reason = f"{what} failed: {describe(error)}"
        self.metrics.inc("engine_call_failures_total", kind=type(error).__name__)
        member.last_error = reason
        if member.breaker.failed(definite=is_definite(error), by_call=True):
            self.mark_down(member, reason)

    def report_success(self, engine: GenerationEngine) -> None:
        member = self.member_of(engine)
        if member is not None:
            member.heard()
            if member.state is EngineState.HEALTHY:
                member.breaker.succeeded()

    def mark_down(self, member: Member, reason: str) -> None:
        """Breaker open: no turns, re-probed with backoff; calls in flight on it fail over now."""
        member.breaker.trip()
        member.last_error = reason
        if member.state is EngineState.UNHEALTHY:
            return
        self.set_state(member, EngineState.UNHEALTHY, reason)
        if not member.reports_version:
            member.version = None  # back from the dead, it may have restarted: --policy-version until set
        member.declare_down()

    def set_state(self, member: Member, state: EngineState, reason: str | None = None) -> None:
        if member.state is state:
            return
        before, member.state = member.state, state
        if state is EngineState.HEALTHY:
            member.last_error = None
        elif reason is not None:
            member.last_error = reason
        event = log.warning if state in (EngineState.UNHEALTHY, EngineState.STALE) else log.info
        event(
            "engine_state",
            engine=member.url,
            state=state.value,
            was=before.value,
            policy_version=member.version,
            reason=reason,
        )
        self.metrics.inc("engine_state_changes_total", state=state.value)
        for listener in self.state_listeners:
            listener(member, before, state)
        self.publish()

    def publish(self) -> None:
        for state in EngineState:
            self.metrics.set(
                "engines", sum(1 for m in self.members.values() if m.shown_state is state), state=state.value
            )
        self.metrics.set("policy_version", self.version)
        self.metrics.set("engines_paused", 1.0 if self.gate.paused else 0.0)
        self.metrics.set("paused_turns", self.gate.waiting)

    # -- probing ----------------------------------------------------------------------------------

    async def _fetch(self, member: Member) -> str | BaseException | None:
        """One probe: health, then the weight version: what it reported, or why not."""
        try:
            async with asyncio.timeout(self.settings.health_timeout * 3):
                await member.client.health()
                reported = await member.client.weight_version()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of a probe is the engine's: judged below, never raised
            return exc
        return reported

    def _judge(self, member: Member, report: str | BaseException | None) -> None:
        """Apply one probe's result to the engine's state."""
        if isinstance(report, BaseException):
            reason = f"probe failed: {describe(report)}"
            member.last_error = reason
            definite = is_definite(report)
            silent = member.silent_for()
            if not definite and silent < self.settings.hang_timeout:
                return  # a slow probe of an engine heard from lately (a call, a streamed token): busy, not down
            opened = member.breaker.failed(definite=definite)
            hung = is_timeout(report)  # and nothing at all came from it for hang_timeout: it hangs (or is stopped)
            if hung and member.state is not EngineState.STARTING:
                reason = f"hung: nothing came from it for {silent:.1f}s and its probes time out"
            if opened or hung or member.state in (EngineState.STARTING, EngineState.UNHEALTHY):
                self.mark_down(member, reason)
            return
        member.heard()
        member.breaker.probe_succeeded()
        try:
            version = parse_version(report, default=self.settings.policy_version)
        except EngineError as exc:
            member.version, member.reports_version = None, True
            self.set_state(member, EngineState.STALE, exc.message)
            return
        if report is None:  # no /weight_info: the version the fleet last set, or --policy-version after a loss
            version = member.version if member.version is not None else self.settings.policy_version
        if member.state is EngineState.PAUSED:
            if report is not None and version not in (member.version, self.next_version):  # restarted while paused
                member.version = version
                self.set_state(member, EngineState.STALE, "restarted during a pause (its weights are not known)")
            return
        if version != self.version and version == self.next_version and report is not None:
            return  # another worker is resuming the fleet at this version: it is not stale, it is ahead
        member.version, member.reports_version = version, report is not None
        if version == self.version:
            self.set_state(member, EngineState.HEALTHY)
        else:
            self.set_state(
                member,
                EngineState.STALE,
                f"its weights are policy version {version}, the fleet's are {self.version}",
            )

    async def probe(self, member: Member) -> None:
        """Probe and judge it; a probe already running is joined, not doubled (turns may ask at once)."""
        await asyncio.shield(self._probe_task(member))

    def _probe_task(self, member: Member) -> asyncio.Future[None]:
        if member.probing is None or member.probing.done():
            member.probing = asyncio.ensure_future(self._probe_once(member))
        return member.probing

    async def _probe_once(self, member: Member) -> None:
        while True:
            epoch = member.epoch
            report = await self._fetch(member)
            if member.epoch == epoch or isinstance(report, BaseException):
                break
            # its version was set while this probe ran (a resume, a readmit): the version it heard may be the old
            # one, which judged now would make the engine stale at the version it was just given; asked again
        self._judge(member, report)

    def _start_prober(self, member: Member) -> None:
        if member.prober is None:
            member.prober = asyncio.get_running_loop().create_task(
                self._probe_forever(member), name=f"probe {member.url}"
            )

    async def _stop_prober(self, member: Member) -> None:
        tasks = [task for task in (member.prober, member.probing) if task is not None]
        for task in tasks:
            task.cancel()
        await _bounded_wait(tasks)
        member.prober = member.probing = None

    async def _probe_forever(self, member: Member) -> None:
        while True:
            delay = member.breaker.backoff() if member.state is EngineState.UNHEALTHY else self.settings.probe_interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await member.wake.wait()
            member.wake.clear()
            await self.probe(member)

    # -- membership ---------------------------------------------------------------------------------

    def _known(self, url: str) -> Member:
        member = self.members.get(url.rstrip("/"))
        if member is None:
            raise NotFound(f"no engine {url!r} in the fleet", param="url")
        return member

    async def admit(self, url: str, *, policy_version: int | None = None) -> dict[str, object]:
        """``POST /v1/admin/engines``: add the engine (or probe a known one again); with ``policy_version``,
        the operator says those are its weights now (``readmit``). Answers its entry, probed.
        Shared: every worker adds it (``shared``)."""
        member, _ = await self.add(url)
        await self._share_membership(added=member.url)
        if policy_version is not None:
            member = await self.readmit(member.url, policy_version)
        return member.view()

    async def _share_membership(self, *, added: str | None = None, removed: str | None = None) -> None:
        if self.shared is None:
            return
        state = await sharing.read(self)
        now_added = set(state.added) if state is not None else set()
        now_removed = set(state.removed) if state is not None else set()
        if added is not None:
            now_added.add(added)
            now_removed.discard(added)
        if removed is not None:
            now_removed.add(removed)
            now_added.discard(removed)
        await sharing.publish(self, added=tuple(sorted(now_added)), removed=tuple(sorted(now_removed)))

    async def add(self, url: str, *, wait: bool = True) -> tuple[Member, bool]:
        """Add an engine by URL (probed before this answers, unless not ``wait``: then in the background);
        (its member, whether it is new). A known URL is re-probed (and a draining one kept)."""
        url = url.rstrip("/")
        member = self.members.get(url)
        if member is not None:
            member.draining = False
            if wait:
                await self.probe(member)
            self.publish()
            return member, False
        if self._connect is None:
            raise InvalidRequest("this proxy cannot add engines by URL", param="url")
        member = self._member(self._connect(url), owned=True)
        self.members[url] = member
        log.info("engine_added", engine=url)
        if wait:
            await self.probe(member)
        else:
            member.wake.set()  # its prober probes it at once
        if self._started:
            self._start_prober(member)
        self.publish()
        return member, True

    async def readmit(self, url: str, version: int) -> Member:
        """The operator loaded ``version`` into this engine: tell it (where served), resume it if it sits
        paused while the fleet is not, and judge it again (healthy if ``version`` is the fleet's)."""
        member = self._known(url)
        timeout = self.settings.control_timeout
        try:
            await member.client.update_weight_version(str(version), within=timeout)
            if not self.paused and await member.client.is_paused():
                await member.client.resume(within=timeout)
        except (EngineError, EngineUnavailable) as exc:
            self.mark_down(member, f"re-admission failed: {describe(exc)}")
            return member
        member.version = version
        member.epoch += 1
        if member.state is EngineState.PAUSED and not self.paused:
            member.state = EngineState.STALE  # judged again just below
        await self.probe(member)
        if not member.reports_version:
            self._judge(member, None)
        self.publish()
        return member

    async def remove(self, url: str) -> dict[str, object]:
        """Drain the engine (no new turns; calls in flight finish) and remove it once idle.

        Answers its entry: state ``removed`` when it had nothing in flight, else ``draining``.
        Shared: every worker drains it (``shared``)."""
        member = self._known(url)
        await self._share_membership(removed=member.url)
        return await self.drain(member)

    async def drain(self, member: Member) -> dict[str, object]:
        """``remove``, on this fleet only."""
        member.draining = True
        log.info("engine_draining", engine=member.url, in_flight=member.in_flight)
        view = member.view()
        if member.in_flight == 0:
            await self._drop(member)
            view["state"] = "removed"
        else:
            task = asyncio.get_running_loop().create_task(self._drop_when_idle(member), name=f"drain {member.url}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.publish()
        return view

    async def _drop_when_idle(self, member: Member) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.call_timeout + self.settings.pause_wait):
                await member.idle.wait()
        if member.draining and self.members.get(member.url) is member:
            await self._drop(member)

    async def _drop(self, member: Member) -> None:
        self.members.pop(member.url, None)
        member.declare_down()
        await self._stop_prober(member)
        if member.owned:
            await member.client.close()
        log.info("engine_removed", engine=member.url)
        self.publish()


#: How long closing waits for a cancelled background task: a cancel that a library turned into an
#: error of its own (and a loop then swallowed) must not hang the shutdown.
CLOSE_WAIT_S = 5.0


async def _bounded_wait(tasks: Sequence[asyncio.Future[Any]]) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
    for task in pending:
        log.warning("background_task_ignored_cancel", task=repr(task))
    for task in tasks:  # retrieve outcomes so none is reported as "never retrieved"
        if task.done() and not task.cancelled():
            task.exception()
