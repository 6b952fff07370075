"""Every ``web.AppKey`` of the application, in one place."""

from __future__ import annotations

from aiohttp import web

from rollout_proxy.core.distill import Distillation
from rollout_proxy.core.rendering import Renderers
from rollout_proxy.core.sessions import SessionService
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turn_service import TurnService
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.policies import Policies
from rollout_proxy.metrics import Metrics
from rollout_proxy.proxy.auth import SessionTokens
from rollout_proxy.proxy.images import ImageIntake
from rollout_proxy.proxy.resent_history import ResentHistory
from rollout_proxy.settings import Settings
from rollout_proxy.state.feed import Feed
from rollout_proxy.state.store import StateStore
from rollout_proxy.tracing import Telemetry
from rollout_proxy.ui.assets import Asset
from rollout_proxy.ui.service import Viewer

SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
TELEMETRY = web.AppKey("telemetry", Telemetry)
TOKENS = web.AppKey("tokens", SessionTokens)
RESENT_HISTORY = web.AppKey("resent_history", ResentHistory)  # resent lists taken in once (``resent_history``)
STORE = web.AppKey("store", StateStore)
IMAGES = web.AppKey("images", ImageIntake)  # the images requests send, taken in (``proxy.images``)
FEED = web.AppKey("feed", Feed)
ENGINES = web.AppKey("engines", Fleet)
POLICIES = web.AppKey("policies", Policies)  # the fleet's LoRA policies (``engines.policies``)
RENDERERS = web.AppKey("renderers", Renderers)  # each engine's renders: local or its /tokenize
SESSIONS = web.AppKey("sessions", SessionService)
TREE = web.AppKey("tree", ResponseTree)
TURNS = web.AppKey("turns", TurnService)  # every API's turns (``core.turn_service``)
VIEWER = web.AppKey("viewer", Viewer)
DISTILLATION = web.AppKey("distillation", Distillation)
UI_ASSETS = web.AppKey("ui_assets", dict[str, Asset])
