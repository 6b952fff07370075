"""Who is calling: the trainer (admin key) or one plugin (its session's token).

A session token is a JWT (HS256) naming one session and expiring with it (a token
without ``exp`` is refused); the plugin uses it as its OpenAI ``api_key`` (in ``Authorization: Bearer``), or its Anthropic one (in
``x-api-key``, or ``Authorization: Bearer`` as ``auth_token``). It opens
that session's data and nothing else, and only while the session exists.

A session with a request bound (a job's ``request_concurrency``) also carries it in its token
(``request_bound``), so a turn can take the bound's slot in the same store round trip as its session
read (``state.store.ReadAhead.bound``). The claim is a hint, never authority: the session record is
(a token without it, from an older proxy, takes its slot at the engine call as before).
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import jwt
from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed, NotFound
from rollout_proxy.state.store import RequestBound

AUDIENCE = "rollout-proxy/session"
#: ``exp`` above all: a token without it would never expire.
REQUIRED_CLAIMS = ["sub", "aud", "exp"]
#: The claim naming the session's request bound: ``{"key": str, "max_requests": int}``.
BOUND_CLAIM = "request_bound"


@dataclass(frozen=True, slots=True)
class Caller:
    admin: bool
    session_id: str | None = None
    bound: RequestBound | None = None  # the session's request bound, as its token names it

    def require_session(self, session_id: str) -> None:
        """Admins see every session; a plugin sees only its own (others do not exist for it)."""
        if not self.admin and self.session_id != session_id:
            raise NotFound(f"session {session_id!r} not found", param="session_id")


#: Verified tokens remembered (a session's plugin sends the same token on every turn): HMAC and JSON
#: decoding once per token instead of once per request. Bounded; the oldest are forgotten first.
VERIFIED_TOKENS = 65_536


class SessionTokens:
    def __init__(self, secret: bytes, *, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._clock = clock
        self._verified: OrderedDict[str, tuple[Caller, int]] = OrderedDict()  # token -> (caller, exp)

    def issue(self, session_id: str, expires_at: float, *, bound: RequestBound | None = None) -> str:
        claims: dict[str, object] = {"sub": session_id, "aud": AUDIENCE, "exp": int(expires_at)}
        if bound is not None:
            claims[BOUND_CLAIM] = {"key": bound.key, "max_requests": bound.limit}
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def verify(self, token: str) -> Caller:
        """The plugin the token names: its session, and its request bound if the token carries one."""
        known = self._verified.get(token)
        if known is not None:
            caller, expires = known
            if self._clock() < expires:  # as PyJWT checks ``exp`` (no leeway)
                self._verified.move_to_end(token)
                return caller
            del self._verified[token]
            raise AuthenticationFailed("session token expired")
        caller, expires = self._decode(token)
        self._verified[token] = (caller, expires)
        if len(self._verified) > VERIFIED_TOKENS:
            self._verified.popitem(last=False)
        return caller

    def _decode(self, token: str) -> tuple[Caller, int]:
        try:
            claims = jwt.decode(
                token, self._secret, algorithms=["HS256"], audience=AUDIENCE, options={"require": REQUIRED_CLAIMS}
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationFailed("session token expired") from None
        except (jwt.InvalidTokenError, UnicodeError):  # UnicodeError: a header that is not UTF-8
            raise AuthenticationFailed("invalid session token") from None
        session_id = claims.get("sub")
        if not isinstance(session_id, str):
            raise AuthenticationFailed("invalid session token")
        caller = Caller(admin=False, session_id=session_id, bound=_bound(claims.get(BOUND_CLAIM)))
        return caller, int(claims["exp"])


def _bound(claim: object) -> RequestBound | None:
    """The bound claim, if well formed (we signed it; anything else is read as no claim: the slot is then
    taken at the engine call, as for an older token)."""
    if not isinstance(claim, dict):
        return None
    key, limit = claim.get("key"), claim.get("max_requests")
    if not isinstance(key, str) or not key or type(limit) is not int or limit < 1:
        return None
    return RequestBound(key, limit)


def bearer_token(request: web.Request) -> str:
    """The key in ``Authorization: Bearer``, else in ``x-api-key`` (as Anthropic's clients send it)."""
    header = request.headers.get("Authorization")
    if header is None and "x-api-key" in request.headers:
        token = request.headers["x-api-key"].strip()
        if not token:
            raise AuthenticationFailed("empty 'x-api-key' header")
        return token
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("missing 'Authorization: Bearer <key>' (or 'x-api-key') header")
    return token.strip()


def is_admin_key(token: str, admin_key: str) -> bool:
    # surrogateescape: a header that is not UTF-8 reaches us with lone surrogates; it is simply no key
    encoded = token.encode("utf-8", "surrogateescape")
    return bool(admin_key) and hmac.compare_digest(encoded, admin_key.encode("utf-8", "surrogateescape"))


def presents_admin_key(request: web.Request, admin_key: str) -> bool:
    """Whether the request carries the admin key, for public routes that show the admin more (never raises)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and is_admin_key(token.strip(), admin_key)


def authenticate(request: web.Request, *, admin_key: str, tokens: SessionTokens, admin_only: bool = False) -> Caller:
    token = bearer_token(request)
    if is_admin_key(token, admin_key):
        return Caller(admin=True)
    if admin_only:
        raise AuthenticationFailed("this endpoint needs the admin key")
    return tokens.verify(token)
