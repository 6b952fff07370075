"""Who is calling: the trainer (admin key) or one plugin (its session's token).

A session token is a JWT (HS256) naming one session and expiring with it; the plugin
uses it as its OpenAI ``api_key``. It opens that session's data and nothing else.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import jwt
from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed, NotFound

AUDIENCE = "rollout-proxy/session"


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
            claims = jwt.decode(token, self._secret, algorithms=["HS256"], audience=AUDIENCE)
        except jwt.ExpiredSignatureError:
            raise AuthenticationFailed("session token expired") from None
        except jwt.InvalidTokenError:
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
    return bool(admin_key) and hmac.compare_digest(token.encode(), admin_key.encode())


def authenticate(request: web.Request, *, admin_key: str, tokens: SessionTokens, admin_only: bool = False) -> Caller:
    token = bearer_token(request)
    if is_admin_key(token, admin_key):
        return Caller(admin=True)
    if admin_only:
        raise AuthenticationFailed("this endpoint needs the admin key")
    return Caller(admin=False, session_id=tokens.verify(token))
