"""A vLLM OpenAI server driven token-in, token-out over HTTP.

Third-party failures are translated here, once: an engine we cannot reach (refused,
reset, no connection within the connect timeout) is ``EngineUnavailable`` (503), one
that took the request and did not answer in time is ``EngineTimeout`` (504), one that
answers with an error or with a body we cannot use is ``EngineError`` (502). Messages
never name the engine: plugins must not learn the fleet's addresses. The URL goes to
the log line written here (same request id as the client's error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import orjson
import structlog

from rollout_proxy.engines.base import EngineCompletion, EngineInfo, SamplingParams
from rollout_proxy.errors import EngineError, EngineTimeout, EngineUnavailable, ProxyError, TemplateRenderError

log = structlog.get_logger(__name__)

#: vLLM's own floor for -inf logprobs; non-finite values are clamped to it and counted.
LOGPROB_FLOOR = -9999.0
#: What vLLM's ``/tokenize`` answers when the chat template fails on the messages it was sent.
TEMPLATE_FAILURE_STATUSES = frozenset({400, 422})


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        # Python's json accepts NaN/Infinity, which some engines emit in logprobs.
        return json.loads(body)


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


class EngineRejected(EngineError):
    """The engine answered an HTTP error (a 502 to the client); ``engine_status`` is what it answered.

    Not ``status``: that is the status the proxy answers with, for every error of the tree.
    """

    def __init__(self, message: str, *, engine_status: int) -> None:
        super().__init__(message)
        self.engine_status = engine_status


class VLLMEngine:
    """Client of one vLLM server (``/tokenize``, ``/v1/completions``, ``/v1/models``)."""

    def __init__(
        self,
        url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        first_byte_timeout: float | None = None,
        health_timeout: float = 0.5,
    ) -> None:
        """Timeouts in seconds: ``request_timeout`` bounds a whole call, ``connect_timeout`` the TCP
        connect, ``first_byte_timeout`` (default: the whole call) the wait for the answer to start."""
        self.url = url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout, sock_connect=connect_timeout, sock_read=first_byte_timeout
        )
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout, sock_connect=health_timeout)
        self._info: EngineInfo | None = None
        #: learned from the first completion: does this engine attach MoE routing?
        self.returns_routing: bool | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

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
    ) -> Any:
        url = self.url + path
        data = None if payload is None else orjson.dumps(payload)
        headers = {"Content-Type": "application/json"} if data is not None else None
        limits = limits or self._timeout
        try:
            async with self._http().request(method, url, data=data, headers=headers, timeout=limits) as response:
                body = await response.read()
                status = response.status
        except aiohttp.ConnectionTimeoutError as exc:  # never connected: the request was not sent
            raise self._failed(
                EngineUnavailable(f"the engine could not be reached within {limits.sock_connect}s"), path, exc
            ) from exc
        except aiohttp.SocketTimeoutError as exc:
            raise self._failed(
                EngineTimeout(f"the engine did not start answering {path} within {limits.sock_read}s"), path, exc
            ) from exc
        except TimeoutError as exc:  # the total; aiohttp's ServerTimeoutError is one too
            raise self._failed(
                EngineTimeout(f"the engine did not answer {path} within {limits.total}s"), path, exc
            ) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise self._failed(
                EngineUnavailable("the engine is unreachable (connection refused or reset)"), path, exc
            ) from exc
        if status >= 400:
            raw = body[:200].decode(errors="replace")
            try:
                message = _error_message(_loads(body), raw) if body else raw
            except ValueError:  # a plain-text error page (a gateway in front of the engine, or the engine's own)
                message = raw
            text = f"the engine answered {path} with {status}: {message}"
            raise self._failed(
                EngineUnavailable(text) if status == 503 else EngineRejected(text, engine_status=status), path
            )
        try:
            return _loads(body) if body else None
        except ValueError as exc:
            raise self._failed(
                EngineError(f"the engine answered {path} with a body that is not JSON"), path, exc
            ) from exc

    async def info(self) -> EngineInfo:
        if self._info is None:
            payload = await self._request("GET", "/v1/models")
            try:
                card = payload["data"][0]
                model, max_model_len = card["id"], int(card["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise self._failed(
                    EngineError("the engine listed no usable model in /v1/models"), "/v1/models", exc
                ) from exc
            self._info = EngineInfo(url=self.url, model=model, max_model_len=max_model_len)
        return self._info

    async def healthy(self) -> bool:
        """``GET /health`` within the health timeout (short: readiness must answer fast, whatever the engine does)."""
        try:
            await self._request("GET", "/health", limits=self._health_timeout)
        except (EngineError, EngineUnavailable, EngineTimeout):
            return False
        return True

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray:
        info = await self.info()
        payload: dict[str, Any] = {
            "model": info.model,
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
            answer = await self._request("POST", "/tokenize", payload)
        except EngineRejected as exc:
            # vLLM answers a template that cannot render the messages (a Jinja error, a
            # raise_exception) with 400 (422 for a request it cannot parse): the request's fault.
            if exc.engine_status not in TEMPLATE_FAILURE_STATUSES:
                raise
            raise TemplateRenderError(
                f"the model's chat template cannot render these messages: {exc.message}", param="messages"
            ) from exc
        return self._tokens(answer)

    async def tokenize_text(self, text: str) -> np.ndarray:
        info = await self.info()
        payload = {"model": info.model, "prompt": text, "add_special_tokens": False}
        return self._tokens(await self._request("POST", "/tokenize", payload))

    def _tokens(self, payload: Any) -> np.ndarray:
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list):
            raise self._failed(EngineError("the engine's /tokenize returned no token list"), "/tokenize")
        return np.asarray(tokens, dtype=np.int32)

    async def complete(self, prompt_ids: np.ndarray, params: SamplingParams) -> EngineCompletion:
        info = await self.info()
        payload: dict[str, Any] = {
            "model": info.model,
            "prompt": prompt_ids.tolist(),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            # vLLM's "no top-k" is -1; the seed's GenerationConfig spells it 0.
            "top_k": params.top_k if params.top_k > 0 else -1,
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": False,
            # Send every setting explicitly: vLLM otherwise fills some from generation_config.json.
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
        }
        if params.seed is not None:
            payload["seed"] = params.seed
        if params.stop:
            payload["stop"] = list(params.stop)
        if params.routed_experts_prompt_start is not None:
            payload["routed_experts_prompt_start"] = params.routed_experts_prompt_start
        response = await self._request("POST", "/v1/completions", payload)
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
        self.returns_routing = routed_experts is not None
        reported = choice.get("prompt_token_ids")
        return EngineCompletion(
            prompt_ids=None if reported is None else np.asarray(reported, dtype=np.int32),
            output_ids=output_ids,
            output_logprobs=logprobs,
            text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason") or "stop",
            nonfinite_logprobs=nonfinite,
            routed_experts=routed_experts,
        )
