"""A per-peer score the DiLoCo master keeps: does a node's delta agree with the other nodes'?

Every round with at least two accepted deltas, each node's delta direction u = Δ/‖Δ‖ is compared
with the sum of the *other* nodes' directions (leave-one-out, unweighted, so neither a token claim
nor a norm buys influence over the score): agreement = cos(u_i, Σ_{j≠i} u_j), over the nodes not in
quarantine. A node's score is an exponential moving average of it (weight 0.3 for the newest round,
so a few rounds decide), bias-corrected like Adam's moments: the first rounds weigh alike instead of
the first one seeding the average, since a node's first round is its least informed (the fewest peers
to agree with; an honest node that met two colluders there was quarantined for it). The score is
persisted in the master's state, published in head.json ("peers", for `hub status`) and metrics.json,
next to its rejection counts.

Quarantine (`distributed.defences.quarantine_below`, default 0, off when null): a node whose score falls below the
threshold after at least MIN_ROUNDS scored rounds is quarantined, logged: its deltas are still
received (decoded, checked, counted, its high-water mark moves, they are deleted), but they weigh 0 in
the round. Its agreement is still measured against the others every round, so it recovers, logged,
once its score is back above the threshold + RECOVERY_MARGIN. Quarantine never covers more than a
strict minority of a round's nodes (the worst-scored first): agreement is a vote, and quarantining
everyone would leave nobody to agree with. Deltas the loss probe caught this round are left out of
"the others", so attackers it sees cannot vote. Honest peers agree positively (their
pseudo-gradients share the descent direction); a reversed delta scores near −1, a random one near 0.
The loss probe (`distributed.defences.loss_probe`, on by default where the master has validation data; the
check `loss_probe` in checks.py) is the Gauntlet's cheap half: each delta applied alone to the global
model, scored on the master's validation batches; one that makes the loss worse than not applying it
weighs 0 that round. Its results are kept here, in each node's score (`note_probe`).

What this cannot see: an attacker that agrees with the others (a small consistent bias rides along
with an honest direction), and a majority of colluders, who define the "others".
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

logger = logging.getLogger("speedtronic.diloco")

ALPHA = 0.3  # weight of the newest round in the score
MIN_ROUNDS = 3  # scored rounds before a node can be quarantined
RECOVERY_MARGIN = 0.1


class Peers:
    """Each node's agreement score, latest probe result and quarantine (`scores`, persisted)."""

    def __init__(self, quarantine_below: float | None) -> None:
        self.threshold = quarantine_below
        self.scores: dict[str, dict[str, Any]] = {}

    def active(self, node: str) -> bool:
        return not (self.scores.get(node) or {}).get("quarantined", False)

    def _entry(self, node: str, agreement: float = 0.0) -> dict[str, Any]:
        return self.scores.setdefault(node, {"agreement": agreement, "rounds": 0, "quarantined": False})

    def note_probe(self, node: str, difference: float) -> None:
        self._entry(node)["probe"] = round(difference, 5)

    def note_probe_failure(self, node: str) -> None:
        entry = self.scores[node]
        entry["probe_failures"] = int(entry.get("probe_failures", 0)) + 1

    def to_json(self) -> str:
        return json.dumps(self.scores)

    def load(self, raw: str) -> None:
        self.scores = json.loads(raw)

    @torch.no_grad()
    def update(
        self, deltas: dict[str, dict[str, torch.Tensor]], probed_worse: set[str] | None = None
    ) -> None:
        """Score this round's accepted deltas ({node: Δ}) and move nodes in or out of quarantine. The
        reference ("the others") is the live nodes whose delta the loss probe did not find harmful this
        round (`probed_worse`: nodes), so attackers the probe caught cannot vote on who agrees."""
        if len(deltas) < 2:
            return  # nothing to agree with
        units: dict[str, dict[str, torch.Tensor]] = {}
        for node, tensors in deltas.items():
            norm = float(torch.sqrt(sum((t.float() ** 2).sum() for t in tensors.values())))
            if norm > 0:
                units[node] = {n: t.float() / norm for n, t in tensors.items()}
        live = [n for n in units if self.active(n)]
        vouched = [n for n in live if n not in (probed_worse or set())]
        live = vouched or live
        if not units or not live:
            return
        total = {n: sum(units[node][n] for node in live) for n in next(iter(units.values()))}
        scored: list[str] = []
        for node, u in units.items():
            others = {n: total[n] - u[n] for n in total} if node in live else total
            size = float(torch.sqrt(sum((t**2).sum() for t in others.values())))
            if size <= 1e-12:
                continue  # only itself among the live ones
            cosine = float(sum((u[n] * others[n]).sum() for n in u)) / size
            entry = self._entry(node, cosine)
            entry["agreement"] = round(_averaged(entry["agreement"], entry["rounds"], cosine), 4)
            entry["last_agreement"] = round(cosine, 4)
            entry["rounds"] += 1
            scored.append(node)
        self._judge(scored)

    def _judge(self, scored: list[str]) -> None:
        threshold = self.threshold
        entries = {node: self.scores[node] for node in scored}
        if threshold is None:
            for entry in entries.values():
                entry["quarantined"] = False  # quarantine switched off since
            return
        for node, entry in entries.items():
            if entry["quarantined"] and entry["agreement"] >= threshold + RECOVERY_MARGIN:
                entry["quarantined"] = False
                logger.warning(
                    "DiLoCo master: node %s leaves quarantine: agreement %.2f is back above %g",
                    node,
                    entry["agreement"],
                    threshold + RECOVERY_MARGIN,
                )
        self._quarantine(entries, threshold)

    def _quarantine(self, entries: dict[str, dict[str, Any]], threshold: float) -> None:
        # At most a strict minority of the round's nodes: agreement is a vote, so it cannot tell a majority
        # of colluders from honest peers, and quarantining everyone would leave nobody to agree with (the run
        # would stop moving for good). The worst-scored go first.
        limit = (len(entries) - 1) // 2
        held = sum(e["quarantined"] for e in entries.values())
        for node, entry in sorted(entries.items(), key=lambda item: item[1]["agreement"]):
            if entry["quarantined"] or entry["rounds"] < MIN_ROUNDS or entry["agreement"] >= threshold:
                continue
            if held >= limit:
                logger.warning(
                    "DiLoCo master: node %s's agreement %.2f is below distributed.defences.quarantine_below %g, but "
                    "%d of this round's %d nodes are already quarantined (a strict minority at most)",
                    node,
                    entry["agreement"],
                    threshold,
                    held,
                    len(entries),
                )
                break
            entry["quarantined"] = True
            held += 1
            logger.warning(
                "DiLoCo master: quarantined node %s: its deltas' agreement with the other nodes is %.2f "
                "(below distributed.defences.quarantine_below %g); they are received but weigh 0 until it recovers",
                node,
                entry["agreement"],
                threshold,
            )


def _averaged(score: float, rounds: int, cosine: float) -> float:
    """The bias-corrected moving average after one more round: `score` is the corrected average of
    `rounds` rounds (its raw, zero-started sum is score × (1 − β^rounds), β = 1 − ALPHA)."""
    beta = 1 - ALPHA
    raw = beta * score * (1 - beta**rounds) + ALPHA * cosine
    return raw / (1 - beta ** (rounds + 1))
