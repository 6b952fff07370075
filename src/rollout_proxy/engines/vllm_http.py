"""A vLLM OpenAI server driven token-in, token-out over HTTP.

Third-party failures are translated here, once: an engine we cannot reach (refused,
reset, no connection within the connect timeout) is ``EngineUnreachable``, an
``EngineUnavailable`` (503), one that took the request and did not answer in time is
``EngineTimeout`` (504), one that answers with an error or with a body we cannot use is
``EngineError`` (502). Messages never name the engine: plugins must not learn the fleet's
addresses. The URL goes to the log line written here (same request id as the client's error).

The dev-mode control routes (``/pause``, ``/resume``, ``/is_paused``, ``/weight_info``,
``/update_weight_version``) are vLLM 0.32's ``vllm/entrypoints/rl/online/api_router.py``.

LoRA adapters (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``): ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` answer 200 with plain text, or vLLM's error body: 400 (a name already
loaded, the base's name), 404 (no adapter at the path, an unknown name), 500 (files it cannot use, a rank
above ``--max-lora-rank``, modules it does not support: the adapter's fault, the engine stays healthy).
They become ``AdapterRefused`` (a 400) in words. A call naming a served model the engine does not have
(an adapter not loaded, or lost in a restart) is vLLM's 404 with ``param: "model"``: ``ServedModelMissing``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import math
import re
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
import numpy as np
import orjson
import structlog

from rollout_proxy import tracing
from rollout_proxy.engines.base import (
    LOGPROB_FLOOR,
    AdapterCard,
    EngineCompletion,
    EngineInfo,
    PauseMode,
    PieceSink,
    PromptImages,
    SamplingParams,
    clamped_logprob,
)
from rollout_proxy.engines.streaming import DONE, SSEReader, StreamAssembly
from rollout_proxy.errors import (
    AdapterRefused,
    EngineBusy,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    ProxyError,
    TemplateRenderError,
)
from rollout_proxy.records import TopLogprobs
from rollout_proxy.settings import default
from rollout_proxy.wire.json_bytes import value_at

log = structlog.get_logger(__name__)

#: What vLLM's ``/tokenize`` answers when the chat template fails on the messages it was sent.
TEMPLATE_FAILURE_STATUSES = frozenset({400, 422})
#: Connections kept beyond the pool of data calls for health probes and control calls, so a pool full
#: of long generations never makes a probe wait (and the fleet think the engine is down).
CONTROL_CONNECTIONS = 8
#: Times a call that failed on a reused keep-alive connection, before any answer, is sent again (on
#: another connection) before the failure counts as the engine's.
STALE_CONNECTION_RETRIES = 2
#: Seconds an idle connection to an engine is kept for reuse: under the 5 s after which vLLM's server
#: closes an idle one (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``). aiohttp keeps them 15 s by default, so a
#: call after 5-15 s of quiet raced the server's close and was reset (seen on a resume after a keep
#: pause); the stale-connection retry above stays for a server configured shorter.
ENGINE_KEEPALIVE_S = 3.0
#: Error statuses that mean "this engine does not serve that route" (vLLM without dev mode).
NOT_SERVED = frozenset({404})
#: What vLLM answers a LoRA load or unload it refuses: the adapter's fault (or a name), not the engine's.
_REFUSALS = frozenset({400, 404, 422, 500})


T = TypeVar("T")


#: vLLM's token-in route that also takes images (``--enable-scale-out``)
GENERATE_PATH = "/inference/v1/generate"

#: the ``request_id`` prefix of ``VLLMEngine.learn_routing``'s probe (vLLM takes a client's request id)
ROUTING_PROBE_ID = "rollout-proxy-routing-probe"


def is_routing_probe(payload: dict[str, Any]) -> bool:
    return str(payload.get("request_id") or "").startswith(ROUTING_PROBE_ID)


def _stop_reason(choice: dict[str, Any]) -> str | int | None:
    """vLLM's ``stop_reason`` (the stop string or token id that ended the completion), if it is one."""
    value = choice.get("stop_reason")
    return value if isinstance(value, str | int) and not isinstance(value, bool) else None


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        # Python's json accepts NaN/Infinity, which some engines emit in logprobs.
        return json.loads(body)


_ECHO_KEY = b'"prompt_token_ids":'


class PromptEcho:
    """The prompt as sent, and the engine's echo of it (``prompt_token_ids``) read back cheaply.

    The prompt is serialized once, as compact JSON, for the request. vLLM answers in compact JSON
    too, so an echo equal to the prompt sent is that same run of bytes: it is found by its key and
    one compare (``wire.json_bytes.value_at``) and left out of the parse, instead of parsing and converting one
    Python int per prompt token (~75 µs per 1,000 tokens here, every turn, growing with the
    conversation). Any other echo (other bytes, other spacing) is parsed and compared as before, so
    a drifted prompt is still refused."""

    __slots__ = ("array", "json")

    def __init__(self, prompt_ids: np.ndarray) -> None:
        self.array = np.ascontiguousarray(prompt_ids, dtype=np.int32)
        self.json = orjson.dumps(self.array, option=orjson.OPT_SERIALIZE_NUMPY)

    def parse(self, body: bytes) -> tuple[Any, bool]:
        """``body`` parsed, and whether it echoed exactly this prompt (then its ``prompt_token_ids`` is null)."""
        at = value_at(body, _ECHO_KEY, self.json)
        if at < 0:
            return _loads(body), False
        return _loads(b"".join((body[:at], b"null", body[at + len(self.json) :]))), True


def _error_message(payload: Any, fallback: str) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(payload.get("detail"), str):
            return payload["detail"]
        if isinstance(payload.get("message"), str):
            return payload["message"]
    return fallback


def _error_param(body: bytes) -> str | None:
    """The ``param`` of vLLM's error body, if it is one."""
    try:
        payload = _loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


