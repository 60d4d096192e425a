"""Which live nodes a round does not wait for because they are much slower than the rest.

A swarm mixes fast and slow machines. Waiting for a node four times slower than the others makes every
round four times longer and idles the fast nodes (they wait for the global that answers their delta),
so slow peers would cost the swarm more than they bring. A node counts as *slow* when, by its own
recent history, either

- its typical interval between deltas (median) is over `distributed.rounds.slow_factor` × that of the
  quorum's pace — the q-th fastest typical interval among the round's expected nodes with a history,
  q = the quorum count — plus two polls (a slow node that is not waited for keeps its own pace), or
- its typical arrival offset in the rounds (median of at least MIN_SAMPLES: as soon as the offsets
  could teach the grace to wait for it) is over (1 − 1/slow_factor) × its own typical interval (one
  interval is enough here). While rounds still wait for a slow node every node sends at the round's pace (the fast
  ones wait for the global that answers them), so intervals look alike; but each round then opens
  with the fast nodes' deltas and the slow one comes last, its offset being about
  interval × (1 − its speed relative to theirs). Upload times that differ by seconds in rounds of
  minutes stay far below the bound.

A slow node is not waited for: the round closes on the others by its usual rule, and a slow node's
delta counts in the round open when it arrives (or opens one), weighted by its tokens and staleness
(outer.staleness_weight), never rejected for being slow. `slow_factor: null` waits for every live node.
"""

from __future__ import annotations

import math
from statistics import median

MIN_SAMPLES = 3  # values of its own a node needs before it can count as slow (rounds.MIN_SAMPLES)


def _pace(history: dict[str, list[float]], nodes: set[str], need: int = MIN_SAMPLES) -> dict[str, float]:
    return {n: median(history[n]) for n in nodes if len(history.get(n, ())) >= need}


def _beyond(typical: dict[str, float], q: int, factor: float, poll: float) -> set[str]:
    """Nodes whose typical value is over factor × the q-th smallest, plus two polls."""
    if len(typical) < 2:
        return set()
    ranked = sorted(typical.values())
    bound = factor * ranked[min(q, len(ranked)) - 1] + 2 * poll
    return {n for n, v in typical.items() if v > bound and math.isfinite(v)}


def _late_in_rounds(
    offsets: dict[str, float], intervals: dict[str, float], factor: float, poll: float
) -> set[str]:
    """Nodes that come last in rounds that wait for them: offset over (1 − 1/factor) × interval."""
    share = 1.0 - 1.0 / factor
    return {n for n, off in offsets.items() if n in intervals and off > share * intervals[n] + 2 * poll}


def slow_nodes(
    offsets: dict[str, list[float]],
    intervals: dict[str, list[float]],
    expected: set[str],
    *,
    quorum_nodes: int,
    factor: float | None,
    poll: float,
) -> set[str]:
    """The slow nodes among `expected` (the round's expected nodes; `quorum_nodes` of them make its
    quorum), by the rule above."""
    if factor is None or len(expected) < 2:
        return set()
    paces = _pace(intervals, expected)
    # As soon as the offsets could teach the grace to wait for it (MIN_SAMPLES of its own), with any
    # interval of its own to compare them with.
    some = _pace(intervals, expected, need=1)
    late = _late_in_rounds(_pace(offsets, expected), some, factor, poll)
    return _beyond(paces, max(1, quorum_nodes), factor, poll) | late
