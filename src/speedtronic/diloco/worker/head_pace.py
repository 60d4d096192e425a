"""How often the master publishes, as one worker sees it: a wait for a global ends early once the
master has been quiet for much longer than its usual round.

A worker that synced waits for the global answering its delta (`distributed.worker.global_wait`,
diloco/worker/overlap.py and coordinator.py), then trains on without it ("late") and installs it when
it comes. When the master is down, failing over or fenced, or the bus is out, nothing comes for the
length of the fault, and every worker spent its whole `global_wait` idle at each such fault before
training on: in the 30-minute S3 chaos soak (docs/guides/chaos.md) 285 waits of 4 s, about 8% of the
swarm's worker-seconds. The wait is worth its seconds only while a global can still come.

The poller records the moment each new head arrives (`saw`); `stalled` says whether the last
one is older than QUIET_FACTOR times the median of the last KEPT intervals between heads. In the
fault-free twin of that soak (691 rounds, median 2.45 s) 3 intervals in 675 were longer than 1.5 times
the median of the 16 before them, none longer than twice it; during faults, 33 were. Too few heads seen
(MIN_INTERVALS) and there is no rule: the wait is `global_wait`, as before. A wrong call costs one
round in the late mode (the global installs when it comes, the next delta is held until it does), not
a lost delta.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

QUIET_FACTOR = 1.5
KEPT = 16
MIN_INTERVALS = 4


class HeadPace:
    """When new heads arrived (written by the poller's thread, read by the training thread's waits)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None  # the last head's (epoch, outer step)
        self._last = 0.0  # when it arrived
        self._intervals: deque[float] = deque(maxlen=KEPT)

    def saw(self, epoch: int, outer_step: int) -> None:
        """A head was read: a master published since the last one seen when its (epoch, outer step)
        differs (a takeover may publish a lower outer step under a higher epoch)."""
        now = self._clock()
        with self._lock:
            if (epoch, outer_step) == self._seen:
                return
            if self._seen is not None:
                self._intervals.append(now - self._last)
            self._seen, self._last = (epoch, outer_step), now

    def usual(self) -> float | None:
        """The median of the last KEPT intervals between new heads; None before MIN_INTERVALS."""
        with self._lock:
            if len(self._intervals) < MIN_INTERVALS:
                return None
            return statistics.median(self._intervals)

    def stalled(self) -> str | None:
        """Why no global is coming ("no new global for 4.1s, over 1.5 × the master's usual 2.5s"), or None while the
        master's quiet is within its usual rounds (or too few rounds were seen to tell)."""
        with self._lock:
            if self._seen is None or len(self._intervals) < MIN_INTERVALS:
                return None
            usual = statistics.median(self._intervals)
            quiet = self._clock() - self._last
        if quiet <= QUIET_FACTOR * usual:
            return None
        return f"no new global for {quiet:.1f}s, over {QUIET_FACTOR:g} × the master's usual {usual:.1f}s"
