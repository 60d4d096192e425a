"""What the DiLoCo master reports: its status document (metrics.json, and head.json's "status", which
`hub status` shows: one function, so the two never disagree), the one-line progress log, the per-node
rejection feedback it publishes in head.json, and its poll pace (logged when it changes).

Rejection feedback: for each node, how many of its deltas were rejected in a row since its last
applied one, and the latest rejected files with their reasons (`head.json` "rejections"). A worker
reads it on every poll, logs the reasons for the files it uploaded itself (anyone who can write to
the bus could plant files under its name) and stops after `distributed.worker.max_consecutive_rejections`
(coordinator.py). When a poll rejects deltas without an outer step, the master republishes the same
global with the new head at most every `distributed.defences.rejection_feedback_s` seconds (default 60), so a
node that is locked out learns it even though the run is not moving.

`Report` owns the feedback, the poll counters and pace and when metrics.json was last written; the
status document only reads the other parts (`Sources`), it never changes them. Each rejection names
the check that refused the file (checks.py), so the status shows which defence is at work.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.config.distributed import wait_poll_s
from speedtronic.diloco import node_eval
from speedtronic.diloco.bus.base import Bus, DeltaRef
from speedtronic.diloco.manifest import now

if TYPE_CHECKING:
    from speedtronic.config.distributed import DistributedConfig
    from speedtronic.diloco.master.end import RunEnd
    from speedtronic.diloco.master.lease import Fence
    from speedtronic.diloco.master.ledger import Ledger
    from speedtronic.diloco.master.peers import Peers
    from speedtronic.diloco.master.rounds import Rounds

logger = logging.getLogger("speedtronic.diloco")

RECENT = 10  # rejected files per node shown in head.json
MAX_NODES = 1000  # nodes with feedback kept (without a collaborator list anyone can make up nodes)
MAX_PENDING_SHOWN = 50  # pending file names per node in the status document (the count is exact)
HISTORY = 500  # global val losses kept in the status document ([outer step, loss]: a dashboard curve)
METRICS_FILE = "metrics.json"
# Rounds at most this many poll intervals long are polled at the wait interval throughout (next_poll)...
SHORT_ROUND_POLLS = 10
# ... except before the next round's deltas can be expected: from the step to one poll interval before
# the second earliest of the last FIRST_ARRIVALS rounds' first deltas (one early round in them is
# tolerated: a straggler of the round before, seen just after the step).
FIRST_ARRIVALS = 8


class Report:
    """Rejection feedback, poll counters and pace, and metrics.json's writing."""

    def __init__(self, dist: DistributedConfig, state_dir: str | Path) -> None:
        self.dist = dist
        self.metrics_path = Path(state_dir) / METRICS_FILE
        self.feedback: dict[str, dict[str, Any]] = {}  # node -> rejections in a row, latest reasons
        self.feedback_due = False
        self.feedback_every_s = float(dist.defences.rejection_feedback_s)
        self.published_at = 0.0
        self.metrics_at = 0.0
        self.polls = 0
        self.poll_cost = 1.0  # requests per poll (moving average, from the bus when it counts them)
        self.poll_delay_s = dist.node.poll_interval
        self.stepped_at: float | None = None  # this process's latest outer step (the master's clock)
        self.step_gaps: deque[float] = deque(maxlen=16)  # seconds between its latest outer steps
        # Seconds from each of the latest outer steps to the first new delta seen after it.
        self.first_arrivals: deque[float] = deque(maxlen=FIRST_ARRIVALS)
        self.heard_since_step = False
        # Called with the master after each poll and on stop: the user's trackers (tracking.py).
        self.watchers: list[Callable[..., None]] = []

    # -- feedback -------------------------------------------------------------------------------------
    def note_rejection(self, node: str, name: str, reason: str) -> None:
        if node not in self.feedback and len(self.feedback) >= MAX_NODES:
            del self.feedback[next(iter(self.feedback))]  # the longest-known one
        entry = self.feedback.setdefault(node, {"consecutive": 0, "recent": []})
        entry["consecutive"] = int(entry.get("consecutive", 0)) + 1
        entry["recent"] = [*entry.get("recent", []), [name, reason[:200]]][-RECENT:]
        self.feedback_due = True

    def note_applied(self, node: str) -> None:
        entry = self.feedback.get(node)
        if entry is not None:
            entry["consecutive"] = 0

    def republish_due(self) -> bool:
        """A poll rejected deltas without an outer step: republish at most every rejection_feedback_s."""
        return self.feedback_due and time.monotonic() - self.published_at >= self.feedback_every_s

    def published(self) -> None:
        self.feedback_due, self.published_at = False, time.monotonic()

    def feedback_json(self) -> str:
        return json.dumps(self.feedback)

    def load_feedback(self, raw: str) -> None:
        self.feedback = json.loads(raw)

    # -- polls -----------------------------------------------------------------------------------------
    def polled(self, cost: float | None) -> None:
        self.polls += 1
        if cost is not None:
            self.poll_cost = 0.8 * self.poll_cost + 0.2 * cost

    def stepped(self, now: float) -> None:
        if self.stepped_at is not None:
            self.step_gaps.append(now - self.stepped_at)
        self.stepped_at = now
        self.heard_since_step = False

    def heard(self, now: float) -> None:
        """A poll saw a new delta: the first since the latest outer step is when its round began to come."""
        if self.stepped_at is not None and not self.heard_since_step:
            self.first_arrivals.append(now - self.stepped_at)
        self.heard_since_step = True

    def quiet_left(self, since_step: float, delay: float) -> float:
        """Seconds after an outer step still before the next round's deltas can be expected: until one
        poll interval before the second earliest recent first arrival (FIRST_ARRIVALS); 0 while fewer
        than 3 rounds are known. A delta sooner than that is found at the usual cadence, one interval
        late at most; the rest of the round is polled at the wait interval."""
        if len(self.first_arrivals) < 3:
            return 0.0
        expected = sorted(self.first_arrivals)[1]
        return max(0.0, expected - delay - since_step)

    def short_rounds(self, delay: float) -> bool:
        """Whether this master's recent rounds are short: at most SHORT_ROUND_POLLS poll intervals from
        one outer step to the next (the median of the last ones)."""
        if len(self.step_gaps) < 3:
            return False
        return statistics.median(self.step_gaps) <= SHORT_ROUND_POLLS * delay

    def since_step(self, now: float) -> float | None:
        return None if self.stepped_at is None else now - self.stepped_at

    def next_poll(self, bus: Bus, pending: int, since_step: float | None) -> float:
        """Seconds to the master's next poll: the configured interval (the faster wait_poll_interval while
        a round has deltas and waits for more, and for one interval after an outer step: `since_step`
        seconds ago, or throughout short rounds, once their deltas can be expected), stretched to the
        bus's budget (a change is logged)."""
        delay = bus.poll_delay(self.dist.node.poll_interval, self.poll_cost)
        if abs(delay - self.poll_delay_s) > max(1.0, 0.2 * self.poll_delay_s):
            logger.info(
                "DiLoCo master: polling every %.1fs (configured %gs; about %.1f requests per poll within "
                "the bus's request and commit budgets)",
                delay,
                self.dist.node.poll_interval,
                self.poll_cost,
            )
            self.poll_delay_s = delay
        fast = min(delay, bus.poll_delay(wait_poll_s(self.dist.node), self.poll_cost))
        if pending:
            # A round has deltas and waits for the rest, which usually come close together: poll at
            # distributed.node.wait_poll_interval, so the last one is not left waiting for a whole interval.
            return fast
        if since_step is not None and (since_step < delay or self.short_rounds(delay)):
            # Within an interval of an outer step the next round's deltas may come at any moment (as soon
            # as the nodes have installed the global and run H steps): poll at the wait interval, so the
            # first is not left waiting for a whole interval (on a fast round that was a third of the
            # round: bench/wan.py). A few polls more per round; later, the usual cadence — unless the
            # rounds are short: then the next round's deltas all land within a few intervals of the
            # step, together (the workers start the round together), and the usual cadence found them a
            # quarter of a second late on a 1.5-s round (bench/wan.py, a timeline with ms stamps).
            # Not before the deltas can come, though (quiet_left): on S3 that was 35 listings a 4-s round,
            # 17 without anything to find (bench/scale.py, 8 nodes).
            quiet = self.quiet_left(since_step, delay)
            return fast if quiet <= 0 else max(fast, min(delay, quiet))
        return delay

    # -- metrics.json ------------------------------------------------------------------------------------
    def write_metrics(self, document: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """metrics.json in the state directory, for operators and dashboards (atomically replaced)."""
        if not force and time.monotonic() - self.metrics_at < 30.0 and self.polls > 1:
            return
        self.metrics_at = time.monotonic()
        try:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.metrics_path, (json.dumps(document(), indent=1) + "\n").encode())
        except OSError as error:
            logger.warning("DiLoCo master: could not write %s (%s)", self.metrics_path, error)


