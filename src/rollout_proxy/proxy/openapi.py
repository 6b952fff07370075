"""The proxy's own API as one OpenAPI 3.1 document, served at ``GET /openapi.json``.

Request bodies are generated from the pydantic models the handlers validate with, and
answers from ``openapi_answers`` and the wire models, so the document follows the code
instead of restating it. Every route that ``app.add_routes`` registers has one
``Operation`` below: tests/proxy/test_openapi.py fails on a route without one, and the
fuzz test (tests/proxy/test_fuzz.py) holds the live answers to what is written here.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import TypeAdapter

from rollout_proxy import __version__
from rollout_proxy.proxy import anthropic_answers
from rollout_proxy.proxy import openapi_answers as answers
from rollout_proxy.proxy import openapi_examples as examples
from rollout_proxy.proxy.anthropic_models import CountTokensRequest, MessagesRequest
from rollout_proxy.proxy.handlers import viewer
from rollout_proxy.proxy.handlers.distill import CriticViewIn, CriticViewOut, TeacherPassIn, TeacherPassOut
from rollout_proxy.proxy.handlers.feed import MAX_PAGE
from rollout_proxy.proxy.handlers.fleet_admin import EngineIn, PauseIn, ResumeIn
from rollout_proxy.proxy.handlers.policies import PolicyIn, VersionIn
from rollout_proxy.proxy.schemas import AppendMessages, ChatRequest, FinishRequest, ResponsesRequest, SessionCreate
from rollout_proxy.wire.trajectory import Trajectory

REF = "#/components/schemas/{model}"
TEXT = "text/plain"  # an answer that is not JSON (the Prometheus metrics)
HTML = ("text/html",)  # the viewer's page
ASSET = ("text/css", "text/javascript")  # the viewer's files
IMAGE = ("image/png", "image/jpeg", "image/webp", "image/gif")  # a stored image, as it was sent


class Access(enum.Enum):
    """Who may call: the security schemes an operation accepts (any one of them)."""

    PUBLIC = ()
    ADMIN = ("adminKey",)
    SESSION = ("sessionToken",)
    EITHER = ("adminKey", "sessionToken")


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    summary: str
    tag: str
    access: Access
    answer: Any  # a type whose JSON Schema pydantic can generate, or TEXT
    status: int = 200
    body: Any = None  # the request model the handler validates with
    examples: dict[str, dict[str, Any]] | None = None  # bodies that succeed, by name
    errors: tuple[int, ...] = ()  # beyond what access (401) and a body (400, 413) imply
    parameters: tuple[dict[str, Any], ...] = ()
    anthropic: bool = False  # errors in Anthropic's shape (the Messages API), not OpenAI's


def _parameter(name: str, where: str, schema: dict[str, Any], what: str) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema, "description": what}


SESSION_ID = _parameter("session_id", "path", {"type": "string"}, "a session id (`sess_…`) from POST /v1/sessions")
RESPONSE_ID = _parameter("response_id", "path", {"type": "string"}, "a response id (`resp_…`), chat or Responses API")
IMAGE_SHA256 = _parameter(
    "sha256",
    "path",
    {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    "the sha256 (hex) of the image's bytes, as a trajectory's `images[].sha256` or a message's image part names it",
)
IDEMPOTENCY_KEY = _parameter(
    "Idempotency-Key",
    "header",
    {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[ -~]+$"},
    "every request with this key makes one node and answers its response_id (printable ASCII)",
)
FEED_QUERY = (
    _parameter("after", "query", {"type": "string"}, "the `next` cursor of the previous page; none: from the start"),
    _parameter("limit", "query", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 100}, "page size"),
)
ENGINE_ERRORS = (502, 503, 504)
POLICY_NAME = _parameter("name", "path", {"type": "string"}, "a policy's name (`base`, or a registered LoRA policy)")
ENGINE_URL = {
    "name": "url",
    "in": "query",
    "required": True,
    "schema": {"type": "string", "minLength": 1},
    "description": "the engine's base URL, as GET /v1/admin/engines lists it",
}
POLICY_EXAMPLES: dict[str, dict[str, Any]] = {
    "register": {"name": "grpo-lora"},
    "register_with_version": {"name": "grpo-lora", "path": "/checkpoints/grpo-lora/step-1"},
    "publish": {"path": "/checkpoints/grpo-lora/step-2"},
}
FLEET_EXAMPLES: dict[str, dict[str, Any]] = {
    "add": {"url": "http://127.0.0.1:8001"},
    "readmit": {"url": "http://127.0.0.1:8001", "policy_version": 12},
    "pause": {"mode": "keep"},
    "resume": {"policy_version": 13},
}


def _flag(name: str, what: str) -> dict[str, Any]:
    return _parameter(name, "query", {"type": "boolean"}, what)


def _text(name: str, what: str) -> dict[str, Any]:
    return _parameter(name, "query", {"type": "string", "minLength": 1, "maxLength": viewer.MAX_TEXT}, what)


LIST_QUERY = (
    _parameter(
        "limit",
        "query",
        {"type": "integer", "minimum": 1, "maximum": viewer.MAX_PAGE, "default": viewer.DEFAULT_PAGE},
        "page size",
    ),
    _text("cursor", "the `next` of the previous page; none: the newest"),
    _parameter("status", "query", {"type": "string", "enum": list(viewer.STATUSES)}, "open or finished sessions"),
    _text("job", "the runner's job id (`context.model_customization_job_id`)"),
    _text("finish_reason", "one of its branches ended so (`stop`, `length`, `tool_calls`, ...)"),
    _flag("forks", "it has a fork (rewritten history), or none"),
    _flag("drift", "routing disagreements or non-finite logprobs were recorded, or none"),
    _text("policy_version", "one of its tokens was sampled by this policy version (`3`; a LoRA policy's: `pol@v3`)"),
    _text("policy", "its turns sample with this policy (`base`, or a LoRA policy's name)"),
    _flag("graded", "the trainer feed has a reward for one of its trajectories, or none"),
    _parameter("min_reward", "query", {"type": "number"}, "one graded trajectory's reward is at least this"),
    _parameter("max_reward", "query", {"type": "number"}, "one graded trajectory's reward is at most this"),
)
ASSET_NAME = _parameter("name", "path", {"type": "string"}, "a file of the page (`viewer.js`, `viewer.css`)")
#: The Messages routes are served under these prefixes too (the same operations, undocumented twice):
#: Anthropic's clients append ``/v1/messages`` to their base URL, which may be the session's ``base_url``
#: (``…/v1``) as well as the proxy's root.
MESSAGES_ALIAS_PREFIXES = ("/v1",)
ALIASES = {
    f"{prefix}{path}": path
    for prefix in MESSAGES_ALIAS_PREFIXES
    for path in ("/v1/messages", "/v1/messages/count_tokens")
}
ANTHROPIC_HEADERS = (
    _parameter(
        "anthropic-version", "header", {"type": "string"}, "accepted (every Anthropic SDK sends one); changes nothing"
    ),
    _parameter("anthropic-beta", "header", {"type": "string"}, "accepted, comma-separated; changes nothing"),
    _parameter("beta", "query", {"type": "string"}, "`?beta=true` (Claude Code's): accepted, ignored"),
)

OPERATIONS: tuple[Operation, ...] = (
    Operation("post", "/v1/chat/completions", "Chat completion, token-exact",
              "plugin", Access.SESSION, answers.ChatCompletion, body=ChatRequest,
              examples=examples.CHAT, errors=(404, 409, *ENGINE_ERRORS)),
    Operation("post", "/v1/responses", "Create a response (previous_response_id extends or forks)",
              "plugin", Access.SESSION, answers.Response, body=ResponsesRequest,
              examples=examples.RESPONSES, errors=(404, 409, *ENGINE_ERRORS)),
    Operation("post", "/v1/messages", "Anthropic Messages API, token-exact (the session key in x-api-key or Bearer)",
              "plugin", Access.SESSION, anthropic_answers.AnthropicMessage, body=MessagesRequest,
              examples=examples.MESSAGES, errors=(404, 409, *ENGINE_ERRORS), parameters=ANTHROPIC_HEADERS,
              anthropic=True),
    Operation("post", "/v1/messages/count_tokens", "The prompt's tokens as the policy's template renders it",
              "plugin", Access.SESSION, anthropic_answers.TokenCount, body=CountTokensRequest,
              examples=examples.COUNT_TOKENS, errors=(404, *ENGINE_ERRORS), parameters=ANTHROPIC_HEADERS,
              anthropic=True),
    Operation("get", "/v1/responses/{response_id}", "A stored response",
              "plugin", Access.EITHER, answers.Response, errors=(404, 503), parameters=(RESPONSE_ID,)),
    Operation("get", "/v1/responses/{response_id}/trajectory", "The trajectory ending at a response",
              "trainer", Access.EITHER, Trajectory, errors=(404, 503), parameters=(RESPONSE_ID,)),
    Operation("get", "/v1/models", "The engines' models",
              "plugin", Access.EITHER, answers.ModelList, errors=ENGINE_ERRORS),
    Operation("post", "/v1/sessions", "Open a session for one rollout",
              "trainer", Access.ADMIN, answers.SessionCreated, status=201, body=SessionCreate,
              examples=examples.SESSION, errors=(503,)),
    Operation("get", "/v1/sessions/{session_id}", "A session's record",
              "trainer", Access.EITHER, answers.SessionInfo, errors=(404, 503), parameters=(SESSION_ID,)),
    Operation("post", "/v1/sessions/{session_id}/messages", "Append messages the policy did not generate",
              "trainer", Access.EITHER, answers.MessagesAppended, status=201, body=AppendMessages,
              examples=examples.APPEND, errors=(404, 409, *ENGINE_ERRORS), parameters=(SESSION_ID, IDEMPOTENCY_KEY)),
    Operation("post", "/v1/sessions/{session_id}/finish", "Record the rollout result, once",
              "trainer", Access.EITHER, answers.SessionFinished, body=FinishRequest,
              examples=examples.FINISH, errors=(404, 409, 503), parameters=(SESSION_ID,)),
    Operation("get", "/v1/sessions/{session_id}/trajectory", "The session's latest trajectory",
              "trainer", Access.EITHER, Trajectory, errors=(404, 503), parameters=(SESSION_ID,)),
    Operation("get", "/v1/sessions/{session_id}/rollout", "Every branch of the session's tree, each token trained once",
              "trainer", Access.EITHER, answers.RolloutExport, errors=(404, 503), parameters=(SESSION_ID,)),
    Operation("get", "/v1/sessions/{session_id}/images/{sha256}", "One image of the session, as it was sent",
              "trainer", Access.EITHER, IMAGE, errors=(404, 503), parameters=(SESSION_ID, IMAGE_SHA256)),
    Operation("get", "/v1/feed", "Graded trajectory groups, paged by cursor",
              "trainer", Access.ADMIN, answers.FeedPage, errors=(400, 404, 503), parameters=FEED_QUERY),
    Operation("get", "/v1/admin/counters", "The proxy's counters",
              "operations", Access.ADMIN, dict[str, float]),
    Operation("get", "/v1/admin/engines", "The engines: state, policy version, calls in flight, last error",
              "fleet", Access.ADMIN, answers.FleetView),
    Operation("post", "/v1/admin/engines", "Add an engine (probed before the answer), or set the weights one has",
              "fleet", Access.ADMIN, answers.EngineEntry, body=EngineIn,
              examples={name: FLEET_EXAMPLES[name] for name in ("add", "readmit")}),
    Operation("delete", "/v1/admin/engines", "Drain an engine (calls in flight finish) and remove it",
              "fleet", Access.ADMIN, answers.EngineEntry, errors=(400, 404), parameters=(ENGINE_URL,)),
    Operation("post", "/v1/admin/pause", "Pause every engine for a weight update; new turns queue",
              "fleet", Access.ADMIN, answers.FleetControl, body=PauseIn, examples={"pause": FLEET_EXAMPLES["pause"]}),
    Operation("post", "/v1/admin/resume", "Set the new policy version on every paused engine and resume",
              "fleet", Access.ADMIN, answers.FleetControl, body=ResumeIn, errors=(409,),
              examples={"resume": FLEET_EXAMPLES["resume"]}),
    Operation("get", "/v1/admin/policies", "The policies: the base and each LoRA policy, their versions and served names",
              "policies", Access.ADMIN, answers.PolicyList),
    Operation("post", "/v1/admin/policies", "Register a LoRA policy (and publish its first version, given a path)",
              "policies", Access.ADMIN, answers.PolicyEntry, body=PolicyIn, errors=(404, 503),
              examples={name: POLICY_EXAMPLES[name] for name in ("register", "register_with_version")}),
    Operation("get", "/v1/admin/policies/{name}", "A policy: its version, and per engine its served name",
              "policies", Access.ADMIN, answers.PolicyEntry, errors=(404,), parameters=(POLICY_NAME,)),
    Operation("post", "/v1/admin/policies/{name}/versions",
              "Publish an adapter as the policy's next version: no pause; calls in flight finish on the last one",
              "policies", Access.ADMIN, answers.PolicyPublished, body=VersionIn, errors=(404, 503),
              parameters=(POLICY_NAME,), examples={"publish": POLICY_EXAMPLES["publish"]}),
    Operation("delete", "/v1/admin/policies/{name}",
              "Retire a LoRA policy: out of the registry at once, each version unloaded once its calls finished",
              "policies", Access.ADMIN, answers.PolicyRetired, errors=(400, 404, 503), parameters=(POLICY_NAME,)),
    Operation("get", "/healthz", "Liveness",
              "operations", Access.PUBLIC, answers.Health),
    Operation("get", "/readyz", "Readiness: the store answers and an engine is healthy (URLs for the admin key)",
              "operations", Access.PUBLIC, answers.Readiness),
    Operation("get", "/metrics", "Prometheus metrics",
              "operations", Access.PUBLIC, TEXT),
    Operation("get", "/openapi.json", "This document",
              "operations", Access.PUBLIC, dict[str, Any]),
    Operation("get", "/ui", "The trajectory viewer (a page without data: it asks for the admin key)",
              "viewer", Access.PUBLIC, HTML),
    Operation("get", "/ui/static/{name}", "The viewer's script and stylesheet",
              "viewer", Access.PUBLIC, ASSET, errors=(404,), parameters=(ASSET_NAME,)),
    Operation("get", "/v1/admin/sessions", "Live sessions, newest first, filtered, paged by cursor",
              "viewer", Access.ADMIN, answers.SessionList, errors=(400, 503), parameters=LIST_QUERY),
    Operation("get", "/v1/admin/sessions/{session_id}", "A session, every node of its response tree, its grades",
              "viewer", Access.ADMIN, answers.SessionTree, errors=(404, 503), parameters=(SESSION_ID,)),
    Operation("get", "/v1/admin/responses/{response_id}/tokens", "A trajectory token by token: pieces, nodes, grade",
              "viewer", Access.ADMIN, answers.TrajectoryTokens, errors=(404, 503), parameters=(RESPONSE_ID,)),
    Operation("post", "/v1/admin/sessions/{session_id}/teacher_pass",
              "A teacher's logprob (and top-k) of every trained token, teacher_context inserted; nothing stored",
              "distillation", Access.ADMIN, TeacherPassOut, body=TeacherPassIn, errors=(400, 404, *ENGINE_ERRORS),
              parameters=(SESSION_ID,)),
    Operation("post", "/v1/admin/sessions/{session_id}/critic_view",
              "The trajectory's tokens with critic_context inserted (the student's template); nothing stored",
              "distillation", Access.ADMIN, CriticViewOut, body=CriticViewIn, errors=(400, 404, *ENGINE_ERRORS),
              parameters=(SESSION_ID,)),
)  # fmt: skip

ERRORS: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "Invalid request: malformed JSON, a refused field, a pinned generation setting (`param`)"),
    401: ("Unauthorized", "Missing or wrong credentials for this route"),
    404: ("NotFound", "Unknown id, or one the caller's session cannot see"),
    409: ("Conflict", "The session is finished, or an idempotency key was reused with another request"),
    413: ("PayloadTooLarge", "The body is over the size limit"),
    415: ("UnsupportedMediaType", "A Content-Encoding the proxy cannot read (it reads gzip and deflate)"),
    500: ("ServerError", "A bug: the proxy's log has it under the answer's X-Request-Id"),
    502: ("BadGateway", "The engine answered badly"),
    503: ("ServiceUnavailable", "No engine reachable, or the state store is down: retry after Retry-After"),
    504: ("GatewayTimeout", "The engine did not answer in time: retry after Retry-After"),
}
RETRY_STATUSES = (503, 504)
#: the error answers of the Messages routes: the same statuses, in Anthropic's shape
ANTHROPIC_PREFIX = "Anthropic"

SECURITY_SCHEMES = {
    "adminKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "The proxy's admin key (`--admin-key`): trainer, fleet and admin routes.",
    },
    "sessionToken": {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "A session's `api_key` from POST /v1/sessions, the plugin's OpenAI `api_key`: that session only.",
    },
}
HEADERS = {
    "RequestId": {
        "description": "The request's id (the client's X-Request-Id, else a new one), as the proxy's log has it",
        "required": True,
        "schema": {"type": "string"},
    },
    "RetryAfter": {
        "description": "Seconds to wait before trying again",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    },
}


def _error_statuses(operation: Operation) -> list[int]:
    implied = {500}
    if operation.access is not Access.PUBLIC:
        implied.add(401)
    if operation.body is not None:
        implied.update((400, 413, 415))
    return sorted(implied.union(operation.errors))


def _answer(description: str, content: dict[str, Any], *, retry: bool = False) -> dict[str, Any]:
    headers: dict[str, Any] = {"X-Request-Id": {"$ref": "#/components/headers/RequestId"}}
    if retry:
        headers["Retry-After"] = {"$ref": "#/components/headers/RetryAfter"}
    return {"description": description, "headers": headers, "content": content}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


#: Operations that answer ``stream: true`` with server-sent events (README "Streaming").
STREAMED = {
    "/v1/chat/completions": "With `stream: true`: `chat.completion.chunk` events (`data: {...}`), each with the "
    "response `id` and the step's `token_ids` (the first also `prompt_token_ids`), then `data: [DONE]`; "
    "a failure after the first event is `event: error` with an error body.",
    "/v1/responses": "With `stream: true`: `response.created`, `response.in_progress`, output item, content part, "
    "`output_text`/`reasoning_text`/`function_call_arguments` delta and done events, `response.completed` "
    "(each `event: <type>` with a `sequence_number`); a failure after the first event is an `error` event.",
    "/v1/messages": "With `stream: true`: Anthropic's `message_start`, `ping`, `content_block_start` / "
    "`content_block_delta` (`thinking_delta`, `signature_delta`, `text_delta`, `input_json_delta`) / "
    "`content_block_stop`, `message_delta` (`stop_reason`, usage, `token_ids`), `message_stop`; a failure after "
    "the first event is an `error` event with Anthropic's error body.",
}


def _operation(operation: Operation, schemas: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    key = f"{operation.method} {operation.path}"
    media = _media_types(operation.answer)
    if media is not None:
        success = _answer("OK", {kind: {"schema": {"type": "string"}} for kind in media})
    else:
        success = _answer("OK", _json(schemas[(key, "serialization")]))
    if operation.path in STREAMED and operation.method == "post":
        success["content"]["text/event-stream"] = {  # OpenAPI 3.1: `schema` describes one event of the stream
            "schema": {
                "type": "object",
                "description": STREAMED[operation.path],
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                "required": ["data"],
            }
        }
    responses: dict[str, Any] = {str(operation.status): success}
    if operation.path == "/readyz":  # not ready is an answer of its own, not an error
        responses["503"] = _answer("Not ready", _json(schemas[(key, "serialization")]))
    prefix = ANTHROPIC_PREFIX if operation.anthropic else ""
    for status in _error_statuses(operation):
        responses.setdefault(str(status), {"$ref": f"#/components/responses/{prefix}{ERRORS[status][0]}"})
    spec: dict[str, Any] = {
        "operationId": _operation_id(operation),
        "summary": operation.summary,
        "tags": [operation.tag],
        "security": [{name: []} for name in operation.access.value],
        "responses": responses,
    }
    if operation.parameters:
        spec["parameters"] = list(operation.parameters)
    if operation.body is not None:
        content = _json(schemas[(key, "validation")])
        if operation.examples:
            content["application/json"]["examples"] = {
                name: {"value": value} for name, value in operation.examples.items()
            }
        spec["requestBody"] = {"required": True, "content": content}
    return spec


def _media_types(answer: Any) -> tuple[str, ...] | None:
    """The media types of an answer that is not JSON (TEXT, HTML, ASSET, IMAGE); None for JSON."""
    if answer == TEXT:
        return (TEXT,)
    if isinstance(answer, tuple) and all(isinstance(kind, str) for kind in answer):
        return answer
    return None


def _operation_id(operation: Operation) -> str:
    words = operation.path.replace("{", "").replace("}", "").replace(".", "_").strip("/").split("/")
    return "_".join([operation.method, *words])


def _schemas() -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, Any]]:
    """Every request and answer schema, generated together so shared models are defined once."""
    inputs: list[tuple[tuple[str, str], Any, TypeAdapter[Any]]] = [
        (("error", "serialization"), "serialization", TypeAdapter(answers.ErrorBody)),
        (("anthropic_error", "serialization"), "serialization", TypeAdapter(anthropic_answers.AnthropicErrorBody)),
    ]
    for operation in OPERATIONS:
        key = f"{operation.method} {operation.path}"
        if _media_types(operation.answer) is None:
            inputs.append(((key, "serialization"), "serialization", TypeAdapter(operation.answer)))
        if operation.body is not None:
            inputs.append(((key, "validation"), "validation", TypeAdapter(operation.body)))
    refs, top = TypeAdapter.json_schemas(inputs, ref_template=REF)
    return {key: schema for (key, _mode), schema in refs.items()}, top.get("$defs", {})


def build_document() -> dict[str, Any]:
    refs, definitions = _schemas()
    paths: dict[str, dict[str, Any]] = {}
    for operation in OPERATIONS:
        paths.setdefault(operation.path, {})[operation.method] = _operation(operation, refs)
    error = refs[("error", "serialization")]
    anthropic_error = refs[("anthropic_error", "serialization")]
    anthropic_statuses = sorted(
        {status for operation in OPERATIONS if operation.anthropic for status in _error_statuses(operation)}
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rollout-proxy",
            "version": __version__,
            "description": (
                "A token-exact, OpenAI-compatible proxy between RL rollout plugins and vLLM engines. "
                "Plugins call the OpenAI routes with their session's token as api_key; the trainer "
                "opens sessions and reads trajectories with the admin key. Every error is OpenAI's "
                "`{error: {message, type, param, code}}`."
            ),
        },
        "tags": [
            {"name": "plugin", "description": "OpenAI-compatible routes a rollout plugin calls"},
            {"name": "trainer", "description": "Sessions, results and trajectories (the runner, the trainer)"},
            {"name": "operations", "description": "Health, readiness, metrics, counters, this document"},
            {"name": "fleet", "description": "The engines: health, adding and draining, pause and resume"},
            {"name": "viewer", "description": "The trajectory viewer at /ui and the admin read API it calls"},
            {"name": "distillation", "description": "On-policy distillation: teacher passes and critic views"},
        ],
        "paths": paths,
        "components": {
            "schemas": definitions,
            "responses": {
                **{
                    name: _answer(description, _json(error), retry=status in RETRY_STATUSES)
                    for status, (name, description) in ERRORS.items()
                },
                **{
                    ANTHROPIC_PREFIX + ERRORS[status][0]: _answer(
                        f"{ERRORS[status][1]} (Anthropic's error shape)",
                        _json(anthropic_error),
                        retry=status in RETRY_STATUSES,
                    )
                    for status in anthropic_statuses
                },
            },
            "headers": HEADERS,
            "securitySchemes": SECURITY_SCHEMES,
        },
    }


@functools.cache
def document_bytes() -> bytes:
    """The document as served: generated once per process (it depends on the code only)."""
    return orjson.dumps(build_document())
