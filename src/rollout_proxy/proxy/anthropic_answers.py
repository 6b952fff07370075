"""The Anthropic Messages API's answers: the message, its content blocks, errors, thinking signatures.

A turn's message is its node's view: a ``thinking`` block (the reasoning, with a signature the proxy
issues), a ``text`` block (the content, when there is any) and a ``tool_use`` block per call (``input``:
the parsed arguments; ``id``: the stored call id, which the client's ``tool_result`` names). ``id`` is the
node's response id, so ``GET /v1/responses/{id}/trajectory`` finds it; the extensions ``prompt_token_ids``
and ``token_ids`` are the tokens, as on the OpenAI routes.

Thinking signatures: ``sign`` is an HMAC (a key derived from the proxy's token secret) over the node id and
the thinking text, sent with the node id; ``signed_node`` checks one echoed back and answers the node it
names, so an echoed block identifies its node, and a block whose text or signature was changed is refused.

Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``, by the status of the proxy's
own error (``anthropic_error_type``); a 503 for no engine is Anthropic's ``overloaded_error`` (which its
SDKs and Claude Code retry), with the proxy's ``code`` and ``param`` kept as extensions.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Any, Literal, NotRequired

import orjson
from pydantic import ConfigDict, with_config
from typing_extensions import TypedDict

from rollout_proxy.core.turns import TurnResult
from rollout_proxy.errors import ProxyError
from rollout_proxy.ids import session_of_response
from rollout_proxy.records import ResponseNode

#: Anthropic's error types by HTTP status (anything else 4xx: invalid_request_error; 5xx: api_error)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

StopReason = Literal["end_turn", "tool_use", "max_tokens", "stop_sequence"]


def anthropic_error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: ProxyError) -> dict[str, Any]:
    """An error as Anthropic writes it; the proxy's ``code`` and ``param`` ride along (the SDKs ignore them)."""
    detail: dict[str, Any] = {"type": anthropic_error_type(error.status), "message": error.message}
    if error.param is not None:
        detail["param"] = error.param
    if error.code is not None:
        detail["code"] = error.code
    return {"type": "error", "error": detail}


def should_retry(status: int) -> bool:
    """What ``x-should-retry`` says: the SDKs would also retry a 409 (a finished session: never worth it)."""
    return status in (408, 429, 503, 504, 529)


# -- thinking signatures -----------------------------------------------------------------------------------

_KEY_LABEL = b"rollout-proxy/thinking-signature/v1"


def signing_key(token_secret: bytes) -> bytes:
    """A key of its own for thinking signatures, derived from the secret the session tokens are signed with."""
    return hmac.new(token_secret, _KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, node_id: str, thinking: str) -> bytes:
    return hmac.new(key, node_id.encode() + b"\x00" + thinking.encode("utf-8", "surrogatepass"), "sha256").digest()


def sign(key: bytes, node_id: str, thinking: str) -> str:
    """The signature of ``thinking`` as node ``node_id`` produced it."""
    return base64.urlsafe_b64encode(node_id.encode() + b"\x00" + _mac(key, node_id, thinking)).decode()


def signed_node(key: bytes, signature: str, thinking: str) -> str | None:
    """The node a signature names, if this proxy issued it for this very text; None otherwise."""
    try:
        raw = base64.urlsafe_b64decode(signature.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        return None
    node, sep, mac = raw.partition(b"\x00")
    if not sep:
        return None
    try:
        node_id = node.decode("ascii")
    except UnicodeDecodeError:
        return None
    if session_of_response(node_id) is None or not hmac.compare_digest(mac, _mac(key, node_id, thinking)):
        return None
    return node_id


# -- the message ---------------------------------------------------------------------------------------------


def stop_reason(node: ResponseNode) -> StopReason:
    """Anthropic's ``stop_reason`` for how the turn ended (a turn cut by a pause reads as ``end_turn``)."""
    if node.finish_reason == "tool_calls":
        return "tool_use"
    if node.finish_reason == "length":
        return "max_tokens"
    if isinstance(node.meta.get("stop_sequence"), str):
        return "stop_sequence"
    return "end_turn"


def stop_sequence(node: ResponseNode) -> str | None:
    """The stop string that ended the turn (the engine says which), for ``stop_sequence``."""
    value = node.meta.get("stop_sequence")
    return value if isinstance(value, str) and node.finish_reason == "stop" else None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object (arguments that are no JSON object: an empty one)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(node: ResponseNode, key: bytes) -> list[dict[str, Any]]:
    message = node.messages[-1]
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": sign(key, node.id, reasoning)})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": tool_input(function["arguments"])}
        )
    return blocks


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(result: TurnResult, *, model: str | None, key: bytes) -> dict[str, Any]:
    node = result.node
    return {
        "id": node.id,
        "type": "message",
        "role": "assistant",
        "model": model or node.model,
        "content": content_blocks(node, key),
        "stop_reason": stop_reason(node),
        "stop_sequence": stop_sequence(node),
        "usage": usage(len(result.prompt_ids), len(node.output_ids)),
        "prompt_token_ids": result.prompt_ids,
        "token_ids": node.output_ids,
    }


# -- the shapes, for the OpenAPI document ----------------------------------------------------------------------


@with_config(ConfigDict(extra="forbid"))
class AnthropicErrorDetail(TypedDict):
    type: str
    message: str
    param: NotRequired[str]
    code: NotRequired[str]


@with_config(ConfigDict(extra="forbid"))
class AnthropicErrorBody(TypedDict):
    """Every 4xx/5xx answer of the Messages routes, in Anthropic's error shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(TypedDict):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class OutputBlock(TypedDict):
    """``text`` (``text``), ``thinking`` (``thinking``, ``signature``) or ``tool_use`` (``id``, ``name``,
    ``input``)."""

    type: Literal["text", "thinking", "tool_use"]
    text: NotRequired[str]
    thinking: NotRequired[str]
    signature: NotRequired[str]
    id: NotRequired[str]
    name: NotRequired[str]
    input: NotRequired[dict[str, Any]]


class AnthropicMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: MessageUsage
    #: extensions: the whole prompt the engine consumed, and the tokens the policy sampled
    prompt_token_ids: list[int]
    token_ids: list[int]


class TokenCount(TypedDict):
    input_tokens: int
