"""Which overdue nodes have left cleanly: the rounds stop waiting for a node that gave up its id.

A worker that stops cleanly (SIGINT, SIGTERM, the run's end for it) releases the lease on its node id
(diloco/identity.py) once nothing of it is still being uploaded. A round that waits for such a node
waits in vain: without this, for the grace its arrival history predicts, in every round until its
liveness window ran out (a soak's departing worker held two rounds 1.4 and 1.6 s each while the
seven others stood waiting for the global).

So when a node the open round waits for is overdue — later than its own median interval after its
last delta — the master reads the lease on its id (`Bus.lease_left`, one request, at most every
LOOK_S per node). No lease, or one that has expired, means nobody holds the id: the node has left (a
frozen one past its lease too), and it is not waited for until a new delta of it arrives. A bus that
cannot answer says nothing: the node is waited for as before. A killed node (kill -9) still holds its
lease until it lapses and is waited for by the rounds' rule; one restarted takes the lease again
before it can send anything.

Only a node this master has seen holding its lease can depart: its lease is read once when it is first
heard from (at most MEET_PER_POLL nodes a poll, so a takeover's first poll stays short), and a node
that holds none then (a client that writes deltas without one) is waited for by the rounds' rule
as before; it is looked at again every MEET_AGAIN_S. A hostile node can release its own lease to
not be waited for, which costs nobody anything; it cannot make an honest node's lease vanish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from speedtronic.errors import BusError

logger = logging.getLogger("speedtronic.diloco")

LOOK_S = 2.0  # how often one overdue node's lease is read while it holds its id
MEET_PER_POLL = 2  # newly heard nodes whose lease one poll reads
MEET_AGAIN_S = 60.0  # a node that held no lease when met is looked at again after this
MAX_LOOKED = 4096  # nodes remembered (a swarm's overdue nodes; the oldest are forgotten past this)


class Departures:
    """The overdue nodes that hold no lease on their id, until they are heard from again."""

    def __init__(self, read: Callable[[str], float | None], clock: Callable[[], float]) -> None:
        self.read, self.clock = read, clock
        self.holders: set[str] = set()  # nodes seen holding the lease on their id (only they depart)
        self._unheld: dict[str, float] = {}  # node -> when it was met without a lease
        # node -> (when its lease was read, the arrival it was overdue after, whether nobody held it)
        self._looked: dict[str, tuple[float, float, bool]] = {}

    def met(self, nodes: set[str]) -> None:
        """Nodes heard from at this poll: read the lease of up to MEET_PER_POLL not yet seen holding one."""
        now, read = self.clock(), 0
        for node in sorted(nodes - self.holders):
            if read >= MEET_PER_POLL or len(self.holders) >= MAX_LOOKED:
                return
            if now - self._unheld.get(node, -MEET_AGAIN_S) < MEET_AGAIN_S:
                continue
            read += 1
            if self._nobody_holds(node, unknown=True):
                self._unheld[node] = now
                while len(self._unheld) > MAX_LOOKED:
                    self._unheld.pop(next(iter(self._unheld)))
            else:
                self.holders.add(node)
                self._unheld.pop(node, None)

    def gone(self, overdue: dict[str, float]) -> set[str]:
        """Of `overdue` ({node: the time its latest delta was seen}), those that hold no lease."""
        now = self.clock()
        left: set[str] = set()
        for node, heard in sorted(overdue.items()):
            if node not in self.holders:
                continue
            looked = self._looked.get(node)
            if looked is not None and looked[1] == heard and (looked[2] or now - looked[0] < LOOK_S):
                gone = looked[2]  # a departure stands until the node sends again
            else:
                gone = self._nobody_holds(node)
                if gone and (looked is None or not looked[2] or looked[1] != heard):
                    logger.info(
                        "DiLoCo master: %s holds no lease on its id (it stopped cleanly, or froze past "
                        "its lease): rounds do not wait for it until it sends again",
                        node,
                    )
                self._remember(node, (now, heard, gone))
            if gone:
                left.add(node)
        return left

    def _nobody_holds(self, node: str, unknown: bool = False) -> bool:
        """Whether nobody holds `node`'s id; `unknown` when the bus cannot say (an overdue node: held,
        so the rounds' rule stands; one being met: not held, so it is met again later)."""
        try:
            seconds = self.read(node)
        except (BusError, OSError) as error:
            logger.debug("DiLoCo master: could not read %s's lease (%s)", node, error)
            return unknown
        return seconds is None or seconds <= 0

    def _remember(self, node: str, entry: tuple[float, float, bool]) -> None:
        self._looked.pop(node, None)
        self._looked[node] = entry
        while len(self._looked) > MAX_LOOKED:
            self._looked.pop(next(iter(self._looked)))
