"""The Anthropic Messages API's request bodies at the edge (pydantic, strict: no coercion).

Open to unknown fields (``cache_control``, ``citations``, ``context_management``, ``container``… are
accepted; what the proxy does with each is in docs/messages.md) and exact where the proxy reads: content
blocks by their ``type``, tools, ``tool_choice``, the generation parameters' types. Messages and tools are
kept as sent, for the wire normalizers (``wire.anthropic``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, model_validator
from pydantic_core import PydanticCustomError

from rollout_proxy.proxy.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_NAME_CHARS, MAX_TOOLS
from rollout_proxy.proxy.validation import TOOLS_CHECKED, field_error, sent_as, sent_as_items, tag
from rollout_proxy.wire.anthropic import ASSISTANT_BLOCKS, CUSTOM_TOOL, RESULT_BLOCKS, TEXT_ONLY, USER_BLOCKS
from rollout_proxy.wire.messages import describe

OPEN = ConfigDict(extra="allow", strict=True)

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
JsonObject = dict[str, Any]
#: stop sequences a request may give (vLLM checks each against the text at every step)
MAX_STOP_SEQUENCES = 64


class TextBlock(BaseModel):
    model_config = OPEN

    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    model_config = OPEN

    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(BaseModel):
    """Fetched where the proxy fetches image URLs (``--image-urls``), refused otherwise."""

    model_config = OPEN

    type: Literal["url"]
    url: str


class FileSource(BaseModel):
    """A file of Anthropic's Files API: refused by the normalizer, in words (the proxy has none)."""

    model_config = OPEN

    type: Literal["file"]
    file_id: str


ImageSource = Annotated[
    Annotated[Base64Source, tag("base64")] | Annotated[UrlSource, tag("url")] | Annotated[FileSource, tag("file")],
    Discriminator(
        lambda value: f"<{value.get('type')}>" if isinstance(value, dict) else None,
        custom_error_type="image_source",
        custom_error_message="an image source is base64 (media_type, data) or url",
    ),
]


class ImageBlock(BaseModel):
    """An image, in a user message or a ``tool_result``'s content (``wire.anthropic``)."""

    model_config = OPEN

    type: Literal["image"]
    source: ImageSource


class ThinkingBlock(BaseModel):
    """Reasoning the policy produced; its ``signature`` (issued by the proxy) names the node it came from."""

    model_config = OPEN

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = OPEN

    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(BaseModel):
    model_config = OPEN

    type: Literal["tool_use"]
    id: Name
    name: Name
    input: JsonObject


def _only(allowed: frozenset[str]) -> BeforeValidator:
    """Refuse a block of another type where it is (raised by the discriminator, the error would lose its
    location)."""

    def check(value: Any) -> Any:
        found = value.get("type") if isinstance(value, dict) else None
        if not (isinstance(found, str) and found in allowed):
            raise PydanticCustomError(
                "content_block",
                "unsupported content block {kind}: this message takes {allowed} blocks",
                {
                    "kind": describe(found) if isinstance(value, dict) else describe(value),
                    "allowed": ", ".join(sorted(allowed)),
                },
            )
        return value

    return BeforeValidator(check)


#: a block union's branch, by its ``type`` (checked first by ``_only``)
BY_TYPE = Discriminator(lambda value: f"<{value.get('type')}>" if isinstance(value, dict) else None)
TextOnly = Annotated[Annotated[TextBlock, tag("text")], BY_TYPE, _only(TEXT_ONLY)]


def _content_kind(value: Any) -> str | None:
    if value is None:
        return "<null>"
    return "<string>" if isinstance(value, str) else "<list>" if isinstance(value, list) else None


def content_of(block: Any, *, nullable: bool = False) -> Any:
    """A content: a string or a list of ``block``s (or null), the branch chosen by the JSON kind."""
    blocks = Annotated[list[block], Field(max_length=MAX_CONTENT_PARTS), tag("list")]
    kinds: Any = Annotated[str, tag("string")] | blocks
    if nullable:
        kinds = kinds | Annotated[None, tag("null")]
    return Annotated[
        kinds,
        Discriminator(
            _content_kind,
            custom_error_type="invalid_content",
            custom_error_message="content must be a string or a list of content blocks",
        ),
    ]


ResultBlock = Annotated[
    Annotated[TextBlock, tag("text")] | Annotated[ImageBlock, tag("image")], BY_TYPE, _only(RESULT_BLOCKS)
]
ResultContent = content_of(ResultBlock, nullable=True)


class ToolResultBlock(BaseModel):
    model_config = OPEN

    type: Literal["tool_result"]
    tool_use_id: Name
    content: ResultContent = None  # type: ignore[valid-type]
    is_error: bool | None = None


