"""The tokens a new node adds: a whole render at the root, else a bridge after its parent.

Per engine, renders come from the proxy's own tokenizer and chat template once they are
proven to be the engine's, else from the engine's ``/tokenize``:

1. Before the first render an engine needs (or at start, ``warm``), its local template is
   loaded (``--tokenizer``, else the engine's model ``root`` when readable here; the
   template ``--chat-template``, else the tokenizer's) and the canonical conversations are
   rendered both ways (``tokenization.selfcheck``). Equal token ids: local from now on.
   No tokenizer here, or any difference: the engine's ``/tokenize``, said in the log (with a
   token diff) and counted.
2. A sample of live turns (``check_rate``) is rendered both ways too; a difference switches
   that engine back to ``/tokenize`` for good, and the turn uses the engine's tokens.
3. A local render that fails (the template refuses the messages) is asked of the engine
   before it is answered: the engine's error is the answer, or, if the engine renders the
   messages, that is a difference as in 2.

Through an engine, developer messages are rendered as the template's system turn where the engine would
drop them (``tokenization.developer``). One ``ChatRenderer`` per engine and source (it learns the
template's shape once); whether
the parent's tokens are already closed decides if the bridge starts with an end-of-turn
token (a turn cut by ``max_tokens`` is not).
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import structlog

from rollout_proxy.core.tree import Placement
from rollout_proxy.engines.base import GenerationEngine
from rollout_proxy.errors import (
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    ImagesUnsupported,
    InvalidRequest,
    ProxyError,
)
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import ImageSpan, NodeKind
from rollout_proxy.settings import from_setting
from rollout_proxy.tokenization.developer import DeveloperRole
from rollout_proxy.tokenization.images import ImagePlaceholders, ImagesUnavailable, image_part_hashes
from rollout_proxy.tokenization.local import LocalTemplate, LocalTemplateUnavailable, read_chat_template, tokenizer_dir
from rollout_proxy.tokenization.renderer import ChatRenderer
from rollout_proxy.tokenization.selfcheck import TOOLS, bridge_check, self_check, token_diff
from rollout_proxy.wire.images import ImageBlob

log = structlog.get_logger(__name__)

RENDERING_MODES = ("auto", "engine")
#: differing cases logged in full when the self-check fails (the count is logged too)
LOGGED_DIFFS = 3
#: engine failures that leave a check undone (it is tried again later), never a turn failed by it
_ENGINE_FAILURES = (EngineUnavailable, EngineTimeout, EngineError)


class RenderSource(str, Enum):
    LOCAL = "local"
    ENGINE = "engine"


@dataclass(frozen=True, slots=True)
class RenderingConfig:
    """Rendering's part of the server's settings (``app.rendering_config``), their defaults the settings' own."""

    mode: str = from_setting("rendering")  # "auto": local once checked against the engine; "engine": always /tokenize
    tokenizer: str = from_setting("tokenizer")  # "": the engine's model root, when readable here
    chat_template: str = from_setting("chat_template")  # "": the tokenizer's own
    content_format: str = from_setting("chat_template_content_format")
    check_rate: float = from_setting("render_check_rate")  # share of live turns rendered both ways

    def __post_init__(self) -> None:
        if self.mode not in RENDERING_MODES:
            raise ValueError(f"rendering must be one of {RENDERING_MODES}, got {self.mode!r}")
        if not 0.0 <= self.check_rate <= 1.0:
            raise ValueError(f"the render check rate must be within [0, 1], got {self.check_rate}")
        if self.chat_template:  # a file named that is not there: a typo, refused as vLLM refuses it
            try:
                read_chat_template(self.chat_template)
            except LocalTemplateUnavailable as exc:
                raise ValueError(f"--chat-template: {exc}") from None


@dataclass(frozen=True, slots=True)
class _EngineRendering:
    """How one engine's renders are made, decided once (and once more if a live check fails)."""

    source: RenderSource
    renderer: ChatRenderer  # over the local template, or over the engine
    by_engine: ChatRenderer  # over the engine: the reference for checks and fallbacks
    local: LocalTemplate | None = None


