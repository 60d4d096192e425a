"""Graceful stop on SIGINT/SIGTERM: the first signal asks the loop to finish its step, save and exit;
a second SIGINT interrupts at once (for when a save itself hangs)."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any


class GracefulStop:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        from speedtronic import interrupts

        interrupts.note(self.signal_name)  # retry loops in other threads give up (interrupts.stopping)

    def __enter__(self) -> GracefulStop:
        # Signal handlers can only be installed from the main thread (a Trainer in a thread just
        # does not get graceful stops).
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
            # A signal that reached the command line's handler during start-up and was swallowed on
            # the way here (speedtronic/interrupts.py) is not lost: the loop starts already stopping.
            from speedtronic import interrupts

            early = interrupts.take_pending()
            if early is not None:
                self.requested, self.signal_name = True, early
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
