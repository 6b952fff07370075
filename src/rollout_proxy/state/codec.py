"""A node as one packed blob: a small JSON header, then its arrays as raw bytes.

    b"RPN1" | u32 header length | header (JSON) | array bytes, in header order

Token ids are little-endian int32 and logprobs float32, so a node's size grows with
the tokens it adds and nothing else; decoding is a few ``np.frombuffer`` views.
MoE routing rows (narrowest unsigned dtype, one mask bit per row) are a second blob,
stored apart: the header keeps only their span. The policy versions that sampled the
output are a few ``[version, start, end]`` triples in the header (one per version change,
usually one), absent when there are none.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

from rollout_proxy.records import NodeKind, PolicySpan, ResponseNode
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
    return ResponseNode(kind=kind, routing_span=span, routing=rows, policy_versions=versions, **header, **arrays)
