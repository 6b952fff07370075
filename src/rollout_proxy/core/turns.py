"""Extending the response tree: one generated turn, or one batch of injected messages.

This is the heart of the one rule: the new prompt is the parent's exact tokens plus
bridge tokens for the new messages; the engine is driven with token ids and what it
sampled is stored as it came. The API layers (chat, responses, session messages) only
decide *which* node is the parent and *which* messages are new (a ``Placement``).

A generated turn is three steps, each small: ``prepare`` (engine, bridge tokens, the
whole prompt, sampling settings), ``sample`` (the engine call through the fleet: failover,
pauses, aborted turns; checked), ``record`` (parse the view, build the node with the policy
version of every sampled token, store it once).

While the fleet is paused for a weight update a new turn waits before it touches an engine
(bounded: ``FleetPaused``). Rendering that fails because its engine failed is done again on
another engine; the session follows the engine its turn ended on (``set_session_engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import structlog

from rollout_proxy.core.rendering import Renderers
from rollout_proxy.core.tree import Placement
from rollout_proxy.core.turn_routing import align_routing
from rollout_proxy.engines.base import Engine, EngineInfo, SamplingParams
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.sampling import Sampled
from rollout_proxy.engines.sampling import sample as sample_on_fleet
from rollout_proxy.errors import (
    ContextLengthExceeded,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    SessionNotFound,
    StoreUnavailable,
)
from rollout_proxy.ids import new_response_id
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import NodeKind, ResponseNode, SessionRecord
from rollout_proxy.routing import prompt_start
from rollout_proxy.state.store import Idempotency, StateStore
from rollout_proxy.tokenization.messages import extend_path_hash
from rollout_proxy.tokenization.parsers import AssistantView, OutputParser, ToolParse

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class TurnResult:
    node: ResponseNode
    prompt_ids: np.ndarray  # the whole prompt the engine consumed
    view: AssistantView


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """Everything a turn sends to its engine, decided before the call."""

    engine: Engine
    info: EngineInfo
    delta: np.ndarray  # bridge tokens for the new messages, then the generation prompt
    prompt: np.ndarray  # the parent's exact tokens, then ``delta``
    params: SamplingParams


def path_tokens(path: Sequence[ResponseNode]) -> np.ndarray:
    """The exact token ids of a root-to-leaf path."""
    parts = [array for node in path for array in (node.prompt_ids, node.output_ids)]
    return np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, dtype=np.int32)


class TurnRunner:
    def __init__(
        self,
        *,
        store: StateStore,
        engines: Fleet,
        parser: OutputParser,
        metrics: Metrics,
        renderers: Renderers | None = None,
    ) -> None:
        self._store = store
        self._engines = engines
        self._parser = parser
        self._metrics = metrics
        self._renderers = renderers or Renderers()
        self._limits: dict[str, asyncio.Semaphore] = {}

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
    ) -> TurnResult:
        await self._engines.gate.wait()  # paused for a weight update: no engine is touched until the resume
        turn = await self._on_an_engine(
            session, lambda engine: self.prepare(session, placement, tools=tools, stop=stop, engine=engine)
        )
        sampled = await self.sample(session, turn)
        return await self.record(session, placement, turn, sampled, api=api, meta=meta)

    async def prepare(
        self,
        session: SessionRecord,
        placement: Placement,
        *,
        tools: Sequence[dict[str, Any]] | None,
        stop: Sequence[str],
        engine: Engine | None = None,
    ) -> PreparedTurn:
        """The engine (the session's while it serves, unless given), the whole prompt (parent's tokens +
        bridge) and the sampling settings."""
        engine = engine or self._engines.route(session.engine)
        info = await engine.info()
        delta = await self._renderers.delta(
            engine,
            placement,
            tools=tools,
            chat_template_kwargs=session.generation.chat_template_kwargs,
            add_generation_prompt=True,
        )
        prompt = np.concatenate([path_tokens(placement.parent), delta]).astype(np.int32, copy=False)
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
        )
        return PreparedTurn(engine=engine, info=info, delta=delta, prompt=prompt, params=params)

    async def sample(self, session: SessionRecord, turn: PreparedTurn) -> Sampled:
        """The turn's engine call through the fleet (``engines.sampling``: failover, pauses, aborted turns),
        within the session's request bound; the prompt the engine consumed is checked."""
        async with self._request_slot(session):
            sampled = await sample_on_fleet(self._engines, turn.engine, turn.prompt, turn.params)
        completion = sampled.completion
        if completion.prompt_ids is not None and not np.array_equal(completion.prompt_ids, turn.prompt):
            self._metrics.inc("prompt_drift_total")
            raise EngineError("the engine reports having consumed other prompt tokens than the proxy sent")
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
    ) -> TurnResult:
        """The sampled tokens as a node (with its parsed view, routing and policy versions), stored once."""
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
        view = self._parse(completion.text)
        node_meta = dict(meta or {})
        if completion.nonfinite_logprobs:
            node_meta["nonfinite_logprobs"] = completion.nonfinite_logprobs
        if disagreements:
            node_meta["routing_disagreements"] = disagreements
        finish_reason = completion.finish_reason
        if view.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        output_ids = completion.output_ids
        node = ResponseNode(
            id=new_response_id(session.id),
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
        ).with_routing(routing)
        hashes = [*placement.new_hashes, extend_path_hash(placement.end_hash, node.messages[-1])]
        await self._save(session, node, hashes)
        await self._follow(session, sampled.engine)
        self._metrics.inc("turns_total", api=api)
        self._metrics.inc("generated_tokens_total", len(output_ids))
        return TurnResult(node=node, prompt_ids=turn.prompt, view=view)

    # -- injected messages ----------------------------------------------------------------------

    async def inject(
        self, session: SessionRecord, placement: Placement, *, api: str, idempotency: Idempotency | None = None
    ) -> ResponseNode:
        """Append messages the policy did not generate, as a node with loss weight 0
        (the earlier node instead, when ``idempotency`` repeats a key already used)."""

        async def render(engine: Engine) -> tuple[EngineInfo, np.ndarray]:
            info = await engine.info()
            delta = await self._renderers.delta(
                engine,
                placement,
                tools=session.tools,
                chat_template_kwargs=session.generation.chat_template_kwargs,
                add_generation_prompt=False,
            )
            return info, delta

        info, delta = await self._on_an_engine(session, render)
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
        )
        node = await self._save(session, node, placement.new_hashes, idempotency=idempotency)
        self._metrics.inc("injected_nodes_total")
        return node

    # -- the steps' parts -------------------------------------------------------------------------

    async def _on_an_engine(self, session: SessionRecord, step: Callable[[Engine], Awaitable[T]]) -> T:
        """``step`` on the session's engine while it serves, else another; a step that fails because its
        engine failed (unreachable, too slow) is counted against that engine and done on the next one."""
        tried: set[str] = set()
        while True:
            engine = self._engines.route(session.engine, exclude=tried)
            try:
                return await step(engine)
            except (EngineUnavailable, EngineTimeout) as exc:
                self._engines.report_failure(engine, exc, what="rendering")
                tried.add(engine.url)
                if len(tried) > self._engines.settings.retries:
                    raise

    async def _follow(self, session: SessionRecord, engine: Engine) -> None:
        """The session's later turns go where this one ended (a failover moved it): best effort, a routing hint."""
        if engine.url == session.engine:
            return
        moved_from, session.engine = session.engine, engine.url
        if moved_from is not None:
            self._metrics.inc("engine_failovers_total")
            log.info("session_moved", engine=engine.url, moved_from=moved_from)
        try:
            await self._store.set_session_engine(session.id, engine.url)
        except StoreUnavailable as exc:  # the turn is stored: its answer must not fail over a hint
            log.warning("session_engine_not_saved", engine=engine.url, error=exc.message)

    def _request_slot(self, session: SessionRecord) -> contextlib.AbstractAsyncContextManager[Any]:
        """A slot of the session's shared request bound (e.g. a job's request_concurrency)."""
        if not session.concurrency:
            return contextlib.nullcontext()
        key = session.concurrency["key"]
        limit = self._limits.get(key)
        if limit is None:
            limit = self._limits[key] = asyncio.Semaphore(session.concurrency["max_requests"])
        return limit

    def _parse(self, text: str) -> AssistantView:
        view = self._parser.parse(text)
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
    ) -> ResponseNode:
        """Store the node with the path hashes of its messages (the last one names the node);
        returns it, or the node an earlier request with the same idempotency key stored."""
        node.path_hash = hashes[-1]
        partial = {path_hash: f"{node.id}#{index + 1}" for index, path_hash in enumerate(hashes[:-1])}
        stored_id = await self._store.put_node(
            session.id,
            node,
            paths={node.path_hash: node.id},
            partial_paths=partial,
            latest=node.api,
            idempotency=idempotency,
        )
        if stored_id == node.id:
            return node
        path = await self._store.get_path(session.id, stored_id)
        if not path:
            raise SessionNotFound(f"session {session.id!r} not found (unknown or expired)", param="session_id")
        return path[-1]
