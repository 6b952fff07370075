"""Pydantic at the edge: request bodies checked against exact shapes, errors naming the field.

Three small conventions keep ``param`` exact (``messages[2].tool_calls[0].function.arguments``):

- a union picks its branch with a ``Discriminator`` whose tags start with ``<`` (``tag``);
  those tags are left out of the location;
- a rule over several fields (``field_error``) names the field it is about;
- ``sent_as`` validates a field against a shape but keeps the JSON as it was sent: the
  wire normalizers, not these models, produce the normal form the proxy stores.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy.limits import format_param

M = TypeVar("M", bound=BaseModel)

_TAG_PREFIX = "<"


def tag(name: str) -> Tag:
    """A union branch's tag, left out of error locations."""
    return Tag(f"{_TAG_PREFIX}{name}>")


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error a model validator raises about one of its fields (``param`` ends with it)."""
    return PydanticCustomError("invalid_field", "{message}", {"field": field, "message": message})


def sent_as(shape: Any, *, unless: str | None = None) -> WrapValidator:
    """Validate as ``shape``, keep the value as sent (the field's own type says what that is). ``unless``: a
    validation context key; where it is true, the value passed this check before (the same JSON: ``TOOLS_CHECKED``)
    and only the field's own type is checked."""
    adapter: TypeAdapter[Any] = TypeAdapter(shape)

    def check(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        if unless is None or not (info.context or {}).get(unless):
            adapter.validate_python(value)
        return handler(value)

    return WrapValidator(check, json_schema_input_type=shape)  # what the API documents


#: validation context: true where the request's ``tools`` are a list whose JSON passed its API's checks before
#: (``resent_history``: Codex and Claude Code send the same ~15-20 KB of tool schemas every turn)
TOOLS_CHECKED = "tools_checked"


#: validation context: the indices of a list's items to check (the others were checked before:
#: ``resent_history``); absent, every item is
CHECK_ITEMS = "check_items"


def sent_as_items(item: Any, *, min_length: int, max_length: int) -> WrapValidator:
    """``sent_as`` a list of ``item``, checking only the items the validation context names (``CHECK_ITEMS``);
    a list with a bad item is checked whole again, so its error is located as ever."""
    shape = Annotated[list[item], Field(min_length=min_length, max_length=max_length)]
    return _checking_items(shape, item, min_length=min_length, max_length=max_length)


def sent_as_with_items(shape: Any, item: Any, *, max_length: int) -> WrapValidator:
    """``sent_as(shape)`` for a field that may be a list of ``item``s (Responses ``input``): a list of at most
    ``max_length`` items is checked only at the indices the validation context names (``CHECK_ITEMS``), as
    ``sent_as_items`` does; any other value, or a list with a bad item, is checked whole."""
    return _checking_items(shape, item, min_length=0, max_length=max_length)


def _checking_items(shape: Any, item: Any, *, min_length: int, max_length: int) -> WrapValidator:
    whole: TypeAdapter[Any] = TypeAdapter(shape)
    one: TypeAdapter[Any] = TypeAdapter(item)

    def check(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        indices = (info.context or {}).get(CHECK_ITEMS)
        if indices is None or type(value) is not list or not min_length <= len(value) <= max_length:
            whole.validate_python(value)
            return handler(value)
        try:
            for index in indices:
                one.validate_python(value[index])
        except ValidationError:
            whole.validate_python(value)  # raises this error, at its place in the list
            raise
        return value  # every item has the shape (checked now or before): kept as sent, not copied again

    return WrapValidator(check, json_schema_input_type=shape)


def error_param(error: ErrorDetails) -> str | None:
    loc = [part for part in error["loc"] if not (isinstance(part, str) and part.startswith(_TAG_PREFIX))]
    field = (error.get("ctx") or {}).get("field")
    if isinstance(field, str):
        loc.append(field)
    return format_param(loc)


def validate(model: type[M], payload: dict[str, Any], *, context: dict[str, Any] | None = None) -> M:
    """Validate with pydantic; the first error becomes a 400 naming its field."""
    try:
        return model.model_validate(payload, context=context)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = error_param(first)
        raise InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
