"""The one place that turns SIGINT and SIGTERM into the documented exit (130, "interrupted") outside a
training loop, installed by the command line before anything heavy is imported.

Three failures this exists for:
- a KeyboardInterrupt raised while torch's modules are being imported (`import torch.distributed`
  runs Python callbacks from C++) aborts the process: "terminate called after throwing an instance
  of …", exit -6. While any `torch*` module is initializing, a signal is only *recorded*; a watcher
  thread re-delivers it (`_thread.interrupt_main`) the moment the import is done, at a safe point.
- a signal that lands during start-up and is swallowed on the way (a library's broad `except`) was
  lost: the run trained to the end and exited 0. Every signal is also recorded (`pending`), and the
  training loop's graceful stop (engine/signals.py) starts already stopping when one is pending.
- SIGTERM in the first second of start-up exited 143 with no output: the handlers are installed by
  `speedtronic/__main__.py` (the console script and `python -m speedtronic`) before the command suite,
  typer, rich or torch is imported.
A second SIGINT while one is deferred interrupts at once, whatever the cost (the user insists).

Threads see a signal too: `stopping()` is true (and `wait` returns at once) from the first SIGINT or
SIGTERM on, whoever handled it (this module, or a training loop's graceful stop: `note`). Retry loops
(speedtronic/retry.py and the DiLoCo bus's own loops) wait through `wait` and give up instead of
retrying once the process is stopping: a SIGTERM to a node whose bus refuses connections exits in
seconds, not after minutes of back-off (systemd SIGKILLs a unit 90 s after its SIGTERM).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

pending: list[str] = []  # names of the signals received and not yet acted on by a training loop
# Every signal received since install(), acted on or not: a graceful stop takes its signal from
# `pending`, and the command line still has to say "interrupted" when the run exits 130.
received: list[str] = []
_previous: dict[int, Any] = {}
_watcher: threading.Thread | None = None
_stopping = threading.Event()  # set by the first signal: the process is on its way out


def torch_importing() -> bool:
    """Whether a torch module is being imported right now (its spec says it is initializing)."""
    for name, module in list(sys.modules.items()):
        if (name == "torch" or name.startswith("torch.")) and getattr(
            getattr(module, "__spec__", None), "_initializing", False
        ):
            return True
    return False


def _redeliver_after_import() -> None:
    global _watcher
    while torch_importing():
        time.sleep(0.02)
    _watcher = None
    import _thread

    _thread.interrupt_main()  # runs the SIGINT handler below in the main thread, now at a safe point


def _handle(signum: int, frame: Any) -> None:
    global _watcher
    name = signal.Signals(signum).name
    deferred = _watcher is not None
    if name not in pending:
        pending.append(name)
    received.append(name)
    _stopping.set()
    if torch_importing() and not (deferred and signum == signal.SIGINT):
        if _watcher is None:
            _watcher = threading.Thread(
                target=_redeliver_after_import, name="interrupt-after-import", daemon=True
            )
            _watcher.start()
        return
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT and SIGTERM as above (from the main thread; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or _previous:
        return
    pending.clear()
    received.clear()
    _stopping.clear()
    for signum in (signal.SIGINT, signal.SIGTERM):
        _previous[signum] = signal.signal(signum, _handle)


def uninstall() -> None:
    for signum, handler in _previous.items():
        signal.signal(signum, handler)
    _previous.clear()


def installed() -> bool:
    return bool(_previous)


def take_pending() -> str | None:
    """The first signal received and not yet acted on (then forgotten), or None."""
    return pending.pop(0) if pending else None


def note(name: str) -> None:
    """A signal handled elsewhere (a training loop's graceful stop): the process is stopping too."""
    _stopping.set()


def stopping() -> bool:
    """Whether a SIGINT or SIGTERM arrived: retry loops stop retrying."""
    return _stopping.is_set()


def wait(seconds: float) -> bool:
    """Sleep up to `seconds`, cut short by a signal; True when the process is stopping."""
    return _stopping.wait(max(0.0, seconds))
