"""Chat messages and tools in one normal form.

Clients send and echo messages in many shapes (the openai SDK's ``model_dump()`` with its
null fields, content as a string or as text parts, with or without the reasoning).
``normalize_message`` gives the one form the proxy stores and renders and the SDK keeps:
``{"role", "content", ["name"], ["tool_calls"], ["reasoning_content"], ["tool_call_id"]}``
with JSON-string tool arguments and text content: a string, or, in a message that holds images (a user
message's ``image_url`` / ``input_image`` parts), a list of ``{"type": "text", "text"}`` and
``{"type": "image", "image": "<sha256>"}`` parts (``wire.images``).

The normalizers take any JSON value (plugin code calls them too) and raise nothing but
``WireFormatError``; what they return can always be encoded, hashed and rendered: the
free-form parts (tool arguments, tool parameters) are bounded to ``MAX_JSON_DEPTH``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.images import INVALID_IMAGE, ImageSet, url_image

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
#: Chat Completions' image part, and the Responses API's (each API's is taken in the other's too, as text parts are)
IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
#: Nesting allowed in free-form JSON (tool arguments and parameters). JSON encoders refuse
#: past ~255 levels, and stored records wrap these values a few levels deeper still.
MAX_JSON_DEPTH = 64


def describe(value: Any) -> str:
    """A short, safe rendering of a client's value for an error message (never a deep repr)."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    return f"a JSON {'object' if isinstance(value, dict) else 'array' if isinstance(value, list) else 'value'}"


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether objects and arrays nest more than ``limit`` levels (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def is_role(value: Any) -> bool:
    return isinstance(value, str) and value in ROLES


def is_text_part(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] in TEXT_PART_TYPES


def is_image_part(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] in IMAGE_PART_TYPES


def content_text(content: Any, *, param: str = "messages", field: str = "content") -> str | None:
    """Content as one string: text parts are joined with newlines, as vLLM does."""
    found = content_parts(content, param=param, field=field, images=None, takes_images=False)
    assert not isinstance(found, list)  # no image part was taken
    return found


def content_parts(
    content: Any,
    *,
    param: str = "messages",
    field: str = "content",
    images: ImageSet | None,
    takes_images: bool,
    refusal: str = "",
) -> str | list[dict[str, str]] | None:
    """Content in the normal form: one string (text parts joined with newlines, as vLLM does) unless it holds
    an image (where ``takes_images``: else ``refusal`` says why not), then its parts in order."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, dict):  # a single part, as some datasets store it
        content = [content]
    if not isinstance(content, list):
        raise WireFormatError(
            f"{field} must be a string, a list of text{' and image' if takes_images else ''} parts or null",
            param=f"{param}.{field}",
        )
    parts: list[dict[str, str]] = []
    imaged = False
    for index, part in enumerate(content):
        where = f"{param}.{field}[{index}]"
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if is_image_part(part):
            if not takes_images:
                raise WireFormatError(refusal or "images are taken in user messages only", param=where)
            parts.append(_image(part, images, where))
            imaged = True
            continue
        if not is_text_part(part):
            kind = describe(part.get("type")) if isinstance(part, dict) else describe(part)
            taken = "text and image" if takes_images else "text"
            raise WireFormatError(f"only {taken} content parts are supported here, got {kind}", param=where)
        text = part.get("text")
        if not isinstance(text, str):
            raise WireFormatError("a text part needs a string 'text'", param=f"{where}.text")
        parts.append({"type": "text", "text": text})
    if imaged:
        return parts
    return "\n".join(part["text"] for part in parts)


def _image(part: dict[str, Any], images: ImageSet | None, where: str) -> dict[str, str]:
    """An ``image_url`` part (``{"url", ["detail"]}``) or an ``input_image`` one (``image_url``: the URL; a
    ``file_id`` names a file of OpenAI's Files API, which the proxy does not have)."""
    if part["type"] == "image_url":
        ref = part.get("image_url")
        if not isinstance(ref, dict):
            raise WireFormatError('an image_url part needs an object {"url": ...}', param=f"{where}.image_url")
        return url_image(ref.get("url"), images, param=f"{where}.image_url.url")
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise WireFormatError(
            "an input_image by file_id is not taken (the proxy has no Files API): send the image inline, as a "
            "data: URL in image_url",
            param=f"{where}.file_id",
            code=INVALID_IMAGE,
        )
    return url_image(part.get("image_url"), images, param=f"{where}.image_url")


def arguments_json(arguments: Any, *, param: str) -> str:
    """Tool-call arguments as the JSON string the normal form keeps (an object is encoded)."""
    if isinstance(arguments, str):
        # Nesting cannot exceed the number of openers: only a string with many is parsed.
        if arguments.count("{") + arguments.count("[") > MAX_JSON_DEPTH:
            try:
                parsed = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                parsed = None  # not JSON: kept as text
            if too_deep(parsed):
                raise WireFormatError(f"arguments nest deeper than {MAX_JSON_DEPTH} levels", param=param)
        return arguments
    return free_form_json(arguments, what="arguments", param=param).decode()


def free_form_json(value: Any, *, what: str, param: str) -> bytes:
    """``value`` encoded, once it is known to nest within bounds and to be encodable at all."""
    if too_deep(value):
        raise WireFormatError(f"{what} nest deeper than {MAX_JSON_DEPTH} levels", param=param)
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise WireFormatError(f"{what} cannot be encoded as JSON: {exc}", param=param) from None


def _normalize_tool_calls(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise WireFormatError("tool_calls must be a list", param=param)
    normalized = []
    for index, call in enumerate(tool_calls):
        where = f"{param}[{index}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise WireFormatError("a tool call needs a 'function' object", param=where)
        function = call["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise WireFormatError("a tool call needs a function name", param=f"{where}.function.name")
        call_id = call.get("id") or f"call_{index}"
        if not isinstance(call_id, str):
            raise WireFormatError("a tool call id must be a string", param=f"{where}.id")
        arguments = arguments_json(function.get("arguments", "{}"), param=f"{where}.function.arguments")
        normalized.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return normalized


#: why a message of a role other than the user's takes no image (OpenAI's Chat Completions: a tool message's
#: parts are text parts; the Responses API's tool output is a ``function_call_output`` item, which takes images)
_NO_IMAGES = {
    "tool": "a tool message takes text parts only (as in OpenAI's Chat Completions): send the image in a user "
    "message after it",
}


def normalize_message(message: Any, *, param: str = "messages", images: ImageSet | None = None) -> dict[str, Any]:
    """The stored and rendered form of a message; raises WireFormatError on bad shapes. ``images``: the
    conversation's (``wire.images``), which a user message's images join."""
    if not isinstance(message, dict):
        raise WireFormatError("a message must be an object", param=param)
    role = message.get("role")
    if not is_role(role):
        raise WireFormatError(f"unknown message role {describe(role)}", param=f"{param}.role")
    content = content_parts(
        message.get("content"),
        param=param,
        images=images,
        takes_images=role == "user",
        refusal=_NO_IMAGES.get(str(role), f"images are taken in user messages only, not in a {role} message"),
    )
    normalized: dict[str, Any] = {"role": role, "content": content}
    if role != "assistant" and normalized["content"] is None:
        raise WireFormatError(f"a {role} message needs content", param=f"{param}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise WireFormatError("a message name must be a string", param=f"{param}.name")
    if name:
        normalized["name"] = name
    if role == "assistant":
        if message.get("tool_calls"):
            normalized["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{param}.tool_calls")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            normalized["reasoning_content"] = reasoning
    if role == "tool":
        tool_call_id = message.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise WireFormatError("a tool message needs a tool_call_id", param=f"{param}.tool_call_id")
        normalized["tool_call_id"] = tool_call_id
    return normalized


def normalize_messages(
    messages: Any, *, param: str = "messages", images: ImageSet | None = None
) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise WireFormatError("messages must be a list", param=param)
    return [
        normalize_message(message, param=f"{param}[{index}]", images=images) for index, message in enumerate(messages)
    ]


@dataclass(slots=True)
class MessageFold:
    """Chat messages folded one by one (``normalize_messages``, as ``wire.responses.InputFold`` folds an
    input): each message's normal form is its own, so a resent history is normalized once."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    images: ImageSet = field(default_factory=ImageSet)  # the images the messages hold

    @property
    def settled(self) -> int:
        """No message added later changes an earlier one: all of them."""
        return len(self.messages)

    def extended(self) -> MessageFold:
        return MessageFold(list(self.messages), self.images.extended())

    def upto(self, count: int) -> MessageFold:
        return MessageFold(self.messages[:count], self.images.upto(self.messages[:count]))

    def add(self, message: Any, where: str) -> None:
        self.messages.append(normalize_message(message, param=where, images=self.images))


#: Tool types the policy cannot call as a JSON function, left out of the prompt (and recorded): tools the
#: OpenAI platform runs itself (search, code, images, MCP servers, tool search), and client tools whose calls
#: are not function calls (custom/freeform text tools, the computer, shell, local_shell and apply_patch tools,
#: which answer with their own output item types).
LEFT_OUT_TOOL_TYPES = frozenset(
    {
        "custom",
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
        "computer",
        "computer_use_preview",
        "computer_use",
        "local_shell",
        "shell",
        "apply_patch",
    }
)
#: Tool types whose functions are rendered: plain functions, and a namespace's member functions.
RENDERED_TOOL_TYPES = ("function", "namespace")


@dataclass(slots=True)
class ToolSet:
    """A request's tools as the policy sees them: the functions rendered (Chat Completions form; None when
    the request sent no ``tools``), which of them belong to a namespace (their calls go back with it), and
    the tools left out of the prompt (``{"type", ["name"], ["namespace"]}``)."""

    functions: list[dict[str, Any]] | None = None
    namespaces: dict[str, str] = field(default_factory=dict)
    left_out: list[dict[str, Any]] = field(default_factory=list)


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    nested = "function" in tool
    function = tool["function"] if nested else tool
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise WireFormatError("a function tool needs a name", param=where)
    at = f"{where}.function" if nested else where
    return function_tool(function["name"], function, at=at)


def function_tool(
    name: str, declared: dict[str, Any], *, at: str, schema_field: str = "parameters", what: str = "tool parameters"
) -> dict[str, Any]:
    """The normal form of a function tool named ``name`` from its declaration (an OpenAI ``function``, an
    Anthropic tool): its description checked, its schema (``schema_field``, an empty object schema when
    absent) a bounded JSON Schema object."""
    spec: dict[str, Any] = {"name": name}
    description = declared.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise WireFormatError("a tool description must be a string", param=f"{at}.description")
        spec["description"] = description
    schema = declared.get(schema_field) or {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise WireFormatError(f"{what} must be a JSON Schema object", param=f"{at}.{schema_field}")
    free_form_json(schema, what=what, param=f"{at}.{schema_field}")
    spec["parameters"] = schema
    return {"type": "function", "function": spec}


def _tool_type(tool: Any, where: str) -> str:
    kind = tool.get("type", "function") if isinstance(tool, dict) else None
    if kind in RENDERED_TOOL_TYPES or kind in LEFT_OUT_TOOL_TYPES:
        return str(kind)
    raise WireFormatError(
        f"unsupported tool type {describe(kind)}: function and namespace tools are rendered for the policy; "
        f"{', '.join(sorted(LEFT_OUT_TOOL_TYPES))} are accepted and left out of the prompt",
        param=where,
    )


def _left_out(tool: dict[str, Any], kind: str, namespace: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": kind}
    name = tool.get("name") if "name" in tool else (tool.get(kind) or {}).get("name")  # Chat's nested custom tool
    if isinstance(name, str):
        entry["name"] = name
    if namespace is not None:
        entry["namespace"] = namespace
    return entry


def split_tools(tools: Any, *, param: str = "tools") -> ToolSet:
    """A request's tools: function tools (Chat Completions' nested form or the Responses API's flat one) and
    a ``namespace``'s member functions are rendered; the types the policy cannot call
    (``LEFT_OUT_TOOL_TYPES``) are left out; anything else is refused. A namespace member's name must be
    unique among the functions (its call is routed back by name)."""
    if tools is None:
        return ToolSet()
    if not isinstance(tools, list):
        raise WireFormatError("tools must be a list", param=param)
    found = ToolSet(functions=[])
    assert found.functions is not None
    names: dict[str, str] = {}  # function name -> where it was given
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        kind = _tool_type(tool, where)
        if kind == "function":
            function = _function_tool(tool, where)
            name = function["function"]["name"]
            if name in found.namespaces:
                raise _same_name(name, found.namespaces[name], names[name], where)
            names.setdefault(name, where)
            found.functions.append(function)
        elif kind == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace:
                raise WireFormatError("a namespace tool needs a name", param=f"{where}.name")
            if not isinstance(members, list):
                raise WireFormatError("a namespace tool needs a list of tools", param=f"{where}.tools")
            for at, member in enumerate(members):
                member_where = f"{where}.tools[{at}]"
                member_kind = _tool_type(member, member_where)
                if member_kind != "function":
                    if member_kind == "namespace":
                        raise WireFormatError("namespaces do not nest", param=member_where)
                    found.left_out.append(_left_out(member, member_kind, namespace))
                    continue
                function = _function_tool(member, member_where)
                name = function["function"]["name"]
                if name in names:
                    raise _same_name(name, namespace, member_where, names[name])
                names[name] = member_where
                found.namespaces[name] = namespace
                found.functions.append(function)
        else:
            found.left_out.append(_left_out(tool, kind))
    return found


def _same_name(name: str, namespace: str, member_where: str, other_where: str) -> WireFormatError:
    return WireFormatError(
        f"function {name!r} of namespace {namespace!r} ({member_where}) has the name of another function "
        f"({other_where}): the policy calls functions by name, so a namespace's must be unique",
        param=f"{member_where}.name",
    )


def normalize_tools(tools: Any, *, param: str = "tools") -> list[dict[str, Any]] | None:
    """Function tools only (a sample's), in Chat Completions form; the flat Responses form is accepted too."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise WireFormatError("tools must be a list", param=param)
    normalized = []
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise WireFormatError("only function tools are supported", param=where)
        normalized.append(_function_tool(tool, where))
    return normalized
