"""Settings declared once: each field's type, default, help and bounds, and all that is made from them.

Three commands have settings, each a ``DeclaredSettings`` (a pydantic-settings model): ``rollout-proxy
serve`` (``Settings``, here), ``rollout-proxy run`` (``runner.settings.RunSettings``) and the reference
trainer (``trainer.settings.TrainerSettings``). From a model's fields come the command's flags and its
``--help`` (``add_arguments``), its environment variables and its docs table (``table``; the server's is
``python -m rollout_proxy.settings``); a test holds each of them to the fields. A flag is ``--`` and the
field's name with dashes, but where ``flag`` says otherwise (``--engine`` for ``engines``, repeatable); a
variable is the model's ``env_prefix`` and the name in capitals (``engine_hang_timeout`` is
``--engine-hang-timeout`` and ``ROLLOUT_PROXY_ENGINE_HANG_TIMEOUT``; ``run``'s ``store`` is
``ROLLOUT_PROXY_RUN_STORE``), but where ``env_prefix`` says otherwise (the admin key is
``ROLLOUT_PROXY_ADMIN_KEY`` for all three). ``from_env``: flags win over variables (read by
pydantic-settings), variables over defaults; a value out of bounds is refused before anything starts,
naming its flag or variable. A model built in code (``Settings(...)``: a test, ``run``'s in-process
proxy) is what it is given: it never reads the environment.

Components get their part of the server's settings from the app factory (``app.fleet_settings``,
``app.redis_options``, ``app.rendering_config``, ``app.engine_client``); nothing else reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import os
import sys
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, Self, TypeVar, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from rollout_proxy.logs import LOG_FORMATS
from rollout_proxy.tokenization.parsers import REASONING_PARSERS, TOOL_PARSERS

T = TypeVar("T")
ENV_PREFIX = "ROLLOUT_PROXY_"
DEFAULT_ENGINE = "http://127.0.0.1:8000"
TOOL_PARSER_NAMES = tuple(sorted(TOOL_PARSERS))
REASONING_PARSER_NAMES = tuple(sorted(REASONING_PARSERS))
LOG_LEVELS = ("debug", "info", "warning", "error")


def setting(
    default: Any,
    help: str,
    *,
    section: str,
    flag: str | None = None,
    metavar: str | None = None,
    separator: str | None = None,
    choices: tuple[str, ...] | None = None,
    show_default: bool = True,
    env_prefix: str | None = None,
    **bounds: Any,
) -> Any:
    """A field of a ``DeclaredSettings``: its default (``...``: required), its help (the default is added by
    whoever shows it), where it goes in ``--help``, for a flag that may repeat how its values are joined
    (``separator``; its variable spells them so), and ``env_prefix`` where its variable is not the model's."""
    extra: dict[str, Any] = {"section": section, "flag": flag, "metavar": metavar, "separator": separator}
    extra.update(choices=list(choices) if choices else None, show_default=show_default, env_prefix=env_prefix)
    return Field(default, description=help, json_schema_extra=extra, **bounds)


def check_engine_url(url: str) -> str:
    """An engine's base URL: http(s)://host[:port][/path], no query, fragment or credentials."""
    parts = urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
        or parts.username is not None
        or any(char.isspace() for char in url)
    ):
        raise ValueError("must be an engine's base URL: http(s)://host[:port][/path]")
    try:
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError:
        raise ValueError("has a port that is not a number in 0-65535") from None
    return url.rstrip("/")


def check_engine_urls(urls: Iterable[str]) -> tuple[str, ...]:
    """Each of ``urls`` (blank ones dropped) checked by ``check_engine_url``; the error quotes the one refused."""
    checked = []
    for url in filter(None, (url.strip() for url in urls)):
        try:
            checked.append(check_engine_url(url))
        except ValueError as exc:
            raise ValueError(f"{url!r} {exc}") from None
    return tuple(checked)


