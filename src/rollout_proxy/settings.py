"""Server settings: one dataclass, filled from the command line or ``ROLLOUT_PROXY_*``."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

ENV_PREFIX = "ROLLOUT_PROXY_"
DEFAULT_ENGINE = "http://127.0.0.1:8000"
PROMPT_ECHO_MODES = ("require", "count")


@dataclass(frozen=True, slots=True)
class Settings:
    engines: tuple[str, ...] = (DEFAULT_ENGINE,)
    teachers: str = ""  # on-policy distillation teachers: name=URL[,URL][;name=URL...], each an engine group
    #: name=FILE[;name=FILE...]: the chat template a teacher's contexts are rendered with (locally, with the
    #: student's tokenizer, which a teacher shares); a teacher without one renders through its engine's /tokenize
    teacher_templates: str = ""
    store: str = "memory"  # "memory" or a redis:// URL
    host: str = "127.0.0.1"
    port: int = 8080
    admin_key: str = ""
    jwt_secret: str = ""  # derived from the admin key when empty
    public_url: str = ""  # base URL handed to plugins; derived from the request when empty
    tool_parser: str = "hermes"
    reasoning_parser: str = "think"
    log_format: str = "auto"
    log_level: str = "info"
    session_ttl: float = 24 * 3600.0
    max_body_bytes: int = 32 * 1024 * 1024
    # Engine calls, in aiohttp's terms: sock_connect, sock_read (a non-streamed completion sends
    # its first byte only when it is done, so this bounds a whole generation) and total.
    engine_connect_timeout: float = 5.0
    engine_first_byte_timeout: float = 600.0
    engine_timeout: float = 600.0  # total, per engine call
    # one probe request (/health, /weight_info): generous, since a probe that times out counts against an
    # engine that may only be busy (a CPU vLLM's API server starves while it generates); /readyz never waits on it
    engine_health_timeout: float = 2.0
    # an engine from which nothing came for this long (no probe or call answered, no token streamed) while its
    # probes time out is hung: out of rotation at once, its calls in flight failed over or ended
    engine_hang_timeout: float = 8.0
    engine_max_inflight: int = 256
    # The fleet (README, "Fleet and weight updates"): probes, circuit breaker, failover, pauses.
    policy_version: int = 0  # the version of weights engines report as "default" (and of a fleet reporting none)
    engine_probe_interval: float = 2.0  # seconds between health probes of an engine that answers
    engine_failure_threshold: int = 3  # 5xx answers or timeouts in a row that take an engine out (refused/reset: one)
    engine_backoff_max: float = 30.0  # the longest wait between probes of an unhealthy engine
    engine_retries: int = 2  # failed engine calls of one turn retried on another engine
    turn_deadline: float = 1800.0  # all engine calls of one turn together, not counting time paused
    pause_queue: int = 4096  # turns that may wait for a resume; beyond it a 503
    pause_wait: float = 600.0  # the longest a turn waits for a resume (queued, or frozen in flight); then a 503
    engine_control_timeout: float = 60.0  # one pause, resume or weight-version call to one engine
    abort_policy: str = "continue"  # a turn an abort-mode pause cut short: "continue" or "regenerate" after resume
    # Redis: a command that waits longer is a 503; pooled connections idle this long are pinged
    # before use; a command that fails on a dead connection is retried this often on a fresh one.
    redis_socket_timeout: float = 5.0
    redis_connect_timeout: float = 2.0
    redis_health_check_interval: int = 5
    redis_retries: int = 1
    # Pools (README, "Scale-out: workers, pools, Redis Cluster"): a request that finds every connection
    # busy waits this long for one, then gets a 503 with Retry-After (never a 500).
    redis_max_connections: int = 512  # per worker process (on a cluster: per node)
    redis_pool_timeout: float = 10.0
    redis_node_compression: int = 3  # zstd level of the stored node blobs; 0: plain (README, "Storage footprint")
    engine_max_connections: int = 1024  # generation and /tokenize calls in flight per engine, per worker
    engine_pool_timeout: float = 300.0  # generations are long: a full pool frees slowly
    workers: int = 1  # serving processes sharing the port (more than one needs the Redis store)
    feed: str = ""  # trainer feed to serve at /v1/feed: jsonl:PATH or redis://...; empty: none
    feed_stream: str = "trajectories"
    # Rendering of the messages the policy did not generate (README, "Rendering"): "auto" renders in the
    # proxy with the model's tokenizer and chat template once they match the engine's /tokenize on a
    # canonical set, "engine" always asks the engine's /tokenize.
    rendering: str = "auto"
    event_loop: str = "auto"  # serve's loop: auto (uvloop when installed), uvloop or asyncio
    # serve's cyclic garbage collector: start-up objects frozen, a collection per this many new container
    # objects (Python's default, 700, runs one every few turns); 0 leaves Python's collector as it is
    gc_threshold: int = 50_000
    tokenizer: str = ""  # directory with the model's tokenizer; empty: the engine's model root, if readable here
    chat_template: str = ""  # the Jinja file the engines were started with (--chat-template); empty: the tokenizer's
    chat_template_content_format: str = "auto"  # as vLLM's flag of that name: auto, string or openai
    render_check_rate: float = 0.01  # share of live turns also rendered by the engine and compared
    # The drift check needs the engine to echo the prompt it consumed (vLLM: return_token_ids). "require": an
    # answer without the echo is an engine error (502); "count": such turns are recorded, flagged and counted.
    prompt_echo: str = "require"
    # Traces (README, "Tracing"): an OTLP/HTTP collector for the proxy's spans; empty: the standard
    # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables, and without those no export at all.
    otlp_endpoint: str = ""

    @property
    def token_secret(self) -> bytes:
        """Key for session tokens; stable across restarts as long as the admin key is."""
        if self.jwt_secret:
            return self.jwt_secret.encode()
        return hmac.new(self.admin_key.encode(), b"rollout-proxy session tokens", hashlib.sha256).digest()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``ROLLOUT_PROXY_<FIELD>`` variables, then explicit overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in fields(cls):
            raw = environ.get(ENV_PREFIX + spec.name.upper())
            if spec.name == "engines":
                raw = raw or environ.get(ENV_PREFIX + "ENGINE")
            if raw is None or raw == "":
                continue
            values[spec.name] = _parse(spec.name, raw)
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)


def _parse(name: str, raw: str) -> Any:
    if name == "engines":
        return tuple(url.strip() for url in raw.split(",") if url.strip())
    kind = {spec.name: spec.type for spec in fields(Settings)}.get(name)
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw
