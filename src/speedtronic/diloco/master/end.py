"""How a DiLoCo run ends on the master: who has finished, who has left, when the master stops, why,
and which global it publishes as the final one.

A node's end. A node is finished once the master has processed a delta of it marked final
(metadata `final="1"`, coordinator.py) — applied, or rejected for what it contains: too stale, a norm
outlier. A final delta past `max_staleness` is rejected from the mean like any other stale delta
(its work was done on a global the run has moved far past; weighting it in would apply it to a model
it never saw), and it still ends its node. A file only ends a node when it has passed the checks of
who sent it: it decoded, its payload checksum matched, its metadata names the node it is filed
under, it is no replay of an applied payload and its local step is sane (the checks that judge the
sender: checks.py). Garbage
or a copy planted under an honest node's name therefore never ends that node. (Files are not signed:
whoever can write under a node's name can forge a well-formed final delta; access control on the
bus is what stops that.)

Who is known: the listed collaborators (less the master when it sends nothing), every node with an
applied delta and every finished node. A known node has *left* when it has not been heard from (a
new delta of it seen on the bus; for a node never heard from: since this master started) for
END_FACTOR (3) × its liveness window, at most max_wait (learnt from its own intervals; `distributed.rounds.never_heard_wait`,
default max_wait, for a node never heard from) — or, never heard from, once the run's end and the late
joiners' window (`late_join_wait`) after it are past. Past the run's end a silent node that still holds
the lease on its id (`Bus.lease_left`, read at most every LEASE_LOOK_S) has not left, up to max_wait: a
worker killed and started again takes its lease back at once, then needs its start-up and H steps
before its next delta.

The master stops (`wait`), and says why in the log, metrics.json, the summary (`end_reason`) and
head.json (`final.reason`):
- complete: outer step `end` reached at least `linger_s` ago (the late joiners' window,
  `late_join_wait`: default 0, so the run ends once its last outer step is out), every known
  node finished, left or done (past the end), and nothing valid pending — confirmed by a poll that started after all of
  that was true ("all 8 nodes finished", "7 of 8 nodes finished; w3 left (last heard 300 s ago)");
- idle: no outer step and no new delta for `idle_s` (3 × that while valid deltas are pending: a
  round always settles them), whatever the outer step ("idle for 600 s at outer step 3 of 10 …").
Before the run's end an idle timeout is the only way out: more nodes may still join to reach it.

The final pick. The master evaluates every global it publishes when it has held-out data
(node_eval.Evaluator) and keeps the best one of the whole run in memory (`RunEnd.remember`: the lowest
val loss since this master started; a hostile majority late in a run cannot push it out of a window).
At the end the final global is
evaluated; if the kept one is better, the master publishes its weights as a new outer step (outer
momentum reset: the weights jumped back) — a normal newer global for any worker still running — and
head.json says so: `final: {outer_step, from_outer_step, val_loss, last_val_loss, chosen:
"best"|"last", reason}`. Otherwise it republishes the last global with that entry (chosen "last").
The kept weights are not saved: after a restart the pick looks only at globals since.

Past the end. Once the end is out (and `late_join_wait` after it, default 0), each node's work counts
up to its share — one delta per outer step of the run, what an honest node sends over the whole run,
plus a quarter of that (at least 1) for syncs a restarted node redoes — and is refused beyond ("after the run's end", checks.py); a node refused so is *done*: rounds and the end no
longer wait for it (`RunEnd.done`). A node's last deltas, a late joiner's whole run and a swarm whose
rounds take one delta each (its outer steps pass the end early) still count in full, but a swarm
whose honest nodes have finished cannot keep the run stepping for long: the others have sent theirs.

`RunEnd` owns the end's state (the best global, the final pick, why the run ended, the rounds
done); the master's `wait` (core.py) drives the end with the questions asked here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.diloco.bus.base import BusError

if TYPE_CHECKING:
    from speedtronic.diloco.master.ledger import Ledger
    from speedtronic.diloco.master.rounds import Rounds

logger = logging.getLogger("speedtronic.diloco")
END_FACTOR = 3.0  # the end waits this × a node's liveness window for its next delta before it has left
LEASE_LOOK_S = 5.0  # how often the end reads a silent node's lease on its id (one request each time)


@dataclass
class Best:
    """The best global of the run: its outer step, val loss and fp32 weights (a copy)."""

    outer_step: int
    val_loss: float
    weights: dict[str, torch.Tensor]


class RunEnd:
    """The best global, the final pick, why the run ended, the rounds done so far, the run's last outer
    step and the nodes done past it, and whether only nodes that cannot weigh are left."""

    def __init__(
        self,
        started: float,
        last_step: int | None = None,
        linger_s: float = 0.0,
        id_leases: IdLeases | None = None,
    ) -> None:
        self.best: Best | None = None  # the best global of the run, for the final pick
        self.id_leases = id_leases  # whether a silent node still holds its id (asked past the end)
        self.last_step = last_step  # the run's end (outer steps); None: not known yet
        self.linger_s = linger_s  # the late joiners' window after the end (late_join_wait)
        self.reached_at: float | None = None  # clock time the master first saw the end reached
        self.done: set[str] = set()  # nodes whose work past the end was refused: the end does not wait
        self.untrusted_only: list[str] | None = None  # the live nodes, when none of them can weigh
        self.final: dict[str, Any] | None = None  # the final pick, once the run is over (head.json)
        self.reason: str | None = None
        self.rounds_done = 0  # the end needs a round that started after it (core.Master.wait)
        self.started = started  # clock time this master started (a never-heard node's silence)

    def ends_at(self, step: int, linger_s: float | None = None) -> None:
        if step != self.last_step:
            self.reached_at = None
        self.last_step = step
        if linger_s is not None:
            self.linger_s = linger_s

    def past(self, outer_step: int) -> bool:
        """Whether `outer_step` is at or past the run's last outer step."""
        return self.last_step is not None and outer_step >= self.last_step

    def reached(self, now: float, outer_step: int) -> float | None:
        """When the run's end was first seen reached (None: not yet)."""
        if self.reached_at is None and self.past(outer_step):
            self.reached_at = now
        return self.reached_at

    def late_open(self, now: float, outer_step: int) -> bool:
        """Whether work built past the end still counts: the end not reached, or within late_join_wait."""
        reached = self.reached(now, outer_step)
        return reached is None or now - reached < self.linger_s

    def refused_after_end(self, node: str) -> None:
        self.done.add(node)

    def only_untrusted(self, nodes: list[str] | None) -> None:
        """Every live node's latest delta weighed 0 (`nodes`), or not (None): said loudly, once a change."""
        if nodes and nodes != self.untrusted_only:
            logger.warning(
                "DiLoCo master: only nodes that cannot weigh are left: %s (quarantined, probed out or their "
                "outer step refused); the global stands still until a trusted node sends. Check those nodes, "
                "or stop the run: its best global is kept",
                ", ".join(nodes),
            )
        elif not nodes and self.untrusted_only:
            logger.warning("DiLoCo master: a node whose delta weighs is back; the global moves again")
        self.untrusted_only = nodes or None

    def round_done(self) -> None:
        self.rounds_done += 1

    def ended(self, reason: str) -> str:
        self.reason = reason
        return reason

    def picked(self, final: dict[str, Any]) -> None:
        self.final = final

    def report(self) -> dict[str, Any]:
        return {
            "end_reason": self.reason,  # null while the run goes on
            "final": self.final,  # the final pick: outer step, from which, val loss, best or last
            # The live nodes when every one of them is quarantined or probed out (null otherwise).
            "untrusted_only": self.untrusted_only,
        }

    def remember(self, step: int, loss: float, weights: dict[str, torch.Tensor]) -> None:
        """Keep the current global if it is the best of the run (see the module docstring)."""
        best = self.best
        if not math.isfinite(loss):
            return  # a diverged global is never the one to go back to
        if best is not None and loss >= best.val_loss:
            return
        if best is None or best.weights.keys() != weights.keys():
            self.best = Best(step, loss, {n: t.detach().clone() for n, t in weights.items()})
            return
        for name, tensor in weights.items():
            best.weights[name].copy_(tensor)  # reuse the buffers: this happens on most outer steps
        best.outer_step, best.val_loss = step, loss

    def better(self, step: int, loss: float | None) -> Best | None:
        """The kept global when it beats the last one (`loss` at `step`), else None."""
        best = self.best
        worse = loss is not None and (not math.isfinite(loss) or (best is not None and best.val_loss < loss))
        return best if worse and best is not None and best.outer_step != step else None