@dataclass
class Sources:
    """What the status document is made of (read only)."""

    ledger: Ledger
    rounds: Rounds
    peers: Peers
    fence: Fence
    end: RunEnd
    report: Report
    bus: Bus
    pending_refs: list[DeltaRef]
    pending_count: int
    evaluate: Callable[..., float] | None  # the evaluator (node_eval.Evaluator); its `tasks` are shown


def status(src: Sources) -> dict[str, Any]:
    """The master's account of the run, in one document: written as metrics.json and published in
    head.json under "status", which `hub status` reports (launch.run_status), so the operator's two
    views never disagree. Totals — applied, rejected (the latest with reasons and the check that
    refused them), pending (valid-looking deltas the master has seen and not settled), finished (nodes
    whose final delta was applied) — and per node the same counts, its pending files, last applied
    delta, tokens, score, the latest rejection and when it was last heard from (wall clock, so the
    published copy stays meaningful). Other parts of the master add their own keys here (leases, the
    fencing epoch)."""
    ledger, report = src.ledger, src.report
    applied = set(ledger.applied_ids)
    pending: dict[str, list[str]] = {}
    for ref in src.pending_refs:
        if ref.id not in applied and not ledger.was_rejected(ref):
            pending.setdefault(ref.node, []).append(ref.name)
    mono, wall = src.rounds.clock(), time.time()
    heard = {node: wall - (mono - t) for node, t in src.rounds.heard.items()}
    known = set(ledger.per_node) | set(ledger.nodes) | set(heard) | set(pending) | set(ledger.finished)
    tasks = getattr(src.evaluate, "tasks", None)
    last = ledger.val_losses[-1] if ledger.val_losses else None
    return {
        "updated_at": now(),
        "outer_step": ledger.outer_step,
        "global_val_loss": last[1] if last else None,
        # The curve so far, so a dashboard started late still draws it (speedtronic/dashboard).
        "global_val_losses": [[int(s), float(v)] for s, v in ledger.val_losses[-HISTORY:]],
        # run.eval_tasks on the last global model: {"core", "tasks"} (diloco/launch.py's evaluator)
        "global_eval_tasks": tasks,
        # The same in the nodes' shape (node_eval.py), which `hub status` shows beside each node's own.
        "global_eval": node_eval.global_summary(last[0] if last else None, last[1] if last else None, tasks),
        "applied": len(ledger.applied_ids),
        "rejected": len(ledger.rejected),
        "rejected_recent": [dict(r) for r in ledger.rejected[-RECENT:]],
        "rejected_by_check": _by_check(ledger.rejected),
        "pending": sum(len(v) for v in pending.values()),
        "finished": sorted(ledger.finished),
        "bytes_in": ledger.bytes_in,
        "polls": report.polls,
        # Hub API requests per poll (moving average); null on a bus that does not count them.
        "requests_per_poll": round(report.poll_cost, 2) if src.bus.requests_spent() is not None else None,
        "poll_interval_s": round(report.poll_delay_s, 2),
        "waiting": src.rounds.waiting or None,
        # The round rule at work: quorum, grace, deadline, live and waited-on nodes (rounds.py).
        "round": src.rounds.report or None,
        **src.fence.report(),  # the fencing epoch and who holds the lease until when
        **src.end.report(),  # why the run ended and the final pick (null while it goes on: end.py)
        "nodes": {node: _node_status(src, node, pending, heard, wall) for node in sorted(known)},
    }


