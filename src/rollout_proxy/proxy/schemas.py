"""Request bodies at the HTTP edge (pydantic); the core gets plain values."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_proxy.errors import PinnedParameter
from rollout_proxy.records import GenerationConfig
from rollout_proxy.wire.generation import PINNED_GENERATION_PARAMETERS


def refuse_pinned(payload: dict[str, Any]) -> None:
    for name in PINNED_GENERATION_PARAMETERS:
        if payload.get(name) is not None:
            raise PinnedParameter(
                f"'{name}' is pinned by the session's generation settings; set it in the sample or "
                "the job's hyperparameters, not in create()",
                param=name,
            )


class SampleIn(BaseModel):
    model_config = ConfigDict(extra="allow")  # datasets carry their own fields

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    thinking: dict[str, Any] | None = None


class GenerationIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(4096, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

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
        )


class ConcurrencyIn(BaseModel):
    """Bound the model requests in flight across all sessions sharing ``key`` (e.g. one job)."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, max_length=200)
    max_requests: int = Field(ge=1)


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sample: SampleIn
    generation: GenerationIn = Field(default_factory=GenerationIn)
    context: dict[str, Any] = Field(default_factory=dict)
    n_sample: int | None = Field(None, ge=1)
    concurrency: ConcurrencyIn | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored, as OpenAI does

    model: str | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: Any = None
    stream: bool | None = False
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Any = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    store: bool = True
    stream: bool | None = False


class AppendMessages(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Any]
    previous_response_id: str | None = None


class ResponseRef(BaseModel):
    id: str
    extra: dict[str, Any] | None = None


class FinishRequest(BaseModel):
    """The rollout result, as the seed's RolloutResult / GroupRolloutResult carry it."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["success", "failure", "discard", "retry"] = "success"
    error: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    responses: list[ResponseRef] | None = None
    config: dict[str, Any] | None = None
