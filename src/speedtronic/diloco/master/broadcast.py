"""What the master sends as each global: the full fp32 file, and with `distributed.sync.global_codec: int8`
its int8 update from the global published one outer step before (diloco/global_update.py explains the
format and why the published global is the rebuilt one, not the master's own weights).

`Broadcast` owns the last global the bus holds from this master (the base of the next update). It is
set only after a publish succeeded (`published`), so a failed publish is encoded again from the same base;
it is forgotten when the master's weights are replaced from outside the outer step (adopting the bus's
global, restoring the best one at the end), which makes the next publish a full one. A republish of
the same outer step (the final status, a head that tells rejected nodes why) sends the same files again.
"""

from __future__ import annotations

import logging

import torch

from speedtronic.diloco import global_update
from speedtronic.diloco.global_update import Encoded, Published

logger = logging.getLogger("speedtronic.diloco")


class Broadcast:
    def __init__(self, global_codec: str, bus_supports_updates: bool, url: str) -> None:
        self.updates = global_codec == "int8" and bus_supports_updates
        if global_codec == "int8" and not bus_supports_updates:
            logger.warning(
                "DiLoCo master: %s does not store global updates; distributed.sync.global_codec int8 "
                "falls back to full fp32 globals",
                url,
            )
        self._base: Published | None = None  # the newest global this master published
        self._last: tuple[tuple[int, str, bool], Encoded] | None = None  # its files, for a republish

    def encode(
        self, weights: dict[str, torch.Tensor], step: int, meta: dict[str, str], exact: bool
    ) -> Encoded:
        """The files for global `step`. `exact`: the full weights as they are, no update (the run's
        final global is exactly the weights its validation loss was measured on)."""
        if not self.updates:  # full globals only: nothing kept (a copy of the model each)
            return global_update.encode(weights, step, meta, None, keep=False)
        key = (step, meta.get("epoch", ""), exact)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        encoded = global_update.encode(weights, step, meta, None if exact else self._base, keep=not exact)
        self._last = (key, encoded)
        return encoded

    def published(self, encoded: Encoded) -> None:
        """The bus holds `encoded` now: the next update starts from it."""
        self._base = encoded.published

    def forget(self) -> None:
        """The weights changed outside the outer step: the next publish is a full one."""
        self._base, self._last = None, None