def _by_check(rejected: list[dict[str, str]]) -> dict[str, int]:
    """How many of the remembered rejections each check made ("?": from a state before checks had names)."""
    counts: dict[str, int] = {}
    for entry in rejected:
        name = str(entry.get("check", "?"))
        counts[name] = counts.get(name, 0) + 1
    return counts


def _node_status(
    src: Sources, node: str, pending: dict[str, list[str]], heard: dict[str, float], wall: float
) -> dict[str, Any]:
    ledger = src.ledger
    counts = ledger.per_node.get(node, {"applied": 0, "rejected": 0, "bytes": 0})
    last = ledger.nodes.get(node) or {}
    feedback = src.report.feedback.get(node) or {}
    seen = heard.get(node)
    return {
        "applied": counts.get("applied", 0),
        "rejected": counts.get("rejected", 0),
        "bytes": counts.get("bytes", 0),
        "pending": len(pending.get(node, [])),
        "pending_deltas": sorted(pending.get(node, []))[:MAX_PENDING_SHOWN],
        "finished": node in ledger.finished,
        "hwm": ledger.hwm.get(node),
        "last_applied_seq": last.get("seq"),
        "last_applied_outer_step": last.get("outer_step"),
        "last_applied_at": last.get("at"),
        "tokens": last.get("tokens", 0),
        "tokens_claimed": last.get("claimed"),  # what its applied deltas claimed (tokens: as counted)
        "eval": last.get("eval"),  # the node's own latest evaluation (node_eval.py), or null
        "score": src.peers.scores.get(node),
        "consecutive_rejections": feedback.get("consecutive", 0),
        "last_rejection": (feedback.get("recent") or [None])[-1],
        "last_seen_at": None if seen is None else _iso(seen),
        "last_seen_s_ago": None if seen is None else round(max(0.0, wall - seen), 1),
    }


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="seconds")


