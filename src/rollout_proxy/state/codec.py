"""A node as one packed blob: a small JSON header, then its arrays as raw bytes.

    b"RPN1" | u32 header length | header (JSON) | array bytes, in header order

Token ids are little-endian int32 and logprobs float32, so a node's size grows with
the tokens it adds and nothing else; decoding is a few ``np.frombuffer`` views.
MoE routing rows (narrowest unsigned dtype, one mask bit per row) are a second blob,
stored apart: the header keeps only their span. The policy versions that sampled the
output are a few ``[version, start, end]`` triples in the header (one per version change,
usually one), absent when there are none. A session that records the policy's top-k
(``GenerationConfig.top_logprobs``) adds ``"topk": k`` to the header and two arrays after the
others: the ids (int32) and the logprobs (float32), k per output token.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

from rollout_proxy.records import NodeKind, PolicySpan, ResponseNode, TeacherScores, TopLogprobs
from rollout_proxy.routing.rows import RoutingRows, RoutingSpan

MAGIC = b"RPN1"
_LENGTH = struct.Struct("<I")
#: node attribute -> little-endian dtype of its stored bytes
ARRAYS: dict[str, str] = {"prompt_ids": "<i4", "output_ids": "<i4", "output_logprobs": "<f4"}
_SCALARS = (
    "id",
    "parent_id",
    "api",
    "messages",
    "n_input_messages",
    "finish_reason",
    "usage",
    "path_hash",
    "created_at",
    "model",
    "fork",
    "meta",
)


def encode_node(node: ResponseNode) -> tuple[bytes, bytes | None]:
    """(the node blob, its routing blob or None)."""
    header: dict[str, Any] = {name: getattr(node, name) for name in _SCALARS}
    header["kind"] = node.kind.value
    chunks = []
    lengths = []
    for name, dtype in ARRAYS.items():
        array = np.ascontiguousarray(getattr(node, name), dtype=dtype)
        lengths.append(len(array))
        chunks.append(array.tobytes())
    header["lengths"] = lengths
    if node.routing_span is not None:
        header["routing"] = node.routing_span.to_dict()
    if node.policy_versions:
        header["versions"] = [[span.version, span.start, span.end] for span in node.policy_versions]
    if node.output_topk is not None:
        header["topk"] = node.output_topk.k
        chunks.append(np.ascontiguousarray(node.output_topk.ids, dtype="<i4").tobytes())
        chunks.append(np.ascontiguousarray(node.output_topk.logprobs, dtype="<f4").tobytes())
    encoded = orjson.dumps(header)
    routing = None if node.routing is None else node.routing.to_bytes()
    return b"".join([MAGIC, _LENGTH.pack(len(encoded)), encoded, *chunks]), routing


def decode_node(blob: bytes, routing: bytes | None = None) -> ResponseNode:
    if blob[:4] != MAGIC:
        raise ValueError("not a stored response node")
    (size,) = _LENGTH.unpack_from(blob, 4)
    start = 4 + _LENGTH.size
    header = orjson.loads(blob[start : start + size])
    offset = start + size
    arrays: dict[str, Any] = {}  # ResponseNode fields by name, passed as keywords
    for (name, dtype), length in zip(ARRAYS.items(), header.pop("lengths"), strict=True):
        arrays[name] = np.frombuffer(blob, dtype=dtype, count=length, offset=offset).astype(dtype[1:], copy=False)
        offset += length * np.dtype(dtype).itemsize
    span_data = header.pop("routing", None)
    span = None if span_data is None else RoutingSpan.from_dict(span_data)
    rows = None if span is None or routing is None else RoutingRows.from_bytes(span, routing)
    kind = NodeKind(header.pop("kind"))
    versions = tuple(PolicySpan(*triple) for triple in header.pop("versions", ()))
    k = header.pop("topk", 0)
    topk = None
    if k:
        n = len(arrays["output_ids"])
        ids = np.frombuffer(blob, dtype="<i4", count=n * k, offset=offset).astype(np.int32, copy=False)
        offset += n * k * 4
        values = np.frombuffer(blob, dtype="<f4", count=n * k, offset=offset).astype(np.float32, copy=False)
        topk = TopLogprobs(ids=ids.reshape(n, k), logprobs=values.reshape(n, k))
    return ResponseNode(
        kind=kind, routing_span=span, routing=rows, policy_versions=versions, output_topk=topk, **header, **arrays
    )


SCORES_MAGIC = b"RPT1"


def encode_scores(scores: TeacherScores) -> bytes:
    """A teacher pass as one blob, as a node: ``RPT1`` | u32 header length | header | logprobs f4 [| ids i4 | f4]."""
    header: dict[str, Any] = {
        "teacher": scores.teacher,
        "n": len(scores.logprobs),
        "n_tokens_injected": scores.n_tokens_injected,
    }
    chunks = [np.ascontiguousarray(scores.logprobs, dtype="<f4").tobytes()]
    if scores.topk is not None:
        header["topk"] = [len(scores.topk), scores.topk.k]
        chunks.append(np.ascontiguousarray(scores.topk.ids, dtype="<i4").tobytes())
        chunks.append(np.ascontiguousarray(scores.topk.logprobs, dtype="<f4").tobytes())
    encoded = orjson.dumps(header)
    return b"".join([SCORES_MAGIC, _LENGTH.pack(len(encoded)), encoded, *chunks])


def decode_scores(blob: bytes) -> TeacherScores:
    if blob[:4] != SCORES_MAGIC:
        raise ValueError("not a stored teacher pass")
    (size,) = _LENGTH.unpack_from(blob, 4)
    start = 4 + _LENGTH.size
    header = orjson.loads(blob[start : start + size])
    offset = start + size
    n = header["n"]
    logprobs = np.frombuffer(blob, dtype="<f4", count=n, offset=offset).astype(np.float32, copy=False)
    offset += 4 * n
    topk = None
    if "topk" in header:
        rows, k = header["topk"]
        ids = np.frombuffer(blob, dtype="<i4", count=rows * k, offset=offset).astype(np.int32, copy=False)
        offset += 4 * rows * k
        values = np.frombuffer(blob, dtype="<f4", count=rows * k, offset=offset).astype(np.float32, copy=False)
        topk = TopLogprobs(ids=ids.reshape(rows, k), logprobs=values.reshape(rows, k))
    return TeacherScores(
        teacher=header["teacher"], logprobs=logprobs, topk=topk, n_tokens_injected=header["n_tokens_injected"]
    )
