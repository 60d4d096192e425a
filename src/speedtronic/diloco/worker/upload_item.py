"""One delta waiting in a DiLoCo worker's upload queue (diloco/worker/coordinator.py), and how two merge.

An item is the part of (anchor − θ) handed to the queue at one sync point, numbered by the node's
sequence; a failed upload that is confirmed absent from the bus, or an overflowing queue
(`delta_upload_overflow: coalesce`), folds an older item into a newer one, which then carries the
cumulative delta under the newer number. Only items of one Streaming DiLoCo fragment merge: each
carries that fragment's tensors alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Item:
    seq: int
    x: dict[str, torch.Tensor]
    base: int
    local_step: int
    tokens: int
    fragment: int = 0  # the Streaming DiLoCo fragment its tensors belong to (diloco/fragments.py)
    fragment_round: int = -1  # that fragment's round in the global it was built on
    in_flight: bool = False
    failed: bool = False
    encoded: tuple[bytes, dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    def merge(self, other: Item) -> None:
        """Fold `other` (the older one, of the same fragment) into this item: one cumulative delta."""
        assert other.fragment == self.fragment, "deltas of two fragments never merge"
        self.fragment_round = min(self.fragment_round, other.fragment_round)
        for n, t in other.x.items():
            self.x[n] = self.x[n] + t
        self.base = min(self.base, other.base)
        self.tokens += other.tokens
        self.encoded = None


def zeros(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in like.items()}
