"""Small HTTP helpers shared by the handlers: JSON in, JSON out."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from rollout_proxy.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)

_DUMP_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def json_response(data: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data, option=_DUMP_OPTIONS), status=status, content_type="application/json")


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (413 past the size limit, 400 if not an object)."""
    body = await request.read()
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return payload


def validate(model: type[M], payload: dict[str, Any]) -> M:
    """Validate with pydantic; the first error becomes a 400 naming its field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
