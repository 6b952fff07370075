"""The log set-up writes to the ``sys.stderr`` of the moment, not the one it was configured under."""

from __future__ import annotations

import io
import sys

import structlog

from rollout_proxy.logs import configure_logging


def test_logging_configured_under_a_stream_since_closed_writes_to_the_current_one(monkeypatch):
    before = structlog.get_config()
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)  # as pytest's capsys, or a redirect, does
    configure_logging("json", "info")
    log = structlog.get_logger("test").bind(kept="yes")  # a bound logger made now, kept for later
    swapped.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    try:
        log.info("still_logged")  # PrintLoggerFactory(file=sys.stderr) raised "I/O operation on closed file"
    finally:
        structlog.configure(**before)
    assert '"event":"still_logged"' in later.getvalue() and '"kept":"yes"' in later.getvalue()
