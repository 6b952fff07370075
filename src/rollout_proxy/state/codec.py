"""A node as one packed blob: a small JSON header, then its arrays as raw bytes.

    b"RPN1" | u32 header length | header (JSON) | array bytes, in header order

Token ids are little-endian int32 and logprobs float32, so a node's size grows with
the tokens it adds and nothing else; decoding is a few ``np.frombuffer`` views.
MoE routing rows (narrowest unsigned dtype, one mask bit per row) are a second blob,
stored apart: the header keeps only their span. The policy versions that sampled the
output are a few ``[version, start, end]`` triples in the header (one per version change,
usually one), absent when there are none; a LoRA policy's spans add its name fourth
(``[version, start, end, policy]``), so a base node is stored as before policies and an old
node reads as the base's. A session that records the policy's top-k
(``GenerationConfig.top_logprobs``) adds ``"topk": k`` to the header and two arrays after the
others: the ids (int32) and the logprobs (float32), k per output token.

A store may compress the whole blob (``BlobCompressor``): ``b"RPZ1" | a zstd frame of the
blob above``. The message text a node carries beside its tokens is most of what compresses
(README, "Storage footprint"); ``decode_node`` reads either form, so stored plain blobs stay
readable after compression is turned on, and compressed ones after it is turned off.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import zstandard

from rollout_proxy.records import BASE_POLICY, ImageSpan, NodeKind, PolicySpan, ResponseNode, TeacherScores, TopLogprobs
from rollout_proxy.routing.rows import RoutingRows, RoutingSpan
from rollout_proxy.wire.images import ImageBlob

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


COMPRESSED_MAGIC = b"RPZ1"
#: Blobs shorter than this stay plain: a zstd frame's own bytes would eat the gain.
MIN_COMPRESSED_BYTES = 256
#: zstd levels a store accepts (0: store plain; 3 is zstd's default, ~40 µs for a node of 400 tokens)
COMPRESSION_LEVELS = range(0, 20)


class BlobCompressor:
    """zstd for a store's node blobs, with its contexts kept (a fresh pair costs ~20 µs a call).

    zstd contexts are not thread-safe: one instance serves one thread (the store's event loop).
    """

    def __init__(self, level: int = 3) -> None:
        if level not in COMPRESSION_LEVELS:
            raise ValueError(f"the node compression level must be 0 (none) to 19, got {level}")
        self.level = level
        self._compressor = zstandard.ZstdCompressor(level=level) if level else None
        self._decompressor = zstandard.ZstdDecompressor()

    def compress(self, blob: bytes) -> bytes:
        """``blob`` compressed, or as it is when compression is off or does not make it smaller."""
        if self._compressor is None or len(blob) < MIN_COMPRESSED_BYTES:
            return blob
        packed = COMPRESSED_MAGIC + self._compressor.compress(blob)
        return packed if len(packed) < len(blob) else blob

    def decompress(self, blob: bytes) -> bytes:
        """A plain blob: ``blob`` itself unless it is compressed."""
        if blob[:4] != COMPRESSED_MAGIC:
            return blob
        try:
            return self._decompressor.decompress(blob[4:])
        except zstandard.ZstdError as exc:
            raise ValueError(f"a compressed blob that does not decompress: {exc}") from exc


def _header(blob: bytes, magic: bytes, what: str) -> tuple[dict[str, Any], int]:
    """A blob's JSON header, and where its arrays start."""
    if blob[:4] != magic:
        raise ValueError(f"not a stored {what}")
    (size,) = _LENGTH.unpack_from(blob, 4)
    start = 4 + _LENGTH.size
    return orjson.loads(blob[start : start + size]), start + size


def _topk_chunks(topk: TopLogprobs) -> list[bytes]:
    return [
        np.ascontiguousarray(topk.ids, dtype="<i4").tobytes(),
        np.ascontiguousarray(topk.logprobs, dtype="<f4").tobytes(),
    ]


def _read_topk(blob: bytes, offset: int, rows: int, k: int) -> TopLogprobs:
    ids = np.frombuffer(blob, dtype="<i4", count=rows * k, offset=offset).astype(np.int32, copy=False)
    values = np.frombuffer(blob, dtype="<f4", count=rows * k, offset=offset + 4 * rows * k)
    return TopLogprobs(ids=ids.reshape(rows, k), logprobs=values.astype(np.float32, copy=False).reshape(rows, k))


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
        header["versions"] = [_span_entry(span) for span in node.policy_versions]
    if node.images:
        header["images"] = [
            [span.start, span.length, span.sha256, span.width, span.height, span.nbytes] for span in node.images
        ]
    if node.output_topk is not None:
        header["topk"] = node.output_topk.k
        chunks += _topk_chunks(node.output_topk)
    encoded = orjson.dumps(header)
    routing = None if node.routing is None else node.routing.to_bytes()
    return b"".join([MAGIC, _LENGTH.pack(len(encoded)), encoded, *chunks]), routing


def _span_entry(span: PolicySpan) -> list[int | str]:
    """``[version, start, end]`` for the base policy (as nodes stored before policies), else the policy's name
    fourth."""
    entry: list[int | str] = [span.version, span.start, span.end]
    if span.policy != BASE_POLICY:
        entry.append(span.policy)
    return entry


def decode_node(blob: bytes, routing: bytes | None = None, *, compressor: BlobCompressor | None = None) -> ResponseNode:
    """A node from its blob, plain or compressed (``compressor``: contexts to reuse; a fresh one otherwise)."""
    if blob[:4] == COMPRESSED_MAGIC:
        blob = (compressor or BlobCompressor(0)).decompress(blob)
    header, offset = _header(blob, MAGIC, "response node")
    arrays: dict[str, Any] = {}  # ResponseNode fields by name, passed as keywords
    for (name, dtype), length in zip(ARRAYS.items(), header.pop("lengths"), strict=True):
        arrays[name] = np.frombuffer(blob, dtype=dtype, count=length, offset=offset).astype(dtype[1:], copy=False)
        offset += length * np.dtype(dtype).itemsize
    span_data = header.pop("routing", None)
    span = None if span_data is None else RoutingSpan.from_dict(span_data)
    rows = None if span is None or routing is None else RoutingRows.from_bytes(span, routing)
    kind = NodeKind(header.pop("kind"))
    versions = tuple(PolicySpan(*entry) for entry in header.pop("versions", ()))  # 3 long: the base's
    images = tuple(ImageSpan(*entry) for entry in header.pop("images", ()))
    k = header.pop("topk", 0)
    topk = _read_topk(blob, offset, len(arrays["output_ids"]), k) if k else None
    return ResponseNode(
        kind=kind,
        routing_span=span,
        routing=rows,
        policy_versions=versions,
        output_topk=topk,
        images=images,
        **header,
        **arrays,
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
        chunks += _topk_chunks(scores.topk)
    encoded = orjson.dumps(header)
    return b"".join([SCORES_MAGIC, _LENGTH.pack(len(encoded)), encoded, *chunks])


def decode_scores(blob: bytes) -> TeacherScores:
    header, offset = _header(blob, SCORES_MAGIC, "teacher pass")
    n = header["n"]
    logprobs = np.frombuffer(blob, dtype="<f4", count=n, offset=offset).astype(np.float32, copy=False)
    topk = _read_topk(blob, offset + 4 * n, *header["topk"]) if "topk" in header else None
    return TeacherScores(
        teacher=header["teacher"], logprobs=logprobs, topk=topk, n_tokens_injected=header["n_tokens_injected"]
    )


IMAGE_MAGIC = b"RPI1"


def encode_image(image: ImageBlob) -> bytes:
    """An image as one blob: ``RPI1`` | u32 header length | header (mime, width, height) | its bytes as sent
    (images are compressed already: stored as they are)."""
    encoded = orjson.dumps({"mime": image.mime, "width": image.width, "height": image.height})
    return b"".join([IMAGE_MAGIC, _LENGTH.pack(len(encoded)), encoded, image.data])


def decode_image(blob: bytes, sha256: str) -> ImageBlob:
    header, offset = _header(blob, IMAGE_MAGIC, "image")
    return ImageBlob(blob[offset:], header["mime"], header["width"], header["height"], sha256)
