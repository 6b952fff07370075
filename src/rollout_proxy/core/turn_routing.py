"""A generated turn's MoE routed experts, aligned to its path (see ``routing/``)."""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from rollout_proxy.engines.base import EngineCompletion
from rollout_proxy.errors import EngineError
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import ResponseNode
from rollout_proxy.routing import (
    RoutingFormatError,
    RoutingRows,
    align_turn,
    decode_engine_routing,
    first_row_position,
    prompt_start,
)
from rollout_proxy.state.store import StateStore

log = structlog.get_logger(__name__)


async def align_routing(
    store: StateStore,
    metrics: Metrics,
    session_id: str,
    parent: Sequence[ResponseNode],
    completion: EngineCompletion,
    *,
    prompt_len: int,
    requested_start: int,
    engine_url: str,
) -> tuple[RoutingRows | None, int]:
    """(the turn's rows, how many re-sent rows disagreed with held ones); (None, 0) for dense models."""
    if completion.routed_experts is None:
        return None, 0
    try:
        rows, valid = decode_engine_routing(completion.routed_experts)
        first = first_row_position(
            prompt_len=prompt_len,
            output_len=len(completion.output_ids),
            requested_start=requested_start,
            n_rows=len(rows),
        )
        if first < prompt_start(parent):  # rows we already hold came again: compare them
            parent = await store.get_path(session_id, parent[-1].id, routing=True) or []
        routing, disagreements = align_turn(parent, first=first, rows=rows, valid=valid)
    except RoutingFormatError as exc:
        metrics.inc("routing_malformed_total")
        log.warning("routing_malformed", engine=engine_url, error=str(exc))
        raise EngineError(f"the engine returned unusable routed experts: {exc}") from None
    if disagreements:
        metrics.inc("routing_disagreements_total", disagreements)
        log.warning("routing_disagreement", rows=disagreements)
    return routing, disagreements
