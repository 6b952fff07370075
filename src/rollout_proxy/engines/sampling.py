"""One turn's engine call through the fleet: failover, deadlines, pauses, aborted turns, versions.

- **Failover.** A call that fails before the engine answered (refused, reset, a 5xx, a
  timeout) is sent again to another engine, at most ``retries`` times and within the turn's
  deadline, invisibly to the client: the prompt is token ids, so any engine takes it as is.
  Nothing of a failed call is kept.
- **Deadlines.** A call may take ``call_timeout`` and the turn's calls together
  ``turn_deadline``, neither counting time the fleet is paused (a call frozen by a keep-mode
  pause must live); the pause itself is bounded by ``pause_wait``.
- **Pauses.** No call leaves while the fleet is paused: the turn waits at the gate first
  (retries and resubmissions too), and a call that got a slot while the gate closed goes back.
- **Aborted turns.** A call cut by an abort-mode pause answers ``finish_reason: "abort"`` with
  the tokens so far. After the resume the turn is *continued* (prompt + those tokens as the
  new prompt, ``max_tokens`` less what was sampled; both parts kept, each with its version)
  or *regenerated* (from the prompt; the partial tokens dropped), per ``abort_policy``. MoE
  engines always regenerate: a continued turn's routing rows would mix two forward passes
  (and so do sessions recording the policy's top-k: only whole calls are kept).
- **Versions.** A call's tokens carry the version of its engine when it was sent. A call during
  which that engine's weights changed (a keep-mode pause resumed under it) cannot say where the
  new weights took over (vLLM's completions do not tell), so it is regenerated too.
- **Policies.** With a registry on the fleet (``engines.policies``), a turn names its ``policy``: each
  call goes to an engine that serves it, names its served name there (held until the call ends, so
  an update never unloads it under the call), and its tokens carry that policy's version. An engine
  that answers it does not have the name (it restarted) is synced again and the call sent again,
  within the retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from rollout_proxy.engines.base import (
    CompletionPiece,
    Engine,
    EngineCompletion,
    GenerationEngine,
    PieceSink,
    PromptImages,
    SamplingParams,
)
from rollout_proxy.engines.gate import Deadline
from rollout_proxy.engines.health import counts_against, describe
from rollout_proxy.engines.member import Member
from rollout_proxy.engines.policies import BASE
from rollout_proxy.engines.vllm_http import ServedModelMissing
from rollout_proxy.errors import EngineTimeout, EngineUnavailable, FleetPaused
from rollout_proxy.records import PolicySpan, merge_spans

if TYPE_CHECKING:  # the fleet calls ``sample`` (``Fleet.sample``)
    from rollout_proxy.engines.fleet import Fleet

log = structlog.get_logger(__name__)

#: A turn aborted (or overtaken by a weight change) more often than this is refused (503):
#: something keeps cutting it, and resubmitting forever would hide that.
MAX_RESUBMISSIONS = 8


def cache_salt(version: int) -> str:
    """vLLM's ``cache_salt`` for a policy version: prefix-cache blocks computed under other weights never match."""
    return f"rollout-proxy-policy-v{version}"


@dataclass(slots=True)
class Sampled:
    completion: EngineCompletion
    engine: Engine  # the engine that answered last
    versions: tuple[PolicySpan, ...]  # over ``completion.output_ids``
    attempts: int = 1


class _Requeue(Exception):
    """The gate closed while this call waited for an engine slot: back to the gate."""


class _WentDown(EngineUnavailable):
    """The engine was declared down while this call was on it (already counted against it)."""


@dataclass(slots=True)
class _Attempt:
    completion: EngineCompletion
    version: int
    straddled: bool  # the engine's weights changed during the call
    policy: str = BASE  # the policy whose served name the call named


@dataclass(slots=True)
class _Kept:
    """Tokens of aborted attempts kept for a continued turn, with their versions."""

    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    spans: list[PolicySpan] = field(default_factory=list)
    nonfinite: int = 0
    count: int = 0

    def add(self, completion: EngineCompletion, version: int, policy: str) -> None:
        n = len(completion.output_ids)
        self.ids.append(completion.output_ids)
        self.logprobs.append(completion.output_logprobs)
        self.text.append(completion.text)
        self.spans.append(PolicySpan(version, self.count, self.count + n, policy))
        self.nonfinite += completion.nonfinite_logprobs
        self.count += n

    def prompt(self, prompt: np.ndarray) -> np.ndarray:
        return np.concatenate([prompt, *self.ids]).astype(np.int32, copy=False) if self.ids else prompt

    def finish(
        self, last: EngineCompletion, version: int, policy: str, prompt: np.ndarray
    ) -> tuple[EngineCompletion, list[PolicySpan]]:
        """The whole turn: kept tokens then ``last``'s; the prompt as the engine reported the original part."""
        last_span = PolicySpan(version, self.count, self.count + len(last.output_ids), policy)
        spans = merge_spans([*self.spans, last_span])
        if not self.ids:
            return last, spans
        reported = last.prompt_ids
        if reported is not None and np.array_equal(reported[len(prompt) :], np.concatenate(self.ids)):
            reported = reported[: len(prompt)]  # else it stays longer than the prompt: the drift check refuses it
        merged = EngineCompletion(
            prompt_ids=reported,
            output_ids=np.concatenate([*self.ids, last.output_ids]).astype(np.int32, copy=False),
            output_logprobs=np.concatenate([*self.logprobs, last.output_logprobs]).astype(np.float32, copy=False),
            text="".join([*self.text, last.text]),
            finish_reason=last.finish_reason,
            nonfinite_logprobs=self.nonfinite + last.nonfinite_logprobs,
            routed_experts=last.routed_experts,
            stop_reason=last.stop_reason,
            image_spans=last.image_spans,
        )
        return merged, spans


