"""What every viewer test starts from."""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def logging_to_the_current_stdout() -> None:
    """structlog as it is by default, printing to whatever stdout is when a line is written.

    ``cli.main`` configures it onto the ``sys.stderr`` of its moment; run in-process by an earlier
    test (tests/test_cli.py), that is a capture stream pytest has closed since, and every log
    line of the proxies started here would raise.
    """
    structlog.reset_defaults()
