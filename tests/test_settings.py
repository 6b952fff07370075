"""Each setting declared once (``rollout_proxy.settings``): its flag, ``--help``, variable and docs row.

Three commands have a settings model: ``serve`` (``Settings``), ``run`` (``RunSettings``) and the trainer
(``TrainerSettings``). Each command's ``--help`` names every field with its flag, help and variable;
``docs/settings.md`` is the generated table of ``serve`` (``run``'s and the trainer's are generated into
their pages at build time); every field reads its variable, and a flag beats it; bounds and choices are the
field's and a bad value is refused naming its flag or variable; a model built in code reads no variable;
the components' own defaults are the server settings' defaults.
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
from rollout_proxy.runner.settings import RunSettings
from rollout_proxy.settings import DeclaredSettings, Settings, SettingsError, part
from rollout_proxy.state.connection import RedisOptions
from rollout_proxy.trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[1]

#: each command's settings model, and how its --help is asked for
COMMANDS: dict[type[DeclaredSettings], list[str]] = {
    Settings: ["-m", "rollout_proxy", "serve", "--help"],
    RunSettings: ["-m", "rollout_proxy", "run", "--help"],
    TrainerSettings: ["-m", "rollout_proxy.trainer", "--help"],
}
#: what each model needs besides the setting under test (its required settings)
REQUIRED = {
    TrainerSettings: {"proxy": "http://p:1", "admin_key": "k", "feed": "redis://r:1/0", "model": "m", "out": "o"}
}
FIELDS = [(model, name) for model in COMMANDS for name in model.model_fields]


def field_id(value: object) -> str:
    return value.__name__ if isinstance(value, type) else str(value)


@pytest.fixture(scope="module")
def helps() -> dict[type[DeclaredSettings], str]:
    done = {
        model: subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True).stdout
        for model, argv in COMMANDS.items()
    }
    return {model: re.sub(r"\s+", " ", text) for model, text in done.items()}  # argparse wraps where it likes


@pytest.mark.parametrize(("model", "name"), FIELDS, ids=field_id)
def test_help_explains_every_setting(helps, model: type[DeclaredSettings], name: str):
    shown = helps[model]
    assert model.flag_name(name) in shown
    assert f"[{model.env_name(name)}]" in shown
    description = " ".join((model.model_fields[name].description or "").split())
    assert description[:60] in shown, name
    for choice in model.choices_of(name) or ():
        assert choice in shown


def test_the_docs_table_is_the_generated_one():
    page = (ROOT / "docs" / "settings.md").read_text()
    between = page.split("<!-- settings:start -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert between.rstrip() == Settings.table().rstrip(), "regenerate it: python -m rollout_proxy.settings"
    for name in Settings.model_fields:
        assert f"`{Settings.flag_name(name)}`" in between and f"`{Settings.env_name(name)}`" in between


@pytest.mark.parametrize(("model", "page"), [(RunSettings, "runner.md"), (TrainerSettings, "training.md")])
def test_the_other_commands_tables_are_generated_into_their_pages(model: type[DeclaredSettings], page: str):
    marker = {RunSettings: "run-settings", TrainerSettings: "trainer-settings"}[model]
    assert f"<!-- generated: {marker} -->" in (ROOT / "docs" / page).read_text()
    table = model.table()
    for name in model.model_fields:
        assert f"| `{model.flag_name(name)}` | `{model.env_name(name)}` |" in table


def test_run_and_the_trainer_share_the_admin_key_variable_and_nothing_else_of_serve():
    """A shell set up for ``serve`` (ROLLOUT_PROXY_STORE, ..._LOG_LEVEL) changes nothing of ``run`` or the
    trainer; the admin key is one variable for all three."""
    for model in (RunSettings, TrainerSettings):
        assert model.env_name("admin_key") == "ROLLOUT_PROXY_ADMIN_KEY"
        others = {model.env_name(name) for name in model.model_fields if name != "admin_key"}
        assert not others & {Settings.env_name(name) for name in Settings.model_fields}, model


def sample_value(model: type[DeclaredSettings], name: str) -> tuple[str, object]:
    """A value other than the default, as a variable spells it, and as the setting holds it."""
    spec = model.model_fields[name]
    choices = model.choices_of(name)
    if name == "lora_rank" and model is TrainerSettings:  # one of the ranks vLLM serves
        return "8", 8
    if choices:
        other = next(choice for choice in choices if choice != spec.default)
        return other, other
    if spec.annotation in (int, int | None):
        return "7", 7
    if spec.annotation is float:
        return "0.5", 0.5
    if spec.annotation is bool:
        return "true", True
    if spec.annotation == tuple[str, ...]:
        return "http://a:1,http://b:2", ("http://a:1", "http://b:2")
    if name == "feed" and model is TrainerSettings:
        return "redis://other:2/1", "redis://other:2/1"
    if name == "chat_template":  # a file that is there, or the template's text itself (as vLLM takes it)
        return "{{ messages }}", "{{ messages }}"
    return "x-value", "x-value"


@pytest.mark.parametrize(("model", "name"), FIELDS, ids=field_id)
def test_every_setting_reads_its_variable_and_a_flag_wins(settings_environ, model, name, tmp_path):
    raw, expected = sample_value(model, name)
    if name == "port":
        raw, expected = "8099", 8099
    required = {key: value for key, value in REQUIRED.get(model, {}).items() if key != name}
    if model is TrainerSettings and name in ("lora_rank", "policy"):  # a LoRA trainer names both
        required.update({"lora_rank": "16", "policy": "pol"})
        required.pop(name)
    if model is TrainerSettings and name == "job":  # a job file the trainer can read
        (tmp_path / "x-value").write_text("customization_type: GRPO\n")
        (tmp_path / "flag-value").write_text("customization_type: GRPO\n")
        settings_environ.chdir(tmp_path)
    settings_environ.setenv(model.env_name(name), raw)
    if model is Settings and name == "workers":  # more than one worker needs what it needs
        settings_environ.setenv(Settings.env_name("store"), "redis://r:1/0")
    settings = model.from_env(**required)
    assert getattr(settings, name) == expected
    flag, flagged_value = flag_value(model, name)
    flagged = model.from_env(**required, **{name: flag})
    assert getattr(flagged, name) == flagged_value


def flag_value(model: type[DeclaredSettings], name: str) -> tuple[object, object]:
    """A flag's value other than ``sample_value``'s, as argparse gives it, and as the setting holds it."""
    spec = model.model_fields[name]
    value = REQUIRED.get(model, {}).get(name, spec.default)
    if name == "lora_rank" and model is TrainerSettings:
        return "32", 32
    if value is None:
        return ("3", 3) if spec.annotation == int | None else ("flag-value", "flag-value")
    return (list(value) if isinstance(value, tuple) else value), value


def test_a_model_built_in_code_reads_no_variable(settings_environ):
    """``run``'s in-process proxy and the tests build ``Settings(...)``: what a shell exported is not theirs."""
    settings_environ.setenv("ROLLOUT_PROXY_PORT", "9999")
    settings_environ.setenv("ROLLOUT_PROXY_STORE", "redis://r:1/0")
    assert (Settings().port, Settings().store) == (8080, "memory")
    assert Settings.from_env().port == 9999