def rejected_final(ledger: Ledger, name: str, node: str, meta: dict[str, str]) -> None:
    """A delta that passed the sender checks was rejected for its content: if it was the node's final
    one, the node is finished all the same (it will send nothing more)."""
    if meta.get("final") != "1":
        return
    ledger.finish(node)
    logger.info(
        "DiLoCo master: %s was %s's final delta: rejected from the mean, the node counts as finished",
        name,
        node,
    )


class IdLeases:
    """Whether a node still holds the lease on its id (`Bus.lease_left`): a worker restarting takes its
    lease back before it can send anything. Read at most every LEASE_LOOK_S per node; a bus error reads
    as no lease (the end goes on by the rounds' rule)."""

    def __init__(self, read: Callable[[str], float | None], clock: Callable[[], float]) -> None:
        self.read, self.clock = read, clock
        self.seen: dict[str, tuple[float, bool]] = {}

    def __call__(self, node: str) -> bool:
        now = self.clock()
        cached = self.seen.get(node)
        if cached is not None and now - cached[0] < LEASE_LOOK_S:
            return cached[1]
        try:
            left = self.read(node)
        except (BusError, OSError) as error:  # unknown: the rounds' rule stands
            logger.debug("DiLoCo master: could not read %s's lease (%s)", node, error)
            left = None
        held = left is not None and left > 0
        self.seen[node] = (now, held)
        return held


