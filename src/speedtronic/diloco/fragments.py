"""Streaming DiLoCo's fragments: which parameters sync together, and when (`distributed.sync.fragments`).

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication" (arXiv:2501.18512): instead
of sending the whole pseudo-gradient every H inner steps, split the model into P fragments and sync
fragment p at inner steps where step % H == p·H // P. Each fragment still syncs once per H steps, but
the syncs are staggered by H/P, so one upload is 1/P of the model: the peak bandwidth falls by P at
the same total bytes.

The partition is a pure function of the parameters' names and shapes, so the master and every worker
derive the same one without talking: names in natural order ("blocks.2" before "blocks.10", so a
transformer's layers stay contiguous), cut into P contiguous groups whose element counts are as
equal as the order allows (every group at least one tensor). Its digest is recorded in the manifest
(run.fragments) and a node whose partition differs is refused (`check`).

Or, with `distributed.sync.fragment_layout` "elements", every fragment holds a share of every tensor:
fragment p is elements p, p+P, p+2P, … of each tensor (flattened). A fragment then touches every layer
at every sync, so no layer waits P−1 syncs for its peers' progress; on the bench's corpora that is the
split whose gap closed stays nearest plain DiLoCo's (bench/diloco.py --fragment-layout). A delta then
carries, under each parameter's name, the 1-D tensor of its fragment's elements, and `part` gives every
fragment's share of a full-shaped dict as strided views (writing one writes the tensor).

With P = 1 everything here reduces to the plain DiLoCo schedule (outer.sync_steps / is_sync_step):
one fragment, the whole model, the same steps — bitwise today's behaviour.

The master's side of a round (master/fragments.py): a round's deltas are grouped by fragment; each
group is aggregated on its own and the outer optimizer steps only that fragment's tensors, with its
momentum buffers and its own round count (the momentum warm-up's clock). Staleness is counted per
fragment: how many rounds *that fragment* took since the delta's base (a delta of fragment 0 is not
stale because fragment 1 moved meanwhile). Never imports anything that does I/O.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speedtronic.diloco import codec
from speedtronic.diloco.outer import is_sync_step, sync_steps
from speedtronic.errors import ConfigError

logger = logging.getLogger("speedtronic.diloco")

LAYOUTS = ("layers", "elements")


def _natural(name: str) -> list[Any]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part]


def _numel(spec: codec.ParamSpec) -> int:
    out = 1
    for d in spec.shape:
        out *= d
    return out


def partition(specs: dict[str, codec.ParamSpec], count: int) -> list[list[str]]:
    """`count` contiguous groups of parameter names (natural order), balanced by element count."""
    names = sorted(specs, key=_natural)
    if count < 1 or count > len(names):
        raise ConfigError(
            f"distributed.sync.fragments is {count}, but the model has {len(names)} parameter tensors; use "
            f"1 to {len(names)}"
        )
    sizes = [_numel(specs[n]) for n in names]
    total = sum(sizes) or 1
    groups: list[list[str]] = [[]]
    acc = 0  # elements in the groups closed so far plus the open one
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        open_ = groups[-1]
        groups_left = count - len(groups)  # groups still to open after the current one
        names_left = len(names) - i  # this one included
        if open_ and groups_left > 0:
            target = total * len(groups) / count
            # Close the open group before `name` when adding it would overshoot the target by more
            # than stopping short does, or when the names left are just enough for the groups left.
            if names_left <= groups_left or abs(acc - target) <= abs(acc + size - target):
                groups.append([])
        groups[-1].append(name)
        acc += size
    return groups


def digest(groups: Sequence[Sequence[str]]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps([list(g) for g in groups]).encode()).hexdigest()


def offsets(inner_steps: int, count: int) -> list[int]:
    """Fragment p syncs at inner steps s with s % inner_steps == offsets[p]."""
    return [p * inner_steps // count for p in range(count)]


def sync_points(total: int, inner_steps: int, count: int, ramp: bool) -> list[int]:
    """Every inner step (1-based, up to `total`) at which some fragment syncs, in order."""
    if count <= 1:
        return sync_steps(total, inner_steps, ramp)
    points = []
    for offset in offsets(inner_steps, count):
        points.extend(range(offset or inner_steps, total + 1, inner_steps))
    return sorted(points)


def fragment_at(step: int, inner_steps: int, count: int, ramp: bool) -> int | None:
    """The fragment that syncs after inner step `step`, or None."""
    if count <= 1:
        return 0 if is_sync_step(step, inner_steps, ramp) else None
    offset = step % inner_steps
    found = offsets(inner_steps, count)
    return found.index(offset) if offset in found else None


class Plan:
    """One run's fragments: the name groups (layout "layers") or element shares ("elements") and the
    schedule."""

    def __init__(
        self,
        specs: dict[str, codec.ParamSpec],
        count: int,
        inner_steps: int,
        ramp: bool,
        layout: str = "layers",
    ) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(
                f"distributed.sync.fragment_layout {layout!r} is not one of {', '.join(LAYOUTS)}"
            )
        self.count = count
        self.inner_steps = inner_steps
        self.ramp = ramp
        self.layout = layout if count > 1 else "layers"
        if self.layout == "elements":
            names = sorted(specs, key=_natural)
            smallest = min(names, key=lambda n: _numel(specs[n]))
            if _numel(specs[smallest]) < count:
                raise ConfigError(
                    f"distributed.sync.fragments is {count}, but parameter {smallest} has only "
                    f"{_numel(specs[smallest])} elements: with fragment_layout elements every fragment needs "
                    f"one of each tensor's; use fragments <= {_numel(specs[smallest])} or fragment_layout layers"
                )
            self.groups = [names for _ in range(count)]  # every fragment: a share of every tensor
            self.digest = digest([["elements", str(count)], names])
        else:
            # With one fragment, names keep the specs' order: nothing about plain DiLoCo changes.
            self.groups = partition(specs, count) if count > 1 else [list(specs)]
            self.digest = digest(self.groups)

    @classmethod
    def from_config(cls, specs: dict[str, codec.ParamSpec], dist: Any) -> Plan:
        layout = str(getattr(dist.sync, "fragment_layout", "layers"))
        return cls(
            specs, int(getattr(dist.sync, "fragments", 1)), dist.sync.inner_steps, dist.sync.ramp, layout
        )

    def at(self, step: int) -> int | None:
        return fragment_at(step, self.inner_steps, self.count, self.ramp)

    def points(self, total: int) -> list[int]:
        return sync_points(total, self.inner_steps, self.count, self.ramp)

    def part(self, p: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fragment p's share of full-shaped `tensors`: the dict itself (P=1), its group's tensors
        (layers), or each tensor's elements p, p+P, … as a strided view (elements: writing to the view
        writes the tensor, which must be contiguous)."""
        if self.count <= 1:
            return tensors
        if self.layout == "layers":
            return {n: tensors[n] for n in self.groups[p]}
        return {n: tensors[n].view(-1)[p :: self.count] for n in self.groups[p]}

    def merged(
        self, p: int, full: dict[str, torch.Tensor], share: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A new dict: `full` with fragment p's share replaced by `share` (elements: each changed tensor
        a copy, so `full`'s tensors are never written)."""
        if self.layout == "layers":
            return {**full, **share}
        out = dict(full)
        for name, t in share.items():
            whole = full[name].clone()
            whole.view(-1)[p :: self.count] = t
            out[name] = whole
        return out

    def viewer(self, p: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What `part` does to one tensor, for the outer optimizer (None: whole tensors)."""
        if self.layout == "layers":
            return None
        count = self.count
        return lambda t: t.view(-1)[p::count]

    def select(self, meta: dict[str, str], specs: dict[str, codec.ParamSpec]) -> dict[str, codec.ParamSpec]:
        """The specs a delta with this metadata must carry: its fragment's (the whole model when P=1)."""
        if self.count <= 1:
            return specs
        p = fragment_of(meta, self.count)
        if self.layout == "layers":
            return {n: specs[n] for n in self.groups[p]}
        return {
            n: codec.ParamSpec((len(range(p, _numel(specs[n]), self.count)),), specs[n].dtype)
            for n in self.groups[p]
        }

    def manifest_entry(self) -> dict[str, Any]:
        entry = {"count": self.count, "digest": self.digest, "offsets": offsets(self.inner_steps, self.count)}
        if self.layout != "layers":  # a layers run's manifest stays what it was
            entry["layout"] = self.layout
        return entry


def fragment_of(meta: dict[str, str], count: int) -> int:
    """The fragment a delta's metadata names (Rejected unless it is one of this run's)."""
    raw = meta.get("fragment", "0" if count <= 1 else "")
    if not raw.isdigit() or int(raw) >= count:
        raise codec.Rejected(f"fragment {raw[:20]!r} is not one of this run's {count} fragments")
    return int(raw)


def check(manifest: dict[str, Any], plan: Plan, where: str) -> None:
    """Refuse (ConfigError, exit 2) a node whose fragments differ from the run's (manifest run.fragments;
    absent: 1)."""
    entry = (manifest.get("run") or {}).get("fragments") or {"count": 1}
    count = entry.get("count") if isinstance(entry, dict) else None
    if count != plan.count:
        raise ConfigError(
            f"{where}: distributed.sync.fragments is {plan.count} here, but the run syncs {count} fragments "
            f"(manifest.json run.fragments); set distributed.sync.fragments={count}"
        )
    layout = entry.get("layout", "layers")
    if plan.count > 1 and layout != plan.layout:
        raise ConfigError(
            f"{where}: distributed.sync.fragment_layout is {plan.layout} here, but the run splits its fragments "
            f"by {str(layout)[:20]} (manifest.json run.fragments); set distributed.sync.fragment_layout={str(layout)[:20]}"
        )
    if plan.count > 1 and entry.get("digest") != plan.digest:
        raise ConfigError(
            f"{where}: this node splits the model into fragments differently from the run (partition "
            f"digest {plan.digest[:19]}… here, {str(entry.get('digest'))[:19]}… in manifest.json); use the "
            "same speedtronic version as the master"
        )


def head_rounds(head: dict[str, Any], count: int) -> list[int] | None:
    """Each fragment's round in a head, or None where the head does not say (P=1 runs; a malformed one)."""
    entry = head.get("fragments")
    rounds = entry.get("rounds") if isinstance(entry, dict) else None
    if (
        not isinstance(rounds, list)
        or len(rounds) != count
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rounds)
    ):
        return None
    return list(rounds)
