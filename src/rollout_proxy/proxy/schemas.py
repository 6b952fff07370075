"""Request bodies at the HTTP edge (pydantic, strict: no coercion); the core gets plain values.

Messages, tools and Responses input are checked against their exact shapes
(``message_models``, ``input_models``) and kept as sent, for the wire normalizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_proxy.proxy.input_models import Input
from rollout_proxy.proxy.limits import MAX_MESSAGES, MAX_NAME_CHARS
from rollout_proxy.proxy.message_models import Messages, SampleMessages, Tools
from rollout_proxy.proxy.validation import field_error
from rollout_proxy.records import BASE_POLICY, GenerationConfig

#: ``chat_template_kwargs`` that would override how the proxy renders: what it renders, how
#: it ends the prompt, the template itself, tokenizer options, the special tokens and the
#: helpers a template is given (``apply_chat_template``'s own arguments, and vLLM's).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "add_special_tokens",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
    }
)

Id = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
#: OpenAI's bound on ``top_logprobs`` in a request (0 to 20)
MAX_TOP_LOGPROBS = 20


class SampleIn(BaseModel):
    """The sample a rollout starts from; a harness that owns its prompt (Codex, Claude Code) may leave out
    ``messages``: its first request is then the root, exactly as it sent it."""

    model_config = ConfigDict(extra="allow", strict=True)  # datasets carry their own fields

    messages: SampleMessages | None = None
    tools: Tools | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    thinking: dict[str, Any] | None = None


class GenerationIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int = Field(4096, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: k > 0: record the policy's top-k at every sampled token (vLLM ``logprobs: k``; its ``--max-logprobs``
    #: must allow k). Turns are then not streamed from the engine, and an aborted one is regenerated.
    top_logprobs: int = Field(0, ge=0, le=128)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _proxy_renders(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise field_error(key, f"'{key}' is set by the proxy when it renders; it cannot be a template kwarg")
        return kwargs

    def to_config(self, thinking: dict[str, Any] | None) -> GenerationConfig:
        kwargs = dict(self.chat_template_kwargs or {})
        if thinking and "enable_thinking" not in kwargs and thinking.get("type") in ("enabled", "disabled"):
            kwargs["enable_thinking"] = thinking["type"] == "enabled"
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            chat_template_kwargs=kwargs or None,
            top_logprobs=self.top_logprobs,
        )


class ConcurrencyIn(BaseModel):
    """Bound the model requests in flight across all sessions sharing ``key`` (e.g. one job)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(min_length=1, max_length=200)
    max_requests: int = Field(ge=1)


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    sample: SampleIn = Field(default_factory=SampleIn)
    generation: GenerationIn = Field(default_factory=GenerationIn)
    context: dict[str, Any] = Field(default_factory=dict)
    n_sample: int | None = Field(None, ge=1)
    concurrency: ConcurrencyIn | None = None
    #: a request's own generation parameters: "refuse" them (a 400 unless the value changes nothing) or
    #: "ignore" them (the session's values are used, the client's recorded on the node); see
    #: ``proxy.client_sampling``
    client_sampling: Literal["refuse", "ignore"] = "refuse"
    #: of the nodes that retried one input, train only those the conversation went on from ("drop"), or all
    #: ("keep"): ``core.branches``
    retry: Literal["keep", "drop"] = "drop"
    #: the policy every turn samples with: "base" (the engines' model) or a registered LoRA policy's name
    #: (``engines.policies``; one no registry knows is a 400, one no engine serves now a 503)
    policy: str = Field(BASE_POLICY, min_length=1, max_length=64)


TOOL_CHOICE_WORDS = ("none", "auto", "required")


def checked_tool_choice(value: Any, *, function_name: Callable[[dict[str, Any]], Any]) -> Any:
    """``tool_choice`` as OpenAI takes it: a word, or an object with a ``type`` (a ``function`` one names the
    function, ``function_name`` says where); accepted, not enforced (the policy samples freely), and recorded
    on the node when it asks for more than ``auto`` (``handlers.turn.turn_meta``)."""
    if value is None or value in TOOL_CHOICE_WORDS:
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise field_error(
            "tool_choice", "tool_choice is 'none', 'auto', 'required' or an object with a type, e.g. a function's"
        )
    name = function_name(value)
    if value["type"] == "function" and not (isinstance(name, str) and name):
        raise field_error("tool_choice", "a tool_choice of type 'function' names the function")
    return value


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown OpenAI fields are ignored, as OpenAI does

    model: str | None = None
    messages: Messages
    tools: Tools | None = None
    tool_choice: Any = None
    stream: bool | None = False
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:  # {"type": "function", "function": {"name": ...}}
        return checked_tool_choice(value, function_name=lambda choice: (choice.get("function") or {}).get("name"))

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:  # as OpenAI answers it
            raise field_error("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Input = None
    instructions: str | None = None
    previous_response_id: Id | None = None
    tools: Tools | None = None
    tool_choice: Any = None
    store: bool = True
    stream: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:  # {"type": "function", "name": ...}
        return checked_tool_choice(value, function_name=lambda choice: choice.get("name"))


class AppendMessages(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    messages: Messages
    previous_response_id: Id | None = None


class ResponseRef(BaseModel):
    model_config = ConfigDict(strict=True)

    id: Id
    extra: dict[str, Any] | None = None


class FinishRequest(BaseModel):
    """The rollout result, as the seed's RolloutResult / GroupRolloutResult carry it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    status: Literal["success", "failure", "discard", "retry"] = "success"
    error: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    responses: Annotated[list[ResponseRef], Field(max_length=MAX_MESSAGES)] | None = None
    config: dict[str, Any] | None = None
