"""The master's side of Streaming DiLoCo (`distributed.sync.fragments` P > 1; the partition and schedule are
in diloco/fragments.py): each fragment's round count, the deltas a round holds back for their peers,
and one outer step per fragment present in a round.

A round's deltas are grouped by fragment; each group is aggregated on its own and the outer optimizer
steps only that fragment's tensors, with its momentum buffers and its own round count. With P = 1
there is one fragment, the whole model, and its round is the outer step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.diloco import fragments
from speedtronic.diloco.bus.base import DeltaRef, Head
from speedtronic.diloco.outer import OuterOptimizer, aggregate, scaled

if TYPE_CHECKING:
    from speedtronic.diloco.master.checks import Delta

logger = logging.getLogger("speedtronic.diloco")


class FragmentState:
    """Each fragment's round, and the bytes of deltas held back for the next round."""

    def __init__(self, plan: fragments.Plan) -> None:
        self.plan = plan
        self.rounds = [0] * plan.count
        self._held: dict[str, bytes] = {}  # "id@etag" -> a delta held back for its peers
        self._read: dict[str, bytes] = {}  # what this round read

    @property
    def count(self) -> int:
        return self.plan.count

    # -- reading ----------------------------------------------------------------------------------------
    def held(self, ref: DeltaRef) -> bytes | None:
        """A delta's bytes when a previous round read and held it back (not read twice)."""
        return self._held.pop(f"{ref.id}@{ref.etag}", None)

    def note_read(self, ref: DeltaRef, data: bytes) -> None:
        self._read[f"{ref.id}@{ref.etag}"] = data

    def hold_back(self, deltas: list[Delta]) -> list[str]:
        """Ids of the accepted deltas this round leaves pending: with P > 1 and deltas of several fragments
        (nodes out of phase by a sync or more), the round is about one fragment — the one whose deltas
        were made earliest (smallest local step; ties: more deltas, then the lower fragment) — so the
        laggard's delta is applied now and the others wait for their peers' delta of the same fragment:
        the phases realign and each fragment is averaged over the nodes instead of taken from one. A held
        delta stays on the bus, unprocessed (its node's high-water mark does not move); its bytes are
        kept for the next round. Deltas are taken in each node's order, so none can be skipped."""
        read, self._read, self._held = self._read, {}, {}  # bounded: one round's
        if self.count <= 1:
            return []
        groups: dict[int, list[Delta]] = {}
        for delta in deltas:
            groups.setdefault(delta.fragment(self.count), []).append(delta)
        if len(groups) <= 1:
            return []

        def earliest(p: int) -> tuple[int, int, int]:
            steps = [d.int("local_step", 0) for d in groups[p]]
            return (min(steps), -len(groups[p]), p)

        chosen = min(groups, key=earliest)
        held = [d for p, ds in groups.items() if p != chosen for d in ds]
        for delta in held:
            key = f"{delta.ref.id}@{delta.ref.etag}"
            if key in read:
                self._held[key] = read[key]
        logger.info(
            "DiLoCo master: round on fragment %d; %s wait for their peers' delta of the same fragment",
            chosen,
            ", ".join(sorted(d.id for d in held)),
        )
        return [d.id for d in held]

    # -- stepping --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        outer: OuterOptimizer,
        live: Iterable[tuple[dict[str, torch.Tensor], float, int]],
        method: str,
        outer_step: int,
        spans: Iterable[tuple[int, float]] = (),
        plain: bool = False,
        fresh: Mapping[int, float] | None = None,
    ) -> list[int]:
        """One outer step per fragment present in the round's live (Δ, weight, fragment) items; the
        fragments stepped, in order. `spans`: the live deltas' (sync points folded, weight), for the
        momentum's share of a plain run's step (outer.momentum_feed); fragments feed it whole.
        `plain`: a plain run's step without the momentum (outer.OuterOptimizer.step). `fresh`: each
        fragment's step scale (pipeline.freshness; absent: 1), applied to Δ̄ before the step."""
        live, fresh = list(live), fresh or {}
        if self.count <= 1:
            mean = scaled(aggregate([(t, w) for t, w, _ in live], method), fresh.get(0, 1.0))
            outer.step(mean, outer_step, spans=spans, plain=plain)
            self.rounds[0] = outer_step + 1
            return [0]
        stepped = []
        for p in sorted({f for _, _, f in live}):
            group = [(t, w) for t, w, f in live if f == p]
            mean = scaled(aggregate(group, method), fresh.get(p, 1.0))
            outer.step(mean, self.rounds[p], view=self.plan.viewer(p))
            self.rounds[p] += 1
            stepped.append(p)
        return stepped

    def snapshot(self) -> list[int]:
        """Each fragment's round, to go back to when an outer step is refused (core.py)."""
        return list(self.rounds)

    def restore(self, rounds: list[int]) -> None:
        self.rounds = list(rounds)

    def advance_all(self) -> None:
        """Every fragment moved (the final pick's jump back): a worker still running installs all of it."""
        self.rounds = [r + 1 for r in self.rounds]

    # -- head and state ------------------------------------------------------------------------------
    def adopt(self, head: Head) -> None:
        self.rounds = fragments.head_rounds(head, self.count) or self.rounds

    def head_entry(self) -> dict[str, Any]:
        """What head.json says about fragments (nothing for P=1, whose heads stay as they were)."""
        if self.count <= 1:
            return {}
        return {"fragments": {"count": self.count, "rounds": list(self.rounds)}}

    def to_json(self) -> str:
        return json.dumps(self.rounds)

    def load(self, raw: str) -> None:
        rounds = json.loads(raw)
        if isinstance(rounds, list) and len(rounds) == len(self.rounds):
            self.rounds = [int(r) for r in rounds]
