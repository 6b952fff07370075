"""Extending the response tree: one generated turn, or one batch of injected messages.

This is the heart of the one rule: the new prompt is the parent's exact tokens plus
bridge tokens for the new messages; the engine is driven with token ids and what it
sampled is stored as it came. The API layers (chat, responses, session messages) only
decide *which* node is the parent and *which* messages are new.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from rollout_proxy.core.types import NodeKind, ResponseNode, SessionRecord
from rollout_proxy.errors import ContextLengthExceeded, EngineError, NotFound
from rollout_proxy.ids import new_response_id
from rollout_proxy.metrics import Metrics
from rollout_proxy.proxy.engines.base import Engine, EngineCompletion, SamplingParams
from rollout_proxy.proxy.engines.pool import EnginePool
from rollout_proxy.routing import (
    RoutingFormatError,
    RoutingRows,
    align_turn,
    decode_engine_routing,
    first_row_position,
    prompt_start,
)
from rollout_proxy.state.store import StateStore
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, path_hashes
from rollout_proxy.tokenization.parsers import AssistantView, OutputParser, ToolParse
from rollout_proxy.tokenization.renderer import ChatRenderer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class TurnResult:
    node: ResponseNode
    prompt_ids: np.ndarray  # the whole prompt the engine consumed
    view: AssistantView


def path_tokens(path: Sequence[ResponseNode]) -> np.ndarray:
    """The exact token ids of a root-to-leaf path."""
    parts = [array for node in path for array in (node.prompt_ids, node.output_ids)]
    return np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, dtype=np.int32)


class TurnRunner:
    def __init__(self, *, store: StateStore, engines: EnginePool, parser: OutputParser, metrics: Metrics) -> None:
        self._store = store
        self._engines = engines
        self._parser = parser
        self._metrics = metrics
        self._renderers: dict[str, ChatRenderer] = {}
        self._limits: dict[str, asyncio.Semaphore] = {}

    def _renderer(self, engine: Engine) -> ChatRenderer:
        renderer = self._renderers.get(engine.url)
        if renderer is None:
            renderer = self._renderers[engine.url] = ChatRenderer(engine)
        return renderer

    def _request_slot(self, session: SessionRecord) -> contextlib.AbstractAsyncContextManager[Any]:
        """A slot of the session's shared request bound (e.g. a job's request_concurrency)."""
        if not session.concurrency:
            return contextlib.nullcontext()
        key = session.concurrency["key"]
        limit = self._limits.get(key)
        if limit is None:
            limit = self._limits[key] = asyncio.Semaphore(session.concurrency["max_requests"])
        return limit

    async def _prompt_delta(
        self,
        engine: Engine,
        parent: Sequence[ResponseNode],
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> np.ndarray:
        renderer = self._renderer(engine)
        if not parent:
            return await renderer.render(
                messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
            )
        last = parent[-1]
        closed = last.kind is NodeKind.INJECTED or (
            len(last.output_ids) > 0 and int(last.output_ids[-1]) == await renderer.end_of_turn_id()
        )
        return await renderer.bridge(
            messages,
            after_role=last.messages[-1]["role"],
            after_closed=closed,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )

    async def generate(
        self,
        session: SessionRecord,
        parent: Sequence[ResponseNode],
        new_messages: Sequence[dict[str, Any]],
        *,
        api: str,
        tools: Sequence[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        fork: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> TurnResult:
        engine = self._engines.get(session.engine)
        info = await engine.info()
        generation = session.generation
        parent_ids = path_tokens(parent)
        delta = await self._prompt_delta(
            engine,
            parent,
            new_messages,
            tools=tools,
            chat_template_kwargs=generation.chat_template_kwargs,
            add_generation_prompt=True,
        )
        prompt = np.concatenate([parent_ids, delta]).astype(np.int32, copy=False)
        room = info.max_model_len - len(prompt)
        if room <= 0:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens and the engine's context is {info.max_model_len}: "
                "no room left to generate",
                param="messages",
            )
        params = SamplingParams(
            max_tokens=min(generation.max_new_tokens, room),
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            seed=generation.seed,
            stop=tuple(stop),
            routed_experts_prompt_start=prompt_start(parent) if engine.returns_routing else None,
        )
        async with self._request_slot(session), self._engines.slot(engine):
            completion = await engine.complete(prompt, params)
        if completion.prompt_ids is not None and not np.array_equal(completion.prompt_ids, prompt):
            self._metrics.inc("prompt_drift_total")
            raise EngineError("the engine reports having consumed other prompt tokens than the proxy sent")
        if completion.nonfinite_logprobs:
            self._metrics.inc("nonfinite_logprobs_total", completion.nonfinite_logprobs)
        routing, disagreements = await self._routing(session, engine, parent, len(prompt), completion, params)
        view = self._parser.parse(completion.text)
        self._metrics.inc("tool_parse_total", outcome=view.tool_parse.value)
        if view.tool_parse is ToolParse.MALFORMED:
            log.info("tool_call_unparsed", text=completion.text[:200])
        node_meta = dict(meta or {})
        if completion.nonfinite_logprobs:
            node_meta["nonfinite_logprobs"] = completion.nonfinite_logprobs
        if disagreements:
            node_meta["routing_disagreements"] = disagreements
        finish_reason = completion.finish_reason
        if view.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        node = ResponseNode(
            id=new_response_id(session.id),
            parent_id=parent[-1].id if parent else None,
            kind=NodeKind.GENERATED,
            api=api,
            messages=[*new_messages, view.message()],
            n_input_messages=len(new_messages),
            prompt_ids=delta,
            output_ids=completion.output_ids,
            output_logprobs=completion.output_logprobs,
            finish_reason=finish_reason,
            usage={
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion.output_ids),
                "total_tokens": len(prompt) + len(completion.output_ids),
            },
            created_at=time.time(),
            model=info.model,
            fork=fork,
            meta=node_meta,
        ).with_routing(routing)
        await self._save(session, parent, node)
        self._metrics.inc("turns_total", api=api)
        self._metrics.inc("generated_tokens_total", len(completion.output_ids))
        return TurnResult(node=node, prompt_ids=prompt, view=view)

    async def _routing(
        self,
        session: SessionRecord,
        engine: Engine,
        parent: Sequence[ResponseNode],
        prompt_len: int,
        completion: EngineCompletion,
        params: SamplingParams,
    ) -> tuple[RoutingRows | None, int]:
        """The turn's routed experts aligned to the path (None for dense models)."""
        if completion.routed_experts is None:
            return None, 0
        try:
            rows, valid = decode_engine_routing(completion.routed_experts)
            first = first_row_position(
                prompt_len=prompt_len,
                output_len=len(completion.output_ids),
                requested_start=params.routed_experts_prompt_start or 0,
                n_rows=len(rows),
            )
            if first < prompt_start(parent):  # rows we already hold came again: compare them
                parent = await self._store.get_path(session.id, parent[-1].id, routing=True) or []
            routing, disagreements = align_turn(parent, first=first, rows=rows, valid=valid)
        except RoutingFormatError as exc:
            self._metrics.inc("routing_malformed_total")
            raise EngineError(f"engine {engine.url} returned unusable routed experts: {exc}") from None
        if disagreements:
            self._metrics.inc("routing_disagreements_total", disagreements)
            log.warning("routing_disagreement", rows=disagreements)
        return routing, disagreements

    async def inject(
        self,
        session: SessionRecord,
        parent: Sequence[ResponseNode],
        messages: Sequence[dict[str, Any]],
        *,
        api: str,
        tools: Sequence[dict[str, Any]] | None,
    ) -> ResponseNode:
        """Append messages the policy did not generate, as a node with loss weight 0."""
        engine = self._engines.get(session.engine)
        info = await engine.info()
        delta = await self._prompt_delta(
            engine,
            parent,
            messages,
            tools=tools,
            chat_template_kwargs=session.generation.chat_template_kwargs,
            add_generation_prompt=False,
        )
        node = ResponseNode(
            id=new_response_id(session.id),
            parent_id=parent[-1].id if parent else None,
            kind=NodeKind.INJECTED,
            api=api,
            messages=list(messages),
            n_input_messages=len(messages),
            prompt_ids=delta,
            finish_reason=None,
            usage={"prompt_tokens": len(delta), "completion_tokens": 0, "total_tokens": len(delta)},
            created_at=time.time(),
            model=info.model,
        )
        await self._save(session, parent, node)
        self._metrics.inc("injected_nodes_total")
        return node

    async def _save(self, session: SessionRecord, parent: Sequence[ResponseNode], node: ResponseNode) -> None:
        start = parent[-1].path_hash if parent else EMPTY_PATH_HASH
        hashes = path_hashes(node.messages, start=start)
        node.path_hash = hashes[-1]
        partial = {path_hash: f"{node.id}#{index + 1}" for index, path_hash in enumerate(hashes[:-1])}
        try:
            await self._store.put_node(
                session.id, node, paths={node.path_hash: node.id}, partial_paths=partial, latest=node.api
            )
        except KeyError:
            raise NotFound(f"session {session.id!r} expired", param="session") from None
