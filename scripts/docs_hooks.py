"""MkDocs hooks (mkdocs.yml ``hooks:``): the parts of the docs that the code itself states, written at build time.

A page asks for one with a marker line; the marker is replaced by what the installed package says now, so
those parts cannot drift from the code:

    <!-- generated: run-help -->     ``rollout-proxy run --help`` (serve's options: the table of docs/settings.md)
    <!-- generated: run-settings -->     the table of ``run``'s options (``RunSettings``)
    <!-- generated: trainer-settings --> the table of the reference trainer's options (``TrainerSettings``)
    <!-- generated: metrics -->      every metric of ``rollout_proxy.metrics.DECLARED``: kind, labels, help
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable
from typing import Any

MARKER = re.compile(r"^<!-- generated: (?P<name>[\w-]+) -->$", re.MULTILINE)
HELP_COLUMNS = "88"  # argparse wraps to the terminal's width: fixed, so the page is the same everywhere


def cli_help(*argv: str) -> str:
    """What ``rollout-proxy ARGV --help`` prints, in a code block."""
    from rollout_proxy import cli

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.main([*argv, "--help"])
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    text = out.getvalue().rstrip()
    if not text:
        raise RuntimeError(f"rollout-proxy {' '.join(argv)} --help printed nothing")
    return f"```text\n{text}\n```"


def metrics_table() -> str:
    """Every declared metric, with the ``rollout_proxy_`` prefix the exposition gives it."""
    from rollout_proxy.metrics import DECLARED

    rows = ["| metric | kind | labels | what |", "|---|---|---|---|"]
    for name, declared in DECLARED.items():
        labels = ", ".join(f"`{label}`" for label in declared.labels)
        text = declared.help.replace("|", "\\|")
        rows.append(f"| `rollout_proxy_{name}` | {declared.kind} | {labels} | {text} |")
    return "\n".join(rows)


def run_settings_table() -> str:
    from rollout_proxy.runner.settings import RunSettings

    return RunSettings.table()


def trainer_settings_table() -> str:
    from rollout_proxy.trainer.settings import TrainerSettings

    return TrainerSettings.table()


GENERATORS: dict[str, Callable[[], str]] = {
    "run-help": lambda: cli_help("run"),
    "run-settings": run_settings_table,
    "trainer-settings": trainer_settings_table,
    "metrics": metrics_table,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: unknown generated part {name!r} (known: {sorted(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)
