"""A slow worker takes the globals that come between its own syncs at its next sync, not as they come.

A worker installs a newer global as it arrives, keeping the progress it has not sent yet (θ ← G − u,
coordinator.py). For a worker in step with the master that is one global a sync, the one answering its
delta. A worker much slower than the master's rounds (a GPU four times slower: a delta every four
rounds) took three more in each of its spans, and its delta was then its progress over four globals,
labelled as built on the last of them, so it weighed as a fresh one. Two such workers beside two fast
ones raised the loss in every round that held their deltas (bench/uneven.py: 2.522 against 2.408 without
them, seed 0); in one process (bench/uneven_rules.py, four seeds) installing every global cost +0.016
against the fast pair, and training the span on one global, its delta weighed by its staleness as
shipped (1/(1+k)), -0.005.

So a worker whose own interval between syncs is over `distributed.rounds.slow_factor` times the
master's usual interval between globals (the master's rule for not waiting on it, master/pace.py; both
medians of the last KEPT intervals, at least MIN_SYNCS of its own) holds a global that arrives between
its syncs (`defer`) and hands the newest held one back right after its next delta is queued (`release`):
installed then, or with `overlap_steps` τ > 0 held by the overlap until the due step, where the global
answering that delta is installed as always (overlap.py). Either way the delta is labelled with the
global it was built on. Never deferred: a global at or past the run's
end, a Streaming DiLoCo run's (fragments sync in turn), a worker with `slow_factor: null`. State: the
worker's own sync times and the held global, in memory only (a restart installs the head it finds).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from speedtronic.diloco.worker.head_pace import KEPT, HeadPace
from speedtronic.diloco.worker.overlap import Global

logger = logging.getLogger("speedtronic.diloco")
MIN_SYNCS = 3  # intervals of its own before a worker calls itself slow (the master's pace.py needs 3 too)


class Deferral:
    """A worker's own sync times and the global it holds for its next sync."""

    def __init__(
        self, node: str, factor: float | None, heads: HeadPace, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.node = node
        self.factor = factor  # distributed.rounds.slow_factor; None: never defer
        self.heads = heads
        self._clock = clock
        self._syncs: deque[float] = deque(maxlen=KEPT + 1)
        self.held: Global | None = None
        self.deferred = 0  # globals held instead of installed, for the summary
        self._said = False

    def synced(self) -> None:
        """This worker queued a delta now."""
        self._syncs.append(self._clock())

    def slow(self) -> tuple[float, float] | None:
        """(own median interval, the master's) when this worker is over `factor` times slower, else None."""
        usual = self.heads.usual()
        if self.factor is None or usual is None or len(self._syncs) <= MIN_SYNCS:
            return None
        own = statistics.median(b - a for a, b in itertools.pairwise(self._syncs))
        return (own, usual) if own > self.factor * usual else None

    def defer(self, g: Global, end: int | None) -> bool:
        """Hold `g` for the next sync instead of installing it now; False: install it now."""
        if isinstance(end, int) and g.outer_step >= end:
            return False
        pace = self.slow()
        if pace is None:
            return False
        if not self._said:
            self._said = True
            logger.info(
                "DiLoCo node %s syncs every %.1fs, over %g × the master's %.1fs between globals: it takes "
                "the globals that come between its syncs at its next sync (each delta built on one global)",
                self.node,
                pace[0],
                self.factor,
                pace[1],
            )
        self.held = g
        self.deferred += 1
        return True

    def release(self) -> Global | None:
        """The global held for this sync, if any (it leaves the hold)."""
        g, self.held = self.held, None
        return g
