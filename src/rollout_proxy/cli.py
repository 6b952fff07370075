"""``rollout-proxy``: the command line.

Each command's options are its settings model's fields (``settings.Settings`` for ``serve``,
``runner.settings.RunSettings`` for ``run``): every option of ``serve`` can also come from a
``ROLLOUT_PROXY_<NAME>`` variable (e.g. ``ROLLOUT_PROXY_ENGINES=http://a:8000,http://b:8000``), every
option of ``run`` from ``ROLLOUT_PROXY_RUN_<NAME>``; flags win.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from rollout_proxy import __version__
from rollout_proxy.logs import configure_logging
from rollout_proxy.proxy.workers import EXIT_CANNOT_SERVE, WORKER_HEADER
from rollout_proxy.runner.settings import RunSettings
from rollout_proxy.settings import Settings

if TYPE_CHECKING:
    from aiohttp import web


def _serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description="Run the OpenAI-compatible rollout proxy in front of one or more vLLM engines.",
        epilog="Every option also reads ROLLOUT_PROXY_<OPTION> (e.g. ROLLOUT_PROXY_ADMIN_KEY); flags win.",
    )
    Settings.add_arguments(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:

    from rollout_proxy.app import create_app
    from rollout_proxy.proxy.server import serve_until_stopped
    from rollout_proxy.proxy.workers import run_workers, worker_index
    from rollout_proxy.state.connection import shown_url

    overrides = {name: getattr(args, name) for name in Settings.model_fields}
    settings = Settings.from_env(**overrides)
    configure_logging(settings.log_format, settings.log_level)
    generated_key = not settings.admin_key
    if generated_key:
        settings = Settings.from_env(**{**overrides, "admin_key": secrets.token_urlsafe(24)})
    index = worker_index()
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
        return _serve_loop(serving, settings.event_loop, cannot_serve=EXIT_CANNOT_SERVE)

    def announce(port: int) -> None:
        print(f"rollout-proxy listening on http://{settings.host}:{port}", file=sys.stderr)
        print(f"  engines: {', '.join(settings.engines)}", file=sys.stderr)
        print(f"  store:   {shown_url(settings.store)}", file=sys.stderr)
        print(f"  parsers: tools={settings.tool_parser} reasoning={settings.reasoning_parser}", file=sys.stderr)
        print(f"  rendering: {settings.rendering} (check rate {settings.render_check_rate:g})", file=sys.stderr)
        if generated_key:
            print(f"  admin key (generated, pass --admin-key to fix it): {settings.admin_key}", file=sys.stderr)

    serving = serve_until_stopped(
        app, settings.host, settings.port, gc_threshold=settings.gc_threshold, on_listening=announce
    )
    return _serve_loop(serving, settings.event_loop)


def _serve_loop(serving: Coroutine[Any, Any, None], event_loop: str, *, cannot_serve: int = 1) -> int:
    """``serving`` run to its end: ``cannot_serve``, with the reason on one line, where it could not start (a
    worker of ``serve --workers`` tells its parent so: not one to restart)."""
    from rollout_proxy.proxy.server import CannotServe

    try:
        _run_loop(serving, event_loop)
    except CannotServe as exc:
        print(f"rollout-proxy serve: {exc}", file=sys.stderr)
        return cannot_serve
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
    RunSettings.add_arguments(run)
    run.set_defaults(handler=_run)


async def _stopped_by_sigterm(main: Coroutine[Any, Any, Any]) -> Any:
    """``main``, cancelled by SIGTERM as Ctrl-C cancels it: what it started stops with it (the harness processes
    of a job: ``runner.processes`` kills their process groups when cancelled)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await main
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from rollout_proxy.errors import StoreUnavailable
    from rollout_proxy.runner import JobConfig, JobError, JobFailed, run_job
    from rollout_proxy.sdk.transport import ProxyUnreachable

    settings = RunSettings.from_env(**{name: getattr(args, name) for name in RunSettings.model_fields})
    configure_logging(settings.log_format, settings.log_level)
    try:
        job = JobConfig.load(args.job)
    except JobError as exc:
        print(f"rollout-proxy run: {exc}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(
            _stopped_by_sigterm(
                run_job(
                    job,
                    proxy_url=settings.proxy_url,
                    admin_key=settings.admin_key,
                    engines=settings.engines,
                    store=settings.store,
                    feed=settings.feed,
                    output_dir=settings.out,
                    job_id=settings.job_id,
                    progress=not settings.no_progress,
                    ray=settings.ray,
                )
            )
        )
    except asyncio.CancelledError:
        print("rollout-proxy run: stopped (SIGTERM)", file=sys.stderr)
        return 143
    except (JobError, ValueError) as exc:
        print(f"rollout-proxy run: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"rollout-proxy run: job failed: {exc}", file=sys.stderr)
        return 1
    except ProxyUnreachable as exc:
        where = f"the proxy at {settings.proxy_url}" if settings.proxy_url else "the in-process proxy"
        print(f"rollout-proxy run: no answer from {where}: {exc}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:  # the in-process proxy's store, or the trainer feed
        print(f"rollout-proxy run: {exc.message}", file=sys.stderr)
        return 1
    print(summary.render())
    if settings.summary_json:
        with open(settings.summary_json, "w", encoding="utf-8") as out:
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
