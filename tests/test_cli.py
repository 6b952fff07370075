"""The command line: --help explains, env vars configure, bad values are refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from rollout_proxy.cli import main
from rollout_proxy.settings import Settings
from tests.conftest import free_port


def test_settings_read_the_environment_and_flags_win(settings_environ):
    env = {
        "ROLLOUT_PROXY_ENGINES": "http://a:1, http://b:2",
        "ROLLOUT_PROXY_STORE": "redis://r:6379/1",
        "ROLLOUT_PROXY_PORT": "9000",
        "ROLLOUT_PROXY_ADMIN_KEY": "from-env",
        "ROLLOUT_PROXY_TOOL_PARSER": "none",
    }
    for name, value in env.items():
        settings_environ.setenv(name, value)
    settings = Settings.from_env(port=9100, admin_key=None)
    assert settings.engines == ("http://a:1", "http://b:2")
    assert settings.store == "redis://r:6379/1"
    assert settings.port == 9100
    assert settings.admin_key == "from-env"
    assert settings.tool_parser == "none"


def test_session_token_secret_is_stable_for_an_admin_key():
    assert Settings(admin_key="k").token_secret == Settings(admin_key="k").token_secret
    assert Settings(admin_key="k").token_secret != Settings(admin_key="other").token_secret
    assert Settings(admin_key="k", jwt_secret="s").token_secret == b"s"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--store", "mongodb://x"], "unknown store"),
        (["--redis-node-compression", "20"], "--redis-node-compression: Input should be less than or equal to 19"),
        (["--redis-node-compression", "-1"], "--redis-node-compression: Input should be greater than or equal to 0"),
        (["--gc-threshold", "-1"], "--gc-threshold: Input should be greater than or equal to 0"),
        (["--port", "eighty"], "--port: Input should be a valid integer"),
        (["--workers", "2", "--port", "8090"], "--workers 2 needs a Redis store"),
        (["--engine-hang-timeout", "0"], "--engine-hang-timeout: Input should be greater than 0"),
        (["--engine", "localhost:8000"], "--engine: 'localhost:8000' must be an engine's base URL"),
        (["--engine", "http://a:1", "--engine", "ftp://b"], "--engine: 'ftp://b' must be an engine's base URL"),
        (["--teacher", "t=127.0.0.1:8001"], "teacher 't': '127.0.0.1:8001' must be an engine's base URL"),
        (["--chat-template", "/nowhere/tool_use.jinja"], "--chat-template: chat template file '/nowhere/tool_use"),
    ],
    ids=[
        "unknown-store",
        "compression-too-high",
        "compression-negative",
        "gc-threshold-negative",
        "port",
        "workers",
        "hang",
        "engine-without-scheme",
        "engine-scheme",
        "teacher-url",
        "chat-template-missing",
    ],
)
def test_bad_serve_options_are_refused_before_serving(options, message, capsys, monkeypatch):
    monkeypatch.setenv("ROLLOUT_PROXY_ADMIN_KEY", "k")
    with pytest.raises(SystemExit) as raised:
        main(["serve", "--port", "0", "--log-format", "json", *options])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("choice", "loop_module"), [("uvloop", "uvloop"), ("auto", "uvloop"), ("asyncio", "asyncio")])
def test_serve_runs_on_the_event_loop_asked_for(choice: str, loop_module: str):
    """``--event-loop``: uvloop (the default when installed: less CPU per turn) or the standard library's."""
    import asyncio

    from rollout_proxy.cli import _run_loop

    seen: list[str] = []

    async def serve() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    _run_loop(serve(), choice)
    assert seen == [loop_module]


def test_serve_on_a_port_in_use_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("ROLLOUT_PROXY_ADMIN_KEY", "k")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port), "--event-loop", "asyncio", "--log-level", "error"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"rollout-proxy serve: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "Traceback" not in err and "listening on" not in err


def test_serve_without_its_redis_says_so_in_one_line(capsys, monkeypatch, redis_gives_up_fast):
    """The store cannot be reached: after the start-up's retries (cut short here), one line, exit 1, nothing
    announced as listening, the password not printed."""
    monkeypatch.setenv("ROLLOUT_PROXY_ADMIN_KEY", "k")
    port = free_port()
    store = f"redis://:hunter2@127.0.0.1:{port}/0"
    code = main(["serve", "--port", "0", "--store", store, "--event-loop", "asyncio", "--log-level", "error"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"rollout-proxy serve: cannot reach Redis at redis://:***@127.0.0.1:{port}/0 (3 tries in " in err
    assert "hunter2" not in err and "Traceback" not in err and "listening on" not in err


def test_serve_announces_the_port_it_listens_on():
    """``--port 0``: the banner, printed once the port is open, names the port the system chose."""
    env = {**os.environ, "ROLLOUT_PROXY_ADMIN_KEY": "k"}
    command = [sys.executable, "-m", "rollout_proxy", "serve", "--port", "0", "--log-level", "error"]
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as serve:
        try:
            assert serve.stderr is not None
            first = serve.stderr.readline()
            assert first.startswith("rollout-proxy listening on http://127.0.0.1:"), first
            port = int(first.rsplit(":", 1)[1])
            assert port != 0
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        finally:
            serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0


def test_serve_with_a_feed_file_it_cannot_write_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_PROXY_ADMIN_KEY", "k")
    code = main(
        ["serve", "--port", "0", "--feed", f"jsonl:{tmp_path}", "--event-loop", "asyncio", "--log-level", "error"]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert f"rollout-proxy serve: cannot write the feed file {str(tmp_path)!r}: Is a directory" in err
    assert "Traceback" not in err and "listening on" not in err


def test_serve_stopped_while_it_waits_for_its_redis_stops_at_once():
    """SIGTERM (Ctrl-C) during the start-up's retries of an unreachable store ends the start, not after it."""
    env = {**os.environ, "ROLLOUT_PROXY_ADMIN_KEY": "k"}
    store = f"redis://127.0.0.1:{free_port()}/0"
    command = [sys.executable, "-m", "rollout_proxy", "serve", "--port", "0", "--store", store]
    command += ["--log-format", "json", "--log-level", "warning"]
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as serve:
        assert serve.stderr is not None
        try:
            lines = [serve.stderr.readline()]
            while lines[-1] and '"event":"redis_waiting"' not in lines[-1]:
                lines.append(serve.stderr.readline())
            waiting = json.loads(lines[-1])
            assert (waiting["url"], waiting["tried"], waiting["of"]) == (store, 1, 6), lines
        finally:
            serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=60)
        rest = serve.stderr.read()
    assert code == 0, rest
    assert "cannot reach Redis" not in rest and "listening on" not in rest
