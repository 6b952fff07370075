"""The SDK's one way to talk to a rollout-proxy: JSON over HTTP, sync and async.

``ProxyClient`` holds at most one sync and one async HTTP connection pool (httpx2,
which the ``openai`` package itself depends on), opened on first use and closed with
the client; constructing one does no I/O. Every failure surfaces as one error type,
so plugin code never sees a server exception or a transport library's own errors::

    ProxyRequestError        the proxy answered with an error status (.status, .body, .message, .type, .param, .code)
    └── ProxyUnreachable     no answer at all (refused, reset, timed out): .status is None

``request`` / ``arequest`` (and ``post`` / ``get``) raise on an error status; ``send`` /
``asend`` return ``(status, parsed body)`` whatever the status, for callers (tests, tools)
that look at error answers themselves.
"""

from __future__ import annotations

import functools
import json
import ssl
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


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every pool: building one loads the CA bundle (~40 ms), and a
    proxy object, hence a pool, exists per rollout."""
    return httpx2.create_ssl_context()


def _parsed(response: httpx2.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return response.text


class ProxyClient:
    """Requests to one base URL with a bearer token, from sync or async code.

    ``path`` is relative to ``base_url``, or an absolute URL (a session's own base URL
    may differ from the admin URL a client was made for). ``token=`` on a call replaces
    the client's token for that call; a client made with ``token=None`` sends none.
    """

    def __init__(self, base_url: str, token: str | None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self._timeout = timeout
        self._sync: httpx2.Client | None = None
        self._async: httpx2.AsyncClient | None = None

    def _url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    def _headers(self, token: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
        token = token or self.token
        return {**({"Authorization": f"Bearer {token}"} if token else {}), **(extra or {})}

    def _send(self, method: str, path: str, what: str, **options: Any) -> httpx2.Response:
        if self._sync is None:
            self._sync = httpx2.Client(timeout=self._timeout, verify=_tls())
        try:
            return self._sync.request(method, self._url(path), **options)
        except httpx2.HTTPError as exc:
            raise ProxyUnreachable(what, exc) from exc

    async def _asend(self, method: str, path: str, what: str, **options: Any) -> httpx2.Response:
        if self._async is None:
            self._async = httpx2.AsyncClient(timeout=self._timeout, verify=_tls())
        try:
            return await self._async.request(method, self._url(path), **options)
        except httpx2.HTTPError as exc:
            raise ProxyUnreachable(what, exc) from exc

    @staticmethod
    def _checked(what: str, response: httpx2.Response) -> Any:
        payload = _parsed(response)
        if response.status_code >= 400:
            raise ProxyRequestError(what, response.status_code, payload)
        return payload

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        what: str | None = None,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """A blocking request (for sync plugin code); the parsed JSON answer. ``headers`` add to the client's."""
        what = what or f"{method} {path}"
        return self._checked(what, self._send(method, path, what, json=body, headers=self._headers(token, headers)))

    async def arequest(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        what: str | None = None,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """The same request without blocking the event loop."""
        what = what or f"{method} {path}"
        answer = await self._asend(method, path, what, json=body, headers=self._headers(token, headers))
        return self._checked(what, answer)

    def post(self, path: str, body: Any, *, what: str | None = None, token: str | None = None) -> Any:
        return self.request("POST", path, body, what=what, token=token)

    async def apost(self, path: str, body: Any, *, what: str | None = None, token: str | None = None) -> Any:
        return await self.arequest("POST", path, body, what=what, token=token)

    def get(self, path: str, *, what: str | None = None, token: str | None = None) -> Any:
        return self.request("GET", path, what=what, token=token)

    async def aget(self, path: str, *, what: str | None = None, token: str | None = None) -> Any:
        return await self.arequest("GET", path, what=what, token=token)

    def send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """``(status, parsed body)`` of one request, error statuses included (only no answer raises).

        ``content`` is sent as raw bytes instead of ``json``; ``headers`` add to (or replace)
        the client's own.
        """
        what = f"{method} {path}"
        response = self._send(method, path, what, json=json, content=content, headers=self._headers(None, headers))
        return response.status_code, _parsed(response)

    async def asend(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """``send`` without blocking the event loop."""
        what = f"{method} {path}"
        options = {"json": json, "content": content, "headers": self._headers(None, headers)}
        response = await self._asend(method, path, what, **options)
        return response.status_code, _parsed(response)

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
