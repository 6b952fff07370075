"""Nodes are stored as packed bytes whose size follows the tokens they add."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import orjson
import pytest

from rollout_proxy.records import ImageSpan, NodeKind, PolicySpan, ResponseNode, TopLogprobs
from rollout_proxy.state.codec import (
    COMPRESSED_MAGIC,
    MIN_COMPRESSED_BYTES,
    BlobCompressor,
    decode_node,
    encode_node,
)


def make_node(n_prompt: int, n_output: int, **fields) -> ResponseNode:
    rng = np.random.default_rng(0)
    return ResponseNode(
        id="resp_" + "a" * 32,
        parent_id="resp_" + "b" * 32,
        kind=NodeKind.GENERATED,
        api="chat",
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        n_input_messages=1,
        prompt_ids=rng.integers(0, 50000, n_prompt, dtype=np.int32),
        output_ids=rng.integers(0, 50000, n_output, dtype=np.int32),
        output_logprobs=-rng.random(n_output, dtype=np.float32),
        finish_reason="stop",
        usage={"prompt_tokens": n_prompt, "completion_tokens": n_output, "total_tokens": n_prompt + n_output},
        path_hash="abc",
        created_at=1.5,
        model="m",
        **fields,
    )


def test_roundtrip_is_exact():
    node = make_node(37, 12, fork={"diverged_from": "x", "at_message": 1}, meta={"k": 1})
    blob, routing = encode_node(node)
    assert routing is None
    back = decode_node(blob)
    for name in ("prompt_ids", "output_ids", "output_logprobs"):
        assert np.array_equal(getattr(back, name), getattr(node, name))
        assert getattr(back, name).dtype == getattr(node, name).dtype
    for name in (
        "id",
        "parent_id",
        "kind",
        "api",
        "messages",
        "n_input_messages",
        "finish_reason",
        "usage",
        "fork",
        "meta",
    ):
        assert getattr(back, name) == getattr(node, name)


def test_arrays_are_packed_bytes_not_json():
    small, large = encode_node(make_node(10, 10))[0], encode_node(make_node(1010, 1010))[0]
    # 4 bytes per token id and per logprob; only a few digits of the header grow besides
    assert 3 * 1000 * 4 <= len(large) - len(small) <= 3 * 1000 * 4 + 16


def test_routing_rows_are_a_separate_blob_and_the_header_keeps_their_span():
    from rollout_proxy.routing import RoutingRows

    experts = np.arange(6 * 4 * 2).reshape(6, 4, 2) % 8
    valid = np.array([True, True, False, True, True, True])
    node = make_node(4, 3).with_routing(RoutingRows.compact(2, experts, valid))
    blob, routing = encode_node(node)
    assert len(routing) == 6 * 4 * 2 + 1  # one byte per expert id, one bit per row
    light = decode_node(blob)
    assert light.routing is None and light.routing_span == node.routing_span
    assert light.routing_span.last_observed == 2 + 5
    full = decode_node(blob, routing)
    assert np.array_equal(full.routing.experts, node.routing.experts)
    assert np.array_equal(full.routing.valid, valid)


def test_the_policys_top_k_rows_roundtrip_after_the_other_arrays():
    rng = np.random.default_rng(1)
    top = TopLogprobs(rng.integers(0, 50000, (12, 4), dtype=np.int32), -rng.random((12, 4), dtype=np.float32))
    plain, with_top = make_node(37, 12), make_node(37, 12, output_topk=top)
    blob = encode_node(with_top)[0]
    assert len(blob) - len(encode_node(plain)[0]) <= 12 * 4 * 8 + 16  # packed: 8 bytes per (id, logprob) pair
    back = decode_node(blob)
    assert back.output_topk is not None and back.output_topk.k == 4
    assert np.array_equal(back.output_topk.ids, top.ids) and np.array_equal(back.output_topk.logprobs, top.logprobs)
    assert np.array_equal(back.output_logprobs, with_top.output_logprobs)
    assert decode_node(encode_node(plain)[0]).output_topk is None


def _same(back: ResponseNode, node: ResponseNode) -> None:
    assert back.messages == node.messages and back.usage == node.usage and back.output_topk == node.output_topk
    for name in ("prompt_ids", "output_ids", "output_logprobs"):
        assert np.array_equal(getattr(back, name), getattr(node, name))
        assert getattr(back, name).dtype == getattr(node, name).dtype


def test_a_compressed_blob_decodes_to_the_same_node_and_is_smaller_when_text_dominates():
    text = "def handler(request):\n    return web.json_response({'ok': True})\n" * 30
    node = replace(make_node(200, 100), messages=[{"role": "tool", "tool_call_id": "c", "content": text}])
    plain = encode_node(node)[0]
    packed = BlobCompressor(3).compress(plain)
    assert packed.startswith(COMPRESSED_MAGIC) and len(packed) < 0.6 * len(plain)
    _same(decode_node(packed), node)  # a fresh decompressor
    _same(decode_node(packed, compressor=BlobCompressor(0)), node)  # or one a plain-writing store keeps
    _same(decode_node(plain, compressor=BlobCompressor(3)), node)  # plain blobs stay readable


def test_blobs_stay_plain_where_compression_cannot_help():
    short = b"x" * (MIN_COMPRESSED_BYTES - 1)  # compressible, but a frame's own bytes would eat the gain
    assert BlobCompressor(3).compress(short) == short
    noise = np.random.default_rng(1).bytes(4000)  # incompressible: a frame would only be longer
    assert BlobCompressor(19).compress(noise) == noise
    assert BlobCompressor(0).compress(encode_node(make_node(500, 500))[0]) == encode_node(make_node(500, 500))[0]


def test_a_corrupt_compressed_blob_is_an_error_not_a_wrong_node():
    packed = BlobCompressor(3).compress(encode_node(make_node(500, 500))[0])
    with pytest.raises(ValueError, match="does not decompress"):
        decode_node(packed[:-20])


@pytest.mark.parametrize("level", [-1, 20])
def test_compression_levels_out_of_range_are_refused(level):
    with pytest.raises(ValueError, match="0 \\(none\\) to 19"):
        BlobCompressor(level)


def _header(blob: bytes) -> dict:
    length = int.from_bytes(blob[4:8], "little")
    return orjson.loads(blob[8 : 8 + length])


def test_a_lora_policys_spans_carry_its_name_and_a_base_nodes_are_stored_as_before_policies():
    """A LoRA span adds the policy's name fourth; base spans stay ``[version, start, end]`` triples, byte for byte
    the form nodes had before policies, so both kinds read back exactly."""
    lora = make_node(5, 9, policy_versions=(PolicySpan(1, 0, 4, "pol"), PolicySpan(2, 4, 9, "pol")))
    base = make_node(5, 9, policy_versions=(PolicySpan(3, 0, 9),))
    lora_blob, _ = encode_node(lora)
    base_blob, _ = encode_node(base)
    assert _header(lora_blob)["versions"] == [[1, 0, 4, "pol"], [2, 4, 9, "pol"]]
    assert _header(base_blob)["versions"] == [[3, 0, 9]]
    assert decode_node(lora_blob).policy_versions == lora.policy_versions
    assert decode_node(base_blob).policy_versions == (PolicySpan(3, 0, 9, "base"),)


def test_a_node_stored_before_policies_reads_as_the_base_policys():
    """A blob written by the codec before policies (its header built by hand as that codec wrote it: triples)."""
    node = make_node(3, 4)
    blob, _ = encode_node(node)
    header = {**_header(blob), "versions": [[7, 0, 2], [8, 2, 4]]}
    encoded = orjson.dumps(header)
    length = int.from_bytes(blob[4:8], "little")
    old = blob[:4] + len(encoded).to_bytes(4, "little") + encoded + blob[8 + length :]
    back = decode_node(old)
    assert back.policy_versions == (PolicySpan(7, 0, 2), PolicySpan(8, 2, 4))
    assert {span.policy for span in back.policy_versions} == {"base"}
    assert np.array_equal(back.output_ids, node.output_ids)


def test_a_nodes_image_spans_roundtrip_and_a_text_node_is_stored_as_before_images():
    spans = (ImageSpan(3, 19, "ab" * 32, 200, 120, 812), ImageSpan(25, 19, "cd" * 32, 40, 300, 97))
    with_images = make_node(50, 4, images=spans)
    blob, _ = encode_node(with_images)
    assert _header(blob)["images"] == [[3, 19, "ab" * 32, 200, 120, 812], [25, 19, "cd" * 32, 40, 300, 97]]
    assert decode_node(blob).images == spans
    text_blob, _ = encode_node(make_node(50, 4))
    assert "images" not in _header(text_blob)
    assert decode_node(text_blob).images == ()
