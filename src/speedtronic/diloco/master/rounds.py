"""Who a DiLoCo round waits for, and until when: live membership, a quorum and a grace learnt from
the arrival history (the master's `round()` asks `Rounds.ready`; core.py keeps the loop). `Rounds` owns
the membership (who is listed, who was heard from and when) and what the open round waits for.

Membership follows the manifest. Unless `distributed.master.collaborators` pins the list in the config, the
master re-reads manifest.json's collaborators every `distributed.master.membership_refresh_s` seconds (0:
every poll), and sooner (at most every HINT_MIN_S) when a poll shows a sign of a new one: a file
of an unlisted node, or a delta repo of the run that no listed node owns. An added collaborator's
deltas are accepted from the next poll and it is waited for from the next round; a removed one's
deltas are no longer accepted or waited for. Each change is logged once. A run that started with a list is never opened to everyone while running: a manifest that
suddenly lists nobody is logged and ignored (a restart does that on purpose).

Who is expected. A round ("outer step s+1") opens at the first poll that finds a valid-looking delta
after the previous round closed. It expects the listed (or, without a list, the heard-from) nodes that
are *live* — a new delta of theirs was first seen within their liveness window, LIVE_FACTOR × the
median of their own intervals between deltas (at least 3 polls; the median of every node's intervals
until a second delta gives one of its own, and max_wait while no node has any) — plus the listed nodes never heard from during a *join grace*: one grace window (below)
counted from when they were listed or from the master's first arrival, whichever is later. So in the
first round, where everyone starts together, the round waits for the others; a collaborator that
never starts is waited for once, never again. A silence of the whole swarm (a bus outage) counts
against no node: the round after it expects the nodes live when it began, for as long as their bus
retries may take (`_excuse`). Nodes that sent their final delta and the master when it
does not train are not expected, nor are nodes that gave up the lease on their id (a clean exit; read once
they are overdue by their own pace, master/departures.py) until they send again, nor live nodes much slower than the fastest (master/pace.py,
`distributed.rounds.slow_factor`): their deltas count when they come, weighted by staleness. With `distributed.rounds.min_deltas` set, none of this applies: a round
takes that many deltas (less finished nodes) or proceeds after max_wait with what it has.

When a round closes, the first of:
- every expected node has a delta ("all");
- at least the quorum — ceil(`distributed.rounds.quorum` × expected), at least 1 — has one, and the grace
  has passed since the round opened ("grace");
- max_wait has passed since it opened ("max_wait": the upper bound, quorum or not).
A round whose missing nodes stop being expected while it waits (their join grace or liveness window
ran out) closes then, reported as "not_live".

A round that holds a delta of a node that was not in the last round (a straggler of it, a joiner)
may have opened early: the last round's nodes are training on its global, so their deltas come one
interval after their last ones, whenever the others arrived. Its grace then lasts until each missing
node of the last round is due by its own intervals (median + k·MAD + a poll, within its liveness
window; at most max_wait; `_carried_due`, reported as grace from "last round"). Counted from the
opening, stragglers that filled a quorum closed the round a second before the others, and the swarm
ran on in two groups half a round apart.

Only deltas that can weigh count. A quarantined node's delta, one the loss probe would weigh 0 this
round and one refused past the run's end open a round, but count toward neither the quorum nor
`min_deltas`, and their nodes are not waited for (the master passes them as `cannot`; the probe's
verdict is known only once the round's deltas are read, so core.py asks again with the probed-out
nodes added before it applies the round). A round with nothing but such deltas and nobody else due
closes at once ("none_can_weigh"): it takes no outer step, it settles them.

The grace is learnt, never a guessed constant (hivemind's median + k·MAD of arrival offsets). Each
round records, per node, its arrival offset: when its delta was first seen, less when the round opened
(0 for a delta that was already waiting). A node that missed a round records, when its next delta
comes, its offset from the opening of the round it missed, so a slow-but-live node teaches the grace
to wait for it, unless it is slow enough to be left out (above). A node's predicted offset is
median + k·max(MAD, 5% of the median) of its own last HISTORY offsets (`distributed.rounds.grace_mad_k` = k), or of everyone's when it has fewer than MIN_SAMPLES,
plus one poll interval (arrivals are only seen at polls); the round's grace is the largest prediction
among the expected nodes still missing, clamped to [2 poll intervals, max_wait]. With fewer than
MIN_SAMPLES offsets in all (the first rounds) it is learnt from the open round itself: once a quorum
of the listed nodes has arrived, median + k·MAD of their offsets in this round plus a poll, at most
`distributed.rounds.initial_grace` (which is also the grace while no quorum has arrived yet). So the grace is short when arrivals are
tight and as long as a consistently slow live node needs; max_wait stays the upper bound.

A straggler — a delta that missed its round — is not lost: it is taken by a later round and weighted
by its staleness (outer.staleness_weight: 1/(1+k) for a delta built k outer steps ago, rejected past
`max_staleness`).

What it shows: `report` (metrics.json and head.json "round"): the rule, quorum, grace and where it came
from, when the open round opened and closes, the live, expected, waiting-on and listed-but-not-waited-for
nodes, and how the last round closed. The offsets and intervals are part of the master's state
(state.py), so a restart keeps what it learnt.

What it never does: trust a name it reads (manifest node ids must match the node-id pattern), or
keep unbounded history (HISTORY values for at most MAX_NODES nodes).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Bus, BusError, DeltaRef
from speedtronic.diloco.identity import MASTER_NODE
from speedtronic.diloco.master.departures import Departures
from speedtronic.diloco.master.pace import slow_nodes

if TYPE_CHECKING:
    from speedtronic.config.distributed import DistributedConfig

logger = logging.getLogger("speedtronic.diloco")

HISTORY = 16  # offsets and intervals kept per node
MIN_SAMPLES = 3  # a node's own history counts once it has this many offsets
# ... and for when the last round's nodes are due (_carried_due), this many intervals: two, its three
# deltas of the first rounds. With three, the first deltas of two slow workers (4x the step time) closed
# round 4 on their own a second before the fast pair's, who took round 5 a step stale at half a step:
# 0.15 above the fast pair alone by round 12, 0.07 at the end (bench/uneven.py, seed 0).
CARRIED_MIN_INTERVALS = 2
LIVE_FACTOR = 3.0  # a node is live while heard within this × its median interval
SILENCE_FACTOR = 2.0  # no delta from anyone for this × the usual interval: the swarm's silence (_excuse)
MAD_FLOOR = 0.05  # the spread used is at least this × the median (a perfectly regular node jitters too)
MAX_MEMBERS = 10_000  # collaborators read from a manifest
MAX_NODES = 1000  # nodes with a history kept (as master_report.MAX_NODES)
HINT_MIN_S = 2.0  # a sign of a new collaborator re-reads the manifest at most this often
MAX_HINTS = 4096  # signs remembered (each re-reads the manifest once)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def robust_bound(values: list[float], k: float) -> float:
    """median + k·max(MAD, MAD_FLOOR × median) of `values` (not empty)."""
    m = median(values)
    mad = median([abs(v - m) for v in values])
    return m + k * max(mad, MAD_FLOOR * m)


def predicted_grace(
    own: list[float], pooled: list[float], *, k: float, poll: float, max_wait: float, initial: float
) -> tuple[float, str]:
    """(seconds after a round opens by which a node's delta is expected, where that came from:
    "own" history, "pooled" history of all nodes, or "initial"), clamped to [2 polls, max_wait]."""
    if len(own) >= MIN_SAMPLES:
        value, source = robust_bound(own, k) + poll, "own"
    elif len(pooled) >= MIN_SAMPLES:
        value, source = robust_bound(pooled, k) + poll, "pooled"
    else:
        value, source = initial, "initial"
    return min(max_wait, max(2 * poll, value)), source


def live_window(intervals: list[float], *, poll: float, max_wait: float) -> float:
    """How long after its latest delta a node still counts as live."""
    if not intervals:
        return max_wait
    return min(max_wait, max(3 * poll, LIVE_FACTOR * median(intervals)))


def quorum_count(quorum: float, expected: int) -> int:
    return max(1, math.ceil(quorum * expected - 1e-9))


def deadline(
    opened: float, have: int, expected: int, *, quorum: float, grace: float, max_wait: float
) -> tuple[float, str]:
    """(when an open round closes, why): at once with every expected node's delta; at opened + grace
    with a quorum; else at opened + max_wait."""
    if have >= expected:
        return opened, "all"
    if have >= quorum_count(quorum, expected):
        return opened + min(grace, max_wait), "grace"
    return opened + max_wait, "max_wait"


def _wall_time(entry: object) -> float | None:
    """The wall-clock time of a ledger entry's "at" (ISO 8601; None when absent or malformed: the
    entries come from a head on the bus, which is not trusted)."""
    at = entry.get("at") if isinstance(entry, dict) else None
    if not isinstance(at, str):
        return None
    try:
        value = datetime.fromisoformat(at)
    except ValueError:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def _capped(at: float | None, wall: float) -> float | None:
    return None if at is None else min(at, wall)


def _push(history: dict[str, list[float]], node: str, value: float) -> None:
    if node not in history and len(history) >= MAX_NODES:
        del history[next(iter(history))]  # the longest-known one: without a list anyone can make up nodes
    history[node] = [*history.get(node, []), round(value, 3)][-HISTORY:]


class Rounds:
    """The round-readiness state of one master: membership, arrivals, the open round."""

    def __init__(
        self,
        dist: DistributedConfig,
        bus: Bus,
        clock: Callable[[], float],
        allowed: set[str] | None,
        min_deltas: int,
    ) -> None:
        self.dist, self.bus, self.clock = dist, bus, clock
        now = clock()
        self.allowed = allowed  # listed collaborators (None: anyone)
        self.min_deltas = min_deltas
        self.min_deltas_set = dist.rounds.min_deltas is not None
        self.silent: set[str] = set()  # listed nodes that send nothing (the master when it does not train)
        self.heard: dict[str, float] = {}  # node -> clock time its latest delta was first seen
        self.quiet: set[str] = set()  # nodes already quiet when this master started (restarted())
        # Nodes whose `heard` time restarted() set, not an arrival: the time to their next delta is no
        # interval of theirs (a takeover's first poll finds deltas that were already waiting).
        self.restored: set[str] = set()
        self.last_arrival = now
        self.closed_at = now  # when the last round closed (restarted(): the adoption)
        self.carried: set[str] = set()  # the nodes of the last round: they train on its global (_carried_due)
        self.excused: dict[str, float] = {}  # node -> seconds of the swarm's silence moved off its `heard`
        self.recovery = 0.0  # the grace the round after a swarm's silence gets at least (_excuse)
        self.awaited: set[str] = set()  # ... and the nodes it expects: those live when the silence began
        self.waiting: dict[str, Any] = {}  # what the current round waits for, and until when
        self.pending_refs: list[DeltaRef] = []  # valid-looking deltas waiting after the latest poll
        self.pending_count = 0  # ... and after the latest round
        self._ignored: set[str] = set()  # unlisted nodes' files, logged once
        self.pinned = bool(dist.master.collaborators)  # the config's list is fixed; the manifest's is live
        self.offsets: dict[str, list[float]] = {}  # node -> recent arrival offsets (s)
        self.intervals: dict[str, list[float]] = {}  # node -> recent intervals between its deltas (s)
        self.joined = dict.fromkeys(allowed or (), now)  # node -> when it was listed
        self.seen_at: dict[str, float] = {}  # pending delta id -> when it was first seen
        self.spans: dict[str, int] = {}  # pending delta id -> its node's usual intervals it took (_span)
        self.opened_at: float | None = None  # the open round's first arrival
        self.first_arrival: float | None = None  # this master's first arrival (the join grace's start)
        self.late: dict[str, float] = {}  # node -> opening of the round it missed
        self.skip: set[str] = set()  # nodes whose offset this round was recorded as a late arrival
        self.expected: set[str] = set()
        self.round_expected: set[str] = set()  # every node the open round expected at some poll
        self.closes_by = ""
        self.last: dict[str, Any] | None = None  # how the last round closed
        self.report: dict[str, Any] = {}
        self.refreshed_at = now
        self.hints: set[str] = set()  # this poll's signs of a new collaborator (unlisted nodes' files)
        self._hinted: set[str] = set()  # signs of a new collaborator the manifest was re-read for
        self._kept: dict[str, bytes] = {}  # "id@etag" -> bytes of the round's deltas while it waits on
        self._wait_key = ""  # why the open round last waited on (core.py logs each reason once)
        self._said: set[str] = set()
        self._last_log = -math.inf
        # Overdue nodes that gave up their id (a clean exit) are not waited for (departures.py).
        self.departures = Departures(bus.lease_left, clock) if bus.reads_leases() else None

    # -- state --------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"offsets": self.offsets, "intervals": self.intervals}

    def load(self, data: Any) -> None:
        """Restore the learnt history (malformed entries are dropped: a state file is not trusted)."""
        for key in ("offsets", "intervals"):
            found = data.get(key) if isinstance(data, dict) else None
            clean = {
                str(node): [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)][
                    -HISTORY:
                ]
                for node, values in (found.items() if isinstance(found, dict) else ())
                if isinstance(values, list)
            }
            setattr(self, key, clean)

    def describe(self) -> str:
        """The rule in a few words, for the master's start-up line."""
        dist = self.dist
        if self.min_deltas_set:
            return f"{dist.rounds.min_deltas} deltas each, or what there is after max_wait {dist.rounds.max_wait:g}s"
        listed = (
            "pinned by the config" if self.pinned else f"re-read every {dist.master.membership_refresh_s:g}s"
        )
        return (
            f"every live node, or a quorum of {dist.rounds.quorum:g} plus a grace learnt from arrivals (initially "
            f"{min(dist.rounds.initial_grace, dist.rounds.max_wait):g}s), at most max_wait {dist.rounds.max_wait:g}s; "
            f"collaborators {listed}"
        )

    # -- membership ---------------------------------------------------------------------------------
    def silence(self, node: str, min_deltas: int | None = None) -> None:
        """`node` sends no deltas (the master when it does not train): rounds never wait for it; without
        `distributed.rounds.min_deltas`, `min_deltas` is how many deltas the rule then takes."""
        self.silent = {node}
        if min_deltas is not None:
            self.min_deltas = min_deltas

    def unlisted(self, ref: DeltaRef) -> bool:
        """A file from a node that is not a listed collaborator (ignored, logged once; a sign that the
        manifest may list it now: `hints`)."""
        if self.allowed is None or ref.node in self.allowed:
            return False
        self.hints.add(ref.node)
        if ref.id not in self._ignored:
            self._ignored.add(ref.id)
            logger.warning("DiLoCo master: ignoring delta %s from unlisted node %s", ref.name, ref.node)
        return True

    def pending(self, pending: dict[str, list[tuple[int, DeltaRef]]]) -> None:
        """What this poll found pending (for the status and the end)."""
        self.pending_count = sum(len(v) for v in pending.values())
        self.pending_refs = [ref for items in pending.values() for _, ref in items]

    def settled(self, ids: set[str], chosen: list[DeltaRef]) -> None:
        """The round applied or rejected `ids` of the `chosen` deltas: they are not pending any more."""
        self.pending_count -= sum(ref.id in ids for ref in chosen)
        self.pending_refs = [ref for ref in self.pending_refs if ref.id not in ids]

    def keep(self, data: dict[str, bytes]) -> None:
        """The bytes of the open round's deltas, read while it waits on (not read from the bus again)."""
        self._kept = data

    def first_wait(self, key: str) -> bool:
        """Whether the open round waits on for this reason for the first time (said once, not every poll)."""
        new, self._wait_key = key != self._wait_key, key
        return new

    def take_kept(self) -> dict[str, bytes]:
        kept, self._kept = self._kept, {}
        return kept

    def pending_except(self, nodes: set[str]) -> int:
        """Deltas still pending after the latest round from nodes other than `nodes`."""
        return sum(ref.node not in nodes for ref in self.pending_refs)

    def seen(self, node: str) -> float | None:
        return self.heard.get(node)

    def restarted(self, nodes: dict[str, Any]) -> None:
        """After a restart or a takeover (`nodes`: the ledger's entries, each with "at", when its last
        delta was applied), the nodes that were live when the last master applied its last round count
        as just heard from: a round waits for them (up to max_wait) instead of going ahead with
        whichever node happens to be first. A node already quiet by then (one that left, or died) keeps
        its real time and is not live until its next delta: waiting for it held every takeover's first
        round until its liveness window ran out (6–9 s of 7 failovers in 16 in a 30-minute chaos soak)."""
        now, wall = self.clock(), time.time()
        # Never later than now: a head from the bus is not trusted, and one future "at" would make
        # every other node look quiet.
        applied = {node: _capped(_wall_time(entry), wall) for node, entry in nodes.items()}
        latest = max((t for t in applied.values() if t is not None), default=None)
        pooled = [v for values in self.intervals.values() for v in values]  # once, not per node
        self.heard, self.quiet, self.excused = {}, set(), {}
        self.recovery, self.awaited = 0.0, set()
        self.restored = set(applied)
        self.carried = set()  # whose deltas the last master applied last is not known here
        self.closed_at = now  # a swarm's silence (_excuse) counts from the adoption at the earliest
        for node, at in applied.items():
            if at is None or latest is None or latest - at <= self._restart_window(node, pooled):
                self.heard[node] = now
            else:
                self.heard[node] = now - max(0.0, wall - at)
                self.quiet.add(node)
        if self.quiet:
            logger.info(
                "DiLoCo master: not waiting for %s: quiet when the last round was applied (live again "
                "with their next delta)",
                ", ".join(sorted(self.quiet)),
            )

    def _restart_window(self, node: str, pooled: list[float]) -> float:
        """How long before the last master's last round a node's last delta may have been applied for
        it to count as live then: its own liveness window, or the pooled one for a node this master
        has no intervals of (a standby's history is its own earlier life's)."""
        poll, max_wait = self.dist.node.poll_interval, self.dist.rounds.max_wait
        own = self.intervals.get(node)
        return live_window(own or pooled, poll=poll, max_wait=max_wait)

    def refresh(self, unclaimed: set[str] | frozenset[str] = frozenset()) -> None:
        """Re-read the manifest's collaborators when due, and follow what changed. Signs of a
        collaborator added since — an unlisted node's file (the last poll's `hints`), or a delta repo of
        the run no listed node owns (`unclaimed`, the bus's) — re-read it now, once per sign and at most
        every HINT_MIN_S, not membership_refresh_s later: a Hub joiner's deltas waited up to a minute
        for it, went stale and were rejected."""
        now = self.clock()
        hints, self.hints = self.hints | unclaimed, set()
        if self.pinned:
            return
        new = hints - self._hinted
        hinted = bool(new) and now - self.refreshed_at >= HINT_MIN_S
        if not hinted and now - self.refreshed_at < self.dist.master.membership_refresh_s:
            return
        if len(self._hinted) + len(new) > MAX_HINTS:
            self._hinted.clear()
        self._hinted |= new
        self.refreshed_at = now
        try:
            manifest = self.bus.read_manifest()
        except BusError as error:
            self._once(
                f"read:{error}", "could not re-read manifest.json (%s); the collaborator list stays", error
            )
            return
        listed = collaborators(manifest)
        if listed is None:
            self._once(
                "malformed", "manifest.json's collaborators are malformed; the collaborator list stays"
            )
            return
        self._follow(listed, now)

    def _follow(self, listed: set[str], now: float) -> None:
        old = self.allowed
        if not listed:
            if old:
                self._once("emptied", "manifest.json lists no collaborators now; the master keeps its list")
            return
        if old is None:
            logger.warning(
                "DiLoCo master: manifest.json now lists collaborators (%s): only their deltas count from now on",
                ", ".join(sorted(listed)),
            )
        for node in sorted(listed - (old or set())):
            self.joined[node] = now
            if old is not None:
                logger.info(
                    "DiLoCo master: collaborator %s added (manifest.json): its deltas are accepted, and "
                    "it is waited for from the next round",
                    node,
                )
        for node in sorted((old or set()) - listed):
            self.joined.pop(node, None)
            logger.warning(
                "DiLoCo master: collaborator %s removed (manifest.json): its deltas are no longer "
                "accepted or waited for",
                node,
            )
        self.allowed = listed

    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning("DiLoCo master: " + message, *args)

    # -- arrivals -----------------------------------------------------------------------------------
    def arrivals(self, pending: dict[str, list[tuple[int, Any]]]) -> bool:
        """Note the deltas first seen by this poll: who was heard, each node's interval, late offsets.
        True when this poll saw a delta for the first time."""
        now, max_wait = self.clock(), self.dist.rounds.max_wait
        fresh_seen = False
        ids = {ref.id for items in pending.values() for _, ref in items}
        if ids - self.seen_at.keys():
            self._excuse(now)
        for node, items in pending.items():
            fresh = [ref.id for _, ref in items if ref.id not in self.seen_at]
            if not fresh:
                continue
            fresh_seen = True
            self.seen_at.update(dict.fromkeys(fresh, now))
            if node in self.heard and node not in self.restored:
                interval = now - self.heard[node] + self.excused.get(node, 0.0)  # the real one
                self.spans[max(fresh)] = self._span(node, interval)
                _push(self.intervals, node, interval)
            self.restored.discard(node)
            self.excused.pop(node, None)
            missed = self.late.pop(node, None)
            if missed is not None and now - missed <= max_wait:
                _push(self.offsets, node, now - missed)  # how late it was for the round it missed
                self.skip.add(node)
            self.heard[node] = self.last_arrival = now
            self.quiet.discard(node)
            if self.first_arrival is None:
                self.first_arrival = now
        if self.departures is not None:
            self.departures.met(
                {n for n, items in pending.items() if self.heard.get(n) == now} - {MASTER_NODE}
            )
        self.seen_at = {i: t for i, t in self.seen_at.items() if i in ids}
        self.spans = {i: n for i, n in self.spans.items() if i in ids}
        self.late = {n: t for n, t in self.late.items() if now - t <= max_wait}
        return fresh_seen

    def _excuse(self, now: float) -> None:
        """New deltas after a silence of the whole swarm — no delta from any node, and no round closed,
        for over SILENCE_FACTOR × the nodes' usual interval: a bus outage, or a master that could not
        read the bus — do not make the nodes heard before it look gone. That silence is nobody's: every
        node's `heard` moves forward by it, less one usual interval. The nodes come back as their bus
        retries let them, seconds apart, so the round after it expects every node live when it began
        (`awaited`) and waits for them up to `recovery` (their longest retry delay, at most the silence,
        plus one usual interval), where its usual grace would have closed it with a quorum of the first
        ones. Before, a 30-minute Hub soak's round after a 20 s outage closed as "all" with 2 of 8
        deltas, each folded over 11 sync points (4.2× the usual step: loss 1.99 → 2.19); the other six
        took the next round alone, and the two groups alternated for rounds (2.31). A node's interval
        and span (`arrivals`) stay the real ones; a node quiet before the silence stays quiet."""
        pooled = [v for values in self.intervals.values() for v in values]
        if len(pooled) < MIN_SAMPLES:
            return
        usual = median(pooled)
        # Counted from the last round's close too: while a round waits, the nodes wait for its global
        # (overlap), so the silence is the master's own (a round that waited for a node that had left
        # made a silence that made the next round wait for it again).
        began = max(self.last_arrival, self.closed_at)
        silence = now - began
        if silence <= SILENCE_FACTOR * usual:
            return
        shift = silence - usual
        # The nodes come back as their bus retries do (backoff up to retry_max, at most the silence):
        # the round after it waits that long for the ones live when it began, not its usual grace.
        self.recovery = min(self.dist.bus.retry_max, silence) + usual
        poll = self.dist.node.poll_interval
        self.awaited = {
            node
            for node, at in self.heard.items()
            if node not in self.quiet and began - at <= self.window(node, poll, pooled)
        }
        for node, at in self.heard.items():
            if node not in self.quiet:
                self.heard[node] = min(now, at + shift)
                self.excused[node] = self.excused.get(node, 0.0) + self.heard[node] - at
        logger.info(
            "DiLoCo master: no delta from any node for %.1fs (%.1f× their usual %.1fs: the bus, not the "
            "nodes); that silence does not count against their liveness",
            silence,
            silence / usual,
            usual,
        )

    def _span(self, node: str, interval: float) -> int:
        """How many of the node's usual intervals (the median of its last ones) its new delta took to
        come: the sync points a worker may have folded into it while the master did not answer (a bus
        outage, a failover: no round passes, so its staleness says 1). 1 without MIN_SAMPLES of history."""
        usual = self.intervals.get(node, [])
        if len(usual) < MIN_SAMPLES:
            return 1
        usual_s = median(usual)
        return max(1, int(interval / usual_s)) if usual_s > 0 else 1

    # -- the rule -----------------------------------------------------------------------------------
    def window(self, node: str, poll: float, pooled: list[float] | None = None) -> float:
        """How long after its latest delta a node counts as live: from its own intervals; for a node
        this master has none of, from every node's (`pooled`, when the caller gives them), else
        max_wait. A standby has no history: a node that left just before its takeover counted as live
        for max_wait, every round waited its grace for it, and a round whose deltas the probe all
        found worse waited for it (a 30-minute soak: 60 s without an outer step)."""
        own = self.intervals.get(node) or pooled or []
        return live_window(own, poll=poll, max_wait=self.dist.rounds.max_wait)

    def pooled(self) -> list[float]:
        return [v for values in self.offsets.values() for v in values]

    def grace_for(
        self, node: str | None, poll: float, pooled: list[float] | None = None
    ) -> tuple[float, str]:
        """A node's predicted grace (None: a node without history of its own, as for a joiner)."""
        dist = self.dist
        return predicted_grace(
            self.offsets.get(node, []) if node is not None else [],
            self.pooled() if pooled is None else pooled,
            k=dist.rounds.grace_mad_k,
            poll=poll,
            max_wait=dist.rounds.max_wait,
            initial=min(dist.rounds.initial_grace, dist.rounds.max_wait),
        )

    def nodes(
        self, have: set[str], now: float, finished: set[str], poll: float, join_grace: float | None = None
    ) -> tuple[set[str], set[str], set[str]]:
        """(expected, live, joining) for a round that has deltas from `have`."""
        members = self.allowed
        pooled = [v for values in self.intervals.values() for v in values]  # once per poll
        live = {
            n
            for n, t in self.heard.items()
            if now - t <= self.window(n, poll, pooled) and n not in self.quiet
        }
        if self.recovery:  # the round after a swarm's silence (_excuse)
            live |= self.awaited
        if members is not None:
            live &= members
        if join_grace is None:
            join_grace = self.grace_for(None, poll)[0]
        joining: set[str] = set()
        for node in members or ():
            if node in self.heard:
                continue
            since = self.joined.get(node, now)
            if self.opened_at is not None and since > self.opened_at:
                continue  # listed while this round was open: it counts from the next one
            if self.first_arrival is None or now < max(since, self.first_arrival) + join_grace:
                joining.add(node)
        expected = (live | joining | have) - finished - (self.silent - have)
        return expected, live, joining

    def _first_rounds_grace(self, have: set[str], initial: float, poll: float) -> tuple[float, str]:
        """Before any history: once a quorum of the round's nodes has arrived, learn from their arrival
        offsets in this very round (median + k·MAD + a poll, at least 2 polls), never beyond the initial
        grace. A listed node that never starts then costs the first round about as long as the
        arrivals were spread, not `initial_grace`."""
        assert self.opened_at is not None
        dist = self.dist
        first: dict[str, float] = {}
        for delta_id, seen in self.seen_at.items():
            node = delta_id.split("/", 1)[0]
            if node in have:
                first[node] = min(first.get(node, seen), seen)
        offsets = [max(0.0, t - self.opened_at) for t in first.values()]
        listed = len(self.allowed) if self.allowed is not None else len(have)
        if len(offsets) < max(2, quorum_count(dist.rounds.quorum, listed)):
            return initial, "initial"
        value = robust_bound(offsets, dist.rounds.grace_mad_k) + poll
        return min(initial, max(2 * poll, value)), "this round"

    def ready(
        self, have: set[str], outer_step: int, finished: set[str], poll: float, cannot: set[str] | None = None
    ) -> bool:
        """Whether the round with deltas from `have` closes now; fills `report` and `waiting`. The deltas
        of `cannot` (quarantined, probed out, refused past the end) open the round but never count
        toward its quorum or `min_deltas`, and their nodes are not waited for; a round of nothing
        but theirs closes at once (it takes no outer step: it only settles them)."""
        dist, now = self.dist, self.clock()
        cannot = cannot or set()
        counted = have - cannot
        self._open(bool(have), now)
        pooled = self.pooled()  # once per poll: a swarm may have thousands of nodes
        fallback = self.grace_for(None, poll, pooled)  # for nodes without enough history of their own
        start_grace = fallback[0]  # for a node not started yet (pooled offsets, else initial_grace)
        if fallback[1] == "initial" and have and self.opened_at is not None:
            fallback = self._first_rounds_grace(have, fallback[0], poll)
        expected, live, joining = self.nodes(counted, now, finished, poll, fallback[0])
        slow = self._slow(expected - cannot, poll)
        expected -= cannot | slow
        departed = self._departed(expected - counted, now, poll)
        expected -= departed
        arrived = counted - slow  # what the quorum counts: a slow node's delta weighs, holds no round
        missing = expected - arrived
        grace, source = self._grace_for_missing(missing, poll, pooled, fallback)
        opened = self.opened_at if self.opened_at is not None else now
        need, due, why = self._due(have, counted, arrived, expected, finished, opened, (grace, start_grace))
        if why == "grace" and (carried := self._carried_due(have, missing, opened, poll)) > due:
            due, grace, source = carried, carried - opened, "last round"
        self.expected, self.closes_by = expected, why
        if have:
            self.round_expected |= expected
        ready = bool(have) and now >= due
        wall = time.time() - now
        quorum_nodes = need if self.min_deltas_set else quorum_count(dist.rounds.quorum, len(expected))
        self.report = {
            **self._rule(outer_step, quorum_nodes, grace, source),
            "opened_at": _iso(wall + self.opened_at) if self.opened_at is not None else None,
            "closes_at": _iso(wall + due) if have else None,
            "closes_by": why if have else None,
            **self._members(live, joining, expected, have, missing),
            "cannot_weigh": sorted(have & cannot),
            "slow": sorted(slow),
            "departed": sorted(departed),
        }
        self.waiting = {}
        if have and not ready:
            self.waiting = {
                "outer_step": outer_step + 1,
                "need": need,
                "have": sorted(counted),
                "cannot_weigh": sorted(have & cannot),
                "waiting_on": sorted(missing),
                "until": wall + due,
                "closes_by": why,
                "quorum_nodes": quorum_nodes,
                "grace_s": round(grace, 2),
            }
            self._log_wait(outer_step, now, need, counted, missing, due, why, grace, source)
        return ready

    def _open(self, have: bool, now: float) -> None:
        """A round opens at the first poll with deltas; one without any closes what was open."""
        if have and self.opened_at is None:
            self.opened_at = now
        elif not have:
            self.opened_at = None  # nothing pending (any more): no round is open
            self.round_expected = set()

    def _grace_for_missing(
        self, missing: set[str], poll: float, pooled: list[float], fallback: tuple[float, str]
    ) -> tuple[float, str]:
        """The longest grace among the nodes still missing: each by its own offsets once it has enough,
        else the pooled `fallback`; after a swarm's silence, at least its `recovery` (_excuse)."""
        graces = [
            self.grace_for(n, poll, pooled) if len(self.offsets.get(n, ())) >= MIN_SAMPLES else fallback
            for n in sorted(missing)
        ] or [fallback]
        grace = max(graces)
        if self.recovery > grace[0]:
            return min(self.recovery, self.dist.rounds.max_wait), "silence"
        return grace

    def _departed(self, missing: set[str], now: float, poll: float) -> set[str]:
        """The missing nodes overdue by their own pace (later than their median interval after their
        last delta, and a poll) that hold no lease on their id: they left (departures.py)."""
        if self.departures is None:
            return set()
        overdue: dict[str, float] = {}
        for node in missing - {MASTER_NODE}:
            at, own = self.heard.get(node), self.intervals.get(node)
            if at is not None and own and now - at > median(own) + poll:
                overdue[node] = at
        return self.departures.gone(overdue) if overdue else set()

    def _carried_due(self, have: set[str], missing: set[str], opened: float, poll: float) -> float:
        """When the missing nodes of the last round are due, for a round that holds a delta of a node
        that was not in it (a straggler of the last round, a joiner): each at its latest arrival plus
        its interval bound (median + k·MAD of its own intervals, + a poll, within its liveness window),
        at most max_wait after the round opened; `opened` when none is predicted. The last round's
        nodes are training on its global, so their deltas come one interval after their last ones,
        whenever the stragglers opened this round. Counted from the round's opening instead, a round
        that stragglers filled to a quorum closed on its grace a second before them, they took the
        next round alone, and the swarm went on in two groups half a round apart (a 30-minute S3
        soak, after a 429/500 storm: three rounds of four deltas each, loss 2.04 → 2.35)."""
        if not self.carried or not have - self.carried:
            return opened
        limit, k = opened + self.dist.rounds.max_wait, self.dist.rounds.grace_mad_k
        due = opened
        for node in missing & self.carried:
            own, at = self.intervals.get(node, []), self.heard.get(node)
            if at is None or len(own) < CARRIED_MIN_INTERVALS:
                continue  # no pace of its own to predict it by: its offset grace stands
            bound = min(robust_bound(own, k) + poll, self.window(node, poll))
            due = max(due, min(limit, at + bound))
        return due

    def _slow(self, expected: set[str], poll: float) -> set[str]:
        """The expected nodes much slower than the fastest (master/pace.py): not waited for, and their
        deltas count toward no quorum (with `min_deltas` set, a round takes that many deltas whoever
        sends them)."""
        if self.min_deltas_set:
            return set()
        slow = slow_nodes(self.intervals, expected, factor=self.dist.rounds.slow_factor, poll=poll)
        for node in slow:
            self._once(
                f"slow:{node}",
                "%s is much slower than the fastest node (rounds.slow_factor %g): rounds do not "
                "wait for it; its deltas count when they come, weighted by tokens and staleness",
                node,
                self.dist.rounds.slow_factor,
            )
        return slow

    def _due(
        self,
        have: set[str],
        counted: set[str],
        arrived: set[str],
        expected: set[str],
        finished: set[str],
        opened: float,
        graces: tuple[float, float],
    ) -> tuple[int, float, str]:
        """(deltas needed, when the round closes, why) for deltas from `have`, of which `counted` weigh
        and `arrived` (not the slow nodes') count toward the quorum; `graces`: the round's, and the one
        for a node that has not started yet."""
        dist = self.dist
        grace, start_grace = graces
        if have and not counted and not expected:
            need, due, why = 1, opened, "none_can_weigh"  # nothing that weighs is due: settle them now
        elif self.min_deltas_set:
            need = max(1, self.min_deltas - len(finished))
            if len(counted) >= need:
                due, why = opened, "min_deltas"
            elif have - counted and expected <= arrived:
                # Some deltas cannot weigh and every node expected is in the round: a round takes one
                # delta per node, so what weighs can only come from a node not started yet, which it
                # waits for as long as one takes to arrive (pooled offsets; initial_grace in the first
                # rounds), not max_wait: every known node waits for this round's global (the attack
                # suite under load: two attackers probed out and a stale honest delta misjudged, 300 s).
                due, why = opened + min(start_grace, dist.rounds.max_wait), "grace"
            else:
                due, why = opened + dist.rounds.max_wait, "max_wait"
        else:
            need = len(expected)
            due, why = deadline(
                opened,
                len(arrived),
                need,
                quorum=dist.rounds.quorum,
                grace=grace,
                max_wait=dist.rounds.max_wait,
            )
        return need, due, why

    def _rule(self, outer_step: int, quorum_nodes: int, grace: float, source: str) -> dict[str, Any]:
        return {
            "outer_step": outer_step + 1,
            "rule": "min_deltas" if self.min_deltas_set else "quorum+grace",
            "quorum": self.dist.rounds.quorum,
            "quorum_nodes": quorum_nodes,
            "grace_s": round(grace, 2),
            "grace_from": source,
            "max_wait_s": self.dist.rounds.max_wait,
        }

    def _members(
        self, live: set[str], joining: set[str], expected: set[str], have: set[str], missing: set[str]
    ) -> dict[str, Any]:
        return {
            "members": sorted(self.allowed) if self.allowed is not None else None,
            "live": sorted(live),
            "joining": sorted(joining),
            "expected": sorted(expected),
            "have": sorted(have),
            "waiting_on": sorted(missing),
            "not_waited_for": sorted((self.allowed or set()) - expected),
            "last": self.last,
        }

    def _log_wait(
        self,
        outer_step: int,
        now: float,
        need: int,
        have: set[str],
        missing: set[str],
        due: float,
        why: str,
        grace: float,
        source: str,
    ) -> None:
        """Say what the round waits for, at most every 10 s (or every poll when polls are slower)."""
        if now - self._last_log < max(10.0, self.dist.node.poll_interval):
            return
        self._last_log = now
        if why == "grace":
            rule = {
                "silence": f"quorum reached; grace {grace:.1f}s after the swarm's silence (the nodes' bus retries)",
                "last round": f"quorum reached with deltas from outside the last round; {grace:.1f}s for the "
                "last round's nodes, training on its global (their intervals)",
            }.get(source, f"quorum reached; grace {grace:.1f}s from {source} arrival history")
        elif why == "max_wait":
            rule = f"quorum of {self.report['quorum_nodes']} not reached: at most max_wait"
        else:
            rule = f"min_deltas {need}"
        logger.info(
            "DiLoCo master: outer step %d waits for deltas from %d nodes: have %s; waiting on %s; "
            "proceeds with what it has at %s (%s)",
            outer_step + 1,
            need,
            ", ".join(sorted(have)) or "none",
            ", ".join(sorted(missing)) or "any node",
            time.strftime("%H:%M:%S", time.localtime(time.time() + due - now)),
            rule,
        )

    def closed(self, ids: dict[str, str], outer_step: int, finished: set[str]) -> None:
        """The open round was applied with {node: delta id}: learn its offsets, remember who missed it."""
        now = self.clock()
        opened = self.opened_at if self.opened_at is not None else now
        self.recovery, self.awaited, self.closed_at = 0.0, set(), now
        self.carried = set(ids)
        for node, delta_id in ids.items():
            if node not in self.skip:
                _push(self.offsets, node, max(0.0, self.seen_at.get(delta_id, opened) - opened))
        missed = sorted(self.round_expected - set(ids) - finished)
        if missed and self.closes_by == "all":
            # Whom it waited on left the expected set (join grace or liveness window over).
            self.closes_by = "not_live"
        for node in missed:
            if node in self.heard:  # a never-heard node's first delta measures its start-up, not its pace
                self.late.setdefault(node, opened)
        self.last = {
            "outer_step": outer_step,
            "waited_s": round(now - opened, 2),
            "closed_by": self.closes_by,
            "without": missed,
        }
        if missed:
            logger.info(
                "DiLoCo master: outer step %d closed after %.1fs (%s) without %s; a later delta of theirs "
                "counts in a later round, weighted by its staleness",
                outer_step,
                now - opened,
                self.closes_by,
                ", ".join(missed),
            )
        self.opened_at = None
        self.skip.clear()
        self.round_expected = set()


def collaborators(manifest: object) -> set[str] | None:
    """The node ids manifest.json lists (None when it is not readable as a collaborator map)."""
    if not isinstance(manifest, dict):
        return None
    listed = manifest.get("collaborators") or {}
    if not isinstance(listed, dict) or len(listed) > MAX_MEMBERS:
        return None
    return {n for n in listed if isinstance(n, str) and codec.NODE_RE.match(n)}


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="seconds")