class Renderers:
    def __init__(self, config: RenderingConfig, *, metrics: Metrics, rng: random.Random | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._by_engine: dict[str, _EngineRendering] = {}
        self._deciding: dict[str, asyncio.Task[_EngineRendering]] = {}
        self._warming: set[asyncio.Task[None]] = set()

    def source(self, engine_url: str) -> RenderSource | None:
        """How this engine's renders are made now (None: not decided yet)."""
        decided = self._by_engine.get(engine_url)
        return decided.source if decided is not None else None

    def bridges_leave_tools_out(self, engine_url: str) -> bool:
        """Whether this engine's bridges leave out the tools its template reads only in its head (decided with
        the local rendering: ``tokenization.tools_head``)."""
        decided = self._by_engine.get(engine_url)
        return decided is not None and decided.renderer.leaves_tools_out

    def warm(self, engines: Iterable[GenerationEngine]) -> None:
        """Decide for each engine in the background, so the first turn finds it done."""
        for engine in engines:
            task = asyncio.create_task(self._warm(engine))
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)

    async def close(self) -> None:
        pending = [*self._warming, *self._deciding.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def render(
        self,
        engine: GenerationEngine,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> np.ndarray:
        """A whole conversation (a session's sample, checked at create)."""
        decided = await self._decided(engine)

        async def rendered(renderer: ChatRenderer) -> np.ndarray:
            return await renderer.render(
                messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
            )

        if decided.source is RenderSource.ENGINE:
            return await rendered(decided.renderer)
        try:
            return await rendered(decided.renderer)
        except Exception as exc:
            return await self._confirm_failure(engine, decided, exc, rendered(decided.by_engine))

    async def delta(
        self,
        engine: GenerationEngine,
        placement: Placement,
        *,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> np.ndarray:
        """Tokens for ``placement``'s new messages (and the generation prompt when asked); messages with images
        are ``image_delta``'s."""
        if image_part_hashes(placement.new_messages):
            raise ProxyError("messages with images are rendered by image_delta")
        decided = await self._decided(engine)

        async def delta_by(renderer: ChatRenderer) -> np.ndarray:
            return await _delta(
                renderer,
                placement,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
            )

        if decided.source is RenderSource.ENGINE:
            self._metrics.inc("renders_total", source="engine")
            return await delta_by(decided.renderer)
        try:
            local = await delta_by(decided.renderer)
        except Exception as exc:
            return await self._confirm_failure(engine, decided, exc, delta_by(decided.by_engine))
        self._metrics.inc("renders_total", source="local")
        if not self._config.check_rate or self._rng.random() >= self._config.check_rate:
            return local
        try:
            reference = await delta_by(decided.by_engine)
        except _ENGINE_FAILURES as exc:
            self._metrics.inc("render_checks_total", check="live", outcome="error")
            log.info("render_check_undone", engine=engine.url, error=str(exc))
            return local
        except InvalidRequest as exc:  # the engine refuses what was rendered here: the engine is right
            self._metrics.inc("render_checks_total", check="live", outcome="mismatch")
            log.warning("render_mismatch", engine=engine.url, check="live", engine_error=exc.message)
            self._fall_back(engine, decided, reason="live_check")
            raise
        assert decided.local is not None
        diff = token_diff("live_turn", local, reference, decided.local)
        if diff is None:
            self._metrics.inc("render_checks_total", check="live", outcome="match")
            return local
        self._metrics.inc("render_checks_total", check="live", outcome="mismatch")
        log.warning("render_mismatch", engine=engine.url, check="live", **diff.log_fields())
        self._fall_back(engine, decided, reason="live_check")
        return reference

    async def image_rule(self, engine: GenerationEngine) -> ImagePlaceholders:
        """The image placeholder rule of this engine's model (``tokenization.images``), read beside the tokenizer
        its renders come from: images need local rendering (``ImagesUnsupported`` in words otherwise)."""
        decided = await self._decided(engine)
        if decided.source is not RenderSource.LOCAL or decided.local is None:
            raise ImagesUnsupported(
                "images are rendered by the proxy itself, with the model's tokenizer and processor config, and this "
                "engine's renders come from its /tokenize (no tokenizer readable here, or its template differs from "
                "the engine's: see the log's local_rendering_off); give the proxy the model's directory "
                "(--tokenizer DIR) and the engine's template (--chat-template)"
            )
        try:
            return decided.local.image_placeholders()
        except ImagesUnavailable as exc:
            raise ImagesUnsupported(f"the policy's model takes no images through this proxy: {exc}") from None

    async def image_delta(
        self,
        engine: GenerationEngine,
        placement: Placement,
        images: Mapping[str, ImageBlob],
        *,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> tuple[np.ndarray, tuple[ImageSpan, ...]]:
        """``delta`` for new messages that hold images (``images``: theirs, by hash): rendered here, each marker
        the template renders expanded to its image's span (``ImagePlaceholders.expand``), and where each span is
        in the tokens returned. Only locally: the engine's ``/tokenize`` would need the images, and its answer
        is checked on every turn anyway (the engine echoes the expanded prompt and the spans: ``core.turns``)."""
        rule = await self.image_rule(engine)
        decided = await self._decided(engine)
        hashes = image_part_hashes(placement.new_messages)
        missing = [sha for sha in hashes if sha not in images]
        if missing:
            raise ProxyError(f"the turn's messages hold images it was not given: {missing[:3]}")
        ids = await _delta(
            decided.renderer,
            placement,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            expanded, spans = rule.expand(ids, [images[sha] for sha in hashes])
        except ValueError as exc:
            raise ImagesUnsupported(
                f"the chat template does not render one {rule.marker!r} per image of these messages ({exc}): the "
                "model's template must place each image part (a text that holds the marker itself counts too)",
                param="messages",
            ) from None
        self._metrics.inc("renders_total", source="local")
        return expanded, spans

    async def generation_prompt_text(self, engine: GenerationEngine, prompt_end: np.ndarray) -> str:
        """The text of the generation prompt that ends ``prompt_end`` (``ChatRenderer.generation_prompt_text``),
        decoded by the renderer this engine's renders come from."""
        decided = await self._decided(engine)
        return await decided.renderer.generation_prompt_text(prompt_end)

    # -- deciding per engine ---------------------------------------------------------------------

    async def _decided(self, engine: GenerationEngine) -> _EngineRendering:
        decided = self._by_engine.get(engine.url)
        if decided is not None:
            return decided
        task = self._deciding.get(engine.url)
        if task is None:
            task = self._deciding[engine.url] = asyncio.create_task(self._decide(engine))
            task.add_done_callback(functools.partial(self._forget, engine.url))
        # shielded: a caller that gives up (a client gone) does not cancel the others' decision
        return await asyncio.shield(task)

    def _forget(self, url: str, task: asyncio.Task[_EngineRendering]) -> None:
        if self._deciding.get(url) is task:
            del self._deciding[url]
        if not task.cancelled():
            task.exception()  # a failed decision is retried by the next caller; nothing is left unretrieved

    async def _warm(self, engine: GenerationEngine) -> None:
        try:
            await self._decided(engine)
        except Exception as exc:  # the engine is not up yet: the first turn decides
            self._metrics.inc("render_checks_total", check="startup", outcome="error")
            log.info("render_source_undecided", engine=engine.url, error=str(exc))

    async def _decide(self, engine: GenerationEngine) -> _EngineRendering:
        through_engine = DeveloperRole(engine, name=engine.url)  # developer messages never dropped
        by_engine = ChatRenderer(through_engine)
        engine_only = _EngineRendering(RenderSource.ENGINE, by_engine, by_engine)
        if self._config.mode == "engine":
            return self._keep(engine, engine_only)
        local = await self._local(engine)
        if local is None:
            self._metrics.inc("render_fallbacks_total", reason="no_local_tokenizer")
            return self._keep(engine, engine_only)
        report = await self_check(local, through_engine)
        if not report.passed:
            self._metrics.inc("render_checks_total", check="startup", outcome="mismatch")
            self._metrics.inc("render_fallbacks_total", reason="startup_check")
            for diff in report.diffs[:LOGGED_DIFFS]:
                log.warning("render_mismatch", engine=engine.url, check="startup", **diff.log_fields())
            log.warning(
                "local_rendering_off",
                engine=engine.url,
                reason="the local render differs from the engine's /tokenize"
                if report.diffs
                else "the template rendered none of the canonical conversations",
                mismatches=len(report.diffs),
                template=local.origin,
            )
            return self._keep(engine, engine_only)
        self._metrics.inc("render_checks_total", check="startup", outcome="match")
        tools_left_out = await self._bridges_leave_tools_out(engine, local)
        log.info(
            "local_rendering_on",
            engine=engine.url,
            template=local.origin,
            cases=report.rendered,
            refused=report.refused,
            bridges_without_tools=tools_left_out,
        )
        renderer = ChatRenderer(local, leave_tools_out=tools_left_out)
        return self._keep(engine, _EngineRendering(RenderSource.LOCAL, renderer, by_engine, local))

    async def _bridges_leave_tools_out(self, engine: GenerationEngine, local: LocalTemplate) -> bool:
        """Whether this engine's bridges leave the tools out where the template reads them only in its head
        (``tokenization.tools_head``): so where the canonical bridges come out the same both ways."""
        try:
            diffs = await bridge_check(local)
        except Exception as exc:  # a template this check cannot drive: the tools stay in, rendering goes on
            log.warning("bridge_tools_check_failed", engine=engine.url, error=f"{type(exc).__name__}: {exc}")
            return False
        for diff in diffs[:LOGGED_DIFFS]:
            log.warning("bridge_tools_mismatch", engine=engine.url, **diff.log_fields())
        return not diffs and local.bridges_ignore(TOOLS)

    def _keep(self, engine: GenerationEngine, decided: _EngineRendering) -> _EngineRendering:
        self._by_engine[engine.url] = decided
        return decided

    async def _local(self, engine: GenerationEngine) -> LocalTemplate | None:
        """The engine's tokenizer and template as files here, or None (said in the log)."""
        given = self._config.tokenizer
        root = None if given else getattr(await engine.info(), "root", None)
        directory = tokenizer_dir(given or root)
        if directory is None:
            where = f"--tokenizer {given!r}" if given else f"the engine's model root {root!r}"
            log.warning(
                "local_rendering_off",
                engine=engine.url,
                reason=f"no tokenizer readable here at {where}; rendering through the engine's /tokenize "
                "(pass --tokenizer DIR to render locally)",
            )
            return None
        try:
            return await asyncio.to_thread(
                LocalTemplate.load,
                directory,
                self._config.chat_template or None,
                content_format=self._config.content_format,
            )
        except (LocalTemplateUnavailable, OSError, ValueError) as exc:
            log.warning("local_rendering_off", engine=engine.url, reason=str(exc))
            return None

    # -- when local and engine disagree ----------------------------------------------------------

    def _fall_back(self, engine: GenerationEngine, decided: _EngineRendering, *, reason: str) -> None:
        self._metrics.inc("render_fallbacks_total", reason=reason)
        log.warning("local_rendering_off", engine=engine.url, reason=reason)
        self._by_engine[engine.url] = _EngineRendering(RenderSource.ENGINE, decided.by_engine, decided.by_engine)

    async def _confirm_failure(
        self, engine: GenerationEngine, decided: _EngineRendering, exc: Exception, by_engine: Awaitable[np.ndarray]
    ) -> np.ndarray:
        """A local render failed: the engine's answer decides (its error, or its tokens and a fallback)."""
        try:
            reference: np.ndarray = await by_engine
        except _ENGINE_FAILURES:
            self._metrics.inc("render_checks_total", check="failure", outcome="error")
            raise
        except Exception:  # refused there too: the engine's error is the answer
            self._metrics.inc("render_checks_total", check="failure", outcome="match")
            raise
        self._metrics.inc("render_checks_total", check="failure", outcome="mismatch")
        log.warning("render_mismatch", engine=engine.url, check="failure", local_error=repr(exc))
        self._fall_back(engine, decided, reason="local_failure")
        return reference


async def _delta(
    renderer: ChatRenderer,
    placement: Placement,
    *,
    tools: Sequence[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool,
) -> np.ndarray:
    messages = placement.new_messages
    if not placement.parent:
        return await renderer.render(
            messages,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )
    last = placement.parent[-1]
    closed = last.kind is NodeKind.INJECTED or (
        len(last.output_ids) > 0 and int(last.output_ids[-1]) == await renderer.end_of_turn_id()
    )
    return await renderer.bridge(
        messages,
        after_role=last.messages[-1]["role"],
        after_closed=closed,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
    )
