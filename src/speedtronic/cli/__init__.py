"""The `speedtronic` command suite (Typer). One module per command group; heavy imports live inside
command bodies so `speedtronic --help` stays fast and never imports torch.

Exit codes: 0 ok · 1 runtime failure · 2 usage or config error · 130 interrupted.
"""

from __future__ import annotations

import contextlib
import os
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
    """Entry point of the console script: run the app, turning every failure into one line on stderr
    and the documented exit code (1 runtime, 2 usage or config, 130 interrupted); with `--json`, stdout
    then ends with one JSON object `{"error", "exit_code", "field"?}`."""
    from speedtronic.engine.quiet import quiet_third_party

    quiet_third_party()  # every command: torch's lines that say nothing to act on (engine/quiet.py)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        try:
            _main(argv)
        except SystemExit as exit_:
            # An interrupt that cut through torch's import can leave CPython's "unhandled
            # KeyboardInterrupt" flag set (code torch runs through PyRun_String), and the interpreter
            # then kills itself with SIGINT on the way out: exit status -2, not the 130 just chosen.
            # The console script (argv None) leaves at once instead; nothing is left to finalize.
            if exit_.code == 130 and argv is None:
                _leave_now(130)
            raise
        return
    # A rank under torchrun. Gloo's worker threads can still hold tensors when the interpreter
    # finalizes, and tearing them down then aborts the process (SIGABRT, "terminate called without
    # an active exception") after a run that succeeded — seen intermittently with FSDP on CPU. The
    # process group is already destroyed by then, so this rank leaves without finalizing.
    try:
        _main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    _leave_now(code)


def _leave_now(code: int) -> None:
    """Flush everything this process wrote, then exit without interpreter finalization."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to flush
            stream.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> None:
    from speedtronic import interrupts
    from speedtronic.cli import common
    from speedtronic.errors import SpeedtronicError
    from speedtronic.secrets import scrub

    if not isinstance(sys.stderr, _ScrubbedStream):
        sys.stderr = _ScrubbedStream(sys.stderr)  # type: ignore[assignment]
    args = list(sys.argv[1:] if argv is None else argv)
    wants_json = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
    common.json_emitted = False
    # Usually installed already by speedtronic/__main__.py, before any heavy import (interrupts.py).
    owned = not interrupts.installed()
    interrupts.install()
    interrupted = interrupts.received  # every signal of this command, also one a graceful stop took

    def fail(message: str, code: int, field: str | None = None) -> None:
        message = _one_line(message)
        sys.stderr.write(scrub(f"error: {message}" if code != 130 else message) + "\n")
        if wants_json and not common.json_emitted:
            common.emit_json({"error": message, "exit_code": code, **({"field": field} if field else {})})
        sys.exit(code)

    ClickException, Abort = _click_exceptions()
    try:
        app = build_app()
        code = app(args=args, prog_name="speedtronic", standalone_mode=False)
    except SpeedtronicError as error:
        fail(str(error), error.exit_code, _field_of(error))
    except ClickException as error:  # a usage mistake Click found: one line, as every error is
        message = error.format_message()
        if not message:  # no arguments at all: Click has shown the help
            sys.exit(error.exit_code)
        fail(_usage_line(error, message), error.exit_code)
    except (KeyboardInterrupt, Abort):
        fail("interrupted", 130)
    except SystemExit:
        raise
    except Exception:
        if interrupted:  # an import cut short by the signal fails in odd ways; the cause was the signal
            fail("interrupted", 130)
        # An unexpected failure: show the traceback for the bug report, with any secret scrubbed.
        sys.stderr.write(scrub(traceback.format_exc()))
        error = sys.exc_info()[1]
        fail(f"unexpected {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}", 1)
    finally:
        if owned:
            interrupts.uninstall()
    if isinstance(code, int) and code:
        if code == 130 and interrupted:
            fail("interrupted", 130)
        if wants_json and not common.json_emitted:
            common.emit_json({"error": f"exit code {code}", "exit_code": code})
        sys.exit(code)


def _one_line(message: str) -> str:
    """An error as one line. An error raised in a DataLoader worker arrives wrapped in the worker's
    traceback ("Caught DataError in DataLoader worker process 0. Original Traceback …"): its last
    line is the error itself."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    if any(line.startswith("Original Traceback") for line in lines):
        last = lines[-1]
        head, _, rest = last.partition(": ")
        return rest if rest and "." in head and " " not in head else last
    return " ".join(lines)


def _click_exceptions() -> tuple[type[Exception], type[Exception]]:
    """(ClickException, Abort) of the Click that Typer runs on (recent Typer vendors its own)."""
    try:
        from typer._click.exceptions import ClickException
        from typer.exceptions import Abort
    except ImportError:
        from click.exceptions import Abort, ClickException
    return ClickException, Abort


_SECTIONS = (
    "run|model|data|optimizer|scheduler|precision|checkpoint|logging|distributed|shape_validation|compile"
)


def _field_of(error: BaseException) -> str | None:
    """The dotted config field an error names: its `field`, else the first `section.name:` in it."""
    import re

    field = getattr(error, "field", None)
    if field:
        return str(field)
    match = re.search(rf"(?:^|\s)((?:{_SECTIONS})(?:\.[A-Za-z0-9_]+)+)[:\s]", str(error))
    return match.group(1) if match else None


def _usage_line(error: Any, message: str) -> str:
    """Click's usage error as the one `error:` line the README promises (Click itself prints a usage
    block and a boxed message first): the message, and where the command's help is."""
    ctx = getattr(error, "ctx", None)
    path = getattr(ctx, "command_path", None) or "speedtronic"
    message = _one_line(message).rstrip(".")
    return f"{message} (see `{path} --help`)"