def unchanged(published: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a published status has the current counts (the final republish is then not needed)."""
    keys = ("outer_step", "applied", "rejected", "pending", "finished")
    return all(published.get(k) == current[k] for k in keys) and _node_counts(published) == _node_counts(
        current
    )


def _node_counts(document: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    nodes = document.get("nodes") or {}
    return {
        n: tuple(v.get(k) for k in ("applied", "rejected", "pending", "finished"))
        for n, v in nodes.items()
        if isinstance(v, dict)
    }


def progress_line(
    outer_step: int,
    end: int,
    pending: int,
    waiting: dict[str, Any],
    poll_delay_s: float,
    unfinished: list[str],
    idle_left: float,
    ended_at: float | None,
    linger_s: float,
) -> str:
    """What the master waits for and until when, in one line."""

    def at(seconds_from_now: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(time.time() + max(0.0, seconds_from_now)))

    parts = [f"outer step {outer_step} of {end}", f"{pending} deltas pending"]
    if waiting:
        parts.append(
            f"outer step {waiting['outer_step']} waits for {', '.join(waiting['waiting_on']) or 'any node'} "
            f"(has {len(waiting['have'])} of {waiting['need']}) until "
            f"{time.strftime('%H:%M:%S', time.localtime(waiting['until']))}"
        )
    elif outer_step < end:
        parts.append("waiting for deltas")
    if unfinished:
        shown = ", ".join(unfinished[:8]) + (
            f" and {len(unfinished) - 8} more" if len(unfinished) > 8 else ""
        )
        parts.append(f"final deltas still due from {shown}")
    elif ended_at is not None:
        parts.append(f"late joiners may still send until {at(ended_at + linger_s - time.monotonic())}")
    parts.append(f"next poll in {poll_delay_s:.0f}s")
    parts.append(f"gives up at {at(idle_left)} without news")
    return " · ".join(parts)