class DeclaredSettings(BaseSettings):
    """One command's settings (see the module docstring): the fields, and what is made from them."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,  # an empty variable is an unset one
        enable_decoding=False,  # a list's variable is its values joined by its separator, not JSON
    )
    #: the groups of ``--help`` and of the docs table, in order
    sections: ClassVar[dict[str, str]] = {}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only what it is given: the environment is read by ``from_env``, for a command, never for a model
        built in code."""
        return (init_settings,)

    @classmethod
    def from_env(cls, **given: Any) -> Self:
        """Defaults, then the variables, then ``given`` (a flag's value; None: not given; empty: the default,
        whatever the variable says). A repeated flag's values come as a list."""
        unknown = set(given) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
        emptied = {name for name, value in given.items() if isinstance(value, str | list | tuple) and not value}
        flags = {name: value for name, value in given.items() if value is not None and name not in emptied}
        variables = {name: value for name, value in cls.variables().items() if name not in emptied}
        try:
            return cls(**{**variables, **flags})
        except ValidationError as exc:
            raise SettingsError(cls, exc, given=set(flags)) from None

    @classmethod
    def variables(cls) -> dict[str, Any]:
        """The values the environment gives, by field name (pydantic-settings reads them: a field's variable
        under its prefix, names in any case, empty ones skipped)."""
        found: dict[str, Any] = {}
        for prefix in {cls.env_prefix_of(name) for name in cls.model_fields}:
            read = EnvSettingsSource(cls, env_prefix=prefix)()
            found |= {name: value for name, value in read.items() if cls.env_prefix_of(name) == prefix}
        return found

    @field_validator("*", mode="before")
    @classmethod
    def _values_of_a_repeated_flag(cls, value: Any, info: ValidationInfo) -> Any:
        """A repeatable setting's values: a list (a flag given several times) or one string (its variable)."""
        separator = cls.extra(str(info.field_name)).get("separator")
        if separator is None:
            return value
        if cls.model_fields[str(info.field_name)].annotation == tuple[str, ...]:
            return tuple(value.split(separator)) if isinstance(value, str) else value
        return separator.join(value) if isinstance(value, list | tuple) else value

    @field_validator("*")
    @classmethod
    def _one_of_its_choices(cls, value: Any, info: ValidationInfo) -> Any:
        choices = cls.extra(str(info.field_name)).get("choices")
        if choices and value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, not {value!r}")
        return value

    # -- what is made from the fields ---------------------------------------------------------------------

    @classmethod
    def extra(cls, name: str) -> dict[str, Any]:
        return dict(cls.model_fields[name].json_schema_extra or {})  # type: ignore[arg-type]

    @classmethod
    def env_prefix_of(cls, name: str) -> str:
        return cls.extra(name).get("env_prefix") or cls.model_config.get("env_prefix", "")

    @classmethod
    def env_name(cls, name: str) -> str:
        return cls.env_prefix_of(name) + name.upper()

    @classmethod
    def flag_name(cls, name: str) -> str:
        return cls.extra(name).get("flag") or "--" + name.replace("_", "-")

    @classmethod
    def choices_of(cls, name: str) -> tuple[str, ...] | None:
        """The values a setting takes, when it takes few (a ``Literal`` or its ``choices``)."""
        extra = cls.extra(name)
        if extra.get("choices"):
            return tuple(extra["choices"])
        annotation = cls.model_fields[name].annotation
        return tuple(str(arg) for arg in get_args(annotation)) if get_origin(annotation) is Literal else None

    @classmethod
    def shown_default(cls, name: str) -> str | None:
        """The default as ``--help`` and the docs show it; None where showing it says nothing (an empty
        string, none at all)."""
        spec = cls.model_fields[name]
        if spec.is_required():
            return "required"
        value = spec.default
        if not cls.extra(name).get("show_default", True) or value is None:
            return None
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, tuple):
            return ",".join(value)
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    @classmethod
    def help_text(cls, name: str) -> str:
        """A setting's help as ``--help`` shows it: its description, and its default."""
        default = cls.shown_default(name)
        text = cls.model_fields[name].description or ""
        if default == "required":
            return f"{text} (required)"
        return f"{text} (default {default})" if default not in (None, "") else text

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, grouped by its section: its name, help, choices and variable are the field's;
        values are checked by the model itself, as the environment's are (a flag not given is None)."""
        groups = {section: parser.add_argument_group(title) for section, title in cls.sections.items()}
        for name, spec in cls.model_fields.items():
            extra = cls.extra(name)
            help = f"{cls.help_text(name)} [{cls.env_name(name)}]".replace("%", "%%")
            options: dict[str, Any] = {"dest": name, "help": help, "default": None}
            if extra.get("metavar"):
                options["metavar"] = extra["metavar"]
            if cls.choices_of(name):
                options["choices"] = cls.choices_of(name)
            if extra.get("separator"):
                options["action"] = "append"
            if spec.annotation is bool:  # a switch: the flag says the other way round from the default
                options.update(action="store_const", const=not spec.default)
            groups[str(extra["section"])].add_argument(cls.flag_name(name), **options)

    @classmethod
    def table(cls) -> str:
        """The docs' table of every setting, by section."""
        lines = []
        for section, title in cls.sections.items():
            names = [name for name in cls.model_fields if cls.extra(name)["section"] == section]
            if not names:
                continue
            lines += [f"### {title}", "", "| flag | environment | default | what |", "|---|---|---|---|"]
            for name in names:
                default = cls.shown_default(name)
                choices = cls.choices_of(name)
                what = (cls.model_fields[name].description or "").replace("|", "\\|").replace("<", "&lt;")
                if choices:
                    what += f" (one of {', '.join(f'`{c}`' for c in choices)})"
                cell = f"`{default}`" if default not in (None, "") else "—"
                lines.append(f"| `{cls.flag_name(name)}` | `{cls.env_name(name)}` | {cell} | {what} |")
            lines.append("")
        return "\n".join(lines)


