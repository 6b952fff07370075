"""The SDK's public types, named and shaped as in the Ark RL SDK the plugins mirror."""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout_proxy.wire.routed_experts import decode_routed_experts
from rollout_proxy.wire.trajectory import Trajectory

__all__ = [
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
    "ChatCompletionSample",
    "CriticContext",
    "Function",
    "GroupGraderResult",
    "GroupRolloutResult",
    "PluginContext",
    "PluginStatus",
    "RolloutResult",
    "SingleGraderResult",
    "SingleResponse",
    "TeacherContext",
    "Thinking",
    "Trajectory",
    "decode_routed_experts",
]


class PluginStatus(str, enum.Enum):
    """What happens to a sample: failure → retried 3x then the job fails; retry → retried
    3x then dropped; discard → dropped at once."""

    SUCCESS = "success"
    FAILURE = "failure"
    DISCARD = "discard"
    RETRY = "retry"


class Function(BaseModel):
    name: str
    arguments: str = "{}"


class ChatCompletionMessageToolCall(BaseModel):
    id: str | None = "user_defined"
    function: Function
    type: Literal["function"] = "function"


class ChatCompletionMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Any = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    reasoning_content: str | None = ""


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "auto"] = "enabled"


class ChatCompletionSample(BaseModel):
    """One dataset sample plus its GenerationConfig (pinned for every call of the rollout)."""

    model_config = ConfigDict(extra="allow")

    # GenerationConfig
    n: int = 1
    max_new_tokens: int = 4096
    top_p: float = 1.0
    top_k: int = 0
    temperature: float = 1.0

    #: empty for a harness that owns its prompt (the task reaches it otherwise: ``extra``, its command line)
    messages: list[ChatCompletionMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    thinking: Thinking | None = None
    extra: dict[str, Any] | None = None

    def generation(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }

    def message_dicts(self) -> list[dict[str, Any]]:
        return [message.model_dump(exclude_none=True) for message in self.messages]


class PluginContext(BaseModel):
    model_config = ConfigDict(extra="allow")

    model_customization_job_id: str = ""
    foundation_model_name: str = ""
    foundation_model_version: str = ""
    customization_type: str = ""
    phase: str = ""
    is_mock: bool = False
    current_training_step: int | None = None


class RolloutResult(BaseModel):
    status: PluginStatus = PluginStatus.SUCCESS
    error: str | None = ""
    extra: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] | None = None  # "teachers" / "critic_context"


class SingleResponse(BaseModel):
    id: str
    extra: dict[str, Any] | None = None


class GroupRolloutResult(BaseModel):
    status: PluginStatus = PluginStatus.SUCCESS
    error: str | None = None
    responses: list[SingleResponse] = Field(default_factory=list)
    config: dict[str, Any] | None = None


class TeacherContext(BaseModel):
    """Context only the teacher sees, inserted before the ``qa_index``-th assistant turn (from 0)."""

    qa_index: int
    message: ChatCompletionMessage


class CriticContext(BaseModel):
    """Context only the critic sees, inserted before the ``qa_index``-th assistant turn (from 0)."""

    qa_index: int
    message: ChatCompletionMessage


class SingleGraderResult(BaseModel):
    reward: float
    metrics: dict[str, float] = Field(default_factory=dict)
    status: PluginStatus = PluginStatus.SUCCESS
    error: str | None = ""


class GroupGraderResult(BaseModel):
    rewards: list[float]
    metrics: dict[str, float] = Field(default_factory=dict)
    status: PluginStatus = PluginStatus.SUCCESS
    error: str | None = ""
    seq_advantages: list[float] | None = None
    #: one entry per trajectory: one value per token of its ``total_token_ids`` (the seed's form, for rollouts of
    #: one sequence), or, for any rollout, one such list per sequence of ``trajectory.sequences()`` (the main one,
    #: then its branches): one form for the whole result
    tok_advantages: list[list[float]] | list[list[list[float]]] | None = None