def test_a_bad_value_names_its_flag_or_its_variable(settings_environ):
    with pytest.raises(SettingsError, match=r"--engine-retries: Input should be greater than or equal to 0"):
        Settings.from_env(engine_retries="-1")
    settings_environ.setenv("ROLLOUT_PROXY_RENDER_CHECK_RATE", "2")
    with pytest.raises(SettingsError, match=r"ROLLOUT_PROXY_RENDER_CHECK_RATE: Input should be less than or equal"):
        Settings.from_env()
    settings_environ.delenv("ROLLOUT_PROXY_RENDER_CHECK_RATE")
    settings_environ.setenv("ROLLOUT_PROXY_TOOL_PARSER", "xml")
    with pytest.raises(SettingsError, match="must be one of hermes, none"):
        Settings.from_env()
    with pytest.raises(ValueError, match="unknown settings: no_such"):
        Settings.from_env(no_such=1)
    with pytest.raises(SettingsError, match=r"--log-format: must be one of auto, json, console"):
        RunSettings.from_env(log_format="xml")
    given = dict(REQUIRED[TrainerSettings])
    with pytest.raises(SettingsError, match=r"--keep-weights: Input should be greater than or equal to 0"):
        TrainerSettings.from_env(**given, keep_weights="-1")
    settings_environ.setenv("ROLLOUT_PROXY_TRAINER_RELOAD_TIMEOUT", "0")
    with pytest.raises(SettingsError, match=r"ROLLOUT_PROXY_TRAINER_RELOAD_TIMEOUT: Input should be greater than 0"):
        TrainerSettings.from_env(**given)
    with pytest.raises(SettingsError, match=r"--proxy \(or ROLLOUT_PROXY_TRAINER_PROXY\) is required"):
        TrainerSettings.from_env(**{**given, "proxy": None})


