"""Rendering in the proxy itself: the model's tokenizer and the chat template vLLM was given.

``LocalTemplate`` is the second implementation of what ``ChatRenderer`` needs from the
engine (``tokenize_messages``, ``tokenize_text``), so the bridge logic stays one piece of
code over either. It renders as vLLM 0.32's ``/tokenize`` does for ``messages``: the
conversation, tools and kwargs prepared as vLLM prepares them (``tokenization.vllm_chat``),
Hugging Face's ``apply_chat_template(tokenize=False)``, then the text encoded without
special tokens, truncation or padding (vLLM's own encode call), piece by piece where the
tokenizer allows it exactly, with the pieces a template repeats cached (``tokenization.pieces``).

Where the files come from, first match wins: the tokenizer directory given (``--tokenizer``)
or else the engine's ``/v1/models`` ``root`` when that is a directory this process can
read; the template given (``--chat-template``, the same file vLLM was started with) or
else the tokenizer's own. Nothing here is trusted until the self-check against the
engine passes (``core.rendering``).

A render costs about a microsecond or two per character (template and encoding; measured in
README, "Rendering"): a bridge (anchor + a message or two, tools included) runs on the event
loop in about a millisecond; a render of more than ``OFF_LOOP_CHARS`` input characters (a long
tool result, a long sample at session create) runs in a worker thread, so the loop is never
held for more than a few milliseconds.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rollout_proxy.errors import TemplateRenderError
from rollout_proxy.tokenization import vllm_chat
from rollout_proxy.tokenization.images import ImagePlaceholders, ImagesUnavailable, load_placeholders
from rollout_proxy.tokenization.pieces import PieceEncoder, exact_split_tokens
from rollout_proxy.tokenization.tools_head import tools_only_shape_the_head

#: Renders of more input characters than this leave the event loop (measured: README, "Rendering").
OFF_LOOP_CHARS = 4096
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class LocalTemplateUnavailable(Exception):
    """The tokenizer or template cannot be loaded here; rendering stays with the engine."""


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What one template text needs at render time, computed once."""

    text: str
    content_format: vllm_chat.ContentFormat
    names_developer: bool
    variables: frozenset[str]
    tools_in_head_only: bool  # the tools change nothing a bridge is cut from (``tokenization.tools_head``)


def _template_error_reason(exc: BaseException) -> str:
    """The template's own words (a Jinja error or ``raise_exception``), as vLLM reports them."""
    import jinja2

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file, or (as vLLM allows) the template text itself."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # not a file name at all (a template's text longer than a name may be)
        pass
    if any(char in value for char in "{}\n"):
        return value
    raise LocalTemplateUnavailable(f"chat template file {value!r} not found")


