"""The application factory: settings in, a ready ``web.Application`` out.

Each resource (store, engines) is opened and closed by its own ``cleanup_ctx``;
tests inject their own store or engines instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import cast

import structlog
from aiohttp import web
from opentelemetry.sdk.trace.export import SpanExporter

from rollout_proxy.core.distill import Distillation, parse_teacher_templates, parse_teachers
from rollout_proxy.core.rendering import Renderers, RenderingConfig
from rollout_proxy.core.sessions import SessionService
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turn_service import TurnService
from rollout_proxy.core.turns import TurnRunner
from rollout_proxy.engines.base import Engine
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.policies import Policies
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.metrics import Metrics
from rollout_proxy.proxy import keys, session_memory
from rollout_proxy.proxy.auth import SessionTokens
from rollout_proxy.proxy.handlers import (
    chat,
    docs,
    fleet_admin,
    messages,
    meta,
    policies,
    responses,
    sessions,
    trajectories,
    ui,
    viewer,
)
from rollout_proxy.proxy.handlers import distill as distill_handlers
from rollout_proxy.proxy.handlers import feed as feed_handlers
from rollout_proxy.proxy.images import ImageIntake, ImageLimits
from rollout_proxy.proxy.middleware import request_middleware
from rollout_proxy.proxy.openapi import MESSAGES_ALIAS_PREFIXES
from rollout_proxy.proxy.resent_history import ResentHistory
from rollout_proxy.proxy.telemetry import telemetry_middleware
from rollout_proxy.settings import Settings, part
from rollout_proxy.state.connection import RedisOptions, is_redis_url
from rollout_proxy.state.feed import Feed, open_feed
from rollout_proxy.state.instrumented import InstrumentedStore
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.store import ImageBound, StateStore
from rollout_proxy.tokenization.parsers import OutputParser
from rollout_proxy.tracing import Telemetry, otlp_endpoint_from_env
from rollout_proxy.ui.assets import load_assets
from rollout_proxy.ui.grades import GradeBook
from rollout_proxy.ui.pieces import PieceCache
from rollout_proxy.ui.service import Viewer

log = structlog.get_logger(__name__)


def check_store_url(url: str) -> None:
    if url != "memory" and not is_redis_url(url):
        raise ValueError(f"unknown store {url!r}: use 'memory' or a redis://HOST:PORT/DB URL")


async def open_store(
    url: str, options: RedisOptions | None = None, image_bound: ImageBound | None = None
) -> StateStore:
    check_store_url(url)
    if url == "memory":
        return MemoryStore(image_bound=image_bound)
    from rollout_proxy.state.redis import RedisStore

    return await RedisStore.connect(url, options=options, image_bound=image_bound)


def redis_options(settings: Settings) -> RedisOptions:
    return part(RedisOptions, settings)


def engine_client(url: str, settings: Settings) -> VLLMEngine:
    return VLLMEngine(
        url,
        request_timeout=settings.engine_timeout,
        connect_timeout=settings.engine_connect_timeout,
        first_byte_timeout=settings.engine_first_byte_timeout,
        health_timeout=settings.engine_health_timeout,
        bound_completions=False,  # the fleet bounds them, not counting time paused (fleet_settings)
        max_connections=settings.engine_max_connections,
        pool_timeout=settings.engine_pool_timeout,
        hang_timeout=settings.engine_hang_timeout,
    )


def fleet_settings(settings: Settings) -> FleetSettings:
    # a non-streamed completion's first byte is its last: both bound the whole call
    return part(FleetSettings, settings, call_timeout=min(settings.engine_timeout, settings.engine_first_byte_timeout))


def rendering_config(settings: Settings) -> RenderingConfig:
    return part(RenderingConfig, settings)


def create_app(
    settings: Settings,
    *,
    store: StateStore | None = None,
    engines: Sequence[Engine] | None = None,
    feed: Feed | None = None,
    span_exporters: Sequence[SpanExporter] = (),
) -> web.Application:
    """``span_exporters`` receive the app's spans besides the OTLP collector, if any (tests: in memory)."""
    if not settings.admin_key:
        raise ValueError("an admin key is required (--admin-key or ROLLOUT_PROXY_ADMIN_KEY)")
    check_store_url(settings.store)
    fleet_settings(settings)  # refuses a bad abort policy now, not at start
    rendering_config(settings)  # refuses a bad rendering setting now, not at start
    teacher_urls = parse_teachers(settings.teachers)  # refuses a bad teacher list now, not at start
    teacher_templates = parse_teacher_templates(settings.teacher_templates, teacher_urls)
    parser = OutputParser.named(settings.tool_parser, settings.reasoning_parser)
    app = web.Application(
        middlewares=[telemetry_middleware, request_middleware], client_max_size=settings.max_body_bytes
    )
    app[keys.SETTINGS] = settings
    app[keys.METRICS] = Metrics()
    app[keys.TELEMETRY] = Telemetry(
        app[keys.METRICS],
        otlp_endpoint=settings.otlp_endpoint or otlp_endpoint_from_env(),
        exporters=span_exporters,
    )
    app[keys.TOKENS] = SessionTokens(settings.token_secret)
    app[keys.RESENT_HISTORY] = ResentHistory()
    app[keys.IMAGES] = ImageIntake(part(ImageLimits, settings))

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        app[keys.STORE] = (
            store
            if store is not None
            else await open_store(settings.store, redis_options(settings), part(ImageBound, settings))
        )
        yield
        if store is None:
            await app[keys.STORE].close()

    async def feed_ctx(app: web.Application) -> AsyncIterator[None]:
        opened = (
            feed
            if feed is not None
            else (await open_feed(settings.feed, stream=settings.feed_stream) if settings.feed else None)
        )
        if opened is not None:
            app[keys.FEED] = opened
        yield
        if feed is None and opened is not None:
            await opened.close()

    async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
        """The fleet: every engine probed once before the first request (bounded), then in the background."""
        clients = list(engines) if engines is not None else [engine_client(url, settings) for url in settings.engines]
        fleet = Fleet(
            clients,
            fleet_settings(settings),
            metrics=app[keys.METRICS],
            connect=lambda url: engine_client(url, settings),
            owned=engines is None,
            # paused, the version and the engines added or removed are shared by every worker on a shared store
            shared=None if isinstance(app[keys.STORE], MemoryStore) else app[keys.STORE],
        )
        app[keys.POLICIES] = Policies(fleet)  # before the start: it follows the engines' states from there
        await fleet.start()
        app[keys.ENGINES] = fleet
        yield
        await app[keys.POLICIES].close()
        await fleet.close()

    async def teachers_ctx(app: web.Application) -> AsyncIterator[None]:
        """Each distillation teacher is an engine group of its own (health probes and failover as the policy's)."""
        teachers = {
            name: Fleet(
                [engine_client(url, settings) for url in urls], fleet_settings(settings), metrics=app[keys.METRICS]
            )
            for name, urls in teacher_urls.items()
        }
        await asyncio.gather(*(teacher.start() for teacher in teachers.values()))
        app[keys.DISTILLATION] = Distillation(
            store=app[keys.STORE],
            student=app[keys.ENGINES],
            teachers=teachers,
            templates=teacher_templates,
            tokenizer=settings.tokenizer,
            image_rule=app[keys.RENDERERS].image_rule,  # a trajectory's images go to a teacher as to the student
        )
        yield
        await asyncio.gather(*(teacher.close() for teacher in teachers.values()))

    async def services_ctx(app: web.Application) -> AsyncIterator[None]:
        # the services' store calls are timed and traced; app[keys.STORE] stays the store itself
        store = cast(StateStore, InstrumentedStore(app[keys.STORE], app[keys.METRICS]))
        renderers = Renderers(rendering_config(settings), metrics=app[keys.METRICS])
        renderers.warm(app[keys.ENGINES].engines)  # each engine's self-check, before its first turn
        app[keys.RENDERERS] = renderers
        turns = TurnRunner(
            store=store,
            engines=app[keys.ENGINES],
            parser=parser,
            metrics=app[keys.METRICS],
            renderers=renderers,
            require_prompt_echo=settings.prompt_echo == "require",
        )
        app[keys.SESSIONS] = SessionService(
            store=store, engines=app[keys.ENGINES], ttl=settings.session_ttl, renderers=renderers
        )
        tree = ResponseTree(store=store, metrics=app[keys.METRICS])
        app[keys.TREE] = tree
        app[keys.TURNS] = TurnService(tree=tree, turns=turns)
        yield
        await renderers.close()

    async def viewer_ctx(app: web.Application) -> AsyncIterator[None]:
        """The trajectory viewer (``/ui``) and its read API; its page's files are read once, here."""
        app[keys.UI_ASSETS] = await asyncio.to_thread(load_assets)
        app[keys.VIEWER] = Viewer(
            store=app[keys.STORE],
            sessions=app[keys.SESSIONS],
            engines=app[keys.ENGINES],
            grades=GradeBook(app.get(keys.FEED)),
            pieces=PieceCache(),
        )
        yield

    async def session_memory_ctx(app: web.Application) -> AsyncIterator[None]:
        """Memory kept per session comes back once the session expires, with or without traffic."""
        sweeper = asyncio.get_running_loop().create_task(session_memory.sweep_forever(app), name="session-memory")
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper

    async def telemetry_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(app[keys.TELEMETRY].shutdown)  # the last spans flushed to the collector

    async def images_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await app[keys.IMAGES].close()  # its HTTP client, opened by the first image URL fetched

    app.cleanup_ctx.extend([telemetry_ctx, store_ctx, feed_ctx, engines_ctx, services_ctx, teachers_ctx])
    app.cleanup_ctx.extend([viewer_ctx, session_memory_ctx, images_ctx])
    add_routes(app)
    return app


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", meta.healthz)
    app.router.add_get("/readyz", meta.readyz)
    app.router.add_get("/metrics", meta.metrics)
    app.router.add_get("/openapi.json", docs.openapi_json)
    app.router.add_get("/v1/admin/counters", meta.counters)
    app.router.add_get("/v1/admin/engines", fleet_admin.list_engines)
    app.router.add_post("/v1/admin/engines", fleet_admin.add_engine)
    app.router.add_delete("/v1/admin/engines", fleet_admin.remove_engine)
    app.router.add_post("/v1/admin/pause", fleet_admin.pause)
    app.router.add_post("/v1/admin/resume", fleet_admin.resume)
    app.router.add_get("/v1/admin/policies", policies.list_policies)
    app.router.add_post("/v1/admin/policies", policies.register_policy)
    app.router.add_get("/v1/admin/policies/{name}", policies.get_policy)
    app.router.add_post("/v1/admin/policies/{name}/versions", policies.publish_version)
    app.router.add_delete("/v1/admin/policies/{name}", policies.retire_policy)
    app.router.add_get("/v1/models", meta.models)
    app.router.add_post("/v1/sessions", sessions.create_session)
    app.router.add_get("/v1/sessions/{session_id}", sessions.get_session)
    app.router.add_get("/v1/sessions/{session_id}/trajectory", trajectories.session_trajectory)
    app.router.add_get("/v1/sessions/{session_id}/rollout", trajectories.session_rollout)
    app.router.add_get("/v1/sessions/{session_id}/images/{sha256}", sessions.session_image)
    app.router.add_post("/v1/sessions/{session_id}/messages", sessions.append_messages)
    app.router.add_post("/v1/sessions/{session_id}/finish", sessions.finish_session)
    app.router.add_post("/v1/chat/completions", chat.chat_completions)
    app.router.add_get("/v1/feed", feed_handlers.read_feed)
    app.router.add_post("/v1/responses", responses.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses.get_response)
    app.router.add_get("/v1/responses/{response_id}/trajectory", trajectories.response_trajectory)
    # the Anthropic Messages API, at the root and under the session's base_url (``openapi.ALIASES``)
    for prefix in ("", *MESSAGES_ALIAS_PREFIXES):
        app.router.add_post(f"{prefix}/v1/messages", messages.create_message)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", messages.count_tokens)
    # the trajectory viewer: its page, and the admin read API it calls
    app.router.add_get("/ui", ui.page)
    app.router.add_get("/ui/static/{name}", ui.static_file)
    app.router.add_get("/v1/admin/sessions", viewer.list_sessions)
    app.router.add_get("/v1/admin/sessions/{session_id}", viewer.session_tree)
    app.router.add_post("/v1/admin/sessions/{session_id}/teacher_pass", distill_handlers.teacher_pass)
    app.router.add_post("/v1/admin/sessions/{session_id}/critic_view", distill_handlers.critic_view)
    app.router.add_get("/v1/admin/responses/{response_id}/tokens", viewer.response_tokens)
