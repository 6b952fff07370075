"""``rollout-proxy``: the command line.

Every option of ``serve`` can also come from a ``ROLLOUT_PROXY_<NAME>`` variable
(e.g. ``ROLLOUT_PROXY_ENGINES=http://a:8000,http://b:8000``); flags win.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from rollout_proxy import __version__
from rollout_proxy.logs import LOG_FORMATS, configure_logging
from rollout_proxy.proxy.workers import WORKER_HEADER
from rollout_proxy.settings import DEFAULT_ENGINE, PROMPT_ECHO_MODES, Settings
from rollout_proxy.tokenization.parsers import REASONING_PARSERS, TOOL_PARSERS

if TYPE_CHECKING:
    from aiohttp import web


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
    serve.add_argument(
        "--teacher",
        dest="teachers",
        action="append",
        metavar="NAME=URL[,URL]",
        help="an on-policy distillation teacher: its name and vLLM server(s), an engine group of its own; repeat "
        "for several (env ROLLOUT_PROXY_TEACHERS, ';'-separated)",
    )
    serve.add_argument(
        "--teacher-template",
        dest="teacher_templates",
        action="append",
        metavar="NAME=FILE",
        help="the chat template a teacher's teacher_context messages are rendered with (locally, with the "
        "student's tokenizer: --tokenizer or the engine's model root); default: the teacher engine's own, "
        "through its /tokenize (env ROLLOUT_PROXY_TEACHER_TEMPLATES, ';'-separated)",
    )
    serve.add_argument(
        "--store",
        help="'memory' (in-process, lost on exit) or redis://HOST:PORT/DB (env ROLLOUT_PROXY_STORE; default memory)",
    )
    serve.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument(
        "--admin-key",
        help="key the trainer uses to create sessions and read trajectories (env ROLLOUT_PROXY_ADMIN_KEY); "
        "a random one is generated and printed if unset",
    )
    serve.add_argument("--jwt-secret", help="secret for session tokens (default: derived from the admin key)")
    serve.add_argument(
        "--public-url", help="base URL handed to plugins in new sessions (default: the URL the trainer called)"
    )
    serve.add_argument(
        "--tool-parser",
        choices=sorted(TOOL_PARSERS),
        help="how tool calls are parsed from generated text (default hermes)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="how reasoning is parsed from generated text (default think)",
    )
    serve.add_argument("--log-format", choices=LOG_FORMATS, help="auto = pretty on a terminal, JSON otherwise")
    serve.add_argument("--log-level", help="debug, info, warning, error (default info)")
    serve.add_argument(
        "--session-ttl", type=float, help="seconds a session and its trajectories are kept (default 86400)"
    )
    serve.add_argument(
        "--engine-timeout",
        type=float,
        help="seconds one engine call may take in all, not counting time the fleet is paused (default 600)",
    )
    serve.add_argument(
        "--engine-connect-timeout",
        type=float,
        help="seconds to connect to an engine before it is unavailable (default 5)",
    )
    serve.add_argument(
        "--engine-first-byte-timeout",
        type=float,
        help="seconds to wait for an engine to start answering; a non-streamed completion answers when it is done, "
        "so this bounds a generation (default 600)",
    )
    serve.add_argument(
        "--engine-health-timeout", type=float, help="seconds one engine health probe may take (default 2)"
    )
    serve.add_argument(
        "--engine-hang-timeout",
        type=float,
        help="seconds an engine may send nothing at all (no probe or call answered, no token streamed) while its "
        "probes time out before it is taken out as hung: its calls in flight fail over, or end with an error "
        "event once part of the answer was streamed; also how long a /tokenize waits for its answer to start. "
        "A slow generation that streams tokens is never cut by it (default 8: a client has an answer within "
        "about 12 s of its engine hanging)",
    )
    serve.add_argument(
        "--engine-max-inflight", type=int, help="requests in flight per engine before queueing (default 256)"
    )
    _fleet_arguments(serve)
    serve.add_argument(
        "--feed", help="trainer feed to serve at GET /v1/feed: jsonl:PATH or redis://HOST:PORT/DB (default: none)"
    )
    serve.add_argument("--feed-stream", help="Redis stream name of the feed (default trajectories)")
    serve.add_argument(
        "--redis-socket-timeout", type=float, help="seconds a Redis command may take before a 503 (default 5)"
    )
    serve.add_argument("--redis-connect-timeout", type=float, help="seconds to connect to Redis (default 2)")
    serve.add_argument(
        "--redis-health-check-interval",
        type=int,
        help="seconds a pooled Redis connection may sit idle before it is pinged before use (default 5)",
    )
    serve.add_argument(
        "--redis-retries",
        type=int,
        help="retries of a Redis command on a fresh connection after a connection error (default 1)",
    )
    serve.add_argument(
        "--redis-node-compression",
        type=int,
        metavar="LEVEL",
        help="zstd level (1-19) of the response nodes the Redis store writes, 0 to store them plain; either "
        "form is read back whatever this says (default 3: ~0.6x the memory for ~40 us a turn)",
    )
    _pool_arguments(serve)
    serve.add_argument(
        "--event-loop",
        choices=("auto", "uvloop", "asyncio"),
        help="the event loop: 'uvloop' (its I/O and scheduling in C: less CPU per turn), 'asyncio' (the "
        "standard library's), or 'auto': uvloop when installed (default auto)",
    )
    serve.add_argument(
        "--gc-threshold",
        type=int,
        metavar="N",
        help="Python's cyclic garbage collector in serve: what was allocated at start is frozen (never scanned "
        "again) and a collection runs once N more container objects are alive, not every 700 (Python's "
        "default, a collection every few turns: ~0.3 ms a turn); 0 leaves the collector as Python sets it "
        "(default 50000)",
    )
    serve.add_argument(
        "--rendering",
        choices=("auto", "engine"),
        help="how the messages the policy did not generate become tokens: 'auto' renders in the proxy with the "
        "model's tokenizer and chat template once they match the engine's /tokenize, else through the engine; "
        "'engine' always asks the engine (default auto)",
    )
    serve.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory of the model's tokenizer for local rendering (default: the engine's model directory, "
        "from its /v1/models root, when readable here)",
    )
    serve.add_argument(
        "--chat-template",
        metavar="FILE",
        help="the chat template file the engines were started with (vLLM's --chat-template); default: the "
        "tokenizer's own",
    )
    serve.add_argument(
        "--chat-template-content-format",
        choices=("auto", "string", "openai"),
        help="as vLLM's flag of that name, if the engines were given it (default auto)",
    )
    serve.add_argument(
        "--render-check-rate",
        type=float,
        metavar="RATE",
        help="share of turns whose local rendering is also asked of the engine and compared; a difference "
        "switches that engine back to its /tokenize (default 0.01)",
    )
    serve.add_argument(
        "--prompt-echo",
        choices=PROMPT_ECHO_MODES,
        help="the drift check compares the prompt the engine says it consumed with the tokens sent: 'require' "
        "makes an answer without that echo an engine error (502); 'count' records such turns unchecked, "
        "flagged on the node and counted in unchecked_prompts_total, for an engine that cannot echo "
        "(default require)",
    )
    serve.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="OTLP/HTTP collector for the proxy's traces, e.g. http://localhost:4318 (default: the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT; neither: no traces are exported)",
    )
    serve.set_defaults(handler=_serve)


def _pool_arguments(serve: argparse.ArgumentParser) -> None:
    """Connection pools and worker processes (README, "Scale-out: workers, pools, Redis Cluster")."""
    serve.add_argument(
        "--redis-max-connections",
        type=int,
        help="Redis connections per worker (per node on a cluster); a command finding all busy waits (default 512)",
    )
    serve.add_argument(
        "--redis-pool-timeout",
        type=float,
        help="seconds a Redis command waits for a free connection before a 503 with Retry-After (default 10)",
    )
    serve.add_argument(
        "--engine-max-connections",
        type=int,
        help="generation and /tokenize calls in flight per engine and worker; more wait (default 1024)",
    )
    serve.add_argument(
        "--engine-pool-timeout",
        type=float,
        help="seconds an engine call waits for a free connection before a 503 with Retry-After (default 300)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        help="serving processes sharing the port (SO_REUSEPORT); more than one needs a Redis store (default 1)",
    )


def _fleet_arguments(serve: argparse.ArgumentParser) -> None:
    """The fleet's options (README, "Fleet and weight updates")."""
    serve.add_argument(
        "--policy-version",
        type=int,
        help="the policy version of the engines' starting weights: what an engine reporting weight_version "
        "'default' (or no /weight_info) serves, and the fleet's version when no engine reports an integer (default 0)",
    )
    serve.add_argument(
        "--engine-probe-interval", type=float, help="seconds between health probes of an engine (default 2)"
    )
    serve.add_argument(
        "--engine-failure-threshold",
        type=int,
        help="5xx answers or timeouts in a row that take an engine out of rotation; a refused or reset "
        "connection takes it out at once (default 3)",
    )
    serve.add_argument(
        "--engine-backoff-max",
        type=float,
        help="the longest wait between probes of an unhealthy engine; the wait doubles from the probe interval "
        "(default 30)",
    )
    serve.add_argument(
        "--engine-retries",
        type=int,
        help="failed engine calls of one turn sent again to another engine, invisibly to the client (default 2)",
    )
    serve.add_argument(
        "--turn-deadline",
        type=float,
        help="seconds all engine calls of one turn may take together, retries included, not counting time paused "
        "(default 1800)",
    )
    serve.add_argument(
        "--pause-queue", type=int, help="turns that may wait for a resume while the engines are paused (default 4096)"
    )
    serve.add_argument(
        "--pause-wait",
        type=float,
        help="seconds a turn waits for a resume (queued, or frozen by a keep-mode pause) before a 503 (default 600)",
    )
    serve.add_argument(
        "--engine-control-timeout",
        type=float,
        help="seconds one pause, resume or weight-version call to one engine may take; a wait-mode pause "
        "may take --engine-timeout (default 60)",
    )
    serve.add_argument(
        "--abort-policy",
        choices=("continue", "regenerate"),
        help="a turn an abort-mode pause cut short, after the resume: 'continue' from the tokens already sampled, "
        "or 'regenerate' it from its prompt (default continue; MoE engines always regenerate)",
    )


