"""The command line: --help explains, env vars configure, bad values are refused."""

from __future__ import annotations

import pytest

from rollout_proxy.cli import main
from rollout_proxy.settings import Settings


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
    ],
    ids=[
        "unknown-store",
        "compression-too-high",
        "compression-negative",
        "gc-threshold-negative",
        "port",
        "workers",
        "hang",
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