UserBlock = Annotated[
    Annotated[TextBlock, tag("text")]
    | Annotated[ImageBlock, tag("image")]
    | Annotated[ToolResultBlock, tag("tool_result")],
    BY_TYPE,
    _only(USER_BLOCKS),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, tag("text")]
    | Annotated[ThinkingBlock, tag("thinking")]
    | Annotated[RedactedThinkingBlock, tag("redacted_thinking")]
    | Annotated[ToolUseBlock, tag("tool_use")],
    BY_TYPE,
    _only(ASSISTANT_BLOCKS),
]
SystemContent = content_of(TextOnly)


class UserMessage(BaseModel):
    model_config = OPEN

    role: Literal["user"]
    content: content_of(UserBlock)  # type: ignore[valid-type]


class AssistantMessage(BaseModel):
    model_config = OPEN

    role: Literal["assistant"]
    content: content_of(AssistantBlock)  # type: ignore[valid-type]


class SystemMessage(BaseModel):
    """A system turn inside the conversation (Claude Code sends them); it stays where it is."""

    model_config = OPEN

    role: Literal["system"]
    content: SystemContent  # type: ignore[valid-type]


def _known_role(value: Any) -> Any:
    role = value.get("role") if isinstance(value, dict) else None
    if role not in ("user", "assistant", "system"):
        raise PydanticCustomError(
            "message_role", "unknown message role {role}: user, assistant or system", {"role": describe(role)}
        )
    return value


Message = Annotated[
    Annotated[UserMessage, tag("user")] | Annotated[AssistantMessage, tag("assistant")]
    | Annotated[SystemMessage, tag("system")],
    Discriminator(lambda value: f"<{value.get('role')}>" if isinstance(value, dict) else None),
    BeforeValidator(_known_role),
]  # fmt: skip


class CustomTool(BaseModel):
    """A tool the client runs, rendered for the policy as a function with ``input_schema``."""

    model_config = OPEN

    type: Literal["custom"] = "custom"
    name: Name
    description: str | None = None
    input_schema: JsonObject | None = None
    defer_loading: bool | None = None


class ServerTool(BaseModel):
    """An Anthropic server tool or versioned client tool (``web_search_20250305``, ``bash_20250124``…):
    accepted, left out of the prompt and recorded."""

    model_config = ConfigDict(
        extra="allow", strict=True, json_schema_extra={"not": {"properties": {"type": {"const": "custom"}}}}
    )

    type: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    name: Name


def _tool_kind(value: Any) -> str:
    if not isinstance(value, dict):
        raise PydanticCustomError("tool_type", "a tool must be an object")
    return "<custom>" if value.get("type", CUSTOM_TOOL) == CUSTOM_TOOL else "<left_out>"


Tool = Annotated[
    Annotated[CustomTool, tag("custom")] | Annotated[ServerTool, tag("left_out")], Discriminator(_tool_kind)
]


class ToolChoice(BaseModel):
    model_config = OPEN

    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _tool_needs_a_name(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise field_error("name", "tool_choice of type 'tool' needs the tool's name")
        return self


Messages = Annotated[list[JsonObject], sent_as_items(Message, min_length=1, max_length=MAX_MESSAGES)]
Tools = Annotated[list[JsonObject], sent_as(Annotated[list[Tool], Field(max_length=MAX_TOOLS)], unless=TOOLS_CHECKED)]
#: kept as sent too (a string, or text blocks as JSON objects)
System = Annotated[str | list[JsonObject], sent_as(SystemContent)]


class ThreadCreate(BaseModel):
    """``thread: {"type": "create"}``: every answer is kept under its ``id`` already; the turn's tools are
    recorded for the thread's later turns."""

    model_config = OPEN

    type: Literal["create"]


class ThreadContinue(BaseModel):
    """``thread: {"type": "continue", "previous_message_id"}``: only the new turn's messages are sent; the
    parent is that message's node (as ``previous_response_id`` names one), its system and tools the thread's."""

    model_config = OPEN

    type: Literal["continue"]
    previous_message_id: Name


Thread = Annotated[
    Annotated[ThreadCreate, tag("create")] | Annotated[ThreadContinue, tag("continue")],
    Discriminator(lambda value: f"<{value.get('type')}>" if isinstance(value, dict) else None),
]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what the prompt of this request would be, counted."""

    model_config = OPEN

    model: Name
    messages: Messages
    system: System | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    thinking: JsonObject | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. The generation parameters are checked against the session's
    (``client_sampling``) once the session is read; here only their types."""

    max_tokens: int = Field(ge=1)
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)] | None
    ) = None
    stream: bool | None = False
    metadata: JsonObject | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    output_config: JsonObject | None = None
    thread: Thread | None = None

    @property
    def previous_message_id(self) -> str | None:
        return self.thread.previous_message_id if isinstance(self.thread, ThreadContinue) else None
