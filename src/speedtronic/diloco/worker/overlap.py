"""Overlapped sync for a DiLoCo worker (`distributed.sync.overlap_steps` = τ): train on while a delta uploads
and the next global downloads, and install that global τ inner steps after the sync, keeping the
local progress made meanwhile.

The merge (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv:2501.18512,
§2.3; the same "eager" correction as Kale et al. 2025, "Eager updates for overlapped communication and
computation in DiLoCo", arXiv:2502.12996): a fragment synced at inner step t, whose new global θ_g
arrives while the worker is at step t+τ, becomes

    θ  ←  θ_g + (θ_{t+τ} − θ_t)

the new global plus what this worker learnt during the τ steps of overlap (the paper's α = 0 mixing,
which it finds as good as any α at small τ). The worker's book-keeping holds θ_t implicitly: with
anchor = the global last installed for the fragment and accounted = what was queued since, θ_t =
anchor − accounted (the per-fragment sync snapshot, in the training checkpoint with both), so

    θ_g + (θ_now − θ_t)  =  θ_g − (anchor − θ_now − accounted)

which is the right-hand side `merge` computes — exactly the install rule DiLoCo workers always used
(diloco/worker/coordinator.py: "θ ← G − u"). What τ adds is *when*: with τ = 0 a global is installed the
moment it arrives; with τ > 0 each synced fragment has a due step t+τ, a global arriving earlier is
held, and at the due step the worker installs the newest held global once it answers this node's delta
(head hwm ≥ the delta's number). If none does by then, the worker waits — logged, polling, bounded by
`distributed.worker.global_wait`, default `distributed.rounds.max_wait`, or sooner once the master has been
quiet far beyond its usual round: head_pace.py — and past that trains on, logged,
installing what comes when it comes. Having given up once, it does not wait again until some global
arrives (`late`): a master that is down or failing over, or a bus that is out, would otherwise cost a
whole wait at every sync point, while the deltas made meanwhile count when the master is back.

The schedule is part of the worker's checkpoint (`Pending.to_json`), so a resume between a sync and
its due step still installs at that step. `Overlap` owns the schedule and the newest global held for
it; the coordinator asks it to install what is due. This module has no I/O of its own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Container
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from speedtronic import interrupts
from speedtronic.config.distributed import global_wait_s
from speedtronic.diloco import codec

if TYPE_CHECKING:
    from speedtronic.config.distributed import DistributedConfig

logger = logging.getLogger("speedtronic.diloco")


class Global(NamedTuple):
    """A global model a worker fetched: its outer step, weights, each fragment's round (None: the head
    said nothing, a single-fragment run) and the head's high-water mark of this node's deltas."""

    outer_step: int
    tensors: dict[str, torch.Tensor]
    rounds: list[int] | None
    hwm: int


def merge(
    global_new: torch.Tensor, local_now: torch.Tensor, anchor: torch.Tensor, accounted: torch.Tensor
) -> torch.Tensor:
    """θ_g + (θ_now − θ_sync) with θ_sync = anchor − accounted, computed as
    θ_g − (anchor − θ_now − accounted): the order of operations plain DiLoCo installs have always
    used, so P=1, τ=0 runs are bitwise what they were."""
    return global_new - (anchor - local_now - accounted)


class Pending:
    """Fragments synced and waiting for their global: fragment -> (delta sequence number, due step)."""

    def __init__(self, tau: int) -> None:
        self.tau = tau
        self.due: dict[int, tuple[int, int]] = {}

    def synced(self, fragment: int, seq: int, step: int) -> None:
        if self.tau > 0:
            self.due[fragment] = (seq, step + self.tau)

    def ready(self, step: int) -> dict[int, int]:
        """{fragment: seq} of the fragments due at or before `step`."""
        return {p: seq for p, (seq, due) in self.due.items() if due <= step}

    def to_json(self) -> list[list[int]]:
        return [[p, seq, due] for p, (seq, due) in sorted(self.due.items())]

    def load(self, data: Any, count: int) -> None:
        self.due = {}
        for entry in data if isinstance(data, list) else []:
            if isinstance(entry, (list, tuple)) and len(entry) == 3 and 0 <= int(entry[0]) < count:
                self.due[int(entry[0])] = (int(entry[1]), int(entry[2]))


class Installer(Protocol):
    """What the late install asks of the worker (diloco/worker/coordinator.py)."""

    node: str
    dist: DistributedConfig

    def delta_marks(self) -> tuple[Container[str], int, int]:
        """(this node's delta files the master rejected, its high-water mark, the newest head's outer step)."""
        ...

    def moved(self, g: Global, fragment: int) -> bool: ...

    def install_fragments(self, model: nn.Module, inner_step: int, g: Global, moved: set[int]) -> None: ...

    def waiting_for_global(self) -> contextlib.AbstractContextManager[None]: ...

    def refresh(self, model: nn.Module, step: int) -> None: ...

    def master_stalled(self) -> str | None:
        """Why no global is coming soon (the master quiet far beyond its usual round), else None."""
        ...


class Overlap:
    """The late install: which synced fragments wait for their global (`pending`, in the checkpoint)
    and the newest global held for them (`latest`)."""

    def __init__(self, tau: int, node: str = "") -> None:
        self.node = node
        self.pending = Pending(tau)
        self.latest: Global | None = None
        # Since when no global has come after a wait gave up (monotonic; None: globals answer in time).
        self.late_since: float | None = None

    def hold(self, g: Global) -> None:
        """A global was taken: with τ > 0 it stays held for the fragments whose due step is still ahead.
        Globals come again: the next due step waits for its answer as usual."""
        self.latest = g if self.pending.tau > 0 else None
        if self.late_since is not None:
            logger.info(
                "DiLoCo node %s: global of outer step %d arrived after %.1fs without one; waiting for "
                "answers again",
                self.node,
                g.outer_step,
                time.monotonic() - self.late_since,
            )
            self.late_since = None

    def resume(self, g: Global) -> None:
        """Resumed inside an overlap: `g` (the current global) is held for the due step."""
        self.latest = g

    def synced(self, fragment: int, seq: int, step: int) -> None:
        """Fragment `fragment` queued delta `seq` at `step`: its global is installed at step + τ."""
        self.pending.synced(fragment, seq, step)

    def due_at(self, step: int) -> bool:
        """Whether some fragment's global is due at or before `step`."""
        return bool(self.pending.ready(step))

    def waiting(self) -> set[int]:
        """The synced fragments inside their overlap (installed at their due step only)."""
        return set(self.pending.due)

    def forget(self) -> None:
        self.pending.due = {}

    def install_due(self, model: nn.Module, step: int, worker: Installer) -> None:
        """At a due step: install each due fragment from the newest global that answers its delta,
        waiting for one (polling, logged) up to max_wait; past that, train on without it."""
        due = self.pending.ready(step)
        if not due:
            return
        dist = worker.dist
        # Late (a wait already gave up and no global came since): train on at once.
        deadline = time.monotonic() + (0.0 if self.late else global_wait_s(dist))
        said = False
        with contextlib.ExitStack() as waiting:  # the poller polls faster while this waits
            while True:
                self._install_answered(model, step, due, worker)
                if not due:
                    return
                if interrupts.stopping():  # a SIGTERM: the loop saves and exits; the fragments stay due
                    return
                if time.monotonic() >= deadline:
                    self._give_up(due, step, worker, f"within {global_wait_s(dist):.3g}s")
                    return
                # Once polled in this wait: a master quiet far beyond its usual round will not answer soon.
                stalled = worker.master_stalled() if said else None
                if stalled is not None:
                    self._give_up(due, step, worker, f"({stalled})")
                    return
                if not said:
                    said = True
                    waiting.enter_context(worker.waiting_for_global())
                    logger.info(
                        "DiLoCo node %s: inner step %d: overlap of %d steps is over but the global for "
                        "fragment(s) %s is not here; waiting (up to %.3gs)",
                        worker.node,
                        step,
                        self.pending.tau,
                        ", ".join(map(str, sorted(due))),
                        global_wait_s(dist),
                    )
                worker.refresh(model, step)
                time.sleep(min(0.05, dist.node.poll_interval))

    def _install_answered(self, model: nn.Module, step: int, due: dict[int, int], worker: Installer) -> None:
        """Install the due fragments whose delta has been answered; they leave `due` and the schedule.

        Answered: the newest global held was published after the master processed the delta, or the
        master processed it (applied or rejected) and no newer global than the one held exists, or the
        master said it rejected it (head.json "rejections"): no global will ever answer a rejected
        delta, since the high-water mark moves only when one is applied."""
        latest = self.latest
        rejected, hwm, head_step = worker.delta_marks()
        answered = {
            p
            for p, seq in due.items()
            if codec.delta_name(worker.node, seq) in rejected
            or (latest is not None and (latest.hwm >= seq or (hwm >= seq and latest.outer_step >= head_step)))
        }
        for p in sorted(answered):
            del self.pending.due[p]
            del due[p]
        if answered and latest is not None:
            # A fragment whose round did not move (the master rejected the delta, or weighed it 0)
            # keeps its weights: its next install realigns it with the global.
            moved = {p for p in answered if worker.moved(latest, p)}
            worker.install_fragments(model, step, latest, moved)

    @property
    def late(self) -> bool:
        """A wait for a global gave up and none has come since: waits are skipped until one does."""
        return self.late_since is not None

    def gave_up(self, what: str, why: str, step: int) -> None:
        """A wait for a global ended without one (logged once per stretch without globals); `why`:
        "within 4s" (global_wait ran out) or the master's quiet (head_pace.py)."""
        if self.late_since is None:
            self.late_since = time.monotonic()
            logger.warning(
                "DiLoCo node %s: no global answered %s %s of step %d; training on without waiting until "
                "a global comes, installing it when it comes",
                self.node,
                what,
                why,
                step,
            )
        else:
            late = time.monotonic() - self.late_since
            logger.debug("DiLoCo node %s: still no global (%.1fs); step %d trains on", self.node, late, step)

    def _give_up(self, due: dict[int, int], step: int, worker: Installer, why: str) -> None:
        self.gave_up(f"fragment(s) {', '.join(map(str, sorted(due)))}", why, step)
        for p in due:
            del self.pending.due[p]
