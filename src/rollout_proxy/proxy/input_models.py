"""The Responses API ``input`` the proxy takes: a string, or a list of items.

Items: ``message`` (the type may be left out when there is a role), ``function_call``,
``function_call_output``, and ``reasoning`` echoed back by clients. Unknown fields
(``id``, ``status``, ``encrypted_content``...) are accepted, as OpenAI clients send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, model_validator
from pydantic_core import PydanticCustomError

from rollout_proxy.proxy.limits import MAX_MESSAGES
from rollout_proxy.proxy.message_models import OPEN, Arguments, Content, Name, Role, json_kind
from rollout_proxy.proxy.validation import field_error, sent_as_with_items, tag
from rollout_proxy.wire.messages import describe

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class MessageItem(BaseModel):
    model_config = OPEN

    type: Literal["message"] = "message"
    role: Role
    content: Content = None

    @model_validator(mode="after")
    def _has_content(self) -> MessageItem:
        if self.content is None:  # an assistant's calls are items of their own here
            raise field_error("content", "a message item needs content")
        return self


class FunctionCallItem(BaseModel):
    model_config = OPEN

    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Arguments = None


class FunctionCallOutputItem(BaseModel):
    model_config = OPEN

    type: Literal["function_call_output"]
    call_id: Name
    output: Content = None


class ReasoningPart(BaseModel):
    model_config = OPEN

    type: str
    text: str


class ReasoningItem(BaseModel):
    model_config = OPEN

    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] | None = None


def _item_type(value: Any) -> Any:
    return value.get("type") or ("message" if "role" in value else None)


def _known_item(value: Any) -> Any:
    if not isinstance(value, dict):
        raise PydanticCustomError("input_item", "an input item must be an object")
    kind = _item_type(value)
    if not (isinstance(kind, str) and kind in ITEM_TYPES):
        raise field_error("type", f"unsupported input item type {describe(kind)}")
    return value


InputItem = Annotated[
    Annotated[MessageItem, tag("message")]
    | Annotated[FunctionCallItem, tag("function_call")]
    | Annotated[FunctionCallOutputItem, tag("function_call_output")]
    | Annotated[ReasoningItem, tag("reasoning")],
    Discriminator(lambda value: f"<{_item_type(value)}>"),
    BeforeValidator(_known_item),
]

ResponsesInput = Annotated[
    Annotated[None, tag("null")]
    | Annotated[str, tag("string")]
    | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES), tag("list")],
    Discriminator(
        lambda value: None if isinstance(value, dict) else json_kind(value),
        custom_error_type="invalid_input",
        custom_error_message="input must be a string or a list of items",
    ),
]

#: ``input`` as sent (``input_to_messages`` reads it) once it has one of these shapes; a resent history's
#: items are not checked again (``proxy.resent_history``)
Input = Annotated[Any, sent_as_with_items(ResponsesInput, InputItem, max_length=MAX_MESSAGES)]
