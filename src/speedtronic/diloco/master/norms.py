"""The arithmetic behind the master's claim and norm checks (checks.py wraps them as named checks).

Peers are listed collaborators, but not trusted. Two kinds of rules live here:

Claims bounded by the run. A delta's `tokens` is its weight in the mean, so it may claim at most the
node's plan for one round, `max_delta_tokens` (manifest.py: inner_steps × tokens per step), times the
rounds a merged delta can honestly span (a failed upload is merged into the next delta; it is then
stale by as many rounds and weighted 1/(1+staleness), so a merged claim never outweighs one round).
Past the bound it is clipped, logged with the node and the claim. A sequence number more than
codec.SEQ_WINDOW past the node's high-water mark and a negative or unparsable local step are rejected.

Norms that cannot be gamed from either side. The outlier check compares a delta's norm with a
reference built from the recent deltas that weighed in an outer step the master kept, plus this
round's candidates (so a new round's own norms always vote and rejections cannot starve it), where
each node has one vote — the median of its own last few norms — so one node cannot fill the history.
Norms of rejected, quarantined or probed-out deltas, or of a refused step, never enter the history:
a hostile majority cannot drag the bounds along with its attack. The reference is the median of the votes on a log scale (with two nodes:
their geometric mean); the allowance is `outlier_factor`, widened by the votes' spread (3 × the
scaled median absolute deviation of log norms) when honest nodes differ legitimately. The
reference is clamped to [norm_floor, 1] × the global weights' norm: tiny deltas can never become a
reference that locks honest peers out, and huge ones can never raise it past the model itself. On top
of it, no delta may exceed `outlier_factor` × the global weights' norm (no history needed).
This module has no I/O beyond logging.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from typing import Any

from speedtronic.diloco import codec

logger = logging.getLogger("speedtronic.diloco")

PER_NODE = 4  # candidates of one node that make its vote
HISTORY = 128  # candidates remembered in all


def rounds_spanned(seq: int, hwm: int, staleness: int, span: int) -> int:
    """The rounds one delta may stand for: the sequence numbers it covers past the node's mark (a worker
    folds the deltas the master did not answer into one), at most its staleness + 1 or `span` — the
    node's usual intervals it took to come, on the master's own clock. At least 1."""
    return max(1, min(seq - hwm, max(staleness + 1, span)))


def clip_tokens(node: str, claim: int, bound: int, rounds: int, delta_id: str, say: bool = True) -> int:
    """The tokens a delta counts for: its claim, at most `bound` × the `rounds` it can span
    (`rounds_spanned`; a clipped claim is logged when `say`: once per delta, however often a waiting
    round reads it). Staleness alone counted a delta folded over a 20-s bus outage as one round (no
    round passes while the bus is down); in a 30-minute soak the applied deltas claimed 0.899 of the
    fault-free twin's tokens and counted for 0.876."""
    limit = bound * rounds
    if claim > limit:
        (logger.warning if say else logger.debug)(
            "DiLoCo master: delta %s from %s claims %d tokens, more than its plan allows (%d: "
            "inner_steps × tokens per step%s); counted as %d",
            delta_id,
            node,
            claim,
            limit,
            f" × {rounds} merged rounds" if rounds > 1 else "",
            limit,
        )
        return limit
    return max(1, claim)


def check_sequence(seq: int, hwm: int) -> None:
    """Reject a sequence number no honest worker would use (it numbers from the master's mark)."""
    if seq > hwm + codec.SEQ_WINDOW:
        raise codec.Rejected(
            f"sequence number {seq} is more than {codec.SEQ_WINDOW} past the node's last applied #{hwm}"
        )


def check_local_step(decoded: codec.Decoded) -> None:
    raw = decoded.meta.get("local_step", "0")
    try:
        step = int(raw)
    except ValueError:
        raise codec.Rejected(f"local_step {raw[:20]!r} is not an integer") from None
    if step < 0:
        raise codec.Rejected(f"local_step {step} is negative")


def norm_reference(
    history: list[list[Any]], current: dict[str, float], floor: float, ceiling: float
) -> tuple[float, float, float]:
    """(reference norm, raw median of the votes, allowed ratio spread as a log) over the history's
    [node, norm] candidates and this round's {node: norm}."""
    per_node: dict[str, list[float]] = {}
    for node, value in history:
        per_node.setdefault(str(node), []).append(float(value))
    for node, value in current.items():
        per_node.setdefault(node, []).append(value)
    votes = [math.log(max(statistics.median(v[-PER_NODE:]), 1e-30)) for v in per_node.values()]
    if not votes:
        return floor, 0.0, 0.0  # nothing to compare with: only the absolute bounds apply
    center = statistics.median(votes)
    mad = statistics.median(abs(v - center) for v in votes)
    raw = math.exp(center)
    return min(ceiling, max(floor, raw)), raw, 3 * 1.4826 * mad


def norm_outliers(
    history: list[list[Any]],
    candidates: dict[str, tuple[str, float]],
    factor: float,
    global_norm: float,
    floor_fraction: float,
) -> dict[str, str]:
    """{delta id: reason} for this round's candidates ({id: (node, norm)}) whose norm is an outlier."""
    current: dict[str, float] = {}
    for node, value in candidates.values():
        current[node] = value
    ref, raw, spread = norm_reference(history, current, floor_fraction * global_norm, global_norm)
    allowed = max(factor, math.exp(spread))
    out: dict[str, str] = {}
    for delta_id, (_node, value) in candidates.items():
        if value > allowed * ref:
            out[delta_id] = (
                f"norm outlier ({value:.3g}, about {value / ref:.0f}× the reference {ref:.3g}: the median "
                f"of recent nodes' norms {raw:.3g}, at least {floor_fraction:g}× the global weights' norm; "
                f"allowed {allowed:.3g}×)"
            )
    return out


def remember(history: list[list[Any]], candidates: dict[str, tuple[str, float]]) -> list[list[Any]]:
    """The history with this round's candidates appended (bounded)."""
    return [*history, *([node, value] for node, value in candidates.values())][-HISTORY:]


class NormHistory:
    """The [node, norm] of recent deltas that weighed in a kept outer step (persisted in the state file)."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []

    def outliers(
        self, candidates: dict[str, tuple[str, float]], factor: float, global_norm: float, floor: float
    ) -> dict[str, str]:
        return norm_outliers(self.entries, candidates, factor, global_norm, floor)

    def remember(self, candidates: dict[str, tuple[str, float]]) -> None:
        self.entries = remember(self.entries, candidates)

    def to_json(self) -> str:
        return json.dumps(self.entries)

    def load(self, raw: str) -> None:
        # [node, norm] pairs; an older state's bare floats (accepted norms only, of unknown nodes: the
        # history that could lock honest peers out) are dropped.
        self.entries = [
            [str(e[0]), float(e[1])]
            for e in json.loads(raw)
            if isinstance(e, list) and len(e) == 2 and isinstance(e[1], (int, float))
        ]
