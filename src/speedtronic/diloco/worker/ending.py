"""Where a DiLoCo worker stops: the run's end (manifest `run.outer_steps`) and this process's own.

Once this node has installed a global at or past the run's end (and newer than the one it joined with,
so a late joiner's work still counts), its next sync point is its last: that delta is marked final and
training stops there as a normal end. Otherwise its last delta is the last sync point at or before the
last step the trainer plans. No I/O here.
"""

from __future__ import annotations

from typing import Any


class Ending:
    def __init__(self, manifest: dict[str, Any]) -> None:
        self.end = (manifest.get("run") or {}).get("outer_steps")  # the run's last outer step, if known
        self.final_step: int | None = None  # this node's last sync point: its delta there says "final"
        self.joined_at: int | None = None  # the outer step of the global this process started from
        self.stop_step = 0  # the last step this process trains (the trainer's plan says, at attach)
        self.ended_early = False  # stopped at the run's end before its own last step

    def plan(self, stop_step: int, points: list[int]) -> None:
        """At attach: the trainer's last step and this process's sync points up to it."""
        self.stop_step = stop_step
        self.final_step = points[-1] if points else None

    def joined(self, outer_step: int) -> None:
        self.joined_at = outer_step

    def reached(self, outer_step: int, step: int) -> bool:
        """True when the run's end has been reached since this node joined, before its own last step."""
        return (
            isinstance(self.end, int)
            and outer_step >= self.end
            and self.joined_at is not None
            and outer_step > self.joined_at
            and step < self.stop_step
        )

    def last_delta_at(self, step: int) -> None:
        """The delta of this sync point is this node's last: the master stops waiting for it."""
        self.final_step = step

    def is_final(self, local_step: int) -> bool:
        return local_step == self.final_step

    def stopped_early(self) -> None:
        self.ended_early = True

    def describe(self) -> str:
        return str(self.end) if self.end is not None else "?"
