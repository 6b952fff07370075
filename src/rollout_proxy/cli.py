"""``rollout-proxy``: the command line.

Every option of ``serve`` can also come from a ``ROLLOUT_PROXY_<NAME>`` variable
(e.g. ``ROLLOUT_PROXY_ENGINES=http://a:8000,http://b:8000``); flags win.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Sequence

from rollout_proxy.logs import LOG_FORMATS, configure_logging
from rollout_proxy.settings import DEFAULT_ENGINE, Settings
from rollout_proxy.tokenization.parsers import REASONING_PARSERS, TOOL_PARSERS


def _serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description="Run the OpenAI-compatible rollout proxy in front of one or more vLLM engines.",
        epilog="Every option also reads ROLLOUT_PROXY_<OPTION> (e.g. ROLLOUT_PROXY_ADMIN_KEY); flags win.",
    )
    serve.add_argument(
        "--engine",
        dest="engines",
        action="append",
        metavar="URL",
        help=f"base URL of a vLLM OpenAI server; repeat for several (env ROLLOUT_PROXY_ENGINES, comma-separated; default {DEFAULT_ENGINE})",
    )
    serve.add_argument("--store", help="'memory' (in-process, lost on exit) or redis://HOST:PORT/DB (env ROLLOUT_PROXY_STORE; default memory)")
    serve.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument(
        "--admin-key",
        help="key the trainer uses to create sessions and read trajectories (env ROLLOUT_PROXY_ADMIN_KEY); "
        "a random one is generated and printed if unset",
    )
    serve.add_argument("--jwt-secret", help="secret for session tokens (default: derived from the admin key)")
    serve.add_argument("--public-url", help="base URL handed to plugins in new sessions (default: the URL the trainer called)")
    serve.add_argument("--tool-parser", choices=sorted(TOOL_PARSERS), help="how tool calls are parsed from generated text (default hermes)")
    serve.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), help="how reasoning is parsed from generated text (default think)"
    )
    serve.add_argument("--log-format", choices=LOG_FORMATS, help="auto = pretty on a terminal, JSON otherwise")
    serve.add_argument("--log-level", help="debug, info, warning, error (default info)")
    serve.add_argument("--session-ttl", type=float, help="seconds a session and its trajectories are kept (default 86400)")
    serve.add_argument("--engine-timeout", type=float, help="seconds to wait for one engine call (default 600)")
    serve.add_argument("--engine-max-inflight", type=int, help="requests in flight per engine before queueing (default 256)")
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from rollout_proxy.app import create_app

    overrides = {
        key: getattr(args, key)
        for key in (
            "store", "host", "port", "admin_key", "jwt_secret", "public_url", "tool_parser", "reasoning_parser",
            "log_format", "log_level", "session_ttl", "engine_timeout", "engine_max_inflight",
        )
    }
    if args.engines:
        overrides["engines"] = tuple(args.engines)
    settings = Settings.from_env(**overrides)
    configure_logging(settings.log_format, settings.log_level)
    generated_key = not settings.admin_key
    if generated_key:
        settings = Settings.from_env(**{**overrides, "admin_key": secrets.token_urlsafe(24)})
    app = create_app(settings)
    print(f"rollout-proxy listening on http://{settings.host}:{settings.port}", file=sys.stderr)
    print(f"  engines: {', '.join(settings.engines)}", file=sys.stderr)
    print(f"  store:   {settings.store}", file=sys.stderr)
    print(f"  parsers: tools={settings.tool_parser} reasoning={settings.reasoning_parser}", file=sys.stderr)
    if generated_key:
        print(f"  admin key (generated, pass --admin-key to fix it): {settings.admin_key}", file=sys.stderr)
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-proxy",
        description="Token-exact OpenAI-compatible proxy between RL rollout plugins and vLLM engines.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as exc:
        parser.exit(2, f"rollout-proxy: error: {exc}\n")