async def sample(
    fleet: Fleet,
    engine: GenerationEngine,
    prompt: np.ndarray,
    params: SamplingParams,
    *,
    sink: PieceSink | None = None,
    policy: str | None = None,
    images: PromptImages | None = None,
) -> Sampled:
    """Sample one turn: ``engine`` first (the session's, if it is routable), failing over as the module says.
    With a ``sink``, every call streams its pieces there (``core.streaming`` decides what a retry means).
    ``policy``: the policy that samples (``engines.policies``; None: the base model); ``images``: the prompt's
    (each call sends them; a continued turn's spans stay where they were, in the prompt it extends)."""
    settings = fleet.settings
    registry = fleet.policies
    deadline = Deadline(fleet.gate, settings.turn_deadline)
    kept = _Kept()
    tried: set[str] = set()
    preferred: str | None = engine.url
    failures = resubmissions = attempts = 0
    queued = True
    while True:
        gate = fleet.gate  # a wait at a closed gate is timed (queue_wait_seconds)
        with fleet.metrics.timer("queue_wait_seconds", reason="pause") if gate.paused else contextlib.nullcontext():
            await gate.wait(queued=queued)
        if registry is not None and policy is not None and not registry.registered(policy):
            raise registry.gone(policy)  # retired since the session began (or while this turn waited)
        unserved = registry.unserved(policy) if registry is not None and policy is not None else frozenset()
        try:
            member = await fleet.available(preferred, exclude=tried | unserved)
        except EngineUnavailable as exc:
            if not unserved or registry is None or policy is None:
                raise
            if await registry.wait_synced(settings.control_timeout):
                continue  # an engine that lost its adapters was being loaded again: choose again
            raise registry.unavailable(policy) from exc
        try:
            attempt = await _attempt(
                fleet, member, kept.prompt(prompt), params, kept.count, deadline, sink, policy, images
            )
        except _Requeue:
            continue
        except FleetPaused:
            raise
        except ServedModelMissing as exc:
            if registry is None:
                raise
            if policy is not None and not registry.registered(policy):
                raise registry.gone(policy) from exc  # unloaded as retired: the engine lost nothing
            attempts += 1
            failures += 1
            registry.lost(member.client)  # it restarted without its adapters: base by name, LoRA after a sync
            if failures > settings.retries or deadline.expired:
                raise
            log.warning("engine_lost_served_model", engine=member.url, policy=policy, failures=failures)
            continue
        except Exception as exc:
            attempts += 1
            if not isinstance(exc, _WentDown):
                fleet.report_failure(member.client, exc)
            if not counts_against(exc):
                raise  # the request's fault, or a bug: the same on any engine
            failures += 1
            tried.add(member.url)
            if failures > settings.retries or deadline.expired or not fleet.any_routable(exclude=tried):
                raise  # no other engine to try: the client gets this failure, not a vaguer one
            fleet.metrics.inc("engine_retries_total")
            log.warning("engine_call_retried", engine=member.url, error=describe(exc), failures=failures)
            preferred = None
            continue
        attempts += 1
        fleet.report_success(member.client)
        completion = attempt.completion
        if not (attempt.straddled or completion.finish_reason == "abort"):
            final, spans = kept.finish(completion, attempt.version, attempt.policy, prompt)
            return Sampled(final, member.client, tuple(spans), attempts)
        resubmissions += 1
        if resubmissions > MAX_RESUBMISSIONS:
            raise EngineUnavailable(
                f"this turn was cut short {resubmissions} times (aborted, or the weights changed under it); "
                "try again later",
                retry_after=5.0,
            )
        dense = completion.routed_experts is None and member.client.returns_routing is False
        # top-k rows are not kept across parts either: such a turn is regenerated, as a MoE one is
        joinable = dense and not params.top_logprobs and not attempt.straddled
        handling = "continue" if settings.abort_policy == "continue" and joinable else "regenerate"
        if handling == "continue":
            kept.add(completion, attempt.version, attempt.policy)
        else:
            kept = _Kept()
        reason = "weights_changed" if attempt.straddled else "abort"
        fleet.metrics.inc("abort_resubmissions_total", policy=handling, reason=reason)
        log.info(
            "turn_resubmitted",
            engine=member.url,
            reason=reason,
            policy=handling,
            kept_tokens=kept.count,
            sampled=len(completion.output_ids),
            policy_version=attempt.version,
        )
        if kept.count >= params.max_tokens:  # cut right after its last token: nothing is left to sample
            final, spans = kept.finish(_nothing(completion), attempt.version, attempt.policy, prompt)
            return Sampled(final, member.client, tuple(spans), attempts)
        preferred = member.url
        queued = False  # work in hand: it waits for the resume, but never counts against the queue's bound


