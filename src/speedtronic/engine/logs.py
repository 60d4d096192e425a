"""Logging set-up for runs: one "speedtronic" logger, secrets scrubbed from every record.

The terminal gets rich-formatted lines on stderr; `logging.file` adds a plain file handler.
"""

from __future__ import annotations

import logging
from pathlib import Path

from speedtronic.secrets import scrub

LOGGER_NAME = "speedtronic"


class ScrubFilter(logging.Filter):
    """Replaces any known secret in a record's final message (args included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = scrub(record.getMessage())
        record.args = None
        return True


def setup_logging(level: str = "info", file: str | None = None) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level.upper())
    logger.propagate = False
    for handler in list(logger.handlers):
        if getattr(handler, "_speedtronic", False):
            logger.removeHandler(handler)
            handler.close()
    from rich.console import Console
    from rich.logging import RichHandler

    console_handler = RichHandler(
        console=Console(stderr=True), show_path=False, show_time=False, markup=False, rich_tracebacks=False
    )
    handlers: list[logging.Handler] = [console_handler]
    if file:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
    for handler in handlers:
        handler.addFilter(ScrubFilter())
        handler._speedtronic = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return logger
