"""What vLLM's ``/tokenize`` hands a chat template, rebuilt without vLLM.

Local rendering is exact only if the template sees what it sees inside vLLM (0.32,
``renderers/chat_utils.py`` and ``renderers/hf.py``), so this ports those steps:

- content: text parts joined with ``"\\n"`` (a ``None`` content is ``""``), or, for a template
  that loops over ``message.content`` (vLLM's "openai" content format, detected from the
  template's AST), a list of ``{"type": "text", "text": ...}`` parts; a tool message's content
  is always joined back into a string unless it holds an image;
- images (``{"type": "image", "image": sha256}`` parts, ``wire.images``): in the "openai" format a
  ``{"type": "image"}`` part in place (a tool message's parts then stay a list); in the "string" format
  the model's image marker (``image_marker``: ``<image>``), one per image not already written in the
  text, in front of the text, joined with ``"\\n"`` (vLLM's ``_get_full_multimodal_text_prompt``);
- only ``role``, ``content``, ``tool_calls``, ``reasoning`` (copied to ``reasoning_content``),
  ``tool_call_id``, ``name`` reach the template: ``reasoning_content`` alone is dropped, as
  vLLM's ``/tokenize`` drops it;
- tool calls keep vLLM's key order (``id``, ``function`` {``arguments``, ``name``}, ``type``), their
  arguments parsed to a dict (``{}`` when empty, invalid or not an object); an empty list is dropped;
- ``developer`` messages become ``system`` (merged into one first system message) when the
  template never names the developer role;
- tools as vLLM's pydantic models dump them (``description``/``parameters`` kept even when null);
- ``chat_template_kwargs`` filtered to what the template reads or ``apply_chat_template`` takes.

The self-check against the engine (``tokenization.selfcheck``) is what proves this for a
given template and engine; these functions are what makes it pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import orjson

ContentFormat = Literal["string", "openai"]
#: the normal form's image part type (``wire.images.IMAGE_PART``)
IMAGE_PART = "image"
CONTENT_FORMATS = ("auto", "string", "openai")
_BILLING_HEADER = "x-anthropic-billing-header"
#: ``chat_template_kwargs`` vLLM never forwards (it refuses them; the proxy's edge does too).
_UNEXPECTED_KWARGS = frozenset({"chat_template", "tokenize"})


class _GenerationTag(jinja2.ext.Extension):
    """Parses ``{% generation %}`` blocks (Hugging Face's assistant-mask tag) so such templates parse."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)


def parse_template(template: str) -> jinja2.nodes.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    return environment.parse(template)


def template_variables(template: str) -> frozenset[str]:
    """The names a template reads from its context (what ``chat_template_kwargs`` can set)."""
    return frozenset(jinja2.meta.find_undeclared_variables(parse_template(template)))


def names_developer_role(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


# -- content format detection (vLLM's _detect_content_format, same walk over the AST) ------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it (or its elements), transitively."""
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_loop_names(root: jinja2.nodes.Node) -> list[str]:
    """Loop variables of ``{% for message in messages %}``-like loops."""
    sources = list(_names_bound_to(root, "messages"))
    found = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, source) for source in sources) and isinstance(
            loop.target, jinja2.nodes.Name
        ):
            found.append(loop.target.name)
    return found


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    messages = _message_loop_names(root)

    def is_content(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems(node, message, "content") for message in messages)

    content_params: dict[int, set[str]] = {}  # loop id -> macro parameters given message.content
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            given |= {params[i] for i, arg in enumerate(call.args) if i < len(params) and is_content(arg)}
            given |= {kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value)}
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if given:
                content_params[id(loop)] = given
    for loop in root.find_all(jinja2.nodes.For):
        if is_content(loop.iter):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


