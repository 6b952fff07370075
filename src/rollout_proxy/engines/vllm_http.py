"""A vLLM OpenAI server driven token-in, token-out over HTTP.

Third-party failures are translated here, once: an engine we cannot reach is
``EngineUnavailable`` (503), an engine that answers with an error or with a body we
cannot use is ``EngineError`` (502).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import orjson

from rollout_proxy.engines.base import EngineCompletion, EngineInfo, SamplingParams
from rollout_proxy.errors import EngineError, EngineUnavailable

#: vLLM's own floor for -inf logprobs; non-finite values are clamped to it and counted.
LOGPROB_FLOOR = -9999.0


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


class VLLMEngine:
    """Client of one vLLM server (``/tokenize``, ``/v1/completions``, ``/v1/models``)."""

    def __init__(
        self,
        url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
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

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        url = self.url + path
        data = None if payload is None else orjson.dumps(payload)
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with self._http().request(method, url, data=data, headers=headers) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientConnectionError, TimeoutError, OSError) as exc:
            raise EngineUnavailable(f"engine {self.url} is unreachable: {exc!r}") from exc
        if status >= 400:
            raw = body[:200].decode(errors="replace")
            try:
                message = _error_message(_loads(body), raw) if body else raw
            except ValueError:  # a plain-text error page (a gateway in front of the engine, or the engine's own)
                message = raw
            error = EngineUnavailable if status == 503 else EngineError
            raise error(f"engine {self.url} answered {path} with {status}: {message}")
        try:
            return _loads(body) if body else None
        except ValueError as exc:
            raise EngineError(f"engine {self.url} answered {path} with a body that is not JSON") from exc

    async def info(self) -> EngineInfo:
        if self._info is None:
            payload = await self._request("GET", "/v1/models")
            try:
                card = payload["data"][0]
                model, max_model_len = card["id"], int(card["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise EngineError(f"engine {self.url} listed no usable model in /v1/models") from exc
            self._info = EngineInfo(url=self.url, model=model, max_model_len=max_model_len)
        return self._info

    async def healthy(self) -> bool:
        try:
            await self._request("GET", "/health")
        except (EngineError, EngineUnavailable):
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
        return self._tokens(await self._request("POST", "/tokenize", payload))

    async def tokenize_text(self, text: str) -> np.ndarray:
        info = await self.info()
        payload = {"model": info.model, "prompt": text, "add_special_tokens": False}
        return self._tokens(await self._request("POST", "/tokenize", payload))

    def _tokens(self, payload: Any) -> np.ndarray:
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list):
            raise EngineError(f"engine {self.url} /tokenize returned no token list")
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
            raise EngineError(f"engine {self.url} returned a completion without choices") from exc
        token_ids = choice.get("token_ids")
        if not isinstance(token_ids, list):
            raise EngineError(f"engine {self.url} returned no token_ids (it must support return_token_ids)")
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