def _serve(args: argparse.Namespace) -> int:

    from rollout_proxy.app import create_app
    from rollout_proxy.proxy.server import serve_until_stopped
    from rollout_proxy.proxy.workers import run_workers, worker_index

    overrides = {
        key: getattr(args, key)
        for key in (
            "store",
            "host",
            "port",
            "admin_key",
            "jwt_secret",
            "public_url",
            "tool_parser",
            "reasoning_parser",
            "log_format",
            "log_level",
            "session_ttl",
            "engine_timeout",
            "engine_connect_timeout",
            "engine_first_byte_timeout",
            "engine_health_timeout",
            "engine_hang_timeout",
            "engine_max_inflight",
            "policy_version",
            "engine_probe_interval",
            "engine_failure_threshold",
            "engine_backoff_max",
            "engine_retries",
            "turn_deadline",
            "pause_queue",
            "pause_wait",
            "engine_control_timeout",
            "abort_policy",
            "feed",
            "feed_stream",
            "redis_socket_timeout",
            "redis_connect_timeout",
            "redis_health_check_interval",
            "redis_retries",
            "redis_node_compression",
            "redis_max_connections",
            "redis_pool_timeout",
            "engine_max_connections",
            "engine_pool_timeout",
            "workers",
            "event_loop",
            "gc_threshold",
            "rendering",
            "tokenizer",
            "chat_template",
            "chat_template_content_format",
            "render_check_rate",
            "prompt_echo",
            "otlp_endpoint",
        )
    }
    if args.engines:
        overrides["engines"] = tuple(args.engines)
    if args.teachers:
        overrides["teachers"] = ";".join(args.teachers)
    if args.teacher_templates:
        overrides["teacher_templates"] = ";".join(args.teacher_templates)
    settings = Settings.from_env(**overrides)
    configure_logging(settings.log_format, settings.log_level)
    generated_key = not settings.admin_key
    if generated_key:
        settings = Settings.from_env(**{**overrides, "admin_key": secrets.token_urlsafe(24)})
    index = worker_index()
    if settings.workers < 1:
        raise ValueError("--workers must be at least 1")
    from rollout_proxy.state.codec import COMPRESSION_LEVELS

    if settings.gc_threshold < 0:
        raise ValueError(f"--gc-threshold must be 0 (Python's collector as it is) or more, got {settings.gc_threshold}")
    if settings.redis_node_compression not in COMPRESSION_LEVELS:
        raise ValueError(f"--redis-node-compression must be 0 (plain) to 19, got {settings.redis_node_compression}")
    if settings.workers > 1 and settings.port == 0:
        raise ValueError("--workers needs a fixed --port: each worker binds the same one")
    if settings.workers > 1 and settings.store == "memory":
        raise ValueError(
            f"--workers {settings.workers} needs a Redis store (--store redis://HOST:PORT/DB): the memory store "
            "lives in one process, so each worker would see only its own sessions"
        )
    if settings.workers > 1 and index is None:  # the supervisor: its workers make the app (and its metrics)
        print(f"rollout-proxy: {settings.workers} workers on http://{settings.host}:{settings.port}", file=sys.stderr)
        if generated_key:
            print(f"  admin key (generated, pass --admin-key to fix it): {settings.admin_key}", file=sys.stderr)
        return run_workers(settings.workers, args.argv, admin_key=settings.admin_key)
    app = create_app(settings)
    if index is not None:  # one of serve --workers' processes: share the port, name ourselves in answers
        app.on_response_prepare.append(_name_worker)
        print(f"rollout-proxy worker {index} (pid {os.getpid()}) on port {settings.port}", file=sys.stderr)
        serving = serve_until_stopped(
            app, settings.host, settings.port, reuse_port=True, gc_threshold=settings.gc_threshold
        )
        _run_loop(serving, settings.event_loop)
        return 0
    print(f"rollout-proxy listening on http://{settings.host}:{settings.port}", file=sys.stderr)
    print(f"  engines: {', '.join(settings.engines)}", file=sys.stderr)
    print(f"  store:   {settings.store}", file=sys.stderr)
    print(f"  parsers: tools={settings.tool_parser} reasoning={settings.reasoning_parser}", file=sys.stderr)
    print(f"  rendering: {settings.rendering} (check rate {settings.render_check_rate:g})", file=sys.stderr)
    if generated_key:
        print(f"  admin key (generated, pass --admin-key to fix it): {settings.admin_key}", file=sys.stderr)
    _run_loop(
        serve_until_stopped(app, settings.host, settings.port, gc_threshold=settings.gc_threshold), settings.event_loop
    )
    return 0


