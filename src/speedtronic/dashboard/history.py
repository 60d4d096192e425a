"""A swarm's history, built up from its successive status documents (`hub status --json`).

The bus holds the run's present, not its past: head.json says the outer step, the latest global and
node evaluations, the round at work and how the last one closed. The dashboard keeps what it saw at
each poll: the global model's val loss per outer step (seeded from the master's own list,
`global_val_losses`, so a dashboard started late still draws the whole curve), each node's own
evaluations, when each outer step was published (round durations), how each round closed and whom it
went without, and each node's counted tokens over the master's clock (tokens/s).

Everything read is untrusted (anyone who can write to the bus can edit head.json): numbers are checked
finite, names bounded, and every list is capped at MAX_POINTS entries (the oldest go first).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

MAX_POINTS = 2000  # per curve, per node
MAX_NODES = 256  # nodes with a curve of their own
RATE_WINDOW = 4  # token-count changes a tokens/s value spans


def finite(value: object) -> float | None:
    """`value` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def stamp(value: object) -> float | None:
    """An ISO 8601 time (the master's clock, UTC) as Unix seconds, or None."""
    if not isinstance(value, str) or len(value) > 40:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def _capped(points: dict[Any, Any]) -> None:
    while len(points) > MAX_POINTS:
        del points[next(iter(points))]


class SwarmHistory:
    """Curves and rounds of one swarm, as seen poll by poll. `add(status)` is the only change."""

    def __init__(self) -> None:
        self.global_loss: dict[int, tuple[float, float | None]] = {}  # outer step -> (loss, published at)
        self.node_loss: dict[str, dict[int, tuple[int, float, float | None]]] = {}  # local step -> …
        self.published: dict[int, float] = {}  # outer step -> when head.json said it was published
        self.closed: dict[int, dict[str, Any]] = {}  # outer step -> how its round closed
        self.tokens: dict[str, dict[float, int]] = {}  # node -> {applied at: counted tokens}

    def add(self, status: dict[str, Any]) -> None:
        """Take what one status document adds to the history."""
        outer = status.get("outer_step")
        at = stamp(status.get("updated_at"))
        if isinstance(outer, int) and at is not None:
            self.published.setdefault(outer, at)
            _capped(self.published)
        for point in status.get("global_val_losses") or []:
            if isinstance(point, list) and len(point) == 2 and isinstance(point[0], int):
                loss = finite(point[1])
                if loss is not None and point[0] not in self.global_loss:
                    self.global_loss[point[0]] = (loss, self.published.get(point[0]))
        summary = status.get("global_eval") or {}
        loss = finite(summary.get("val_loss"))
        if isinstance(summary.get("step"), int) and loss is not None:
            self.global_loss[summary["step"]] = (loss, self.published.get(summary["step"], at))
        _capped(self.global_loss)
        self._add_round(status.get("round"))
        for entry in (status.get("collaborators") or [])[:MAX_NODES]:
            if isinstance(entry, dict) and isinstance(entry.get("node"), str):
                self._add_node(entry)

    def _add_round(self, report: object) -> None:
        last = report.get("last") if isinstance(report, dict) else None
        if isinstance(last, dict) and isinstance(last.get("outer_step"), int):
            without = last.get("without") if isinstance(last.get("without"), list) else []
            self.closed[last["outer_step"]] = {
                "closed_by": str(last.get("closed_by") or "?")[:40],
                "waited_s": finite(last.get("waited_s")),
                "without": [str(n)[:64] for n in without[:32]],
            }
            _capped(self.closed)

    def _add_node(self, entry: dict[str, Any]) -> None:
        node = entry["node"][:64]
        if node not in self.node_loss and len(self.node_loss) >= MAX_NODES:
            return
        summary = entry.get("eval") or {}
        loss = finite(summary.get("val_loss"))
        outer = entry.get("latest_applied_outer_step")
        if isinstance(summary.get("step"), int) and loss is not None and isinstance(outer, int):
            curve = self.node_loss.setdefault(node, {})
            curve.setdefault(summary["step"], (outer, loss, stamp(entry.get("latest_applied_at"))))
            _capped(curve)
        tokens, at = entry.get("tokens"), stamp(entry.get("latest_applied_at"))
        if isinstance(tokens, int) and not isinstance(tokens, bool) and at is not None:
            seen = self.tokens.setdefault(node, {})
            seen.setdefault(at, tokens)
            _capped(seen)

    # -- what the page draws ---------------------------------------------------------------------
    def rounds(self) -> list[dict[str, Any]]:
        """Each outer step seen: when it was published, how long since the one before (when both were
        seen: a step the dashboard missed leaves a gap), and how its round closed."""
        out = []
        for step in sorted(set(self.published) | set(self.closed)):
            at, before = self.published.get(step), self.published.get(step - 1)
            duration = at - before if at is not None and before is not None else None
            out.append({"outer_step": step, "at": at, "duration_s": duration, **self.closed.get(step, {})})
        return out

    def token_rates(self) -> dict[str, list[list[float]]]:
        """Per node, [[time, tokens/s]]: counted tokens over the master's clock, across the last
        RATE_WINDOW changes of the count."""
        out: dict[str, list[list[float]]] = {}
        for node, seen in self.tokens.items():
            points = sorted(seen.items())
            rates = []
            for i in range(1, len(points)):
                t0, n0 = points[max(0, i - RATE_WINDOW)]
                t1, n1 = points[i]
                if t1 > t0 and n1 >= n0:
                    rates.append([t1, (n1 - n0) / (t1 - t0)])
            out[node] = rates
        return out

    def document(self) -> dict[str, Any]:
        """The history as the page reads it (JSON)."""
        return {
            "global_loss": [[s, v, t] for s, (v, t) in sorted(self.global_loss.items())],
            "node_loss": {
                node: [[outer, loss, at, step] for step, (outer, loss, at) in sorted(curve.items())]
                for node, curve in self.node_loss.items()
            },
            "rounds": self.rounds(),
            "tokens_per_s": self.token_rates(),
        }
