"""The engine interface: token ids in, token ids (and their logprobs) out; and its control plane.

The proxy never sends text to generate from: ``complete`` takes the exact prompt
token ids, and the chat template is only used, through ``tokenize_messages``, to
render the messages the policy did not generate.

The control plane is vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``): pause and resume for a
weight update, and the weight version the engine reports. An engine that does not serve
those routes answers ``None`` / ``False`` where that is an answer (no version known, no
version set), and raises where the fleet needs the step done (pause, resume).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from rollout_proxy.records import TopLogprobs
from rollout_proxy.wire.images import ImageBlob

#: vLLM's own floor for -inf logprobs; non-finite values are clamped to it and counted.
LOGPROB_FLOOR = -9999.0


def clamped_logprob(value: Any) -> float:
    """A logprob as vLLM's floor reads it: None and non-finite values are ``LOGPROB_FLOOR``."""
    number = LOGPROB_FLOOR if value is None else float(value)
    return number if math.isfinite(number) else LOGPROB_FLOOR


PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    routed_experts_prompt_start: int | None = None  # only for engines that return routing
    cache_salt: str | None = None  # the fleet's per-version salt: no KV computed under other weights is reused
    top_logprobs: int = 0  # k > 0: the top-k at each sampled token too (vLLM ``logprobs: k``); not streamed
    #: the ``model`` the call names: a LoRA adapter's served name (``engines.policies``); None: the base model
    served_model: str | None = None


@dataclass(frozen=True, slots=True)
class PromptImages:
    """The images of a prompt, for an engine that expands them itself (vLLM's ``/inference/v1/generate``): the
    prompt the proxy holds has each image's placeholder span at ``spans`` (offset, length), in order; the engine
    is sent the prompt with each span collapsed to the one ``marker_id`` (``collapse``) and ``images`` in the
    same order, and echoes the spans it expanded (``EngineCompletion.image_spans``)."""

    marker_id: int
    spans: tuple[tuple[int, int], ...]
    images: tuple[ImageBlob, ...]

    def collapse(self, prompt: np.ndarray) -> np.ndarray:
        """``prompt`` (the expanded one, maybe followed by tokens of a continued turn) with each span replaced by
        the marker; ``core`` has checked that the spans are the model's (``tokenization.images``)."""
        parts: list[np.ndarray] = []
        start = 0
        marker = np.asarray([self.marker_id], dtype=np.int32)
        for offset, length in self.spans:
            parts += [prompt[start:offset], marker]
            start = offset + length
        parts.append(prompt[start:])
        return np.concatenate(parts).astype(np.int32, copy=False)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    url: str
    model: str
    max_model_len: int
    root: str | None = None  # the model card's ``root`` (vLLM: the model path it loaded), for local rendering


@dataclass(slots=True)
class EngineCompletion:
    prompt_ids: np.ndarray | None  # what the engine says it consumed (None if not reported)
    output_ids: np.ndarray  # int32
    output_logprobs: np.ndarray  # float32, the sampled tokens' logprobs
    text: str
    finish_reason: str  # stop, length, or abort (cut by a pause or an abort request: the tokens so far)
    nonfinite_logprobs: int = 0  # how many logprobs were NaN/inf and clamped
    routed_experts: str | None = None  # the engine's encoded routing, decoded by routing/
    output_topk: TopLogprobs | None = None  # with ``SamplingParams.top_logprobs``
    #: vLLM's ``stop_reason``: the stop string (or token id) that ended it; None for EOS or a length cut
    stop_reason: str | int | None = None
    #: with ``PromptImages``: the (offset, length) of each image's span in the prompt the engine expanded, as it
    #: reports them (vLLM's ``mm_placeholders``); None when it does not say
    image_spans: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class CompletionPiece:
    """Part of a completion as the engine streamed it (all of it at once, from an engine that cannot stream)."""

    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, clamped as in ``EngineCompletion``
    text: str
    finish_reason: str | None = None


class PieceSink(Protocol):
    """Who receives a streamed completion's pieces as they arrive (``core.streaming``)."""

    async def begin(self, prompt_ids: np.ndarray) -> None:
        """A call from ``prompt_ids`` is about to be sent (a failover or a resubmission sends another)."""
        ...

    async def piece(self, piece: CompletionPiece) -> None: ...


class GenerationEngine(Protocol):
    """What a turn needs of an engine: its model card, its chat template's renders, and samples.

    ``core`` depends on this alone; a scripted one in the tests' own process stands in for it there."""

    url: str
    #: whether completions carry MoE routing; None until the first completion tells
    returns_routing: bool | None

    async def info(self) -> EngineInfo: ...

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray: ...

    async def tokenize_text(self, text: str) -> np.ndarray: ...

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included."""
        ...

    async def complete(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        *,
        on_sent: Callable[[], None] | None = None,
        sink: PieceSink | None = None,
        images: PromptImages | None = None,
    ) -> EngineCompletion:
        """``on_sent`` is called once the request has left for the engine (the fleet's pause waits for it).
        With a ``sink`` the output also goes there in pieces as it is sampled, where the engine can stream it
        exactly (else nothing goes there: the caller relays the completion); the completion is the same.
        ``images``: the prompt's images (its spans expanded in ``prompt_ids``); only passed when there are some,
        so an engine that takes none never sees the argument."""
        ...


class EngineControl(Protocol):
    """What the fleet needs of an engine besides generation: health, the weight version, pause and resume
    (vLLM's dev mode), and closing its connections."""

    url: str

    async def healthy(self) -> bool: ...

    async def health(self) -> None:
        """``GET /health`` within the health timeout; raises the error of the tree that says why not."""
        ...

    async def weight_version(self) -> str | None:
        """The engine's ``weight_version`` (``GET /weight_info``), as it reports it; None: not served."""
        ...

    async def update_weight_version(self, version: str, *, within: float) -> bool:
        """Tell the engine its weights are now ``version``; False: the engine does not serve this."""
        ...

    async def pause(self, mode: PauseMode, *, within: float) -> None: ...

    async def resume(self, *, within: float) -> None: ...

    async def is_paused(self) -> bool | None:
        """None: the engine does not serve ``/is_paused``."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AdapterCard:
    """A LoRA adapter an engine serves, as ``GET /v1/models`` lists it (``parent``: the base's served name)."""

    name: str
    path: str | None
    parent: str | None


@runtime_checkable
class AdapterControl(Protocol):
    """Loading and unloading LoRA adapters at run time (vLLM with ``--enable-lora`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``). An engine without it serves the base model only."""

    url: str

    async def load_adapter(self, name: str, path: str, *, within: float) -> None:
        """Serve the adapter at ``path`` (a directory on the engine's host) as ``name``; raises
        ``AdapterRefused`` when the engine refuses it (and stays healthy)."""
        ...

    async def unload_adapter(self, name: str, *, within: float) -> bool:
        """Stop serving ``name`` (calls in flight on it finish); False: it was not loaded."""
        ...

    async def adapters(self) -> list[AdapterCard]:
        """The adapters the engine serves now."""
        ...


class Engine(GenerationEngine, EngineControl, Protocol):
    """One engine of the fleet: generation and control (a vLLM server's HTTP client, or a test's double)."""
