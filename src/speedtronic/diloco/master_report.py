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

Both only read the master's fields (master.py keeps the state and the loop); split out so the master
module stays about the outer loop itself.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any

from speedtronic.config.distributed import wait_poll_s
from speedtronic.diloco import codec, master_lease, node_eval
from speedtronic.diloco.bus.base import BusError
from speedtronic.diloco.manifest import now
from speedtronic.errors import SpeedtronicError

logger = logging.getLogger("speedtronic.diloco")

RECENT = 10  # rejected files per node shown in head.json
MAX_NODES = 1000  # nodes with feedback kept (without a collaborator list anyone can make up nodes)
MAX_PENDING_SHOWN = 50  # pending file names per node in the status document (the count is exact)


def note_rejection(master: Any, node: str, name: str, reason: str) -> None:
    if node not in master.feedback and len(master.feedback) >= MAX_NODES:
        del master.feedback[next(iter(master.feedback))]  # the longest-known one
    entry = master.feedback.setdefault(node, {"consecutive": 0, "recent": []})
    entry["consecutive"] = int(entry.get("consecutive", 0)) + 1
    entry["recent"] = [*entry.get("recent", []), [name, reason[:200]]][-RECENT:]
    master.feedback_due = True


def own_rejections(head: Any, node: str, uploaded: list[str], seen: dict[str, str]) -> list[tuple[str, str]]:
    """The worker's side: the files of head.json's "rejections" that this node uploaded itself and
    that are new to `seen` (which is updated); files others planted under its name do not count."""
    entry = (head.get("rejections") or {}).get(node)
    recent = entry.get("recent") if isinstance(entry, dict) else None
    mine = set(uploaded)
    new: list[tuple[str, str]] = []
    for item in recent if isinstance(recent, list) else []:
        if isinstance(item, list) and len(item) == 2 and item[0] in mine and item[0] not in seen:
            seen[item[0]] = str(item[1])
            new.append((item[0], seen[item[0]]))
    return new


def rejection_streak(rejected: dict[str, str], hwm: int) -> list[str]:
    """Own rejected files since the node's last applied delta (the high-water mark is its number)."""
    return sorted(name for name in rejected if codec.parse_delta_name(name)[1] > hwm)


def next_poll(master: Any) -> float:
    """Seconds to the master's next poll: the configured interval (the faster wait_poll_interval while
    a round has deltas and waits for more, and for one interval after an outer step),
    stretched to the bus's budget (a change is logged)."""
    delay = master.bus.poll_delay(master.dist.node.poll_interval, master.poll_cost)
    if abs(delay - master.poll_delay_s) > max(1.0, 0.2 * master.poll_delay_s):
        logger.info(
            "DiLoCo master: polling every %.1fs (configured %gs; about %.1f requests per poll within "
            "the bus's request and commit budgets)",
            delay,
            master.dist.node.poll_interval,
            master.poll_cost,
        )
        master.poll_delay_s = delay
    fast = min(delay, master.bus.poll_delay(wait_poll_s(master.dist.node), master.poll_cost))
    if master.pending_count:
        # A round has deltas and waits for the rest, which usually come close together: poll at
        # distributed.node.wait_poll_interval, so the last one is not left waiting for a whole interval.
        return fast
    stepped_at = getattr(master, "stepped_at", None)
    if stepped_at is not None and master.clock() - stepped_at < delay:
        # Within an interval of an outer step the next round's deltas may come at any moment (as soon
        # as the nodes have installed the global and run H steps): poll at the wait interval, so the
        # first is not left waiting for a whole interval (on a fast round that was a third of the
        # round: bench/wan.py). A few polls more per round; later, the usual cadence.
        return fast
    return delay


def note_applied(master: Any, node: str) -> None:
    entry = master.feedback.get(node)
    if entry is not None:
        entry["consecutive"] = 0


