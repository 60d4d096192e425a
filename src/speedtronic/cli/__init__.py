"""The `speedtronic` command suite (Typer). One module per command group; heavy imports live inside
command bodies so `speedtronic --help` stays fast and never imports torch.

Exit codes: 0 ok · 1 runtime failure · 2 usage or config error · 130 interrupted.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, TextIO

from speedtronic.cli.app import build_app

__all__ = ["build_app", "main"]


class _ScrubbedStream:
    """A text stream that removes secrets from everything written through it.

    Click prints usage errors itself (e.g. "unexpected extra argument hf_…" after a mistyped --set),
    before our error handling runs, so the streams themselves must be scrubbed.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from speedtronic.secrets import scrub

        return self._stream.write(scrub(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: run the app, turning our errors into one line + exit code."""
    from speedtronic.errors import SpeedtronicError
    from speedtronic.secrets import scrub

    if not isinstance(sys.stderr, _ScrubbedStream):
        sys.stderr = _ScrubbedStream(sys.stderr)  # type: ignore[assignment]
    try:
        app = build_app()
        app(args=argv, prog_name="speedtronic")
    except SpeedtronicError as error:
        sys.stderr.write(scrub(f"error: {error}") + "\n")
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception:
        # An unexpected failure: show the traceback for the bug report, with any secret scrubbed.
        sys.stderr.write(scrub(traceback.format_exc()))
        sys.exit(1)
