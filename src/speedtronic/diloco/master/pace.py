"""Which live nodes a round does not wait for because they are much slower than the rest.

A swarm mixes fast and slow machines. Waiting for a node four times slower than the others makes every
round four times longer and idles the fast nodes (they wait for the global that answers their delta),
so slow peers would cost the swarm more than they bring. A node counts as *slow* when its typical
interval between deltas (the median of its own, at least MIN_INTERVALS of them: three deltas) is over
`distributed.rounds.slow_factor` × the fastest expected node's typical interval, plus two polls.

Why the fastest, not the quorum's pace: with two fast and two slow nodes, one fast node briefly out of
the expected set (it waits for its global) made the slow ones the quorum's pace, and rounds waited
for them again.

A slow node neither holds a round nor makes one: it is not waited for, and its delta does not count
toward the quorum (a round that slow deltas open waits for the others by the usual rule), but it is
applied in the round open when it comes, weighted by its tokens and staleness
(outer.staleness_weight), never rejected for being slow. When only slow nodes are live, nothing is
waited for: their deltas are applied as they come. `slow_factor: null` waits for every live node.

Why intervals, not arrival offsets: offsets are measured from when a round opens, and a round opened
by a slow node's delta finds the fast nodes mid-way through their inner steps, so a fast node can look
late by offset; its interval stays its own pace.
"""

from __future__ import annotations

import math
from statistics import median

MIN_INTERVALS = 2  # intervals of its own (three deltas) a node needs before it can count as slow


def slow_nodes(
    intervals: dict[str, list[float]], expected: set[str], *, factor: float | None, poll: float
) -> set[str]:
    """The slow nodes among `expected` (the round's expected nodes), by the rule above."""
    if factor is None or len(expected) < 2:
        return set()
    paces = {n: median(intervals[n]) for n in expected if len(intervals.get(n, ())) >= MIN_INTERVALS}
    if len(paces) < 2:
        return set()
    bound = factor * min(paces.values()) + 2 * poll
    return {n for n, v in paces.items() if v > bound and math.isfinite(v)}
