"""Records for the core tests, built by hand: sessions, and nodes indexed as the proxy indexes them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rollout_proxy.ids import new_response_id, new_session_id
from rollout_proxy.records import GenerationConfig, NodeKind, ResponseNode, SessionRecord
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, path_hashes


def session_record(
    *,
    messages: list[dict[str, Any]] | None = None,
    engine: str | None = None,
    ttl: float = 60.0,
    now: float | None = None,
    n_sample: int | None = None,
    generation: GenerationConfig | None = None,
    tools: list[dict[str, Any]] | None = None,
    concurrency: dict[str, Any] | None = None,
) -> SessionRecord:
    now = time.time() if now is None else now
    return SessionRecord(
        id=new_session_id(),
        messages=messages if messages is not None else [{"role": "user", "content": "What is 2+2?"}],
        tools=tools,
        extra={},
        generation=generation or GenerationConfig(max_new_tokens=64),
        context={},
        created_at=now,
        expires_at=now + ttl,
        engine=engine,
        n_sample=n_sample,
        concurrency=concurrency,
    )


async def put_node(
    store: Any,
    session_id: str,
    parent: list[ResponseNode],
    messages: list[dict[str, Any]],
    *,
    kind: NodeKind = NodeKind.GENERATED,
    n_tokens: int = 3,
) -> list[ResponseNode]:
    """Store a node under ``parent`` (a root-to-parent path); returns the path to the new node.

    The path index follows the store contract: the node's end hash names it, every
    hash inside its messages names ``"id#k"``.
    """
    start = parent[-1].path_hash if parent else EMPTY_PATH_HASH
    hashes = path_hashes(messages, start=start)
    generated = kind is NodeKind.GENERATED
    node = ResponseNode(
        id=new_response_id(session_id),
        parent_id=parent[-1].id if parent else None,
        kind=kind,
        api="chat",
        messages=messages,
        n_input_messages=len(messages) - 1 if generated else len(messages),
        prompt_ids=np.arange(n_tokens, dtype=np.int32) + 100,
        output_ids=np.arange(n_tokens, dtype=np.int32) + 200 if generated else np.zeros(0, dtype=np.int32),
        output_logprobs=np.full(n_tokens if generated else 0, -0.5, dtype=np.float32),
        finish_reason="stop" if generated else None,
        path_hash=hashes[-1],
    )
    partial = {path_hash: f"{node.id}#{index + 1}" for index, path_hash in enumerate(hashes[:-1])}
    await store.put_node(session_id, node, paths={node.path_hash: node.id}, partial_paths=partial, latest="chat")
    return [*parent, node]
