"""pdd's log lines: ``INFO 12-07 02:31:05 [pdd.gateway.orchestrator] reconnected to md0`` on stderr.

:func:`configure_logging` is called once at each command's start (``pdd.cli.main``: ``pdd serve``,
``pdd launch`` and so every instance and gateway a topology starts, ``pdd demo``, ``pdd bench``,
...). The level (``--log-level`` of ``pdd serve`` / ``pdd launch``, else ``PDD_LOG_LEVEL``, else
INFO) applies to pdd's own loggers (``pdd.*``); other libraries' loggers (httpx, asyncio) print
WARNING and above in the same format. uvicorn's loggers keep their own handlers and format
(``pdd.gateway.api.http_server_config``: warnings only, no access log). A process started by a
command inherits ``PDD_LOG_LEVEL``, which ``pdd serve --log-level`` sets for its instances.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["DATEFMT", "FORMAT", "LEVELS", "LEVEL_ENV", "configure_logging", "level_name", "level_problem"]

LEVEL_ENV = "PDD_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LEVEL = "INFO"
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"  # vLLM's order: level, time, where
DATEFMT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a line is logged (as logging's own
    last-resort handler does), so a replaced stderr (a test's capture) is followed, not kept."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def level_name(value) -> str:
    """``value`` as a level name: stripped, upper case, ``WARN`` (Python's alias) as ``WARNING``."""
    v = str(value).strip().upper()
    return "WARNING" if v == "WARN" else v


def level_problem(value: str) -> str | None:
    """Why ``value`` is not a log level (case-insensitive: ``debug``, ``INFO``, ...), as the end
    of a one-line refusal (``'loud': not a log level (one of DEBUG, ...)``) that its caller
    prefixes with the flag or variable it came from; None when it is one."""
    if level_name(value) in LEVELS:
        return None
    return f"{value!r}: not a log level (one of {', '.join(LEVELS)}, any case; WARN for WARNING)"


def configure_logging(level: str | None = None) -> str:
    """Print pdd's log lines on stderr with their level name, time and logger name, at ``level``
    (default: ``$PDD_LOG_LEVEL``, else INFO) for the ``pdd`` loggers and WARNING for the others;
    returns the level set (upper case). Called again (a second entry point in one process), it
    replaces what it set before rather than adding a second handler. Raises ValueError (one line
    naming ``PDD_LOG_LEVEL``) when the level comes from the environment and is not one; a flag's
    value is checked by its parser (:func:`level_problem`)."""
    if level is None:
        level = os.environ.get(LEVEL_ENV, "").strip() or DEFAULT_LEVEL
        bad = level_problem(level)
        if bad:
            raise ValueError(f"{LEVEL_ENV} {bad}")
    level = level_name(level)
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_pdd", False)]:
        root.removeHandler(h)
    handler = _StderrHandler()
    handler._pdd = True  # ours: replaced by the next call, removed by tests' clean-up
    handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    root.addHandler(handler)  # the root's level (Python's default, WARNING) stays the others'
    logging.getLogger("pdd").setLevel(level)
    return level
