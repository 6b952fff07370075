"""Small HTTP helpers shared by the handlers: JSON in, JSON out."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from rollout_proxy.errors import InvalidRequest, UnsupportedMediaType
from rollout_proxy.proxy.limits import parse_json_object

_DUMP_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS

#: What aiohttp decodes (br and zstd only when their libraries are installed); anything else it passes on raw.
DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


def json_response(data: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data, option=_DUMP_OPTIONS), status=status, content_type="application/json")


async def read_body(request: web.Request) -> bytes:
    """The body, decoded from its ``Content-Encoding`` by aiohttp; 400 (not a 500) when that fails.

    aiohttp passes an encoding it does not know through undecoded, so those are refused here;
    ``br``/``zstd`` without their libraries are refused by aiohttp itself (proxy/server.py words it).
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in DECODED_ENCODINGS:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported: send the body as is, gzip or deflate",
        )
    try:
        return await request.read()
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # it does not decompress, bad chunking
        raise InvalidRequest(f"the request body could not be read: {_reason(exc)}", code="unreadable_body") from None
    except ConnectionResetError:  # the client left mid-body; nobody reads this answer, but it is no 500
        raise InvalidRequest("the connection closed before the body was complete", code="unreadable_body") from None


def _reason(exc: BaseException) -> str:
    """aiohttp's words for a body it could not read (its payload error wraps the parser's)."""
    cause = exc if isinstance(exc, HttpProcessingError) else exc.__cause__
    if isinstance(cause, HttpProcessingError) and cause.message:
        return cause.message.splitlines()[0]
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (413 past the size limit; 400 if not an object, or past
    the bounds of ``proxy.limits``)."""
    body = await read_body(request)
    return parse_json_object(body)