def test_repeated_flags_and_list_variables(settings_environ):
    """``--engine`` and ``--teacher`` repeat; their variables join the values (',' and ';')."""
    settings = Settings.from_env(engines=["http://a:1", "http://b:2"], teachers=["m=http://t:1", "n=http://u:2"])
    assert settings.engines == ("http://a:1", "http://b:2") and settings.teachers == "m=http://t:1;n=http://u:2"
    settings_environ.setenv("ROLLOUT_PROXY_ENGINES", " http://a:1, ,http://b:2")
    assert Settings.from_env().engines == ("http://a:1", "http://b:2")
    settings_environ.setenv("ROLLOUT_PROXY_RUN_ENGINES", "http://c:3")
    assert RunSettings.from_env().engines == ("http://c:3",)


def test_the_legacy_single_engine_variable_still_works(settings_environ):
    settings_environ.setenv("ROLLOUT_PROXY_ENGINE", "http://only:1")
    assert Settings.from_env().engines == ("http://only:1",)
    settings_environ.setenv("ROLLOUT_PROXY_ENGINES", "http://a:1")
    assert Settings.from_env().engines == ("http://a:1",)


def test_an_empty_variable_is_an_unset_one(settings_environ):
    settings_environ.setenv("ROLLOUT_PROXY_PORT", "")
    settings_environ.setenv("ROLLOUT_PROXY_ADMIN_KEY", "")
    assert Settings.from_env().port == 8080
    with pytest.raises(SettingsError, match="--admin-key"):
        TrainerSettings.from_env(**{**REQUIRED[TrainerSettings], "admin_key": None})


@pytest.mark.parametrize("component", [FleetSettings, RedisOptions, RenderingConfig])
def test_components_take_their_part_of_the_settings(settings_environ, component):
    """A component's config names the settings it takes (``from_setting``): built without the app (a test, a
    library user) it behaves as the server does by default, and ``part`` fills it from given settings."""
    linked = [field for field in dataclasses.fields(component) if "setting" in field.metadata]
    assert linked
    for field in linked:
        assert field.default == Settings.model_fields[field.metadata["setting"]].default, field.name
    changed = {field.metadata["setting"]: sample_value(Settings, field.metadata["setting"]) for field in linked}
    for name, (raw, _) in changed.items():
        settings_environ.setenv(Settings.env_name(name), raw)
    config = part(component, Settings.from_env())
    for field in linked:
        assert getattr(config, field.name) == changed[field.metadata["setting"]][1], field.name
