"""The SDK's one way to talk to a rollout-proxy: JSON over HTTP, sync and async.

``ProxyClient`` holds at most one sync and one async HTTP connection pool (httpx2,
which the ``openai`` package itself depends on), opened on first use and closed with
the client; constructing one does no I/O. Every failure surfaces as one error type,
``ProxyRequestError``, carrying the HTTP status and the OpenAI-style error body the
proxy answered (``ProxyUnreachable``, its subclass, when no answer came at all), so
plugin code never sees a server exception or a transport library's own errors.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2

DEFAULT_TIMEOUT = 60.0


class ProxyRequestError(RuntimeError):
    """The proxy answered a request with an error status.

    ``status`` is the HTTP status, ``body`` the parsed answer (an OpenAI-style
    ``{"error": {"message", "type", "param", "code"}}`` from a rollout-proxy), and
    ``message`` / ``type`` / ``param`` / ``code`` its fields, where present.
    """

    def __init__(self, what: str, status: int | None, body: Any = None, *, detail: str | None = None) -> None:
        self.what = what
        self.status = status
        self.body = body
        error = body.get("error") if isinstance(body, dict) else None
        self.error: dict[str, Any] = error if isinstance(error, dict) else {}
        self.message: str = str(self.error.get("message") or detail or (body if isinstance(body, str) else ""))
        self.type: str | None = self.error.get("type")
        self.param: str | None = self.error.get("param")
        self.code: str | None = self.error.get("code")
        super().__init__(f"{what} failed ({status if status is not None else 'no answer'}): {self.message}")


class ProxyUnreachable(ProxyRequestError):
    """No answer at all: the proxy could not be reached or did not answer in time."""

    def __init__(self, what: str, cause: Exception) -> None:
        super().__init__(what, None, detail=f"{type(cause).__name__}: {cause}")


def _parsed(response: httpx2.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return response.text


class ProxyClient:
    """JSON requests to one base URL with a bearer token, from sync or async code."""

    def __init__(self, base_url: str, token: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self._timeout = timeout
        self._sync: httpx2.Client | None = None
        self._async: httpx2.AsyncClient | None = None

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def _check(self, what: str, response: httpx2.Response) -> Any:
        payload = _parsed(response)
        if response.status_code >= 400:
            raise ProxyRequestError(what, response.status_code, payload)
        return payload

    def request(self, method: str, path: str, body: Any = None, *, what: str | None = None) -> Any:
        """A blocking request (for sync plugin code); the parsed JSON answer."""
        what = what or f"{method} {path}"
        if self._sync is None:
            self._sync = httpx2.Client(timeout=self._timeout)
        try:
            response = self._sync.request(method, self.base_url + path, json=body, headers=self._headers)
        except httpx2.HTTPError as exc:
            raise ProxyUnreachable(what, exc) from exc
        return self._check(what, response)

    async def arequest(self, method: str, path: str, body: Any = None, *, what: str | None = None) -> Any:
        """The same request without blocking the event loop."""
        what = what or f"{method} {path}"
        if self._async is None:
            self._async = httpx2.AsyncClient(timeout=self._timeout)
        try:
            response = await self._async.request(method, self.base_url + path, json=body, headers=self._headers)
        except httpx2.HTTPError as exc:
            raise ProxyUnreachable(what, exc) from exc
        return self._check(what, response)

    def post(self, path: str, body: Any, *, what: str | None = None) -> Any:
        return self.request("POST", path, body, what=what)

    async def apost(self, path: str, body: Any, *, what: str | None = None) -> Any:
        return await self.arequest("POST", path, body, what=what)

    def get(self, path: str, *, what: str | None = None) -> Any:
        return self.request("GET", path, what=what)

    async def aget(self, path: str, *, what: str | None = None) -> Any:
        return await self.arequest("GET", path, what=what)

    def close(self) -> None:
        """Close the sync pool (an async pool must be closed with ``aclose``)."""
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def aclose(self) -> None:
        """Close both pools."""
        self.close()
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ProxyClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
