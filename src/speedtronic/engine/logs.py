"""Logging set-up for runs: one "speedtronic" logger, one console, secrets scrubbed from every record.

On a terminal, log records and the progress bar (engine/progress.py) share one Rich console, so a
record is printed above the live bar and never glued onto it. When stderr is not a terminal (a file,
nohup, SLURM, a pipe), records are plain lines, one per event, never wrapped, each with a timestamp
that grep and sort understand. `logging.file` adds the same plain lines to a file.

Never imports torch: the CLI sets logging up before the engine loads.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.engine.quiet import quiet_third_party
from speedtronic.secrets import scrub

if TYPE_CHECKING:
    from rich.console import Console

LOGGER_NAME = "speedtronic"
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"

_console: Console | None = None


def run_console() -> Console:
    """The one stderr console that log records and the progress bar both print through."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(stderr=True, highlight=False)
    return _console


def stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class ScrubFilter(logging.Filter):
    """Replaces any known secret in a record's final message (args included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = scrub(record.getMessage())
        record.args = None
        return True


class _PlainFormatter(logging.Formatter):
    """The plain format with multi-line messages folded onto one line, so one event is one line."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", " ").replace("\n", " ⏎ ")


def setup_logging(level: str = "info", file: str | None = None) -> logging.Logger:
    quiet_third_party()  # torch's lines that say nothing to act on (engine/quiet.py)
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level.upper())
    logger.propagate = False
    for handler in list(logger.handlers):
        if getattr(handler, "_speedtronic", False):
            logger.removeHandler(handler)
            handler.close()
    console_handler: logging.Handler
    if stderr_is_terminal():
        from rich.logging import RichHandler

        console_handler = RichHandler(
            console=run_console(), show_path=False, show_time=False, markup=False, rich_tracebacks=False
        )
    else:
        console_handler = logging.StreamHandler(sys.stderr)
        console_handler.setFormatter(_PlainFormatter(PLAIN_FORMAT, DATE_FORMAT))
    handlers: list[logging.Handler] = [console_handler]
    if file:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(file, encoding="utf-8")
        file_handler.setFormatter(_PlainFormatter(PLAIN_FORMAT, DATE_FORMAT))
        handlers.append(file_handler)
    for handler in handlers:
        handler.addFilter(ScrubFilter())
        handler._speedtronic = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return logger
