"""The OpenAI chat shapes the proxy takes: messages, content, tool calls, function tools.

Content parts are text and images (``image_url``, ``input_image``); which roles take images is the
normalizer's to say (``wire.messages``). Strict (no coercion) and open to unknown fields: the openai SDK's
``model_dump()`` adds
``refusal``, ``audio``, ``annotations``, ``function_call``... and an echoed assistant
message must still be taken. A dataset's conveniences stay accepted as the wire
normalizers accept them: bare strings among content parts, a single part as content.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, model_validator
from pydantic_core import PydanticCustomError

from rollout_proxy.proxy.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_NAME_CHARS, MAX_TOOL_CALLS, MAX_TOOLS
from rollout_proxy.proxy.validation import TOOLS_CHECKED, field_error, sent_as, sent_as_items, tag
from rollout_proxy.wire.messages import LEFT_OUT_TOOL_TYPES, describe, is_image_part, is_text_part

OPEN = ConfigDict(extra="allow", strict=True)

Role = Literal["system", "developer", "user", "assistant", "tool"]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
JsonObject = dict[str, Any]


def json_kind(value: Any) -> str | None:
    """The tag of a JSON value's kind, for unions of string / object / list / null."""
    if value is None:
        return "<null>"
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, dict):
        return "<object>"
    return "<list>" if isinstance(value, list) else None


class TextPart(BaseModel):
    model_config = OPEN

    type: Literal["text", "input_text", "output_text"]
    text: str


class ImageUrl(BaseModel):
    model_config = OPEN

    url: str  # a data: URL (base64), or an http(s) URL where the proxy fetches them (--image-urls)
    detail: str | None = None


class ImageUrlPart(BaseModel):
    """Chat Completions' image part (taken in user messages: ``wire.messages``)."""

    model_config = OPEN

    type: Literal["image_url"]
    image_url: ImageUrl


class InputImagePart(BaseModel):
    """The Responses API's image part: ``image_url`` a data: URL (or an http(s) one where the proxy fetches
    them); a ``file_id`` is refused (the proxy has no Files API)."""

    model_config = OPEN

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


def _part_kind(value: Any) -> str | None:
    """The tag of a content part: a string, or an object by its ``type`` (``_known_part`` refused the rest)."""
    if isinstance(value, str):
        return "<string>"
    if is_text_part(value):
        return "<text>"
    return f"<{value['type']}>" if is_image_part(value) else None


def _known_part(value: Any) -> Any:
    """Refuse a part of another type where it is (raised by the discriminator, the error would lose its place)."""
    if isinstance(value, str) or is_text_part(value) or is_image_part(value):
        return value
    kind = describe(value.get("type")) if isinstance(value, dict) else describe(value)
    raise PydanticCustomError(
        "content_part", "only text and image content parts are supported, got {kind}", {"kind": kind}
    )


ObjectPart = (
    Annotated[TextPart, tag("text")]
    | Annotated[ImageUrlPart, tag("image_url")]
    | Annotated[InputImagePart, tag("input_image")]
)
Part = Annotated[Annotated[str, tag("string")] | ObjectPart, Discriminator(_part_kind), BeforeValidator(_known_part)]
OnePart = Annotated[ObjectPart, Discriminator(_part_kind), BeforeValidator(_known_part)]

Content = Annotated[
    Annotated[None, tag("null")]
    | Annotated[str, tag("string")]
    | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS), tag("list")]
    | Annotated[OnePart, tag("object")],  # a single part, as some datasets store it
    Discriminator(
        json_kind,
        custom_error_type="invalid_content",
        custom_error_message="content must be a string, a list of text and image parts or null",
    ),
]

Arguments = Annotated[
    Annotated[None, tag("null")] | Annotated[str, tag("string")] | Annotated[JsonObject, tag("object")],
    Discriminator(
        lambda value: None if isinstance(value, list) else json_kind(value),
        custom_error_type="invalid_arguments",
        custom_error_message="arguments must be a JSON string or an object",
    ),
]


class CalledFunction(BaseModel):
    model_config = OPEN

    name: Name
    arguments: Arguments = None


class ToolCall(BaseModel):
    model_config = OPEN

    id: Name | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = OPEN

    role: Role
    content: Content = None
    name: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Name | None = None

    @model_validator(mode="after")
    def _what_the_role_needs(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise field_error("tool_call_id", "a tool message needs a tool_call_id")
        return self


class FunctionSpec(BaseModel):
    model_config = OPEN

    name: Name
    description: str | None = None
    parameters: JsonObject | None = None  # a JSON Schema object
    strict: bool | None = None


class ChatTool(BaseModel):
    """``{"type": "function", "function": {...}}``, as Chat Completions sends it."""

    model_config = OPEN

    type: Literal["function"] = "function"
    function: FunctionSpec


class FlatTool(FunctionSpec):
    """``{"type": "function", "name": ...}``, as the Responses API sends it."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"not": {"required": ["function"]}})

    type: Literal["function"] = "function"


class NamespaceTool(BaseModel):
    """``{"type": "namespace", "name", "description", "tools": [...]}`` (Responses): its member functions are
    rendered, its custom members left out."""

    model_config = OPEN

    type: Literal["namespace"]
    name: Name
    description: str | None = None
    tools: Annotated[list[JsonObject], Field(max_length=MAX_TOOLS)]


class LeftOutTool(BaseModel):
    """A tool the policy cannot call as a function (hosted, custom/freeform): accepted, left out of the prompt."""

    model_config = OPEN

    type: str


def _tool_kind(value: Any) -> str:
    """The tag of a tool's shape; refused as a whole, as the normalizer refuses it."""
    if not isinstance(value, dict):
        raise PydanticCustomError("tool_type", "a tool must be an object")
    kind = value.get("type", "function")
    if kind == "function":
        function = value.get("function", value)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PydanticCustomError("tool_name", "a function tool needs a name")
        return "<chat>" if "function" in value else "<flat>"
    if kind == "namespace":
        return "<namespace>"
    if isinstance(kind, str) and kind in LEFT_OUT_TOOL_TYPES:
        return "<left_out>"
    raise PydanticCustomError(
        "tool_type",
        "unsupported tool type {kind}: function and namespace tools are rendered, {left_out} are left out",
        {"kind": describe(kind), "left_out": ", ".join(sorted(LEFT_OUT_TOOL_TYPES))},
    )


def _known_tool(value: Any) -> Any:
    _tool_kind(value)
    return value


Tool = Annotated[
    Annotated[ChatTool, tag("chat")]
    | Annotated[FlatTool, tag("flat")]
    | Annotated[NamespaceTool, tag("namespace")]
    | Annotated[LeftOutTool, tag("left_out")],
    Discriminator(_tool_kind),
    BeforeValidator(_known_tool),
]

#: Fields that keep the JSON as sent (the wire normalizers read it) once it has these shapes.
Messages = Annotated[list[JsonObject], sent_as_items(ChatMessage, min_length=1, max_length=MAX_MESSAGES)]
#: a sample's messages: may be empty (a harness that owns its prompt sends the whole conversation itself)
SampleMessages = Annotated[list[JsonObject], sent_as_items(ChatMessage, min_length=0, max_length=MAX_MESSAGES)]
Tools = Annotated[list[JsonObject], sent_as(Annotated[list[Tool], Field(max_length=MAX_TOOLS)], unless=TOOLS_CHECKED)]
