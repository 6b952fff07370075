"""The application factory: settings in, a ready ``web.Application`` out.

Each resource (store, engines) is opened and closed by its own ``cleanup_ctx``;
tests inject their own store or engines instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import structlog
from aiohttp import web

from rollout_proxy.core.chat import ChatService
from rollout_proxy.core.responses import ResponsesService
from rollout_proxy.core.sessions import SessionService
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnRunner
from rollout_proxy.engines.base import Engine
from rollout_proxy.engines.pool import EnginePool
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.metrics import Metrics
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import SessionTokens
from rollout_proxy.proxy.handlers import chat, docs, meta, responses, sessions, trajectories
from rollout_proxy.proxy.handlers import feed as feed_handlers
from rollout_proxy.proxy.middleware import request_middleware
from rollout_proxy.settings import Settings
from rollout_proxy.state.connection import RedisOptions, is_redis_url
from rollout_proxy.state.feed import Feed, open_feed
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.store import StateStore
from rollout_proxy.tokenization.parsers import OutputParser

log = structlog.get_logger(__name__)


def check_store_url(url: str) -> None:
    if url != "memory" and not is_redis_url(url):
        raise ValueError(f"unknown store {url!r}: use 'memory' or a redis://HOST:PORT/DB URL")


async def open_store(url: str, options: RedisOptions | None = None) -> StateStore:
    check_store_url(url)
    if url == "memory":
        return MemoryStore()
    from rollout_proxy.state.redis import RedisStore

    return await RedisStore.connect(url, options=options)


def redis_options(settings: Settings) -> RedisOptions:
    return RedisOptions(
        socket_timeout=settings.redis_socket_timeout,
        connect_timeout=settings.redis_connect_timeout,
        health_check_interval=settings.redis_health_check_interval,
        retries=settings.redis_retries,
    )


def engine_client(url: str, settings: Settings) -> VLLMEngine:
    return VLLMEngine(
        url,
        request_timeout=settings.engine_timeout,
        connect_timeout=settings.engine_connect_timeout,
        first_byte_timeout=settings.engine_first_byte_timeout,
        health_timeout=settings.engine_health_timeout,
    )


def create_app(
    settings: Settings,
    *,
    store: StateStore | None = None,
    engines: Sequence[Engine] | None = None,
    feed: Feed | None = None,
) -> web.Application:
    if not settings.admin_key:
        raise ValueError("an admin key is required (--admin-key or ROLLOUT_PROXY_ADMIN_KEY)")
    check_store_url(settings.store)
    parser = OutputParser.named(settings.tool_parser, settings.reasoning_parser)
    app = web.Application(middlewares=[request_middleware], client_max_size=settings.max_body_bytes)
    app[keys.SETTINGS] = settings
    app[keys.METRICS] = Metrics()
    app[keys.TOKENS] = SessionTokens(settings.token_secret)

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        app[keys.STORE] = store if store is not None else await open_store(settings.store, redis_options(settings))
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
        clients = list(engines) if engines is not None else [engine_client(url, settings) for url in settings.engines]
        pool = EnginePool(clients, max_inflight=settings.engine_max_inflight)
        app[keys.ENGINES] = pool
        yield
        if engines is None:
            await pool.close()

    async def services_ctx(app: web.Application) -> AsyncIterator[None]:
        turns = TurnRunner(store=app[keys.STORE], engines=app[keys.ENGINES], parser=parser, metrics=app[keys.METRICS])
        app[keys.SESSIONS] = SessionService(store=app[keys.STORE], engines=app[keys.ENGINES], ttl=settings.session_ttl)
        tree = ResponseTree(store=app[keys.STORE], metrics=app[keys.METRICS])
        app[keys.TREE] = tree
        app[keys.CHAT] = ChatService(tree=tree, turns=turns)
        app[keys.RESPONSES] = ResponsesService(tree=tree, turns=turns)
        yield

    app.cleanup_ctx.extend([store_ctx, feed_ctx, engines_ctx, services_ctx])
    add_routes(app)
    return app


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", meta.healthz)
    app.router.add_get("/readyz", meta.readyz)
    app.router.add_get("/metrics", meta.metrics)
    app.router.add_get("/openapi.json", docs.openapi_json)
    app.router.add_get("/v1/admin/counters", meta.counters)
    app.router.add_get("/v1/models", meta.models)
    app.router.add_post("/v1/sessions", sessions.create_session)
    app.router.add_get("/v1/sessions/{session_id}", sessions.get_session)
    app.router.add_get("/v1/sessions/{session_id}/trajectory", trajectories.session_trajectory)
    app.router.add_post("/v1/sessions/{session_id}/messages", sessions.append_messages)
    app.router.add_post("/v1/sessions/{session_id}/finish", sessions.finish_session)
    app.router.add_post("/v1/chat/completions", chat.chat_completions)
    app.router.add_get("/v1/feed", feed_handlers.read_feed)
    app.router.add_post("/v1/responses", responses.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses.get_response)
    app.router.add_get("/v1/responses/{response_id}/trajectory", trajectories.response_trajectory)