def detect_content_format(template: str) -> ContentFormat:
    """ "openai" when the template iterates over a message's content parts, else "string" (as vLLM)."""
    try:
        root = parse_template(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if _loops_over_content(root) else "string"


# -- messages and tools ---------------------------------------------------------------------------


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    parts = content if isinstance(content, list) else [content]
    return [part if isinstance(part, str) else str(part.get("text", "")) for part in parts]


def _strip_billing_header(texts: list[str]) -> list[str]:
    kept = []
    for text in texts:
        if text.startswith(_BILLING_HEADER):
            rest = text.partition("\n")[2]
            if rest:
                kept.append(rest)
        else:
            kept.append(text)
    return kept


def _arguments(arguments: Any) -> dict[str, Any]:
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    prepared: dict[str, Any] = {}
    if "id" in call:
        prepared["id"] = call["id"]
    prepared["function"] = {"arguments": _arguments(function.get("arguments")), "name": function.get("name")}
    prepared["type"] = call.get("type", "function")
    return prepared


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART


def _image_content(
    content: list[Any], content_format: ContentFormat, image_marker: str | None
) -> str | list[dict[str, Any]]:
    """Content with images, as vLLM hands it to the template (see the module docstring)."""
    if content_format == "openai":
        return [
            {"type": "image"} if _is_image(part) else {"type": "text", "text": _texts([part])[0]} for part in content
        ]
    if image_marker is None:
        raise ValueError("this model's image marker is not known: its messages with images cannot be rendered")
    texts = _texts([part for part in content if not _is_image(part)])
    text = "\n".join(texts)
    missing = sum(1 for part in content if _is_image(part)) - text.count(image_marker)
    if missing < 0:
        raise ValueError(f"Found more '{image_marker}' placeholders in input prompt than actual multimodal data items.")
    if text:
        return "\n".join([image_marker] * missing + [text])
    return "\n".join([image_marker] * missing)


def _message(message: dict[str, Any], content_format: ContentFormat, image_marker: str | None = None) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    prepared: dict[str, Any] = {"role": role}
    if isinstance(content, list) and any(_is_image(part) for part in content):
        prepared["content"] = _image_content(content, content_format, image_marker)
    else:
        texts = _texts(content)
        if role == "system":
            texts = _strip_billing_header(texts)
        if content_format == "openai" and role != "tool":
            prepared["content"] = [{"type": "text", "text": text} for text in texts]
        else:
            prepared["content"] = "\n".join(texts)
    if role == "assistant":
        if message.get("tool_calls") is not None:
            prepared["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
            if not prepared["tool_calls"]:
                del prepared["tool_calls"]
        if message.get("reasoning") is not None:
            prepared["reasoning"] = prepared["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        prepared["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        prepared["name"] = message["name"]
    if role == "developer":
        prepared["tools"] = message.get("tools")
    return prepared


def developer_as_system(conversation: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.32 for a template without a developer branch: each ``developer`` message becomes ``system``
    (its ``tools`` dropped), and when that leaves a system message anywhere but first, all of them are
    merged into one first system message (their texts joined with a blank line)."""
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {key: value for key, value in message.items() if key != "tools"}
            message["role"] = "system"
        converted.append(message)
    systems = [i for i, message in enumerate(converted) if message["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    contents = ["\n".join(_texts(converted[i].get("content"))) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(text for text in contents if text)}
    return [merged, *(message for message in converted if message["role"] != "system")]


def vllm_conversation(
    messages: Sequence[dict[str, Any]],
    *,
    content_format: ContentFormat,
    names_developer: bool,
    image_marker: str | None = None,
) -> list[dict[str, Any]]:
    """The conversation vLLM passes to ``apply_chat_template`` for these (normalized) messages;
    ``image_marker``: the model's (``tokenization.images``), for images in the "string" content format.

    New dicts throughout: the caller's messages are never changed (the template gets its own copy)."""
    conversation = [_message(message, content_format, image_marker) for message in messages]
    if not names_developer and any(message["role"] == "developer" for message in conversation):
        conversation = developer_as_system(conversation)
    return conversation


def vllm_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM's request model dumps them for the template."""
    if tools is None:
        return None
    dumped = []
    for tool in tools:
        function = tool.get("function") or {}
        spec: dict[str, Any] = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for optional in ("strict", "defer_loading"):
            if function.get(optional) is not None:
                spec[optional] = function[optional]
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": spec}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        dumped.append(entry)
    return dumped


def accepted_kwargs(
    kwargs: dict[str, Any] | None, *, template_vars: frozenset[str], call_params: frozenset[str]
) -> dict[str, Any]:
    """The ``chat_template_kwargs`` vLLM forwards: what the template reads or the call takes."""
    accepted = (template_vars | call_params) - _UNEXPECTED_KWARGS
    return {key: value for key, value in (kwargs or {}).items() if key in accepted}