def _sampled_logprobs(choice: dict[str, Any], n_tokens: int) -> tuple[np.ndarray, int]:
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) != n_tokens:
        raise EngineError("engine returned no sampled logprob for every token (was logprobs=0 ignored?)")
    missing = sum(1 for value in values if value is None)
    clean = [LOGPROB_FLOOR if value is None else float(value) for value in values]
    nonfinite = missing + sum(1 for value in clean if not math.isfinite(value))
    array = np.asarray(clean, dtype=np.float32)
    if nonfinite:
        array = np.nan_to_num(array, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0)
    return array, nonfinite


def _top_logprobs(choice: dict[str, Any], output_ids: np.ndarray, k: int) -> TopLogprobs:
    """vLLM's ``logprobs: k`` with ``return_tokens_as_token_ids``: per token a dict ``"token_id:N" -> logprob``
    listing the sampled token first, then the top k (one key fewer when the sampled token is among them).
    Read back as the top k, best first (ties in vLLM's order), non-finite values clamped as sampled ones are."""
    logprobs = choice.get("logprobs")
    entries = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list) or len(entries) != len(output_ids):
        raise EngineError(f"the engine returned no top-{k} logprobs for every sampled token")
    ids = np.empty((len(entries), k), dtype=np.int32)
    values = np.empty((len(entries), k), dtype=np.float32)
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise EngineError(f"the engine's top logprobs at token {position} are not a mapping")
        try:
            ranked = [(int(str(key).removeprefix("token_id:")), clamped_logprob(value)) for key, value in entry.items()]
        except (TypeError, ValueError) as exc:
            raise EngineError(f"the engine's top logprobs at token {position} are not keyed by token id") from exc
        if len(ranked) == k + 1:
            ranked = ranked[1:]  # the sampled token, outside the top k
        else:
            ranked.sort(key=lambda item: -item[1])  # the sampled one in its place (stable: ties keep vLLM's order)
        if len(ranked) != k:
            raise EngineError(f"the engine returned {len(ranked)} top logprobs at token {position}, not {k}")
        ids[position] = [token for token, _ in ranked]
        values[position] = [value for _, value in ranked]
    return TopLogprobs(ids=ids, logprobs=values)


def placeholder_spans(response: dict[str, Any]) -> tuple[tuple[int, int], ...] | None:
    """Where a ``/inference/v1/generate`` answer (or its first streamed chunk) says the engine put each image's
    span (``mm_placeholders["image"]``: offset, length); None when it does not say."""
    placeholders = response.get("mm_placeholders")
    if not isinstance(placeholders, dict):
        return None
    try:
        return tuple((int(item["offset"]), int(item["length"])) for item in placeholders.get("image") or ())
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError("the engine's mm_placeholders are not offsets and lengths") from exc