def status(master: Any) -> dict[str, Any]:
    """The master's account of the run, in one document: written as metrics.json and published in
    head.json under "status", which `hub status` reports (launch.run_status), so the operator's two
    views never disagree. Totals — applied, rejected (the latest with reasons), pending (valid-looking
    deltas the master has seen and not settled), finished (nodes whose final delta was applied) — and
    per node the same counts, its pending files, last applied delta, tokens, score, the latest
    rejection and when it was last heard from (wall clock, so the published copy stays meaningful).
    Other parts of the master add their own keys here (leases, the fencing epoch)."""
    applied = set(master.applied)
    pending: dict[str, list[str]] = {}
    for ref in getattr(master, "pending_refs", []):
        if ref.id not in applied and f"{ref.id}@{ref.etag}" not in master.rejected_versions:
            pending.setdefault(ref.node, []).append(ref.name)
    mono, wall = master.clock(), time.time()
    heard = {node: wall - (mono - t) for node, t in master._heard.items()}
    known = set(master.per_node) | set(master.nodes) | set(heard) | set(pending) | set(master.finished)
    return {
        "updated_at": now(),
        "outer_step": master.outer_step,
        "global_val_loss": master.val_losses[-1][1] if master.val_losses else None,
        # run.eval_tasks on the last global model: {"core", "tasks"} (diloco/launch.py's evaluator)
        "global_eval_tasks": getattr(master.evaluate, "tasks", None),
        # The same in the nodes' shape (node_eval.py), which `hub status` shows beside each node's own.
        "global_eval": node_eval.global_summary(
            master.val_losses[-1][0] if master.val_losses else None,
            master.val_losses[-1][1] if master.val_losses else None,
            getattr(master.evaluate, "tasks", None),
        ),
        "applied": len(master.applied),
        "rejected": len(master.rejected),
        "rejected_recent": [dict(r) for r in master.rejected[-RECENT:]],
        "pending": sum(len(v) for v in pending.values()),
        "finished": sorted(master.finished),
        "bytes_in": master.bytes_in,
        "polls": master.polls,
        # Hub API requests per poll (moving average); null on a bus that does not count them.
        "requests_per_poll": round(master.poll_cost, 2) if master.bus.requests_spent() is not None else None,
        "poll_interval_s": round(master.poll_delay_s, 2),
        "waiting": master.waiting or None,
        # The round rule at work: quorum, grace, deadline, live and waited-on nodes (master_rounds.py).
        "round": master.rounds.report or None,
        **master_lease.report(master),  # the fencing epoch and who holds the lease until when
        "end_reason": master.end_reason,  # null while the run goes on (master_end.py)
        "final": master.final,  # the final pick: outer step, from which, val loss, best or last
        "nodes": {node: _node_status(master, node, pending, heard, mono, wall) for node in sorted(known)},
    }


def _node_status(
    master: Any, node: str, pending: dict[str, list[str]], heard: dict[str, float], mono: float, wall: float
) -> dict[str, Any]:
    counts = master.per_node.get(node, {"applied": 0, "rejected": 0, "bytes": 0})
    last = master.nodes.get(node) or {}
    feedback = master.feedback.get(node) or {}
    seen = heard.get(node)
    return {
        "applied": counts.get("applied", 0),
        "rejected": counts.get("rejected", 0),
        "bytes": counts.get("bytes", 0),
        "pending": len(pending.get(node, [])),
        "pending_deltas": sorted(pending.get(node, []))[:MAX_PENDING_SHOWN],
        "finished": node in master.finished,
        "hwm": master.hwm.get(node),
        "last_applied_seq": last.get("seq"),
        "last_applied_outer_step": last.get("outer_step"),
        "last_applied_at": last.get("at"),
        "tokens": last.get("tokens", 0),
        "eval": last.get("eval"),  # the node's own latest evaluation (node_eval.py), or null
        "score": master.peers.get(node),
        "consecutive_rejections": feedback.get("consecutive", 0),
        "last_rejection": (feedback.get("recent") or [None])[-1],
        "last_seen_at": None if seen is None else _iso(seen),
        "last_seen_s_ago": None if seen is None else round(max(0.0, wall - seen), 1),
    }


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="seconds")


def metrics(master: Any) -> dict[str, Any]:
    """What metrics.json shows: the status document (see `status`)."""
    return status(master)


def publish_final(master: Any) -> None:
    """On stop: publish the head once more when the counts in the published status are not the
    master's latest (rejections or arrivals after the last outer step), so `hub status` ends equal to
    metrics.json. Never after an error (another master, no permission): nothing is published then."""
    head = master.head
    if master.error is not None or head is None:
        return
    published = head.get("status") or {}
    current = status(master)
    keys = ("outer_step", "applied", "rejected", "pending", "finished")
    if all(published.get(k) == current[k] for k in keys) and _node_counts(published) == _node_counts(current):
        return
    try:
        master.publish()
    except (BusError, SpeedtronicError) as error:
        logger.warning("DiLoCo master: could not publish the final status (%s)", error)


def _node_counts(document: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    nodes = document.get("nodes") or {}
    return {
        n: tuple(v.get(k) for k in ("applied", "rejected", "pending", "finished"))
        for n, v in nodes.items()
        if isinstance(v, dict)
    }


def progress_line(
    master: Any, end: int, unfinished: list[str], idle_left: float, ended_at: float | None, linger_s: float
) -> str:
    """What the master waits for and until when, in one line."""

    def at(seconds_from_now: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(time.time() + max(0.0, seconds_from_now)))

    parts = [f"outer step {master.outer_step} of {end}", f"{master.pending_count} deltas pending"]
    if master.waiting:
        parts.append(
            f"outer step {master.waiting['outer_step']} waits for {', '.join(master.waiting['waiting_on']) or 'any node'} "
            f"(has {len(master.waiting['have'])} of {master.waiting['need']}) until "
            f"{time.strftime('%H:%M:%S', time.localtime(master.waiting['until']))}"
        )
    elif master.outer_step < end:
        parts.append("waiting for deltas")
    if unfinished:
        shown = ", ".join(unfinished[:8]) + (
            f" and {len(unfinished) - 8} more" if len(unfinished) > 8 else ""
        )
        parts.append(f"final deltas still due from {shown}")
    elif ended_at is not None:
        parts.append(f"late joiners may still send until {at(ended_at + linger_s - time.monotonic())}")
    parts.append(f"next poll in {master.poll_delay_s:.0f}s")
    parts.append(f"gives up at {at(idle_left)} without news")
    return " · ".join(parts)
