"""Extending the response tree: one generated turn, or one batch of injected messages.

This is the heart of the one rule: the new prompt is the parent's exact tokens plus
bridge tokens for the new messages; the engine is driven with token ids and what it
sampled is stored as it came. The APIs (``core.turn_service``'s placements: chat, responses, the
Messages API, session messages) only decide *which* node is the parent and *which* messages are new
(a ``Placement``).

A generated turn is three steps, each small: ``prepare`` (engine, bridge tokens, the
whole prompt, sampling settings), ``sample`` (the engine call through the fleet: failover,
pauses, aborted turns; checked), ``record`` (parse the view, build the node with the policy
version of every sampled token, store it once).

While the fleet is paused for a weight update a new turn waits before it touches an engine
(bounded: ``FleetPaused``). Rendering that fails because its engine failed is done again on
another engine; the session follows the engine its turn ended on (written with the turn's node).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import structlog

from rollout_proxy import tracing
from rollout_proxy.core.rendering import Renderers
from rollout_proxy.core.tree import Placement, SamplePlacement, node_entries
from rollout_proxy.core.turn_routing import align_routing
from rollout_proxy.engines.base import EngineInfo, GenerationEngine, PieceSink, PromptImages, SamplingParams
from rollout_proxy.engines.router import EngineRouter
from rollout_proxy.engines.sampling import Sampled
from rollout_proxy.errors import (
    ContextLengthExceeded,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    ProxyError,
    SessionNotFound,
)
from rollout_proxy.ids import new_response_id
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import BASE_POLICY, ImageSpan, NodeKind, ResponseNode, SessionRecord
from rollout_proxy.routing import prompt_start
from rollout_proxy.state.store import REQUEST_LEASE_S, Idempotency, SessionLease, StateStore
from rollout_proxy.tokenization.images import image_part_hashes
from rollout_proxy.tokenization.messages import extend_path_hash
from rollout_proxy.tokenization.parsers import AssistantView, OutputParser, ToolParse
from rollout_proxy.wire.images import ImageBlob, image_hashes

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class TurnResult:
    node: ResponseNode
    prompt_ids: np.ndarray  # the whole prompt the engine consumed
    view: AssistantView


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """Everything a turn sends to its engine, decided before the call, for every API alike (``prepare``
    builds it, ``sample`` sends it): what the engine call of a turn carries is added here once."""

    engine: GenerationEngine
    info: EngineInfo
    delta: np.ndarray  # bridge tokens for the new messages, then the generation prompt
    prompt: np.ndarray  # the parent's exact tokens, then ``delta``
    params: SamplingParams
    #: the prompt leaves a reasoning block open (its generation prompt opens ``<think>``): the output starts as
    #: reasoning; decided from the rendered prompt, for the final parse and the streamed one alike
    reasoning_opened: bool = False
    #: the session's policy (``engines.policies``): its served name is what the call names, on an engine serving it
    policy: str = BASE_POLICY
    #: the images of the whole prompt (the parent's and the bridge's), for the engine; None: a text-only prompt
    images: PromptImages | None = None
    #: where the images of ``delta`` are in it (the node records them)
    delta_images: tuple[ImageSpan, ...] = ()
    #: where the images of the whole prompt are in it (the node's ``path_images``: its output holds none)
    prompt_images: tuple[ImageSpan, ...] = ()


def path_tokens(path: Sequence[ResponseNode]) -> np.ndarray:
    """The exact token ids of a root-to-leaf path (the leaf's ``path_ids`` when it has them)."""
    if not path:
        return np.zeros(0, dtype=np.int32)
    leaf = path[-1]
    if leaf.path_ids is None:
        parts = [array for node in path for array in (node.prompt_ids, node.output_ids)]
        leaf.path_ids = np.concatenate(parts).astype(np.int32, copy=False)
    return leaf.path_ids


def path_image_spans(path: Sequence[ResponseNode]) -> tuple[ImageSpan, ...]:
    """The images of a root-to-leaf path, each span at its place in the path's tokens, kept on the leaf: every
    turn asks, and walking the path each time would make a conversation's turns quadratic in its length."""
    if not path:
        return ()
    leaf = path[-1]
    if leaf.path_images is None:
        spans: list[ImageSpan] = []
        offset = 0
        for node in path:
            spans += [span.shifted(offset) for span in node.images]
            offset += len(node.prompt_ids) + len(node.output_ids)
        leaf.path_images = tuple(spans)
    return leaf.path_images


class TurnRunner:
    def __init__(
        self,
        *,
        store: StateStore,
        engines: EngineRouter,
        parser: OutputParser,
        metrics: Metrics,
        renderers: Renderers,
        require_prompt_echo: bool = True,
    ) -> None:
        """``require_prompt_echo``: an engine answer without the prompt it consumed is an ``EngineError``;
        False (``--prompt-echo count``) records such a turn unchecked, flagged on its node and counted."""
        self._store = store
        self._require_prompt_echo = require_prompt_echo
        self._engines = engines
        self._parser = parser
        self._metrics = metrics
        self._renderers = renderers

    @property
    def parser(self) -> OutputParser:
        return self._parser

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    # -- a generated turn ---------------------------------------------------------------------

    async def generate(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        api: str,
        tools: Sequence[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        meta: dict[str, Any] | None = None,
        lease: SessionLease | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> TurnResult:
        """``lease``: the turn's session read (its request slot, given back with the node's write); ``images``:
        those its new messages hold (``new_images``), stored with its node."""
        turn = await self.prepare_anywhere(session, placement, tools=tools, stop=stop, images=images)
        sampled = await self.sample(session, turn, lease=lease)
        return await self.record(session, placement, turn, sampled, api=api, meta=meta, lease=lease, images=images)

    async def new_images(
        self, session: SessionRecord, placement: Placement, images: Mapping[str, ImageBlob]
    ) -> tuple[ImageBlob, ...]:
        """The images ``placement``'s new messages hold (from ``images``, the request's), checked against what
        the session may still store: ``TooManyImages`` before anything is sampled (the node's write checks
        again, atomically)."""
        hashes = image_hashes(placement.new_messages)
        if not hashes:
            return ()
        missing = [sha for sha in hashes if sha not in images]
        if missing:  # the intake hands the turn every image its conversation holds
            raise ProxyError(f"the turn's messages hold images the request did not bring: {missing[:3]}")
        found = tuple(images[sha] for sha in hashes)
        await self._store.check_images(session.id, found)
        return found

    async def prepare_anywhere(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        tools: Sequence[dict[str, Any]] | None,
        stop: Sequence[str],
        images: Sequence[ImageBlob] = (),
    ) -> PreparedTurn:
        """``prepare`` after a pause's resume, on the session's engine or another if rendering there fails."""
        gate = self._engines.gate  # paused for a weight update: no engine is touched until the resume
        with self._metrics.timer("queue_wait_seconds", reason="pause") if gate.paused else contextlib.nullcontext():
            await gate.wait()
        return await self._on_an_engine(
            session,
            lambda engine: self.prepare(session, placement, tools=tools, stop=stop, engine=engine, images=images),
        )

    async def prepare(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        tools: Sequence[dict[str, Any]] | None,
        stop: Sequence[str],
        engine: GenerationEngine | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> PreparedTurn:
        """The engine (the session's while it serves, unless given), the whole prompt (parent's tokens +
        bridge), its images (``images``: those of the new messages) and the sampling settings."""
        engine = engine or self._engines.route(session.engine)
        info = await engine.info()
        with tracing.span("render", **{"rollout_proxy.session_id": session.id}):
            delta, delta_images = await self._render(
                engine, session, placement, tools, generation_prompt=True, images=images
            )
        prompt = np.concatenate([path_tokens(placement.parent), delta]).astype(np.int32, copy=False)
        spans = path_image_spans(placement.parent)
        if delta_images:
            spans = (*spans, *(span.shifted(len(prompt) - len(delta)) for span in delta_images))
        prompt_images = await self._prompt_images(session, engine, prompt, spans, images) if spans else None
        opened = self._parser.reasons and self._parser.reasoning.opened_by(
            await self._renderers.generation_prompt_text(engine, delta)
        )
        room = info.max_model_len - len(prompt)
        if room <= 0:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens and the engine's context is {info.max_model_len}: "
                "no room left to generate",
                param="messages",
            )
        generation = session.generation
        params = SamplingParams(
            max_tokens=min(generation.max_new_tokens, room),
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            seed=generation.seed,
            stop=tuple(stop),
            routed_experts_prompt_start=prompt_start(placement.parent) if engine.returns_routing else None,
            top_logprobs=generation.top_logprobs,
        )
        return PreparedTurn(
            engine=engine,
            info=info,
            delta=delta,
            prompt=prompt,
            params=params,
            reasoning_opened=opened,
            policy=session.policy,
            images=prompt_images,
            delta_images=delta_images,
            prompt_images=spans,
        )

    async def prompt_tokens(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        tools: Sequence[dict[str, Any]] | None,
        images: Mapping[str, ImageBlob] | None = None,
    ) -> np.ndarray:
        """The prompt a turn at ``placement`` would send (the parent's exact tokens and the bridge with the
        generation prompt, its images expanded: ``images``, the request's), rendered on the session's engine or
        another; no engine call, nothing stored, no context check (a count of tokens, e.g. the Messages API's
        ``count_tokens``)."""

        given = tuple((images or {}).values())
        delta, _ = await self._on_an_engine(
            session,
            lambda engine: self._render(engine, session, placement, tools, generation_prompt=True, images=given),
        )
        return np.concatenate([path_tokens(placement.parent), delta]).astype(np.int32, copy=False)

    async def sample(
        self,
        session: SessionRecord,
        turn: PreparedTurn,
        *,
        sink: PieceSink | None = None,
        lease: SessionLease | None = None,
    ) -> Sampled:
        """The turn's engine call through the fleet (``engines.sampling``: failover, pauses, aborted turns),
        within the session's request bound (the slot ``lease`` took, if any); the prompt the engine consumed
        is checked."""
        waiting = time.perf_counter()
        async with self._request_slot(session, lease):
            if session.concurrency:  # the job's request bound: how long this turn waited for a slot
                self._metrics.observe("queue_wait_seconds", time.perf_counter() - waiting, reason="concurrency")
            with_images = {"images": turn.images} if turn.images is not None else {}
            sampled = await self._engines.sample(
                turn.engine, turn.prompt, turn.params, sink=sink, policy=turn.policy, **with_images
            )
        completion = sampled.completion
        if completion.prompt_ids is None:
            self._metrics.inc("unchecked_prompts_total")
            if self._require_prompt_echo:
                raise EngineError(
                    "the engine's answer does not say which prompt tokens it consumed (vLLM: return_token_ids), so "
                    "the drift check cannot run; serve with --prompt-echo count to record such turns unchecked"
                )
        elif not np.array_equal(completion.prompt_ids, turn.prompt):
            self._metrics.inc("prompt_drift_total")
            if turn.images is not None:
                raise EngineError(
                    "the engine reports having consumed other prompt tokens than the proxy holds: it expanded the "
                    "prompt's images into other tokens than the model's processor config says"
                )
            raise EngineError("the engine reports having consumed other prompt tokens than the proxy sent")
        elif turn.images is not None and completion.image_spans != turn.images.spans:
            self._metrics.inc("prompt_drift_total")
            raise EngineError(
                f"the engine placed the prompt's images at {list(completion.image_spans or ())}, the proxy at "
                f"{list(turn.images.spans)} (offset, length)"
            )
        if completion.nonfinite_logprobs:
            self._metrics.inc("nonfinite_logprobs_total", completion.nonfinite_logprobs)
        return sampled

    async def record(
        self,
        session: SessionRecord,
        placement: Placement,
        turn: PreparedTurn,
        sampled: Sampled,
        *,
        api: str,
        meta: dict[str, Any] | None,
        view: AssistantView | None = None,
        node_id: str | None = None,
        lease: SessionLease | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> TurnResult:
        """The sampled tokens as a node (with its parsed view, routing and policy versions), stored once with
        ``images`` (those its new messages hold); ``view``, ``node_id``: what a streamed turn already parsed
        (``parse``) and named (its chunks carry both)."""
        completion = sampled.completion
        routing, disagreements = await align_routing(
            self._store,
            self._metrics,
            session.id,
            placement.parent,
            completion,
            prompt_len=len(turn.prompt),
            requested_start=turn.params.routed_experts_prompt_start or 0,
            engine_url=sampled.engine.url,
        )
        view = view or self.parse(completion.text, opened=turn.reasoning_opened)
        node_meta = dict(meta or {})
        self._note_sample(placement, api, node_meta)
        if placement.ambiguity is not None:
            node_meta["parent_ambiguity"] = placement.ambiguity
        if completion.nonfinite_logprobs:
            node_meta["nonfinite_logprobs"] = completion.nonfinite_logprobs
        if isinstance(completion.stop_reason, str) and completion.finish_reason == "stop":
            node_meta["stop_sequence"] = completion.stop_reason  # the stop string that ended the turn
        if disagreements:
            node_meta["routing_disagreements"] = disagreements
        if completion.prompt_ids is None:  # only with --prompt-echo count: the drift check could not run
            node_meta["prompt_unchecked"] = True
        if (trace_id := tracing.current_trace_id()) is not None:
            node_meta["trace_id"] = trace_id  # the request's trace (README, "Tracing")
        finish_reason = completion.finish_reason
        if view.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        output_ids = completion.output_ids
        node = ResponseNode(
            id=node_id or new_response_id(session.id),
            parent_id=placement.parent_id,
            kind=NodeKind.GENERATED,
            api=api,
            messages=[*placement.new_messages, view.message()],
            n_input_messages=len(placement.new_messages),
            prompt_ids=turn.delta,
            output_ids=output_ids,
            output_logprobs=completion.output_logprobs,
            finish_reason=finish_reason,
            usage={
                "prompt_tokens": len(turn.prompt),
                "completion_tokens": len(output_ids),
                "total_tokens": len(turn.prompt) + len(output_ids),
            },
            created_at=time.time(),
            model=turn.info.model,
            fork=placement.fork,
            meta=node_meta,
            policy_versions=sampled.versions,
            output_topk=completion.output_topk,
            images=turn.delta_images,
        ).with_routing(routing)
        hashes = [*placement.new_hashes, extend_path_hash(placement.end_hash, node.messages[-1])]
        moved_to = sampled.engine.url if sampled.engine.url != session.engine else None
        # the node, its images and the move: one round trip
        await self._save(session, node, hashes, engine=moved_to, lease=lease, images=images)
        node.path_ids = np.concatenate([turn.prompt, output_ids]).astype(np.int32, copy=False)
        node.path_images = turn.prompt_images  # the prompt's; the output holds none
        if placement.parent:  # the conversation moved on: only its latest node keeps its path's ids
            placement.parent[-1].path_ids = None
        self._follow(session, sampled.engine)
        self._metrics.inc("turns_total", api=api)
        self._metrics.inc("generated_tokens_total", len(output_ids))
        self._metrics.inc("policy_turns_total", policy=turn.policy)  # registered policies only: a bounded set
        self._metrics.inc("policy_generated_tokens_total", len(output_ids), policy=turn.policy)
        self._metrics.observe("turn_tokens", len(turn.prompt), kind="prompt")
        self._metrics.observe("turn_tokens", len(output_ids), kind="generated")
        return TurnResult(node=node, prompt_ids=turn.prompt, view=view)

    # -- injected messages ----------------------------------------------------------------------

    async def inject(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        api: str,
        idempotency: Idempotency | None = None,
        lease: SessionLease | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> ResponseNode:
        """Append messages the policy did not generate, as a node with loss weight 0
        (the earlier node instead, when ``idempotency`` repeats a key already used); ``images``: those the
        messages hold, stored with the node (their spans recorded on it)."""

        async def render(engine: GenerationEngine) -> tuple[EngineInfo, tuple[np.ndarray, tuple[ImageSpan, ...]]]:
            info = await engine.info()
            rendered = await self._render(
                engine, session, placement, session.tools, generation_prompt=False, images=images
            )
            return info, rendered

        info, (delta, delta_images) = await self._on_an_engine(session, render)
        total = sum(len(node.prompt_ids) + len(node.output_ids) for node in placement.parent) + len(delta)
        if total >= info.max_model_len:
            raise ContextLengthExceeded(
                f"with these messages the conversation has {total} tokens and the engine's context is "
                f"{info.max_model_len}: no room left to generate",
                param="messages",
            )
        node = ResponseNode(
            id=new_response_id(session.id),
            parent_id=placement.parent_id,
            kind=NodeKind.INJECTED,
            api=api,
            messages=list(placement.new_messages),
            n_input_messages=len(placement.new_messages),
            prompt_ids=delta,
            finish_reason=None,
            usage={"prompt_tokens": len(delta), "completion_tokens": 0, "total_tokens": len(delta)},
            created_at=time.time(),
            model=info.model,
            images=delta_images,
        )
        self._note_sample(placement, api, node.meta)
        if placement.ambiguity is not None:
            node.meta["parent_ambiguity"] = placement.ambiguity
        node = await self._save(
            session, node, placement.new_hashes, idempotency=idempotency, lease=lease, images=images
        )
        if placement.parent:  # only a conversation's latest generated node keeps its path's ids
            placement.parent[-1].path_ids = None
        self._metrics.inc("injected_nodes_total")
        return node

    # -- the steps' parts -------------------------------------------------------------------------

    async def _render(
        self,
        engine: GenerationEngine,
        session: SessionRecord,
        placement: Placement,
        tools: Sequence[dict[str, Any]] | None,
        *,
        generation_prompt: bool,
        images: Sequence[ImageBlob] = (),
    ) -> tuple[np.ndarray, tuple[ImageSpan, ...]]:
        """The bridge tokens of ``placement``'s new messages, as the session's template renders them, and where
        their images' spans are in them (``images``: theirs; one the turn was not given is read from the
        session's image store): every render of a turn (a generated one's, a count's, injected messages') is
        this one call."""
        kwargs = session.generation.chat_template_kwargs
        hashes = image_part_hashes(placement.new_messages)
        if not hashes:
            delta = await self._renderers.delta(
                engine, placement, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=generation_prompt
            )
            return delta, ()
        blobs = await self._images_of(session, hashes, images)
        return await self._renderers.image_delta(
            engine, placement, blobs, tools=tools, chat_template_kwargs=kwargs, add_generation_prompt=generation_prompt
        )

    async def _images_of(
        self, session: SessionRecord, hashes: Sequence[str], given: Sequence[ImageBlob]
    ) -> dict[str, ImageBlob]:
        """The images of ``hashes``: those ``given``, the others read from the session's image store (one
        round trip); a ``ProxyError`` for one it does not hold."""
        found = {image.sha256: image for image in given}
        wanted = list(dict.fromkeys(sha for sha in hashes if sha not in found))
        if wanted:
            found.update(await self._store.get_images(session.id, wanted))
            missing = [sha for sha in wanted if sha not in found]
            if missing:
                raise ProxyError(
                    f"the session's image store does not hold {len(missing)} image(s) of this conversation "
                    f"({missing[0][:16]}...): the session expired, or the image was never stored"
                )
        return found

    async def _prompt_images(
        self,
        session: SessionRecord,
        engine: GenerationEngine,
        prompt: np.ndarray,
        spans: Sequence[ImageSpan],
        given: Sequence[ImageBlob],
    ) -> PromptImages:
        """The images of the whole prompt for the engine: each of ``spans`` (the parent's path's and the bridge's,
        at their places in ``prompt``) with its image (the parent's read from the session's image store); the
        prompt collapsed to one marker per image is checked here (a marker where no image is would be taken for
        one: a 400 in words)."""
        rule = await self._renderers.image_rule(engine)
        try:
            rule.collapse(prompt, spans)
        except ValueError as exc:
            raise InvalidRequest(f"this conversation cannot be sent with its images: {exc}", param="messages") from None
        blobs = await self._images_of(session, [span.sha256 for span in spans], given)
        return PromptImages(
            rule.marker_id,
            tuple((span.start, span.length) for span in spans),
            tuple(blobs[span.sha256] for span in spans),
        )

    async def _on_an_engine(self, session: SessionRecord, step: Callable[[GenerationEngine], Awaitable[T]]) -> T:
        """``step`` on the session's engine while it serves, else another; a step that fails because its
        engine failed (unreachable, too slow) is counted against that engine and done on the next one; with
        no next one the client gets that failure, not a vaguer "no engine can take this turn"."""
        tried: set[str] = set()
        failure: EngineUnavailable | EngineTimeout | None = None
        while True:
            try:
                engine = await self._engines.route_now(session.engine, exclude=tried)
            except EngineUnavailable:
                if failure is None:
                    raise
                raise failure from None
            try:
                return await step(engine)
            except (EngineUnavailable, EngineTimeout) as exc:
                self._engines.report_failure(engine, exc, what="rendering")
                failure = exc
                tried.add(engine.url)
                if len(tried) > self._engines.retries:
                    raise

    def _note_sample(self, placement: Placement, api: str, meta: dict[str, Any]) -> None:
        """How the session's sample stands in a conversation placed from the root: counted, and on the node
        when the proxy added it or the conversation does not hold all of it (``core.tree.SamplePlacement``)."""
        placed = placement.sample
        if placed is None or placed is SamplePlacement.NO_SAMPLE:
            return
        self._metrics.inc("sample_placements_total", api=api, placement=placed.value)
        if placed.flagged:
            meta["sample_placement"] = placed.value
            log.info("sample_placement", placement=placed.value, api=api)

    def _follow(self, session: SessionRecord, engine: GenerationEngine) -> None:
        """The session's later turns go where this one ended (a failover moved it; stored with the node)."""
        if engine.url == session.engine:
            return
        moved_from, session.engine = session.engine, engine.url
        if moved_from is not None:
            self._metrics.inc("engine_failovers_total")
            log.info("session_moved", engine=engine.url, moved_from=moved_from)

    def _request_slot(
        self, session: SessionRecord, lease: SessionLease | None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """A slot of the session's shared request bound (e.g. a job's request_concurrency), kept in the
        store so that it holds across workers (a dead worker's slots come back after ``REQUEST_LEASE_S``).
        The store may have taken it with the session read (``SessionLease.slot``): then it is held from
        that read to the node write, which gives it back (the Redis store: in its own round trip)."""
        if not session.concurrency:
            return contextlib.nullcontext()
        concurrency = session.concurrency
        return self._store.request_slot(
            concurrency["key"],
            concurrency["max_requests"],
            lease=REQUEST_LEASE_S,
            taken=None if lease is None else lease.slot,
        )

    def parse(self, text: str, *, opened: bool = False) -> AssistantView:
        """The view of generated text, counted by how tool-call parsing ended; ``opened``: the turn's
        ``reasoning_opened``."""
        view = self._parser.parse(text, opened=opened)
        self._metrics.inc("tool_parse_total", outcome=view.tool_parse.value)
        if view.tool_parse is ToolParse.MALFORMED:
            log.info("tool_call_unparsed", text=text[:200])
        return view

    async def _save(
        self,
        session: SessionRecord,
        node: ResponseNode,
        hashes: Sequence[str],
        *,
        idempotency: Idempotency | None = None,
        engine: str | None = None,
        lease: SessionLease | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> ResponseNode:
        """Store the node with the path hashes of its messages (the last one names the node), the images its
        messages hold, and the session's new engine if it moved (and give back ``lease``'s slot); returns the
        node, or the one an earlier request with the same idempotency key stored."""
        node.path_hash = hashes[-1]
        partial = {path_hash: f"{node.id}#{index + 1}" for index, path_hash in enumerate(hashes[:-1])}
        partial.update(node_entries(node))  # what tells it apart from siblings of the same content (core.tree)
        stored_id = await self._store.put_node(
            session.id,
            node,
            paths={node.path_hash: node.id},
            partial_paths=partial,
            latest=node.api,
            idempotency=idempotency,
            engine=engine,
            lease=lease,
            images=images,
        )
        if stored_id == node.id:
            return node
        path = await self._store.get_path(session.id, stored_id)
        if not path:
            raise SessionNotFound(f"session {session.id!r} not found (unknown or expired)", param="session_id")
        return path[-1]