class SettingsError(ValueError):
    """Settings refused, in words that name each flag (or variable) and what it takes, on one line each."""

    def __init__(self, model: type[DeclaredSettings], error: ValidationError, *, given: set[str]) -> None:
        lines = []
        for problem in error.errors():
            name = str(problem["loc"][0]) if problem["loc"] else ""
            message = problem["msg"].removeprefix("Value error, ")
            if name not in model.model_fields:  # about several settings together: the message names them
                lines.append(message)
            elif problem["type"] == "missing":
                lines.append(f"{model.flag_name(name)} (or {model.env_name(name)}) is required")
            else:
                where = model.flag_name(name) if name in given else model.env_name(name)
                lines.append(f"{where}: {message} (got {problem['input']!r})")
        super().__init__("; ".join(lines))


class Settings(DeclaredSettings):
    """Every setting of ``rollout-proxy serve`` (see the module docstring)."""

    sections: ClassVar[dict[str, str]] = {
        "serving": "Serving",
        "engines": "Engines",
        "fleet": "Fleet, failover and weight updates",
        "pools": "Pools and worker processes",
        "redis": "Redis",
        "rendering": "Rendering and parsing",
        "images": "Images",
        "feed": "Trainer feed",
        "telemetry": "Logs and traces",
        "distillation": "On-policy distillation",
    }

    # -- serving --------------------------------------------------------------------------------------
    host: str = setting("127.0.0.1", "interface to listen on", section="serving")
    port: int = setting(8080, "port to listen on", section="serving", ge=0, le=65535)
    admin_key: str = setting(
        "",
        "key the trainer uses to create sessions and read trajectories; a random one is generated and printed if unset",
        section="serving",
        show_default=False,
    )
    jwt_secret: str = setting(
        "", "secret for session tokens (default: derived from the admin key)", section="serving", show_default=False
    )
    public_url: str = setting(
        "",
        "base URL handed to plugins in new sessions (default: the URL the trainer called)",
        section="serving",
        show_default=False,
    )
    store: str = setting(
        "memory",
        "'memory' (in-process, lost on exit), redis://HOST:PORT/DB, or redis+cluster://HOST:PORT for a Redis Cluster",
        section="serving",
    )
    session_ttl: float = setting(
        24 * 3600.0, "seconds a session and its trajectories are kept", section="serving", gt=0
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024, "largest request body accepted (413 beyond)", section="serving", ge=1
    )
    resent_history: Literal["reuse", "check"] = setting(
        "reuse",
        "a conversation a client resends whole each turn (Chat's messages, Responses' input, the Messages API's "
        "messages): 'reuse' parses, checks and normalizes only what it adds to the last one; 'check' takes every "
        "body in whole (slower, the same result: the intake's one stage that can be switched off)",
        section="serving",
    )
    workers: int = setting(
        1,
        "serving processes sharing the port (SO_REUSEPORT); more than one needs a Redis store and a fixed --port",
        section="pools",
        ge=1,
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = setting(
        "auto",
        "the event loop: 'uvloop' (its I/O and scheduling in C: less CPU per turn), 'asyncio' (the standard "
        "library's), or 'auto': uvloop when installed",
        section="serving",
    )
    gc_threshold: int = setting(
        50_000,
        "Python's cyclic garbage collector in serve: what was allocated at start is frozen (never scanned again) and "
        "a collection runs once N more container objects are alive, not every 700 (Python's default: ~0.3 ms a "
        "turn); 0 leaves the collector as Python sets it",
        section="serving",
        metavar="N",
        ge=0,
    )

    # -- engines ----------------------------------------------------------------------------------------
    engines: tuple[str, ...] = setting(
        (DEFAULT_ENGINE,),
        "base URL of a vLLM OpenAI server; repeat for several (environment: comma-separated)",
        section="engines",
        flag="--engine",
        metavar="URL",
        separator=",",
    )
    engine_timeout: float = setting(
        600.0, "seconds one engine call may take in all, not counting time the fleet is paused", section="engines", gt=0
    )
    engine_connect_timeout: float = setting(
        5.0, "seconds to connect to an engine before it is unavailable", section="engines", gt=0
    )
    engine_first_byte_timeout: float = setting(
        600.0,
        "seconds to wait for an engine to start answering; a non-streamed completion answers when it is done, so "
        "this bounds a generation",
        section="engines",
        gt=0,
    )
    engine_health_timeout: float = setting(2.0, "seconds one engine health probe may take", section="engines", gt=0)
    engine_hang_timeout: float = setting(
        8.0,
        "seconds an engine may send nothing at all (no probe or call answered, no token streamed) while its probes "
        "time out before it is taken out as hung: its calls in flight fail over, or end with an error event once "
        "part of the answer was streamed; also how long a /tokenize waits for its answer to start. A slow "
        "generation that streams tokens is never cut by it (a client has an answer within about 12 s of its "
        "engine hanging)",
        section="engines",
        gt=0,
    )
    engine_max_inflight: int = setting(256, "requests in flight per engine before queueing", section="engines", ge=1)
    prompt_echo: Literal["require", "count"] = setting(
        "require",
        "the drift check compares the prompt the engine says it consumed with the tokens sent: 'require' makes an "
        "answer without that echo an engine error (502); 'count' records such turns unchecked, flagged on the node "
        "and counted in unchecked_prompts_total, for an engine that cannot echo",
        section="engines",
    )

    # -- the fleet --------------------------------------------------------------------------------------
    policy_version: int = setting(
        0,
        "the policy version of the engines' starting weights: what an engine reporting weight_version 'default' (or "
        "no /weight_info) serves, and the fleet's version when no engine reports an integer",
        section="fleet",
    )
    engine_probe_interval: float = setting(2.0, "seconds between health probes of an engine", section="fleet", gt=0)
    engine_failure_threshold: int = setting(
        3,
        "5xx answers or timeouts in a row that take an engine out of rotation; a refused or reset connection takes "
        "it out at once",
        section="fleet",
        ge=1,
    )
    engine_backoff_max: float = setting(
        30.0,
        "the longest wait between probes of an unhealthy engine; the wait doubles from the probe interval",
        section="fleet",
        gt=0,
    )
    engine_retries: int = setting(
        2,
        "failed engine calls of one turn sent again to another engine, invisibly to the client",
        section="fleet",
        ge=0,
    )
    turn_deadline: float = setting(
        1800.0,
        "seconds all engine calls of one turn may take together, retries included, not counting time paused",
        section="fleet",
        gt=0,
    )
    pause_queue: int = setting(
        4096, "turns that may wait for a resume while the engines are paused", section="fleet", ge=0
    )
    pause_wait: float = setting(
        600.0,
        "seconds a turn waits for a resume (queued, or frozen by a keep-mode pause) before a 503",
        section="fleet",
        gt=0,
    )
    engine_control_timeout: float = setting(
        60.0,
        "seconds one pause, resume or weight-version call to one engine may take; a wait-mode pause may take "
        "--engine-timeout",
        section="fleet",
        gt=0,
    )
    abort_policy: Literal["continue", "regenerate"] = setting(
        "continue",
        "a turn an abort-mode pause cut short, after the resume: 'continue' from the tokens already sampled, or "
        "'regenerate' it from its prompt (MoE engines always regenerate)",
        section="fleet",
    )

    # -- pools ------------------------------------------------------------------------------------------
    redis_max_connections: int = setting(
        512,
        "Redis connections per worker (per node on a cluster); a command finding all busy waits",
        section="pools",
        ge=1,
    )
    redis_pool_timeout: float = setting(
        10.0,
        "seconds a Redis command waits for a free connection before a 503 with Retry-After",
        section="pools",
        gt=0,
    )
    engine_max_connections: int = setting(
        1024,
        "generation and /tokenize calls in flight per engine and worker; more wait",
        section="pools",
        ge=1,
    )
    engine_pool_timeout: float = setting(
        300.0,
        "seconds an engine call waits for a free connection before a 503 with Retry-After",
        section="pools",
        gt=0,
    )

    # -- Redis ------------------------------------------------------------------------------------------
    redis_socket_timeout: float = setting(5.0, "seconds a Redis command may take before a 503", section="redis", gt=0)
    redis_connect_timeout: float = setting(2.0, "seconds to connect to Redis", section="redis", gt=0)
    redis_health_check_interval: int = setting(
        5,
        "seconds a pooled Redis connection may sit idle before it is pinged before use",
        section="redis",
        ge=0,
    )
    redis_retries: int = setting(
        1, "retries of a Redis command on a fresh connection after a connection error", section="redis", ge=0
    )
    redis_node_compression: int = setting(
        3,
        "zstd level (1-19) of the response nodes the Redis store writes, 0 to store them plain; either form is read "
        "back whatever this says (3: ~0.6x the memory for ~40 us a turn)",
        section="redis",
        metavar="LEVEL",
        ge=0,
        le=19,
    )

    # -- rendering and parsing ----------------------------------------------------------------------------
    rendering: Literal["auto", "engine"] = setting(
        "auto",
        "how the messages the policy did not generate become tokens: 'auto' renders in the proxy with the model's "
        "tokenizer and chat template once they match the engine's /tokenize, else through the engine; 'engine' "
        "always asks the engine",
        section="rendering",
    )
    tokenizer: str = setting(
        "",
        "directory of the model's tokenizer for local rendering (default: the engine's model directory, from its "
        "/v1/models root, when readable here)",
        section="rendering",
        metavar="DIR",
        show_default=False,
    )
    chat_template: str = setting(
        "",
        "the chat template file the engines were started with (vLLM's --chat-template); default: the tokenizer's own",
        section="rendering",
        metavar="FILE",
        show_default=False,
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = setting(
        "auto", "as vLLM's flag of that name, if the engines were given it", section="rendering"
    )
    render_check_rate: float = setting(
        0.01,
        "share of turns whose local rendering is also asked of the engine and compared; a difference switches that "
        "engine back to its /tokenize",
        section="rendering",
        metavar="RATE",
        ge=0.0,
        le=1.0,
    )
    tool_parser: str = setting(
        "hermes", "how tool calls are parsed from generated text", section="rendering", choices=TOOL_PARSER_NAMES
    )
    reasoning_parser: str = setting(
        "think", "how reasoning is parsed from generated text", section="rendering", choices=REASONING_PARSER_NAMES
    )

    # -- images -------------------------------------------------------------------------------------------------
    image_urls: bool = setting(
        False,
        "fetch the http(s) URL of an image a request sends (Chat image_url, Responses input_image, a Messages url "
        "source) within --image-url-timeout and --max-image-bytes, once per session; off, such an image is a 400 "
        "and images are sent inline, base64-encoded",
        section="images",
    )
    image_url_timeout: float = setting(
        10.0, "seconds fetching one image URL may take in all (then a 400 naming it)", section="images", gt=0
    )
    max_image_bytes: int = setting(
        5 * 1024 * 1024,
        "largest image, in bytes as sent (decoded from base64), fetched included; a data URL is also bounded at "
        "8 Mi characters (about 6 MiB of image)",
        section="images",
        ge=1,
    )
    max_image_pixels: int = setting(
        4096 * 4096, "largest image in pixels (width times height): larger ones are a 400", section="images", ge=1
    )
    max_images_per_request: int = setting(
        64,
        "image parts one request's conversation may hold (a resent history's count, as the policy sees them all)",
        section="images",
        ge=0,
    )
    max_images_per_session: int = setting(
        256,
        "distinct images a session may store (each once, by content); a turn that would store more is a 400",
        section="images",
        ge=0,
    )
    max_image_session_bytes: int = setting(
        128 * 1024 * 1024,
        "bytes of distinct images a session may store; a turn that would store more is a 400",
        section="images",
        ge=0,
    )

    # -- the trainer feed -----------------------------------------------------------------------------------
    feed: str = setting(
        "",
        "trainer feed to serve at GET /v1/feed: jsonl:PATH or redis://HOST:PORT/DB (default: none)",
        section="feed",
        show_default=False,
    )
    feed_stream: str = setting("trajectories", "Redis stream name of the feed", section="feed")

    # -- logs and traces ------------------------------------------------------------------------------------
    log_format: str = setting(
        "auto", "auto = pretty on a terminal, JSON otherwise", section="telemetry", choices=LOG_FORMATS
    )
    log_level: str = setting("info", "the lowest level logged", section="telemetry", choices=LOG_LEVELS)
    otlp_endpoint: str = setting(
        "",
        "OTLP/HTTP collector for the proxy's traces, e.g. http://localhost:4318 (default: the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT; neither: no traces are exported)",
        section="telemetry",
        metavar="URL",
        show_default=False,
    )

    # -- on-policy distillation -------------------------------------------------------------------------------
    teachers: str = setting(
        "",
        "an on-policy distillation teacher: its name and vLLM server(s), an engine group of its own; repeat for "
        "several (environment: ';'-separated)",
        section="distillation",
        flag="--teacher",
        metavar="NAME=URL[,URL]",
        separator=";",
        show_default=False,
    )
    teacher_templates: str = setting(
        "",
        "the chat template a teacher's teacher_context messages are rendered with (locally, with the student's "
        "tokenizer: --tokenizer or the engine's model root); default: the teacher engine's own, through its "
        "/tokenize (environment: ';'-separated)",
        section="distillation",
        flag="--teacher-template",
        metavar="NAME=FILE",
        separator=";",
        show_default=False,
    )

    @field_validator("engines")
    @classmethod
    def _some_engine(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        engines = check_engine_urls(value)
        if not engines:
            raise ValueError("name at least one engine")
        return engines

    @model_validator(mode="after")
    def _workers_share_a_store_and_a_port(self) -> Settings:
        if self.workers > 1 and self.port == 0:
            raise ValueError("--workers needs a fixed --port: each worker binds the same one")
        if self.workers > 1 and self.store == "memory":
            raise ValueError(
                f"--workers {self.workers} needs a Redis store (--store redis://HOST:PORT/DB): the memory store lives "
                "in one process, so each worker would see only its own sessions"
            )
        return self

    @classmethod
    def variables(cls) -> dict[str, Any]:
        """The variables, and ``ROLLOUT_PROXY_ENGINE`` (one engine: the name before several could be given)."""
        found = super().variables()
        legacy = os.environ.get(ENV_PREFIX + "ENGINE")
        if "engines" not in found and legacy:
            found["engines"] = legacy
        return found

    @property
    def token_secret(self) -> bytes:
        """Key for session tokens; stable across restarts as long as the admin key is."""
        if self.jwt_secret:
            return self.jwt_secret.encode()
        return hmac.new(self.admin_key.encode(), b"rollout-proxy session tokens", hashlib.sha256).digest()


def default(name: str) -> Any:
    """A server setting's default, for a component's own default of the same value (never retyped)."""
    return Settings.model_fields[name].default


def from_setting(name: str) -> Any:
    """A field of a component's config dataclass that is the server setting ``name``: its default is the
    setting's, and ``part`` fills it from the settings (the link is declared here, once)."""
    return dataclasses.field(default=default(name), metadata={"setting": name})


def part(component: type[T], settings: Settings, **given: Any) -> T:
    """A component's config dataclass from the settings its ``from_setting`` fields name (``given``: the
    fields computed from several settings)."""
    values = {
        field.name: getattr(settings, field.metadata["setting"])
        for field in dataclasses.fields(component)  # type: ignore[arg-type]
        if "setting" in field.metadata
    }
    return component(**{**values, **given})


if __name__ == "__main__":
    sys.stdout.write(Settings.table())
