"""``rollout-proxy run``'s settings, declared once (``rollout_proxy.settings``): its flags, ``--help``, the
``ROLLOUT_PROXY_RUN_<NAME>`` variables and the table of docs/runner.md come from ``RunSettings``.

The job file names what the job runs (and its in-process proxy's engines, store and parsers); these say
where it runs and what it writes, and override the job's where they overlap. The admin key is
``ROLLOUT_PROXY_ADMIN_KEY``, as for ``serve`` and the trainer.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator
from pydantic_settings import SettingsConfigDict

from rollout_proxy.logs import LOG_FORMATS
from rollout_proxy.settings import ENV_PREFIX, DeclaredSettings, check_engine_urls, setting


class RunSettings(DeclaredSettings):
    """Every setting of ``rollout-proxy run`` (the job file is its argument, not a setting)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "RUN_")
    sections: ClassVar[dict[str, str]] = {"proxy": "The proxy", "output": "Output", "logs": "Logs"}

    # -- the proxy --------------------------------------------------------------------------------------
    engines: tuple[str, ...] = setting(
        (),
        "vLLM server(s) of the in-process proxy; overrides proxy.engines; repeat for several (environment: "
        "comma-separated)",
        section="proxy",
        flag="--engine",
        metavar="URL",
        separator=",",
        show_default=False,
    )
    store: str | None = setting(
        None, "state store of the in-process proxy: memory or redis://... (default: the job's, memory)", section="proxy"
    )
    proxy_url: str | None = setting(
        None, "use this running proxy instead of starting one (needs --admin-key)", section="proxy"
    )
    admin_key: str | None = setting(None, "admin key of --proxy-url", section="proxy", env_prefix=ENV_PREFIX)
    ray: str | None = setting(
        None,
        "run each sample's rollout and grading calls as Ray tasks on this cluster: HOST:PORT of the head, "
        "ray://HOST:PORT or 'auto' (overrides the job's ray.address; the workers must reach the proxy)",
        section="proxy",
        metavar="ADDRESS",
    )

    # -- output -----------------------------------------------------------------------------------------
    feed: str | None = setting(
        None, "trainer feed: jsonl:PATH or redis://... (default: OUT/<job name>/feed.jsonl)", section="output"
    )
    out: str | None = setting(None, "output directory (default: the job's proxy.output_dir, 'out')", section="output")
    job_id: str | None = setting(
        None, "id of this run (default: the job's name); a rerun with the same id resumes", section="output"
    )
    summary_json: str | None = setting(None, "also write the summary to this JSON file", section="output")
    no_progress: bool = setting(False, "no progress bar", section="output")

    # -- logs -------------------------------------------------------------------------------------------
    log_format: str = setting(
        "auto", "auto = pretty on a terminal, JSON otherwise", section="logs", choices=LOG_FORMATS
    )
    log_level: str = setting("warning", "the runner's log level (warning: retries and discards)", section="logs")

    @field_validator("engines")
    @classmethod
    def _engine_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_engine_urls(value)
