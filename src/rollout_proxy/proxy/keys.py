"""Every ``web.AppKey`` of the application, in one place."""

from __future__ import annotations

from aiohttp import web

from rollout_proxy.core.chat import ChatService
from rollout_proxy.core.responses import ResponsesService
from rollout_proxy.core.sessions import SessionService
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.engines.pool import EnginePool
from rollout_proxy.metrics import Metrics
from rollout_proxy.proxy.auth import SessionTokens
from rollout_proxy.settings import Settings
from rollout_proxy.state.feed import Feed
from rollout_proxy.state.store import StateStore

SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
TOKENS = web.AppKey("tokens", SessionTokens)
STORE = web.AppKey("store", StateStore)
FEED = web.AppKey("feed", Feed)
ENGINES = web.AppKey("engines", EnginePool)
SESSIONS = web.AppKey("sessions", SessionService)
TREE = web.AppKey("tree", ResponseTree)
CHAT = web.AppKey("chat", ChatService)
RESPONSES = web.AppKey("responses", ResponsesService)
