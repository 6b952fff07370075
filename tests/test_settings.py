"""Each setting declared once (``rollout_proxy.settings.Settings``): its flag, ``--help``, variable and docs row.

``serve --help`` names every field with its flag, help and variable; ``docs/settings.md`` is the generated
table; every field reads its variable (and a flag beats it); bounds and choices are the field's; the
components' own defaults are the settings' defaults.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_proxy.core.rendering import RenderingConfig
from rollout_proxy.engines.fleet import FleetSettings
from rollout_proxy.settings import Settings, SettingsError, choices_of, env_name, flag_name, part, settings_table
from rollout_proxy.state.connection import RedisOptions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "rollout_proxy", "serve", "--help"], capture_output=True, text=True, check=True
    )
    return re.sub(r"\s+", " ", done.stdout)  # argparse wraps lines where it likes


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_serve_help_explains_every_setting(serve_help: str, name: str):
    assert flag_name(name) in serve_help
    assert f"[{env_name(name)}]" in serve_help
    description = " ".join((Settings.model_fields[name].description or "").split())
    assert description[:60] in serve_help, name
    for choice in choices_of(name) or ():
        assert choice in serve_help


def test_the_docs_table_is_the_generated_one():
    page = (ROOT / "docs" / "settings.md").read_text()
    between = page.split("<!-- settings:start -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert between.rstrip() == settings_table().rstrip(), "regenerate it: python -m rollout_proxy.settings"
    for name in Settings.model_fields:
        assert f"`{flag_name(name)}`" in between and f"`{env_name(name)}`" in between


def sample_value(name: str) -> tuple[str, object]:
    """A value other than the default, as a variable spells it, and as the setting holds it."""
    spec = Settings.model_fields[name]
    choices = choices_of(name)
    if choices:
        other = next(choice for choice in choices if choice != spec.default)
        return other, other
    if spec.annotation is int:
        return "7", 7
    if spec.annotation is float:
        return "0.5", 0.5
    if spec.annotation == tuple[str, ...]:
        return "http://a:1,http://b:2", ("http://a:1", "http://b:2")
    return "x-value", "x-value"


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_every_setting_reads_its_variable_and_a_flag_wins(name: str):
    raw, expected = sample_value(name)
    environ = {env_name(name): raw}
    if name == "workers":  # more than one worker needs what it needs
        environ |= {env_name("store"): "redis://r:1/0"}
    if name == "port":
        raw, expected = "8099", 8099
        environ = {env_name(name): raw}
    settings = Settings.from_env(environ)
    assert getattr(settings, name) == expected
    default = Settings.model_fields[name].default
    flagged = Settings.from_env(environ, **{name: list(default) if isinstance(default, tuple) else default})
    assert getattr(flagged, name) == default


def test_a_bad_value_names_its_flag_or_its_variable():
    with pytest.raises(SettingsError, match=r"--engine-retries: Input should be greater than or equal to 0"):
        Settings.from_env({}, engine_retries="-1")
    with pytest.raises(SettingsError, match=r"ROLLOUT_PROXY_RENDER_CHECK_RATE: Input should be less than or equal"):
        Settings.from_env({"ROLLOUT_PROXY_RENDER_CHECK_RATE": "2"})
    with pytest.raises(SettingsError, match="must be one of hermes, none"):
        Settings.from_env({"ROLLOUT_PROXY_TOOL_PARSER": "xml"})
    with pytest.raises(ValueError, match="unknown settings: no_such"):
        Settings.from_env({}, no_such=1)


def test_the_legacy_single_engine_variable_still_works():
    assert Settings.from_env({"ROLLOUT_PROXY_ENGINE": "http://only:1"}).engines == ("http://only:1",)


@pytest.mark.parametrize("component", [FleetSettings, RedisOptions, RenderingConfig])
def test_components_take_their_part_of_the_settings(component):
    """A component's config names the settings it takes (``from_setting``): built without the app (a test, a
    library user) it behaves as the server does by default, and ``part`` fills it from given settings."""
    linked = [field for field in dataclasses.fields(component) if "setting" in field.metadata]
    assert linked
    for field in linked:
        assert field.default == Settings.model_fields[field.metadata["setting"]].default, field.name
    changed = {field.metadata["setting"]: sample_value(field.metadata["setting"]) for field in linked}
    settings = Settings.from_env({env_name(name): raw for name, (raw, _) in changed.items()})
    config = part(component, settings)
    for field in linked:
        assert getattr(config, field.name) == changed[field.metadata["setting"]][1], field.name