def generate_chunk(chunk: Any) -> Any:
    """A streamed ``/inference/v1/generate`` chunk in a streamed ``/v1/completions`` chunk's shape, as
    ``StreamAssembly`` reads it: the prompt's echo (top-level there) on the choice, each token's logprob from
    ``logprobs.content`` as ``token_logprobs``. Anything else (an error, a usage chunk) is left as it is."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return chunk
    choice = dict(choices[0])
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list):
        choice["logprobs"] = {"token_logprobs": [e.get("logprob") if isinstance(e, dict) else None for e in content]}
    choice["prompt_token_ids"] = chunk.get("prompt_token_ids")
    return {**chunk, "choices": [choice]}


def generated(response: Any, *, top_logprobs: int = 0) -> EngineCompletion:
    """vLLM's ``GenerateTextResponse`` (``/inference/v1/generate``, ``output_mode: "text"``) as a completion:
    ``choices[0]``'s ``token_ids``, ``text``, ``logprobs.content[i].logprob`` (and its ``top_logprobs``, keyed
    ``token_id:N``), the expanded ``prompt_token_ids`` and ``mm_placeholders["image"]``."""
    try:
        choice = response["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineError("the engine returned a generation without choices") from exc
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list):
        raise EngineError("the engine returned no token_ids")
    output_ids = np.asarray(token_ids, dtype=np.int32)
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(output_ids):
        raise EngineError("the engine returned no sampled logprob for every token (was logprobs=0 ignored?)")
    values = [clamped_logprob(entry.get("logprob") if isinstance(entry, dict) else None) for entry in content]
    nonfinite = sum(
        1
        for entry in content
        if not isinstance(entry, dict) or entry.get("logprob") is None or not math.isfinite(float(entry["logprob"]))
    )
    topk = _generated_topk(content, top_logprobs) if top_logprobs else None
    prompt = response.get("prompt_token_ids")
    spans = placeholder_spans(response)
    return EngineCompletion(
        prompt_ids=None if prompt is None else np.asarray(prompt, dtype=np.int32),
        output_ids=output_ids,
        output_logprobs=np.asarray(values, dtype=np.float32),
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason") or "stop",
        nonfinite_logprobs=nonfinite,
        routed_experts=choice.get("routed_experts"),
        output_topk=topk,
        stop_reason=_stop_reason(choice),
        image_spans=spans,
    )


def _generated_topk(content: list[Any], k: int) -> TopLogprobs:
    """The top ``k`` per sampled token from a text-mode generation asked for ``k + 1`` (vLLM lists the sampled
    token first, then the best, and keeps only the first ``k + 1`` of them: with one more asked for, those hold
    the top ``k`` whether or not the sampled token is among them). Keys must be ``token_id:N``."""
    ids = np.empty((len(content), k), dtype=np.int32)
    values = np.empty((len(content), k), dtype=np.float32)
    for position, entry in enumerate(content):
        items = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(items, list):
            raise EngineError(f"the engine returned no top logprobs at token {position}")
        try:
            ranked = [
                (int(str(item["token"]).removeprefix("token_id:")), clamped_logprob(item.get("logprob")))
                for item in items
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(
                "the engine's top logprobs are not keyed by token id: an image turn's top logprobs need vLLM "
                "started with --return-tokens-as-token-ids"
            ) from exc
        ranked = list(dict(ranked).items())  # each token once
        ranked.sort(key=lambda item: -item[1])  # stable: ties keep vLLM's order
        if len(ranked) < k:
            raise EngineError(f"the engine returned {len(ranked)} top logprobs at token {position}, not {k}")
        ids[position] = [token for token, _ in ranked[:k]]
        values[position] = [value for _, value in ranked[:k]]
    return TopLogprobs(ids=ids, logprobs=values)


class EngineRejected(EngineError):
    """The engine answered an HTTP error (a 502 to the client); ``engine_status`` is what it answered.

    Not ``status``: that is the status the proxy answers with, for every error of the tree.
    """

    def __init__(self, message: str, *, engine_status: int) -> None:
        super().__init__(message)
        self.engine_status = engine_status


class ServedModelMissing(EngineRejected):
    """The engine does not serve the model the call named (vLLM's 404 with ``param: "model"``): an adapter
    that is not loaded there, or no longer (unloaded, or the engine restarted without it)."""

    code = "served_model_missing"


class AdapterAlreadyLoaded(AdapterRefused):
    """``load_adapter`` under a name the engine already serves (vLLM's 400; the path may differ)."""


class AdapterLoadingNotServed(AdapterRefused):
    """The engine has no run-time LoRA routes (vLLM without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``)."""


#: vLLM's words around a worker's error in a failed load (``Call to add_lora method failed: ...``)
_WORKER_ERROR = re.compile(r"Worker failed with error '(?P<words>.*)', please check the stack trace", re.DOTALL)


def _adapter_words(message: str) -> str:
    """vLLM's reason for refusing an adapter, without its wrapping about stack traces."""
    found = _WORKER_ERROR.search(message)
    return found.group("words") if found else message


class EngineUnreachable(EngineUnavailable):
    """Refused, reset, or no connection within the connect timeout: the engine is down, not just busy
    (the fleet opens its circuit breaker at once, where a 503 or a timeout only counts)."""


async def _request_sent(session: aiohttp.ClientSession, context: SimpleNamespace, params: object) -> None:
    """Trace hook: the request is on the wire; tell whoever asked (``complete``'s ``on_sent``)."""
    callback = (context.trace_request_ctx or {}).get("on_sent")
    if callback is not None:
        callback()


async def _connection_reused(session: aiohttp.ClientSession, context: SimpleNamespace, params: object) -> None:
    """Trace hook: the request went out on a pooled keep-alive connection (``_send`` may retry it once)."""
    if isinstance(context.trace_request_ctx, dict):
        context.trace_request_ctx["reused"] = True


async def _carry_trace(session: aiohttp.ClientSession, context: SimpleNamespace, params: Any) -> None:
    """Trace hook: the W3C ``traceparent`` of the current span (``tracing.engine_call``'s) on to the engine."""
    tracing.inject(params.headers)


def _tracing() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_request_sent)
    trace.on_request_chunk_sent.append(_request_sent)
    trace.on_connection_reuseconn.append(_connection_reused)
    trace.on_request_start.append(_carry_trace)
    return trace


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The sampling settings of a generate call, as ``/v1/completions`` and ``/inference/v1/generate``'s
    ``sampling_params`` both take them. Every setting is sent explicitly: vLLM otherwise fills some from the
    model's ``generation_config.json``."""
    fields: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # vLLM's "no top-k" is -1; the seed's GenerationConfig spells it 0.
        "top_k": params.top_k if params.top_k > 0 else -1,
        "n": 1,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    if params.seed is not None:
        fields["seed"] = params.seed
    if params.stop:
        fields["stop"] = list(params.stop)
    if params.routed_experts_prompt_start is not None:
        fields["routed_experts_prompt_start"] = params.routed_experts_prompt_start
    return fields


def generate_payload(
    model: str, prompt_ids: np.ndarray, images: PromptImages, sampling: dict[str, Any]
) -> dict[str, Any]:
    """A ``/inference/v1/generate`` body for a prompt with images: each span collapsed to its marker, the images
    as ``content_parts`` in prompt order (data URLs; ``uuid``: the sha256, vLLM's cache key for the image), and
    the echo of the expanded prompt and its spans asked for (``return_token_ids``)."""
    return {
        "model": model,
        "token_ids": images.collapse(prompt_ids).tolist(),
        "content_parts": [
            {
                "type": "image_url",
                "url": f"data:{image.mime};base64,{base64.b64encode(image.data).decode('ascii')}",
                "uuid": image.sha256,
            }
            for image in images.images
        ],
        "sampling_params": sampling,
        "return_token_ids": True,
        "output_mode": "text",
        "stream": False,
    }


class VLLMEngine:
    """Client of one vLLM server (``/tokenize``, ``/v1/completions``, ``/v1/models``, the dev-mode routes)."""

    def __init__(
        self,
        url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        request_timeout: float = default("engine_timeout"),
        connect_timeout: float = default("engine_connect_timeout"),
        first_byte_timeout: float | None = None,
        health_timeout: float = default("engine_health_timeout"),
        bound_completions: bool = True,
        max_connections: int = default("engine_max_connections"),
        pool_timeout: float = default("engine_pool_timeout"),
        hang_timeout: float | None = None,
    ) -> None:
        """Timeouts in seconds: ``request_timeout`` bounds a whole call, ``connect_timeout`` the TCP
        connect, ``first_byte_timeout`` (default: the whole call) the wait for the answer to start.

        ``bound_completions=False`` leaves completions to the caller's deadline (the fleet's, which
        stops counting while the fleet is paused: a call frozen by a keep-mode pause must live).

        Data calls (generation, ``/tokenize``) share ``max_connections`` connections; one that finds
        them all busy waits up to ``pool_timeout`` seconds, then fails with ``EngineBusy`` (a 503).

        ``hang_timeout``: how long a call that is no generation (``/tokenize``, ``/detokenize``, ``/v1/models``)
        waits for its answer to start: such answers take milliseconds, so a hung engine is given up on in
        seconds, not after ``first_byte_timeout`` (generations are watched by the fleet instead)."""
        self.url = url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout, sock_connect=connect_timeout, sock_read=first_byte_timeout
        )
        self._completion_timeout = (
            self._timeout if bound_completions else aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        )
        self._connect_timeout = connect_timeout
        self._quick_timeout = (
            self._timeout
            if hang_timeout is None
            else aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout, sock_read=hang_timeout)
        )
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout, sock_connect=health_timeout)
        self._max_connections = max_connections
        self._pool_timeout = pool_timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._info: EngineInfo | None = None
        #: does this engine attach MoE routing? Learned from a completion (``learn_routing`` before the first
        #: streamed one)
        self.returns_routing: bool | None = None
        self._routing_probe: asyncio.Future[None] | None = None
        #: whether it serves ``/weight_info`` (dev mode); None until the first probe
        self.serves_versions: bool | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections + CONTROL_CONNECTIONS, keepalive_timeout=ENGINE_KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, trace_configs=[_tracing()]
            )
        return self._session

    def _control_limits(self, timeout: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self._connect_timeout))

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _failed(self, error: ProxyError, path: str, cause: object = None) -> ProxyError:
        """Log what the client's error leaves out (the engine's URL, the driver's words); return ``error``."""
        log.warning("engine_call_failed", engine=self.url, path=path, error=error.message, cause=repr(cause))
        return error

    async def _request(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        limits: aiohttp.ClientTimeout | None = None,
        params: dict[str, str] | None = None,
        on_sent: Callable[[], None] | None = None,
        pooled: bool = False,
        expected: frozenset[int] = frozenset(),
        raw: bool = False,
    ) -> Any:
        """One call; a ``pooled`` one (a data call) first waits, bounded, for one of the pool's slots.
        ``expected``: error statuses the caller handles as an answer (raised, not logged as failures).
        ``raw``: the answer's bytes, for the caller to parse."""
        send = functools.partial(
            self._send, method, path, payload, limits=limits, params=params, on_sent=on_sent, expected=expected, raw=raw
        )
        if not pooled:
            with tracing.engine_call(self.url, method, path):  # a span per call (traceparent: _tracing)
                return await send()
        async with self._pool_slot(path):
            with tracing.engine_call(self.url, method, path):
                return await send()

    @contextlib.asynccontextmanager
    async def _pool_slot(self, path: str) -> AsyncIterator[None]:
        """One of the pool's slots for a data call, waited for within ``pool_timeout``."""
        try:
            async with asyncio.timeout(self._pool_timeout):
                await self._slots.acquire()
        except TimeoutError:
            log.warning("engine_pool_exhausted", engine=self.url, path=path, waited=self._pool_timeout)
            raise EngineBusy(
                f"all {self._max_connections} of the proxy's connections to the engine stayed busy for "
                f"{self._pool_timeout:g}s; try again shortly"
            ) from None
        try:
            yield
        finally:
            self._slots.release()

    def _translated(self, exc: BaseException, path: str, limits: aiohttp.ClientTimeout) -> ProxyError:
        """aiohttp's failure as the error of the tree that says what happened (logged with the URL)."""
        error: ProxyError
        if isinstance(exc, aiohttp.ConnectionTimeoutError):  # never connected: the request was not sent
            error = EngineUnreachable(f"the engine could not be reached within {limits.sock_connect}s")
        elif isinstance(exc, aiohttp.SocketTimeoutError):
            error = EngineTimeout(f"the engine did not start answering {path} within {limits.sock_read}s")
        elif isinstance(exc, TimeoutError):  # the total; aiohttp's ServerTimeoutError is one too
            error = EngineTimeout(f"the engine did not answer {path} within {limits.total}s")
        else:
            error = EngineUnreachable("the engine is unreachable (connection refused or reset)")
        return self._failed(error, path, exc)

    def _rejected(self, path: str, status: int, body: bytes, *, quiet: bool = False) -> ProxyError:
        """An HTTP error answer: 503 is the engine's unavailability, anything else a rejection (logged
        unless ``quiet``: an answer the caller expects, such as a 404 from a route only dev mode serves)."""
        raw = body[:200].decode(errors="replace")
        try:
            message = _error_message(_loads(body), raw) if body else raw
        except ValueError:  # a plain-text error page (a gateway in front of the engine, or the engine's own)
            message = raw
        text = f"the engine answered {path} with {status}: {message}"
        error: ProxyError
        if status == 503:
            error = EngineUnavailable(text)
        elif status == 404 and _error_param(body) == "model":
            error = ServedModelMissing(text, engine_status=status)
        else:
            error = EngineRejected(text, engine_status=status)
        return error if quiet else self._failed(error, path)

    async def _send(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None,
        *,
        limits: aiohttp.ClientTimeout | None,
        params: dict[str, str] | None,
        on_sent: Callable[[], None] | None,
        expected: frozenset[int] = frozenset(),
        raw: bool = False,
    ) -> Any:
        """Send once; again (at most ``STALE_CONNECTION_RETRIES`` times) while the call failed on a reused
        keep-alive connection before any answer: the engine closed it while idle, which says nothing
        about the engine (uvicorn drops idle connections after 5 s), so that is not an engine failure."""
        url = self.url + path
        data = None if payload is None else orjson.dumps(payload)
        headers = {"Content-Type": "application/json"} if data is not None else None
        limits = limits or self._timeout
        if on_sent is not None and not self._owns_session:
            on_sent()  # a client we were lent has no trace hook of ours: say so now, not never
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            trace: dict[str, Any] = {"on_sent": on_sent, "reused": False}
            answered = False
            try:
                async with self._http().request(
                    method, url, data=data, headers=headers, params=params, timeout=limits, trace_request_ctx=trace
                ) as response:
                    answered = True
                    body = await response.read()
                    status = response.status
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                stale = trace["reused"] and not answered and not isinstance(exc, aiohttp.ClientConnectorError)
                if not stale or attempt == STALE_CONNECTION_RETRIES:
                    raise self._translated(exc, path, limits) from exc
                log.info("engine_connection_stale", engine=self.url, path=path, cause=repr(exc))
                continue
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
                raise self._translated(exc, path, limits) from exc
            break
        if status >= 400:
            raise self._rejected(path, status, body, quiet=status in expected)
        if raw:
            return body
        return self._parsed(path, _loads, body) if body else None

    def _parsed(self, path: str, parse: Callable[[bytes], T], body: bytes) -> T:
        try:
            return parse(body)
        except ValueError as exc:
            raise self._failed(
                EngineError(f"the engine answered {path} with a body that is not JSON"), path, exc
            ) from exc

    async def info(self) -> EngineInfo:
        if self._info is None:
            payload = await self._request("GET", "/v1/models", limits=self._quick_timeout)
            try:
                card = payload["data"][0]
                model, max_model_len = card["id"], int(card["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise self._failed(
                    EngineError("the engine listed no usable model in /v1/models"), "/v1/models", exc
                ) from exc
            root = card.get("root")
            self._info = EngineInfo(
                url=self.url, model=model, max_model_len=max_model_len, root=root if isinstance(root, str) else None
            )
        return self._info

    async def health(self) -> None:
        """``GET /health`` within the health timeout (short: a probe must answer fast, whatever the engine does)."""
        await self._request("GET", "/health", limits=self._health_timeout)

    async def healthy(self) -> bool:
        try:
            await self.health()
        except (EngineError, EngineUnavailable, EngineTimeout):
            return False
        return True

    async def weight_version(self) -> str | None:
        """``GET /weight_info``'s ``weight_version`` ("default" before any update); None: not served (no dev mode)."""
        try:
            answer = await self._request("GET", "/weight_info", limits=self._health_timeout, expected=NOT_SERVED)
        except EngineRejected as exc:
            if exc.engine_status not in NOT_SERVED:
                raise
            if self.serves_versions is not False:  # said once, not at every probe
                log.info(
                    "engine_serves_no_versions",
                    engine=self.url,
                    detail="no /weight_info (vLLM without VLLM_SERVER_DEV_MODE=1): its version is the one "
                    "the proxy last set, else --policy-version",
                )
            self.serves_versions = False
            return None
        self.serves_versions = True
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        if not isinstance(version, str):
            raise self._failed(EngineError("the engine's /weight_info has no weight_version string"), "/weight_info")
        return version

    async def update_weight_version(self, version: str, *, within: float) -> bool:
        """``POST /update_weight_version {"new_version": "<version>"}`` (vLLM wants a string); False: not served."""
        try:
            await self._request(
                "POST",
                "/update_weight_version",
                {"new_version": version},
                limits=self._control_limits(within),
                expected=NOT_SERVED,
            )
        except EngineRejected as exc:
            if exc.engine_status in NOT_SERVED:
                return False
            raise
        return True

    async def pause(self, mode: PauseMode, *, within: float) -> None:
        """``POST /pause?mode=...``: answered once the engine is paused (for ``wait``, once in-flight requests ended)."""
        await self._request("POST", "/pause", params={"mode": mode}, limits=self._control_limits(within))

    async def resume(self, *, within: float) -> None:
        await self._request("POST", "/resume", limits=self._control_limits(within))

    async def collective_rpc(self, method: str, *, kwargs: dict[str, str] | None = None, within: float) -> list[Any]:
        """``POST /collective_rpc`` (dev mode): run a worker method on every worker (vLLM passes strings
        only); one result per worker."""
        body = {"method": method, "args": [], "kwargs": kwargs or {}, "timeout": within}
        answer = await self._request("POST", "/collective_rpc", body, limits=self._control_limits(within + 5.0))
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise self._failed(
                EngineError("the engine's /collective_rpc answer has no results list"), "/collective_rpc"
            )
        return results

    async def reload_weights(self, weights_path: str, *, within: float) -> None:
        """Load a checkpoint of the same architecture in place (vLLM's ``reload_weights``, as the trainer
        does between ``pause`` and ``resume``). The prefix cache is not cleared: the proxy's per-version
        ``cache_salt`` keeps KV computed under the old weights from being reused."""
        await self.collective_rpc("reload_weights", kwargs={"weights_path": weights_path}, within=within)

    async def load_adapter(self, name: str, path: str, *, within: float) -> None:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (never ``load_inplace``: a new version gets a
        new name, so calls in flight keep their weights). vLLM's refusals become ``AdapterRefused`` in words."""
        body = {"lora_name": name, "lora_path": path}
        path_ = "/v1/load_lora_adapter"
        try:
            await self._request("POST", path_, body, limits=self._control_limits(within), expected=_REFUSALS, raw=True)
        except EngineRejected as exc:
            raise self._adapter_refused(exc, f"load adapter {name!r} from {path}") from None

    async def unload_adapter(self, name: str, *, within: float) -> bool:
        """``POST /v1/unload_lora_adapter {"lora_name"}``: calls in flight on it finish, new ones get a 404.
        False: the engine did not serve ``name`` (already unloaded, or restarted since)."""
        path_ = "/v1/unload_lora_adapter"
        try:
            await self._request(
                "POST", path_, {"lora_name": name}, limits=self._control_limits(within), expected=_REFUSALS, raw=True
            )
        except EngineRejected as exc:
            if exc.engine_status == 404 and "cannot be found" in exc.message:
                return False
            raise self._adapter_refused(exc, f"unload adapter {name!r}") from None
        return True

    async def adapters(self) -> list[AdapterCard]:
        """The LoRA adapters ``GET /v1/models`` lists now (every card with a ``parent``: the base's name)."""
        payload = await self._request("GET", "/v1/models", limits=self._quick_timeout)
        cards = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(cards, list):
            raise self._failed(EngineError("the engine's /v1/models has no data list"), "/v1/models")
        return [
            AdapterCard(
                name=card["id"],
                path=card.get("root") if isinstance(card.get("root"), str) else None,
                parent=card["parent"],
            )
            for card in cards
            if isinstance(card, dict) and isinstance(card.get("id"), str) and isinstance(card.get("parent"), str)
        ]

    def _adapter_refused(self, exc: EngineRejected, what: str) -> AdapterRefused:
        words = exc.message.split(": ", 1)[1] if ": " in exc.message else exc.message
        if exc.engine_status == 404 and "No adapter found" not in words:
            return AdapterLoadingNotServed(
                f"the engine cannot {what}: it serves no run-time LoRA loading (start vLLM with --enable-lora "
                "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                param="path",
            )
        if exc.engine_status == 400 and "has already been loaded" in words:
            return AdapterAlreadyLoaded(f"the engine cannot {what}: {words}", param="name")
        return AdapterRefused(f"the engine cannot {what}: {_adapter_words(words)}", param="path")

    async def is_paused(self) -> bool | None:
        try:
            answer = await self._request("GET", "/is_paused", limits=self._health_timeout, expected=NOT_SERVED)
        except EngineRejected as exc:
            if exc.engine_status in NOT_SERVED:
                return None
            raise
        paused = answer.get("is_paused") if isinstance(answer, dict) else None
        if not isinstance(paused, bool):
            raise self._failed(EngineError("the engine's /is_paused has no is_paused boolean"), "/is_paused")
        return paused

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        model: str | None = None,
    ) -> np.ndarray:
        """``model``: a served adapter's name (vLLM renders and tokenizes as for its base); None: the base."""
        info = await self.info()
        payload: dict[str, Any] = {
            "model": model or info.model,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": False,
            "add_special_tokens": False,
        }
        if tools:
            payload["tools"] = list(tools)
        if chat_template_kwargs:
            payload["chat_template_kwargs"] = chat_template_kwargs
        try:
            answer = await self._request("POST", "/tokenize", payload, limits=self._quick_timeout, pooled=True)
        except EngineRejected as exc:
            # vLLM answers a template that cannot render the messages (a Jinja error, a
            # raise_exception) with 400 (422 for a request it cannot parse): the request's fault.
            if exc.engine_status not in TEMPLATE_FAILURE_STATUSES:
                raise
            raise TemplateRenderError(
                f"the model's chat template cannot render these messages: {exc.message}", param="messages"
            ) from exc
        return self._tokens(answer)

    async def tokenize_text(self, text: str, *, model: str | None = None) -> np.ndarray:
        info = await self.info()
        payload = {"model": model or info.model, "prompt": text, "add_special_tokens": False}
        return self._tokens(await self._request("POST", "/tokenize", payload, limits=self._quick_timeout, pooled=True))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """``POST /detokenize``: the text of ``token_ids`` (special tokens included), for viewers only."""
        info = await self.info()
        answer = await self._request(
            "POST",
            "/detokenize",
            {"model": info.model, "tokens": list(token_ids)},
            limits=self._quick_timeout,
            pooled=True,
        )
        text = answer.get("prompt") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise self._failed(EngineError("the engine's /detokenize returned no text"), "/detokenize")
        return text

    def _tokens(self, payload: Any) -> np.ndarray:
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list):
            raise self._failed(EngineError("the engine's /tokenize returned no token list"), "/tokenize")
        return np.asarray(tokens, dtype=np.int32)

    async def complete(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        *,
        on_sent: Callable[[], None] | None = None,
        sink: PieceSink | None = None,
        images: PromptImages | None = None,
    ) -> EngineCompletion:
        """With a ``sink``: streamed (``engines.streaming``) once this engine is known not to return routing
        (vLLM does not stream ``routed_experts``); else one plain call, whose output the sink's owner relays
        from the completion returned. A prompt with ``images`` goes to ``/inference/v1/generate`` in one plain
        call (``_generate``), streamed or not."""
        if images is not None:
            if sink is not None:
                await sink.begin(prompt_ids)
                if await self._streams(params, prompt_ids):
                    return await self._generate_stream(prompt_ids, params, images, sink, on_sent=on_sent)
            return await self._generate(prompt_ids, params, images, on_sent=on_sent)
        info = await self.info()
        echo = PromptEcho(prompt_ids)
        payload: dict[str, Any] = {
            "model": params.served_model or info.model,
            "prompt": orjson.Fragment(echo.json),
            **sampling_fields(params),
            "logprobs": 0,
            "return_token_ids": True,
            "stream": False,
        }
        if params.cache_salt is not None:
            payload["cache_salt"] = params.cache_salt
        if params.top_logprobs:
            payload["logprobs"] = params.top_logprobs
            payload["return_tokens_as_token_ids"] = True
        if sink is not None:
            await sink.begin(prompt_ids)
            if await self._streams(params, prompt_ids):
                return await self._stream(payload, echo, sink, on_sent=on_sent)
        return await self._complete_once(payload, echo, on_sent=on_sent)

    async def _streams(self, params: SamplingParams, prompt_ids: np.ndarray) -> bool:
        """Whether a turn with a sink is streamed from this engine: not with top-k rows (they are not streamed),
        nor from an engine that returns MoE routing (vLLM does not stream it: learned once, by a probe)."""
        if params.top_logprobs:
            return False
        if self.returns_routing is None:
            await self.learn_routing(int(prompt_ids[0]) if len(prompt_ids) else 0)
        return self.returns_routing is False

    async def _generate_stream(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        images: PromptImages,
        sink: PieceSink,
        *,
        on_sent: Callable[[], None] | None,
    ) -> EngineCompletion:
        """``_generate``, streamed: the same body with ``stream: true``; each chunk (vLLM's
        ``GenerateTextStreamResponse``) read as a ``/v1/completions`` one (``generate_chunk``), the first with
        the expanded prompt's echo and its spans, which the completion carries as ``_generate``'s does."""
        payload = await self._generate_body(prompt_ids, params, images)
        spans: list[tuple[tuple[int, int], ...] | None] = []

        def as_completion_chunk(chunk: Any) -> Any:
            if not spans and isinstance(chunk, dict) and "mm_placeholders" in chunk:
                spans.append(placeholder_spans(chunk))
            return generate_chunk(chunk)

        completion = await self._stream(
            payload, PromptEcho(prompt_ids), sink, on_sent=on_sent, path=GENERATE_PATH, adapt=as_completion_chunk
        )
        completion.image_spans = spans[0] if spans else None
        return completion

    async def _generate_body(
        self, prompt_ids: np.ndarray, params: SamplingParams, images: PromptImages
    ) -> dict[str, Any]:
        """The ``/inference/v1/generate`` body of a turn's call (``_generate``; ``_generate_stream`` sends it with
        ``stream: true``)."""
        info = await self.info()
        sampling = sampling_fields(params)
        sampling["logprobs"] = params.top_logprobs + 1 if params.top_logprobs else 0  # see ``_generated_topk``
        payload = generate_payload(params.served_model or info.model, prompt_ids, images, sampling)
        if params.cache_salt is not None:
            payload["cache_salt"] = params.cache_salt
        return payload

    async def _generate(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        images: PromptImages,
        *,
        on_sent: Callable[[], None] | None,
    ) -> EngineCompletion:
        """A prompt with images through vLLM's ``/inference/v1/generate`` (served with ``--enable-scale-out``): the
        only route that takes token ids and images together. Each image's span is collapsed to its marker and
        the images go as ``content_parts`` (data URLs, in prompt order, ``uuid``: the sha256, which vLLM then
        uses as the image's cache key); vLLM expands every marker again and, with ``return_token_ids``, echoes
        the expanded prompt and where it put each span (``mm_placeholders``). ``output_mode: "text"``: vLLM's
        text, stop strings cut as on ``/v1/completions``; top logprobs come back by id only from an engine
        started with ``--return-tokens-as-token-ids``."""
        path = GENERATE_PATH
        payload = await self._generate_body(prompt_ids, params, images)
        response = await self._request(
            "POST", path, payload, limits=self._completion_timeout, on_sent=on_sent, pooled=True
        )
        try:
            completion = generated(response, top_logprobs=params.top_logprobs)
        except EngineError as exc:
            raise self._failed(exc, path) from None
        if completion.routed_experts is not None or completion.finish_reason != "abort":
            self.returns_routing = completion.routed_experts is not None  # as ``_complete_once`` learns it
        return completion

    async def learn_routing(self, token: int) -> None:
        """Whether this engine attaches MoE routing to its completions, found before its first streamed call
        (vLLM streams no ``routed_experts``, so a streamed turn on a MoE engine is one plain call): one token
        generated, greedy, from the one prompt token ``token``, not streamed; its answer says. Concurrent first
        calls share the probe. An engine that refuses it (4xx) stays unknown, and that turn is one plain call."""
        if self._routing_probe is None or self._routing_probe.done():
            self._routing_probe = asyncio.ensure_future(self._probe_routing(token))
        try:
            await asyncio.shield(self._routing_probe)
        except EngineRejected as exc:
            if exc.engine_status >= 500:
                raise
            log.info("routing_probe_refused", engine=self.url, error=exc.message)

    async def _probe_routing(self, token: int) -> None:
        info = await self.info()
        payload = {
            "model": info.model,
            "prompt": [token],
            "max_tokens": 1,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "n": 1,
            "return_token_ids": True,
            "stream": False,
            "request_id": f"{ROUTING_PROBE_ID}-{secrets.token_hex(6)}",
        }
        response = await self._request("POST", "/v1/completions", payload, limits=self._completion_timeout, pooled=True)
        try:
            choice = response["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise self._failed(
                EngineError("the engine answered its routing probe without choices"), "/v1/completions", exc
            ) from exc
        if choice.get("routed_experts") is not None or choice.get("finish_reason") != "abort":
            self.returns_routing = choice.get("routed_experts") is not None

    async def prompt_logprobs(
        self, prompt_ids: np.ndarray, k: int, *, model: str | None = None, images: PromptImages | None = None
    ) -> list[dict[str, Any] | None]:
        """``prompt_logprobs: k`` over a token-id prompt (``max_tokens: 1``): per position the prompt token's
        logprob (and rank) and the top ``k``; entry 0 is None. The teacher pass of on-policy distillation.
        ``model``: a served adapter's name (the teacher is that adapter); None: the base. ``images``: the
        prompt's, when it holds any (``/inference/v1/generate``, as for a turn)."""
        info = await self.info()
        scoring: dict[str, Any] = {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1}
        if images is not None:
            return await self._image_prompt_logprobs(model or info.model, prompt_ids, k, images, scoring)
        path = "/v1/completions"
        payload = {
            "model": model or info.model,
            "prompt": prompt_ids.tolist(),
            **scoring,
            "prompt_logprobs": k,
            "stream": False,
        }
        response = await self._request("POST", path, payload, limits=self._completion_timeout, pooled=True)
        try:
            entries = response["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError) as exc:
            raise self._failed(EngineError("the engine returned no prompt_logprobs"), path, exc) from exc
        if not isinstance(entries, list):
            raise self._failed(EngineError("the engine returned no prompt_logprobs"), path)
        return entries

    async def _image_prompt_logprobs(
        self, model: str, prompt_ids: np.ndarray, k: int, images: PromptImages, scoring: dict[str, Any]
    ) -> list[dict[str, Any] | None]:
        """``prompt_logprobs`` of a prompt with images, through ``/inference/v1/generate`` as a turn's prompt goes
        (spans collapsed, the images as ``content_parts``). The scores are the expanded prompt's, so the engine's
        echo of it (and of where it put each span) must be ``prompt_ids`` (and ``images.spans``) exactly: else a
        score would sit on another token than the one it is read for."""
        path = GENERATE_PATH
        # logprobs 0: the one sampled token's, which ``generated`` reads with the echo
        payload = generate_payload(model, prompt_ids, images, {**scoring, "logprobs": 0, "prompt_logprobs": k})
        response = await self._request("POST", path, payload, limits=self._completion_timeout, pooled=True)
        entries = response.get("prompt_logprobs") if isinstance(response, dict) else None
        if not isinstance(entries, list):
            raise self._failed(EngineError("the engine returned no prompt_logprobs"), path)
        try:
            echoed = generated(response)
        except EngineError as exc:
            raise self._failed(exc, path) from None
        if echoed.prompt_ids is None or not np.array_equal(echoed.prompt_ids, prompt_ids):
            raise self._failed(
                EngineError("the engine expanded the prompt's images into other tokens than the recorded ones"), path
            )
        if echoed.image_spans is not None and echoed.image_spans != images.spans:
            raise self._failed(EngineError("the engine placed the prompt's images elsewhere than recorded"), path)
        return entries

    async def _stream(
        self,
        payload: dict[str, Any],
        echo: PromptEcho,
        sink: PieceSink,
        *,
        on_sent: Callable[[], None] | None,
        path: str = "/v1/completions",
        adapt: Callable[[Any], Any] | None = None,
    ) -> EngineCompletion:
        """``stream: true``: each chunk to ``sink`` as it arrives. Leaving early (the sink raised, the caller was
        cancelled) closes the response: that is how vLLM learns to abort the request. ``adapt``: each parsed chunk
        of another route (``path``) in ``/v1/completions``' shape."""
        limits = self._completion_timeout
        trace = {"on_sent": on_sent} if on_sent is not None else None
        if on_sent is not None and not self._owns_session:
            on_sent()
        reader, assembly = SSEReader(), StreamAssembly()
        data = orjson.dumps({**payload, "stream": True})
        try:
            async with (
                self._pool_slot(path),
                tracing.engine_call_async(self.url, "POST", path),  # the whole stream is one span
                self._http().post(
                    self.url + path,
                    data=data,
                    headers={"Content-Type": "application/json"},
                    timeout=limits,
                    trace_request_ctx=trace,
                ) as response,
            ):
                if response.status >= 400:
                    raise self._rejected(path, response.status, await response.read())
                try:
                    async for data_chunk in response.content.iter_any():
                        for event in reader.feed(data_chunk):
                            if event is DONE:
                                continue  # read on to the end of the body: the connection goes back to the pool
                            assert isinstance(event, bytes)
                            try:
                                if assembly.prompt_ids is None:  # the first chunk echoes the prompt
                                    chunk, same = echo.parse(event)
                                    if same:
                                        assembly.prompt_ids = echo.array
                                else:
                                    chunk = _loads(event)
                            except ValueError as exc:
                                raise self._failed(
                                    EngineError("the engine streamed a chunk that is not JSON"), path, exc
                                ) from exc
                            if adapt is not None:
                                chunk = adapt(chunk)
                            piece = assembly.add(chunk, _sampled_logprobs)
                            if piece is not None:
                                await sink.piece(piece)
                except BaseException:
                    response.close()
                    raise
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise self._translated(exc, path, limits) from exc
        if assembly.finish_reason is None:  # the connection ended cleanly, halfway through the answer
            raise self._failed(EngineUnreachable("the engine's stream ended before its last chunk"), path)
        return assembly.completion()

    async def _complete_once(
        self, payload: dict[str, Any], echo: PromptEcho, *, on_sent: Callable[[], None] | None
    ) -> EngineCompletion:
        body = await self._request(
            "POST", "/v1/completions", payload, limits=self._completion_timeout, on_sent=on_sent, pooled=True, raw=True
        )
        response, same = self._parsed("/v1/completions", echo.parse, body)
        try:
            choice = response["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise self._failed(
                EngineError("the engine returned a completion without choices"), "/v1/completions", exc
            ) from exc
        token_ids = choice.get("token_ids")
        if not isinstance(token_ids, list):
            raise self._failed(
                EngineError("the engine returned no token_ids (it must support return_token_ids)"), "/v1/completions"
            )
        output_ids = np.asarray(token_ids, dtype=np.int32)
        logprobs, nonfinite = _sampled_logprobs(choice, len(output_ids))
        routed_experts = choice.get("routed_experts")
        finish_reason = choice.get("finish_reason") or "stop"
        if routed_experts is not None or finish_reason != "abort":  # an aborted answer may come without its routing
            self.returns_routing = routed_experts is not None
        reported = echo.array if same else choice.get("prompt_token_ids")
        k = payload["logprobs"]
        try:
            topk = _top_logprobs(choice, output_ids, k) if k else None
        except EngineError as exc:
            raise self._failed(exc, "/v1/completions") from None
        return EngineCompletion(
            prompt_ids=None if reported is None else np.asarray(reported, dtype=np.int32),
            output_ids=output_ids,
            output_logprobs=logprobs,
            text=choice.get("text") or "",
            finish_reason=finish_reason,
            nonfinite_logprobs=nonfinite,
            routed_experts=routed_experts,
            output_topk=topk,
            stop_reason=_stop_reason(choice),
        )
