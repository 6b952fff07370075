"""structlog set-up: JSON lines in production, readable lines on a terminal.

Context (request id, session id, response id) is bound with contextvars by the
middleware and the handlers, so every line of a request carries it.
"""

from __future__ import annotations

import logging
import sys

import orjson
import structlog

LOG_FORMATS = ("auto", "json", "console")


def _dumps(data: object, default=None) -> str:
    return orjson.dumps(data, default=default or str).decode()


class StderrLogger:
    """structlog's ``PrintLogger``, but writing to whatever ``sys.stderr`` is when a line is logged.

    ``PrintLoggerFactory(file=sys.stderr)`` keeps the stream it was configured with: configured while
    the stream was swapped (pytest's capture, a redirect) it later writes to a closed file and every
    log call raises ``ValueError: I/O operation on closed file``.
    """

    def msg(self, message: str) -> None:
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


_STDERR_LOGGER = StderrLogger()  # stateless: one serves every bound logger


def stderr_logger(*args: object) -> StderrLogger:
    """The logger factory: the current ``sys.stderr``, looked up at each line."""
    return _STDERR_LOGGER


def configure_logging(log_format: str = "auto", level: str = "info") -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if log_format == "console"
        else structlog.processors.JSONRenderer(serializer=_dumps)
    )
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=stderr_logger,
        cache_logger_on_first_use=False,
    )
