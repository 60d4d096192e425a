"""A DiLoCo worker's delta numbers: the next sequence number it gives a delta, and the master's
high-water mark of this node's deltas (the highest number it processed, from head.json).

Each delta's file name carries its number (codec.delta_name), so re-sending an item (a retry, a replay
after resume) yields the same name and the master processes it once. Numbers at or below the mark would
be refused, so the numbering never falls behind it. No I/O here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Head

logger = logging.getLogger("speedtronic.diloco")


class Numbering:
    def __init__(self, node: str) -> None:
        self.node = node
        self.seq: int | None = None  # the next delta's number (None: not numbered yet; set at attach)
        self.hwm = -1  # the highest number of this node's the master has processed

    def load(self, seq: int | None) -> None:
        """The next number a checkpoint saved (None: not numbered yet)."""
        self.seq = int(seq) if seq is not None else None

    def forget(self) -> None:
        self.seq = None

    def head_mark(self, head: Head, default: int) -> int:
        return int((head.get("hwm") or {}).get(self.node, default))

    def overtaken(self) -> bool:
        """The master processed numbers this node has not given yet (a later run of it sent them)."""
        return self.seq is not None and self.hwm >= self.seq

    def start(self, own: Iterable[str]) -> None:
        """Number after the master's mark and after our own unprocessed files (`own`: their names), but
        never after a file far beyond the mark: that is garbage someone dropped, not ours."""
        if self.seq is None:
            seqs = [codec.parse_delta_name(n)[1] for n in own]
            self.seq = max([self.hwm, *(s for s in seqs if s <= self.hwm + codec.SEQ_WINDOW)]) + 1

    def join(self, head: Head) -> None:
        """At attach: the head's mark of this node's deltas (none: -1)."""
        self.hwm = self.head_mark(head, -1)

    def observe(self, head: Head) -> None:
        """A newer head: its mark of this node's deltas."""
        self.hwm = self.head_mark(head, self.hwm)

    def catch_up(self) -> None:
        """Number on from the master's mark when it is at or past the next number."""
        if self.overtaken():
            logger.warning(
                "DiLoCo node %s: the master is at #%d; numbering on from there", self.node, self.hwm
            )
            self.seq = self.hwm + 1

    def take(self) -> int:
        """The next delta's number (numbered from then on after it)."""
        assert self.seq is not None
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def processed(self, names: Iterable[str]) -> list[str]:
        """The delta files among `names` the master has processed (sorted)."""
        return sorted(n for n in names if codec.parse_delta_name(n)[1] <= self.hwm)