class Liveness:
    """Who is known, who has left (module docstring), from the rounds' membership and the ledger."""

    def __init__(
        self,
        rounds: Rounds,
        ledger: Ledger,
        never_heard_wait: float,
        poll: float,
        started: float,
        done: set[str] | None = None,
        untrusted: list[str] | None = None,
        holds_id: Callable[[str], bool] | None = None,
    ) -> None:
        self.rounds, self.ledger = rounds, ledger
        self.holds_id = holds_id  # IdLeases, once the run's end is out (None: not asked)
        self.untrusted = untrusted or []  # RunEnd.untrusted_only
        self.never_heard_wait, self.poll, self.started = never_heard_wait, poll, started
        self.done = done or set()  # nodes whose work past the run's end was refused (RunEnd.done)

    def window(self, node: str) -> float:
        """Seconds without news after which a node counts as gone: END_FACTOR × the window the round rule
        learnt from the node's own intervals (rounds.py: a few of its intervals), at most max_wait;
        never_heard_wait (default max_wait) for a node never heard from: only the run's end asks (rounds
        have their own rule for joiners, rounds.py), so a test can end a run with a ghost listed quickly.
        Longer than the rounds' window: a round that stops waiting for a slow node loses nothing, a run
        that ends without it leaves its last deltas unprocessed (seen under CPU contention: a worker's
        last delta came 3 × its usual interval late)."""
        if self.rounds.seen(node) is None:
            return float(self.never_heard_wait)
        learnt = END_FACTOR * self.rounds.window(node, self.poll)
        return float(min(self.rounds.dist.rounds.max_wait, learnt))

    def known(self) -> set[str]:
        listed = set(self.rounds.allowed or ()) - set(self.rounds.silent)
        return listed | set(self.ledger.nodes) | set(self.ledger.finished)

    def left(self, now: float, late_join_over: bool = False) -> dict[str, float | None]:
        """{node: seconds since it was last heard from (None: never)} of the known unfinished nodes
        that have been silent past their liveness window. A listed node never heard from has also left
        once the run's end is past and the late joiners' window with it (`late_join_over`): it had the
        whole run and `late_join_wait` to show up."""
        out: dict[str, float | None] = {}
        for node in self.known() - set(self.ledger.finished) - self.done:
            heard = self.rounds.seen(node)
            quiet = now - (heard if heard is not None else self.started)
            if quiet > self.window(node) or (heard is None and late_join_over):
                if heard is not None and self._restarting(node, quiet):
                    continue
                out[node] = round(quiet) if heard is not None else None
        return out

    def _restarting(self, node: str, quiet: float) -> bool:
        """A silent node that still holds the lease on its id has not left, up to max_wait: a worker
        killed and started again takes its lease back at once but needs its start-up and H steps before
        its next delta (under load, more than END_FACTOR × its window), and ending the run then left its
        last deltas unprocessed."""
        if self.holds_id is None or quiet > self.rounds.dist.rounds.max_wait:
            return False
        return self.holds_id(node)

    def unfinished(self, left: dict[str, float | None] | None = None) -> list[str]:
        return sorted(self.known() - set(self.ledger.finished) - self.done - set(left or {}))

    def done_reason(self, left: dict[str, float | None]) -> str:
        known = self.known()
        finished = len(known & set(self.ledger.finished))
        done = sorted((known & self.done) - set(self.ledger.finished))
        past = f"; {len(done)} refused past the end: {', '.join(done)}" if done else ""
        if not left and not done:
            return f"all {finished} nodes finished"
        if not left:
            return f"{finished} of {len(known)} nodes finished{past}"
        return f"{finished} of {len(known)} nodes finished; {len(left)} left: {describe_left(left)}{past}"

    def idle_reason(self, quiet: float, end: int, now: float, pending: int) -> str:
        unfinished = self.unfinished()
        left = self.left(now)
        parts = [
            f"idle for {quiet:.0f} s at outer step {self.ledger.outer_step} of {end} with "
            f"{pending} deltas pending"
        ]
        if unfinished:
            parts.append(f"no final delta from {', '.join(unfinished)}")
        if left:
            parts.append(f"left: {describe_left(left)}")
        if self.untrusted:
            parts.append(f"only nodes that cannot weigh are left: {', '.join(self.untrusted)}")
        return "; ".join(parts)


def describe_left(left: dict[str, float | None]) -> str:
    """'w3 (last heard 300 s ago), w4 (never heard from)'."""
    return ", ".join(
        f"{n} (last heard {q:.0f} s ago)" if q is not None else f"{n} (never heard from)"
        for n, q in sorted(left.items())
    )


def final_line(final: dict[str, Any]) -> str:
    """The final pick, said in the run's last log line."""
    if final["chosen"] == "best":
        return (
            f"final global: outer step {final['outer_step']} = the weights of outer step "
            f"{final['from_outer_step']} (val loss {final['val_loss']:.4f}; the last global, outer step "
            f"{final['outer_step'] - 1}, had {final['last_val_loss']:.4f})"
        )
    if final["val_loss"] is not None:
        return f"final global: outer step {final['outer_step']}, the last (val loss {final['val_loss']:.4f})"
    return f"final global: outer step {final['outer_step']}, the last (no held-out data to evaluate)"
