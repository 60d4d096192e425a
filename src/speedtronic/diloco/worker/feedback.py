"""What a worker reads from the master's head: its fencing epoch (a head or global of a master that lost
the run is ignored) and the master's word on this node's own rejected deltas.

The master writes these facts (diloco/master/lease.py: the epoch; diloco/master/report.py: "rejections");
a worker only reads them, so they live on the worker's side and the worker never imports the master.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import shown_name
from speedtronic.diloco.documents import epoch_of

logger = logging.getLogger("speedtronic.diloco")


class EpochFence:
    """A worker's highest master epoch seen: a head or global from a lower one comes from a master that
    lost the run and is ignored (logged once per epoch)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.highest = 0
        self._said: set[int] = set()

    def admit(self, head: Any) -> bool:
        epoch = epoch_of(head)
        if epoch < self.highest:
            if epoch not in self._said:
                self._said.add(epoch)
                logger.warning(
                    "DiLoCo node %s: ignoring a head of master epoch %d (epoch %d has taken the run over): "
                    "a master that lost the run",
                    self.node,
                    epoch,
                    self.highest,
                )
            return False
        if epoch > self.highest and self.highest:
            logger.info("DiLoCo node %s: master epoch %d has taken the run over", self.node, epoch)
        self.highest = epoch
        return True

    def check(self, head: Any, decoded: codec.Decoded) -> None:
        """A global from a lower epoch than its head or than any seen: rejected."""
        epoch = decoded.int("epoch", 0)
        if not self.admit(head) or epoch < epoch_of(head):
            raise codec.Rejected(f"a global of master epoch {epoch}, older than epoch {self.highest}")


def own_rejections(head: Any, node: str, uploaded: list[str], seen: dict[str, str]) -> list[tuple[str, str]]:
    """The worker's side: the files of head.json's "rejections" that this node uploaded itself and
    that are new to `seen` (which is updated); files others planted under its name do not count."""
    entry = (head.get("rejections") or {}).get(node)
    recent = entry.get("recent") if isinstance(entry, dict) else None
    mine = set(uploaded)
    new: list[tuple[str, str]] = []
    for item in recent if isinstance(recent, list) else []:
        if isinstance(item, list) and len(item) == 2 and item[0] in mine and item[0] not in seen:
            seen[item[0]] = shown_name(str(item[1]), 500)  # logged and raised: no control characters
            new.append((item[0], seen[item[0]]))
    return new


STALE_RE = re.compile(r"stale: built on outer step (-?\d+),")  # master/checks.py StalenessCheck's reason


def rejection_streak(rejected: dict[str, str], hwm: int, sent_here: set[str] | None = None) -> list[str]:
    """Own rejected files since the node's last applied delta (the high-water mark is its number), of
    those this process sent (`sent_here`; None: all): a restart is the fix the error asks for, and
    a restarted worker that counted its previous life's rejections stopped again before sending
    anything (a Hub soak's joiner: 5 lives in a row). Of the ones rejected as stale, one per global
    they were built on: a worker that trained through a master's failover uploads a backlog built on
    one old global, which the next master rejects as stale all together — counted one by one, that
    stopped seven workers of a 30-minute soak at once — while a worker too slow for the run is stale
    on a new global each time, and still stops."""
    streak: list[str] = []
    bases: set[str] = set()
    mine = [n for n in rejected if sent_here is None or n in sent_here]
    for name in sorted(n for n in mine if codec.parse_delta_name(n)[1] > hwm):
        stale = STALE_RE.match(rejected[name])
        if stale is not None:
            if stale[1] in bases:
                continue
            bases.add(stale[1])
        streak.append(name)
    return streak