def tokenizer_dir(candidate: str | None) -> Path | None:
    """``candidate`` if it is a directory here with tokenizer files in it."""
    if not candidate:
        return None
    path = Path(candidate).expanduser()
    try:
        if path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES):
            return path
    except OSError:
        return None
    return None


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """vLLM's ``tokenizer(text, add_special_tokens=False)``; thread-safe.

    A fast tokenizer is copied once with truncation and padding off (what that call sets up
    on every use) and called directly; a slow one is called under a lock.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
        copy.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        return lambda text: copy.encode(text, add_special_tokens=False).ids
    lock = threading.Lock()

    def encode(text: str) -> list[int]:
        with lock:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode


class LocalTemplate:
    """The model's tokenizer and chat template, rendering as vLLM's ``/tokenize``; immutable once built
    (but for the cache of encoded pieces). ``in_pieces=False`` encodes every text whole (benchmarks)."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        *,
        content_format: str = "auto",
        origin: str = "",
        in_pieces: bool = True,
        directory: Path | None = None,
    ):
        """``directory``: where the tokenizer was read from; the model's image placeholder rule is read there
        (``tokenization.images``), when a turn first needs it."""
        if content_format not in vllm_chat.CONTENT_FORMATS:
            raise ValueError(f"chat template content format must be one of {vllm_chat.CONTENT_FORMATS}")
        self._tokenizer = tokenizer
        self._directory = directory
        self._images: ImagePlaceholders | ImagesUnavailable | None = None
        whole = _encoder(tokenizer)
        self._encode = PieceEncoder(whole, exact_split_tokens(tokenizer, whole) if in_pieces else ())
        self.origin = origin
        templates = tokenizer.chat_template if chat_template is None else chat_template
        if templates is None:
            raise LocalTemplateUnavailable("the tokenizer has no chat template and none was given")
        texts = templates.values() if isinstance(templates, dict) else [templates]
        self._content_format = content_format
        self._prepared = {text: self._prepare(text, content_format) for text in texts}
        self._template = chat_template  # None: the tokenizer's own (a dict picks "tool_use" when tools are given)
        self._call_params = frozenset(
            name
            for name, param in inspect.signature(tokenizer.apply_chat_template).parameters.items()
            if param.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        )

    @staticmethod
    def _prepare(text: str, content_format: str) -> _Prepared:
        import jinja2

        detected = vllm_chat.detect_content_format(text) if content_format == "auto" else content_format
        try:
            variables = vllm_chat.template_variables(text)
        except jinja2.TemplateError:  # a template that does not parse fails every render, as in vLLM
            variables = frozenset()
        return _Prepared(
            text=text,
            content_format=detected,  # type: ignore[arg-type]
            names_developer=vllm_chat.names_developer_role(text),
            variables=variables,
            tools_in_head_only=tools_only_shape_the_head(text),
        )

    @classmethod
    def load(cls, directory: Path, chat_template: str | None = None, *, content_format: str = "auto") -> LocalTemplate:
        """Read the tokenizer (and template) from disk: blocking, seconds on first use (imports transformers)."""
        template = read_chat_template(chat_template) if chat_template else None
        stamps = tuple(
            (name, (directory / name).stat().st_mtime_ns) for name in _TOKENIZER_FILES if (directory / name).is_file()
        )
        return _load_cached(str(directory.resolve()), stamps, template, content_format)

    def image_placeholders(self) -> ImagePlaceholders:
        """The model's image placeholder rule, read once from the tokenizer's directory; ``ImagesUnavailable``
        (why not) for a model that takes no images here."""
        if self._images is None:
            if self._directory is None:
                self._images = ImagesUnavailable("the proxy has no model directory to read its processor config from")
            else:
                try:
                    self._images = load_placeholders(self._directory, self._encode.ids)
                except ImagesUnavailable as exc:
                    self._images = exc
        if isinstance(self._images, ImagesUnavailable):
            raise self._images
        return self._images

    def bridges_ignore(self, tools: Sequence[dict[str, Any]] | None) -> bool:
        """Whether a bridge renders the same without ``tools``: the template chosen is the same with and without
        them, and it reads them only in its head (``tokenization.tools_head``). The same for any tools given
        (the choice only asks whether there are any): a renderer asks once (``ChatRenderer(leave_tools_out)``)."""
        template = self._tokenizer.get_chat_template(self._template, vllm_chat.vllm_tools(tools or None))
        if template != self._tokenizer.get_chat_template(self._template, None):
            return False
        prepared = self._prepared.get(template)
        return prepared is not None and prepared.tools_in_head_only

    # -- rendering (blocking; thread-safe) ---------------------------------------------------------

    def render_text(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        continue_final_message: bool = False,
    ) -> str:
        tool_dicts = vllm_chat.vllm_tools(tools or None)
        template = self._tokenizer.get_chat_template(self._template, tool_dicts)
        prepared = self._prepared.get(template) or self._prepare(template, self._content_format)
        marker = self._images.marker if isinstance(self._images, ImagePlaceholders) else None
        try:
            conversation = vllm_chat.vllm_conversation(
                messages,
                content_format=prepared.content_format,
                names_developer=prepared.names_developer,
                image_marker=marker,
            )
        except ValueError as exc:  # images vLLM would refuse to place (its 400)
            raise TemplateRenderError(f"the messages' images cannot be rendered: {exc}", param="messages") from exc
        kwargs = vllm_chat.accepted_kwargs(
            chat_template_kwargs, template_vars=prepared.variables, call_params=self._call_params
        )
        try:
            return self._tokenizer.apply_chat_template(
                conversation,
                tools=tool_dicts,
                chat_template=template,
                tokenize=False,
                **{**kwargs, "add_generation_prompt": add_generation_prompt},
                continue_final_message=continue_final_message,
            )
        except Exception as exc:  # vLLM answers any failure of the template with a 400
            raise TemplateRenderError(
                f"the model's chat template cannot render these messages: {_template_error_reason(exc)}",
                param="messages",
            ) from exc

    def render_ids(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        continue_final_message: bool = False,
    ) -> np.ndarray:
        text = self.render_text(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )
        return self.encode(text)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(self._encode.ids(text), dtype=np.int32)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [str(token) for token in self._tokenizer.convert_ids_to_tokens([int(i) for i in ids])]

    # -- the TemplateSource interface (what ChatRenderer calls) ---------------------------------------

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray:
        render = functools.partial(
            self.render_ids,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        if _input_chars(messages, tools) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(render)
        return render()

    async def tokenize_text(self, text: str) -> np.ndarray:
        if len(text) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self.encode, text)
        return self.encode(text)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included (as the engine's ``/detokenize``)."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=False))


def _input_chars(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
    """A cheap bound on what a render handles (a template rarely renders much more than its input)."""
    total = len(orjson.dumps(tools)) if tools else 0
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(orjson.dumps(content)) if content else 0
        for call in message.get("tool_calls") or ():
            total += len(str(call.get("function", {}).get("arguments", "")))
        total += len(message.get("reasoning_content") or "")
    return total


@functools.lru_cache(maxsize=8)
def _load_cached(
    directory: str, stamps: tuple[tuple[str, int], ...], template: str | None, content_format: str
) -> LocalTemplate:
    """Tokenizers load once per process (a proxy with many engines, a test suite with many
    proxies), keyed by the files' modification times so a rebuilt directory is read again."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # any failure to load means: render through the engine
        raise LocalTemplateUnavailable(f"cannot load the tokenizer in {directory}: {exc}") from exc
    origin = f"{directory} (template: {'given' if template is not None else 'the tokenizer own'})"
    return LocalTemplate(tokenizer, template, content_format=content_format, origin=origin, directory=Path(directory))