def _run_loop(main: Coroutine[Any, Any, None], event_loop: str) -> None:
    """``asyncio.run`` on uvloop's loop when ``event_loop`` is ``uvloop`` (or ``auto`` and it is installed):
    the same asyncio API, its I/O and scheduling in C (README "Performance")."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise SystemExit("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(main)
            return
    asyncio.run(main)


async def _name_worker(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[WORKER_HEADER] = str(os.getpid())


def _run_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="run a rollout job (job.yaml)",
        description="Run every sample of a job through the proxy, grade it, and publish graded groups to the "
        "trainer feed. Without --proxy-url a proxy is started in-process on the job's engines.",
    )
    run.add_argument("job", help="the job file (the seed's job.yaml format)")
    run.add_argument(
        "--engine", dest="engines", action="append", metavar="URL", help="vLLM server(s); overrides proxy.engines"
    )
    run.add_argument(
        "--store", help="state store of the in-process proxy: memory or redis://... (default: the job's, memory)"
    )
    run.add_argument("--feed", help="trainer feed: jsonl:PATH or redis://... (default: OUT/<job name>/feed.jsonl)")
    run.add_argument("--out", help="output directory (default: the job's proxy.output_dir, 'out')")
    run.add_argument("--proxy-url", help="use this running proxy instead of starting one (needs --admin-key)")
    run.add_argument("--admin-key", help="admin key of --proxy-url (env ROLLOUT_PROXY_ADMIN_KEY)")
    run.add_argument("--job-id", help="id of this run (default: the job's name); a rerun with the same id resumes")
    run.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run each sample's rollout and grading calls as Ray tasks on this cluster: HOST:PORT of the head, "
        "ray://HOST:PORT or 'auto' (overrides the job's ray.address; the workers must reach the proxy)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--summary-json", help="also write the summary to this JSON file")
    run.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    run.add_argument("--log-level", default="warning", help="runner log level (default warning: retries and discards)")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os

    from rollout_proxy.runner import JobConfig, JobError, JobFailed, run_job

    configure_logging(args.log_format, args.log_level)
    try:
        job = JobConfig.load(args.job)
    except JobError as exc:
        print(f"rollout-proxy run: {exc}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(
            run_job(
                job,
                proxy_url=args.proxy_url,
                admin_key=args.admin_key or os.environ.get("ROLLOUT_PROXY_ADMIN_KEY"),
                engines=args.engines,
                store=args.store,
                feed=args.feed,
                output_dir=args.out,
                job_id=args.job_id,
                progress=not args.no_progress,
                ray=args.ray,
            )
        )
    except (JobError, ValueError) as exc:
        print(f"rollout-proxy run: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"rollout-proxy run: job failed: {exc}", file=sys.stderr)
        return 1
    print(summary.render())
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as out:
            json.dump(summary.to_json(), out, indent=2, default=str)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-proxy",
        description="Token-exact OpenAI-compatible proxy between RL rollout plugins and vLLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"rollout-proxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(commands)
    _run_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve --workers starts its workers with it
    try:
        return args.handler(args)
    except ValueError as exc:
        parser.exit(2, f"rollout-proxy: error: {exc}\n")
