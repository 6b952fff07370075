"""The one exception tree of rollout-proxy, mapped to OpenAI-style error bodies.

    ProxyError                      500 server_error (a bug if it ever reaches a client)
    ├── InvalidRequest              400 invalid_request_error
    │   ├── PinnedParameter         400 a generation setting the session pins
    │   ├── ContextLengthExceeded   400 the prompt leaves no room to generate
    │   ├── MessagesMergeIntoParent 400 the template folds new messages into a fixed turn
    │   ├── TemplateRenderError     400 the chat template cannot render what was sent
    │   ├── BadCursor               400 a feed cursor the feed never gave out
    │   ├── ImageRefused            400 an image not taken: not decodable, its format, its size, its URL
    │   ├── TooManyImages           400 past an image bound: a request's, or what its session may store
    │   ├── ImagesUnsupported       400 a conversation with images for a policy that is given none
    │   └── AdapterRefused          400 a LoRA adapter the engines cannot load (its files, its rank, ...)
    ├── AuthenticationFailed        401 authentication_error
    ├── NotFound                    404 not_found_error
    │   ├── SessionNotFound         404 a session that is unknown or expired
    │   └── UnknownPolicy           404 a policy the proxy does not know
    ├── MethodNotAllowed            405 the route exists, not with this method
    ├── Conflict                    409 conflict (e.g. a session already finished)
    │   ├── SessionFinished         409 a turn or message for a session already finished
    │   ├── IdempotencyKeyReused    409 an idempotency key sent again with another request
    │   └── PolicyRetired           409 a turn of a session whose LoRA policy was retired
    ├── PayloadTooLarge             413 request_too_large
    ├── UnsupportedMediaType        415 a body encoding the proxy cannot read
    ├── EngineError                 502 upstream_error (the engine answered badly)
    │   └── StreamInterrupted       502 a streamed answer broke after its first byte (never retried)
    ├── EngineUnavailable           503 service_unavailable (no engine reachable), Retry-After
    │   ├── FleetPaused             503 the engines are paused for a weight update (queue full, or waited too long)
    │   └── PolicyUnavailable       503 no engine serves the policy now (each one's reason in the message)
    ├── StoreUnavailable            503 service_unavailable (the state store is down), Retry-After
    │   └── StoreBusy               503 every Redis connection stayed busy for the pool's wait
    ├── EngineBusy                  503 every connection to the engine stayed busy for the pool's wait
    └── EngineTimeout               504 timeout (the engine did not answer in time), Retry-After

Core code raises these and knows nothing of HTTP; one middleware turns them into
``{"error": {"message", "type", "param", "code"}}`` with the status above (and the
wire package's ``WireFormatError``, raised by pure shape checks, into ``InvalidRequest``).
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    #: seconds a client should wait before trying again (sent as ``Retry-After``); None: no header
    retry_after: float | None = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after is not None:
            self.retry_after = retry_after

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class PinnedParameter(InvalidRequest):
    code = "parameter_pinned_by_session"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class MessagesMergeIntoParent(InvalidRequest):
    code = "messages_merge_into_parent"


class TemplateRenderError(InvalidRequest):
    code = "template_render_failed"


class BadCursor(InvalidRequest):
    code = "invalid_cursor"


class ImageRefused(InvalidRequest):
    """An image that is not taken: it does not decode, its format is not one taken, it is too large (bytes or
    pixels), or its URL could not be fetched (or is not fetched at all)."""

    code = "invalid_image"


class TooManyImages(InvalidRequest):
    """More images than a request may hold, or than its session may store."""

    code = "too_many_images"


class ImagesUnsupported(InvalidRequest):
    code = "images_unsupported_by_model"


class AdapterRefused(InvalidRequest):
    """A LoRA adapter that cannot be served: its directory or files, a rank above the engine's
    ``--max-lora-rank``, a feature vLLM refuses, or an engine that serves no run-time LoRA loading."""

    code = "adapter_refused"


class AuthenticationFailed(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class SessionNotFound(NotFound):
    code = "session_not_found"


class UnknownPolicy(NotFound):
    """A policy name the proxy has not registered (``engines.policies``)."""

    code = "unknown_policy"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(ProxyError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class SessionFinished(Conflict):
    code = "session_finished"


class IdempotencyKeyReused(Conflict):
    code = "idempotency_key_reused"


class PolicyRetired(Conflict):
    """A turn of a session whose LoRA policy left the registry (``DELETE /v1/admin/policies/{name}``): the
    session cannot go on, and a retry will not help (not the client's malformed input, not the engines' state)."""

    code = "policy_retired"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ProxyError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class EngineError(ProxyError):
    status = 502
    type = "upstream_error"
    code = "engine_error"


class StreamInterrupted(EngineError):
    """The engine failed, or the turn had to start over, after part of it was streamed to the client:
    what the client saw cannot be taken back, so the turn ends here (an SSE ``error`` event)."""

    code = "stream_interrupted"


class EngineUnavailable(ProxyError):
    status = 503
    type = "service_unavailable"
    code = "engine_unavailable"
    retry_after = 1.0


class FleetPaused(EngineUnavailable):
    code = "engines_paused"
    retry_after = 5.0


class PolicyUnavailable(EngineUnavailable):
    """The policy is known, but no engine serves it now (each engine drained for it, or down)."""

    code = "policy_unavailable"
    retry_after = 5.0


class StoreUnavailable(ProxyError):
    status = 503
    type = "service_unavailable"
    code = "store_unavailable"
    retry_after = 1.0


class StoreBusy(StoreUnavailable):
    """The store answers, but all of this process's connections to it stayed in use for the pool's wait."""

    code = "store_busy"


class EngineBusy(ProxyError):
    """All of this process's connections to an engine stayed in use for the pool's wait: the proxy's
    own limit, not the engine's failure (so not an ``EngineUnavailable``: the fleet must not count it)."""

    status = 503
    type = "service_unavailable"
    code = "engine_busy"
    retry_after = 1.0


class EngineTimeout(ProxyError):
    status = 504
    type = "timeout"
    code = "engine_timeout"
    retry_after = 1.0
