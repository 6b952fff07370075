"""Who is calling: the trainer (admin key) or one plugin (its session's token).

A session token is a JWT (HS256) naming one session and expiring with it (a token
without ``exp`` is refused); the plugin uses it as its OpenAI ``api_key``. It opens
that session's data and nothing else, and only while the session exists.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import jwt
from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed, NotFound

AUDIENCE = "rollout-proxy/session"
#: ``exp`` above all: a token without it would never expire.
REQUIRED_CLAIMS = ["sub", "aud", "exp"]


@dataclass(frozen=True, slots=True)
class Caller:
    admin: bool
    session_id: str | None = None

    def require_session(self, session_id: str) -> None:
        """Admins see every session; a plugin sees only its own (others do not exist for it)."""
        if not self.admin and self.session_id != session_id:
            raise NotFound(f"session {session_id!r} not found", param="session_id")


class SessionTokens:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def issue(self, session_id: str, expires_at: float) -> str:
        claims = {"sub": session_id, "aud": AUDIENCE, "exp": int(expires_at)}
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def verify(self, token: str) -> str:
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
        return session_id


def bearer_token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("missing 'Authorization: Bearer <key>' header")
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
    return Caller(admin=False, session_id=tokens.verify(token))