def _nothing(completion: EngineCompletion) -> EngineCompletion:
    """No more tokens, and the turn ended by its length."""
    return dataclasses.replace(
        completion,
        output_ids=completion.output_ids[:0],
        output_logprobs=completion.output_logprobs[:0],
        text="",
        finish_reason="length",
        nonfinite_logprobs=0,
    )


async def _attempt(
    fleet: Fleet,
    member: Member,
    prompt: np.ndarray,
    params: SamplingParams,
    kept: int,
    deadline: Deadline,
    sink: PieceSink | None = None,
    policy: str | None = None,
    images: PromptImages | None = None,
) -> _Attempt:
    """One call on ``member``: gated, slotted, watched (its deadline, the engine going down, the pause's bound)."""
    waiting = time.perf_counter()
    async with member.occupied(), member.limit:
        fleet.metrics.observe("queue_wait_seconds", time.perf_counter() - waiting, reason="slot")
        registry = fleet.policies
        if fleet.gate.paused or not member.routable:
            raise _Requeue()
        if registry is not None and policy is not None and member.url in registry.unserved(policy):
            raise _Requeue()  # drained for this policy (or lost it) while this call waited for a slot
        # from here to the send there is no await: a pause that closes the gate after this sees the call
        version = member.version if member.version is not None else fleet.version
        served = registry.hold(policy or BASE, member) if registry is not None else None
        params = dataclasses.replace(
            params,
            max_tokens=params.max_tokens - kept,
            cache_salt=cache_salt(version),
            served_model=served.model if served is not None else params.served_model,
        )
        if served is not None:
            version = served.version
        sent = asyncio.Event()
        member.unsent.add(sent)
        epoch, down = member.epoch, member.down
        call_deadline = Deadline(fleet.gate, fleet.settings.call_timeout)
        # engines without streaming never see the argument; each streamed piece says the engine is alive
        streamed: dict[str, Any] = {"sink": _Heard(sink, member)} if sink is not None else {}
        if images is not None:  # likewise: an engine that takes no images never sees the argument
            streamed["images"] = images
        task = asyncio.ensure_future(member.client.complete(prompt, params, on_sent=sent.set, **streamed))
        try:
            completion = await _watch(fleet, task, down, call_deadline, deadline)
        finally:
            sent.set()  # sent or given up: either way no longer on its way
            member.unsent.discard(sent)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if served is not None and registry is not None:
                registry.release(served)
    return _Attempt(completion, version, straddled=member.epoch != epoch, policy=policy or BASE)


class _Heard:
    """A ``PieceSink`` passing pieces on, each one noted as a sign of the engine's life (``Member.heard``): a
    busy engine whose probes time out while it streams tokens is not hung."""

    def __init__(self, sink: PieceSink, member: Member) -> None:
        self._sink = sink
        self._member = member

    async def begin(self, prompt_ids: np.ndarray) -> None:
        await self._sink.begin(prompt_ids)

    async def piece(self, piece: CompletionPiece) -> None:
        self._member.heard()
        await self._sink.piece(piece)


async def _watch(
    fleet: Fleet, task: asyncio.Future[EngineCompletion], down: asyncio.Event, call: Deadline, turn: Deadline
) -> EngineCompletion:
    gate = fleet.gate
    gone: asyncio.Future[Any] = asyncio.ensure_future(down.wait())
    watched: set[asyncio.Future[Any]] = {task, gone}
    try:
        while True:
            paused_left = gate.max_wait - gate.paused_for() if gate.paused else math.inf
            timeout = min(call.remaining(), turn.remaining(), paused_left)
            if timeout > 0:
                done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if gone in done:
                    raise _WentDown("the engine stopped answering during the call")
            if gate.paused and gate.paused_for() >= gate.max_wait:
                raise FleetPaused(f"this turn waited {gate.max_wait:g}s for the engines to resume", retry_after=5.0)
            if call.expired or turn.expired:
                limit = call.budget if call.remaining() <= turn.remaining() else turn.budget
                raise EngineTimeout(f"the engine did not answer within {limit:g}s")
            # the fleet was paused meanwhile: those seconds do not count; keep waiting
    finally:
        gone.cancel()
