"""One background thread that a DiLoCo worker part owns for one job (uploading deltas, polling globals),
and the `Fault` where such threads leave the error that the training thread raises.

The coordinator keeps one `Background` per job for its whole life: `stop` asks the thread to end (an
uploader first flushes its queue, up to a deadline), `join` waits for it, and `ensure` (the next
`train()` attaching again) resumes the thread if it is still running, for example an upload that
outlived the shutdown timeout, instead of starting a second one beside it. Two uploaders on one queue
would both upload its head and both pop an item for it, so one delta would never be sent.

The thread decides to end only while holding its owner's condition (in `wait_for_work` or
`sleep`), and `ensure` decides to resume it under the same condition. So a thread is either resumed
before it decides, or it has decided and touches nothing shared any more; never both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from speedtronic.errors import SpeedtronicError

if TYPE_CHECKING:
    from speedtronic.diloco.identity import NodeLease


class Fault:
    """The error a worker thread (uploader, poller) or a rule recorded, raised on the training thread:
    a thread cannot stop training itself, so it leaves the reason here and ends."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def set(self, error: BaseException) -> None:
        self.error = error

    def raise_if_set(self) -> None:
        if self.error is not None:
            raise SpeedtronicError(f"DiLoCo: {self.error}") from None

    def check(self, lease: NodeLease | None) -> None:
        """Raise what a thread recorded, or the lost lease on this node id (recorded first)."""
        if self.error is None and lease is not None:
            self.error = lease.error
        self.raise_if_set()


class Background:
    def __init__(self, name: str, target: Callable[[], None], cond: threading.Condition) -> None:
        self.name = name
        self._target = target
        self._cond = cond
        self._thread: threading.Thread | None = None
        # All three are read and written under `cond`.
        self.live = False  # a thread runs and has not decided to end
        self.stopping = False
        self.deadline: float | None = None  # after a stop: work not begun by then is left undone

    def ensure(self) -> None:
        """Resume the thread if it still runs, otherwise start it; never a second one beside it."""
        with self._cond:
            self.stopping, self.deadline = False, None
            if self.live:
                return
            ended = self._thread
        if ended is not None:
            ended.join()  # it has decided to end and touches nothing shared: it is only returning
        with self._cond:
            self.live = True
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, deadline: float | None = None) -> None:
        """Ask the thread to end: after its pending work, or once `deadline` (monotonic) has passed."""
        with self._cond:
            self.stopping, self.deadline = True, deadline
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the thread to end; True when none runs. A thread still
        running stays this object's: a later `join` waits for it again and `ensure` resumes it."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def wait_for_work(self, has_work: Callable[[], bool]) -> bool:
        """For the thread: block until `has_work()` (checked under the condition); False, and the thread
        counts as ended, once it was asked to stop and no work is left or the deadline has passed."""
        with self._cond:
            while not has_work() and not self.stopping:
                self._cond.wait(1.0)
            late = self.stopping and self.deadline is not None and time.monotonic() > self.deadline
            if not has_work() or late:
                self.live = False
                return False
            return True

    def capped(self, seconds: float) -> float:
        """`seconds`, cut to what is left before the deadline once the thread was asked to stop."""
        with self._cond:
            if self.stopping and self.deadline is not None:
                return max(0.0, min(seconds, self.deadline - time.monotonic()))
        return seconds

    def sleep(self, seconds: float, sooner: Callable[[], float | None] | None = None) -> bool:
        """For the thread: wait `seconds`; False, and the thread counts as ended, once asked to stop.
        `sooner()` (called under the condition at every wake-up, so a notify re-reads it) may shorten
        the wait to fewer seconds from its start: the poller's faster cadence while training waits."""
        start = time.monotonic()
        with self._cond:
            while not self.stopping:
                shorter = sooner() if sooner is not None else None
                limit = seconds if shorter is None else min(seconds, shorter)
                left = start + limit - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self.stopping:
                self.live = False
                return False
            return True

    def _run(self) -> None:
        try:
            self._target()
        finally:
            # A target that returns without deciding in wait_for_work/sleep has recorded a fatal error,
            # which stops training before anything could resume this thread.
            with self._cond:
                self.live = False
