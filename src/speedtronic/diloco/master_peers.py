"""A per-peer score the DiLoCo master keeps: does a node's delta agree with the other nodes'?

Every round with at least two accepted deltas, each node's delta direction u = Δ/‖Δ‖ is compared
with the sum of the *other* nodes' directions (leave-one-out, unweighted, so neither a token claim
nor a norm buys influence over the score): agreement = cos(u_i, Σ_{j≠i} u_j), over the nodes not in
quarantine. A node's score is an exponential moving average of it (weight 0.3 for the newest round,
so a few rounds decide), persisted in the master's state, published in head.json ("peers", for
`hub status`) and metrics.json, next to its rejection counts.

Quarantine (`distributed.quarantine_below`, off when null): a node whose score falls below the
threshold after at least MIN_ROUNDS scored rounds is quarantined, logged: its deltas are still
received (decoded, checked, counted, its high-water mark moves, they are deleted), but they weigh 0 in
the round. Its agreement is still measured against the others every round, so it recovers, logged,
once its score is back above the threshold + RECOVERY_MARGIN. Honest peers agree positively (their
pseudo-gradients share the descent direction); a reversed delta scores near −1, a random one near 0.
The loss probe (`distributed.loss_probe`, `probe`) is the Gauntlet's cheap half: each delta applied
alone to the global model, scored on the master's validation batches; one that makes the loss worse
than not applying it weighs 0 that round.

What this cannot see: an attacker that agrees with the others (a small consistent bias rides along
with an honest direction), and a majority of colluders, who define the "others".
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("speedtronic.diloco")

ALPHA = 0.3  # weight of the newest round in the score
MIN_ROUNDS = 3  # scored rounds before a node can be quarantined
RECOVERY_MARGIN = 0.1


def active(master: Any, node: str) -> bool:
    return not (master.peers.get(node) or {}).get("quarantined", False)


@torch.no_grad()
def update(master: Any, deltas: dict[str, dict[str, torch.Tensor]]) -> None:
    """Score this round's accepted deltas ({node: Δ}) and move nodes in or out of quarantine."""
    if len(deltas) < 2:
        return  # nothing to agree with
    units: dict[str, dict[str, torch.Tensor]] = {}
    for node, tensors in deltas.items():
        norm = float(torch.sqrt(sum((t.float() ** 2).sum() for t in tensors.values())))
        if norm > 0:
            units[node] = {n: t.float() / norm for n, t in tensors.items()}
    live = [n for n in units if active(master, n)]
    if not units or not live:
        return
    total = {n: sum(units[node][n] for node in live) for n in next(iter(units.values()))}
    for node, u in units.items():
        others = {n: total[n] - u[n] for n in total} if node in live else total
        size = float(torch.sqrt(sum((t**2).sum() for t in others.values())))
        if size <= 1e-12:
            continue  # only itself among the live ones
        cosine = float(sum((u[n] * others[n]).sum() for n in u)) / size
        entry = master.peers.setdefault(node, {"agreement": cosine, "rounds": 0, "quarantined": False})
        entry["agreement"] = round(
            cosine if entry["rounds"] == 0 else (1 - ALPHA) * entry["agreement"] + ALPHA * cosine, 4
        )
        entry["last_agreement"] = round(cosine, 4)
        entry["rounds"] += 1
        _judge(master, node, entry)


def _judge(master: Any, node: str, entry: dict[str, Any]) -> None:
    threshold = master.dist.quarantine_below
    if threshold is None:
        if entry.get("quarantined"):
            entry["quarantined"] = False  # quarantine switched off since
        return
    if not entry["quarantined"] and entry["rounds"] >= MIN_ROUNDS and entry["agreement"] < threshold:
        entry["quarantined"] = True
        logger.warning(
            "DiLoCo master: quarantined node %s: its deltas' agreement with the other nodes is %.2f "
            "(below distributed.quarantine_below %g); they are received but weigh 0 until it recovers",
            node,
            entry["agreement"],
            threshold,
        )
    elif entry["quarantined"] and entry["agreement"] >= threshold + RECOVERY_MARGIN:
        entry["quarantined"] = False
        logger.warning(
            "DiLoCo master: node %s leaves quarantine: agreement %.2f is back above %g",
            node,
            entry["agreement"],
            threshold + RECOVERY_MARGIN,
        )


@torch.no_grad()
def probe(master: Any, accepted: dict[str, tuple[Any, ...]]) -> set[str]:
    """The loss probe (`distributed.loss_probe`): ids of this round's deltas that, applied alone at
    the outer lr (θ − η·Δ), raise the master's validation loss above not applying them. They are
    received but weigh 0 this round; each node's latest probe result and its failures are kept in its
    score. Cost: one evaluation of the master's validation batches per delta per round (the loss of
    the current global is the one the master already computed after the last step)."""
    if not master.dist.loss_probe or len(accepted) < 1:
        return set()
    if master.evaluate is None:
        if not getattr(master, "_probe_warned", False):
            master._probe_warned = True
            logger.warning(
                "DiLoCo master: distributed.loss_probe is on but the master has no validation data"
            )
        return set()
    known = master.val_losses[-1] if master.val_losses else None
    base = (
        known[1] if known and known[0] == master.outer_step else float(master.evaluate(master.outer.weights))
    )
    lr = master.outer.lr
    worse: set[str] = set()
    for delta_id, (tensors, _w, _seq, ref, _decoded) in accepted.items():
        # A fragment's delta (Streaming DiLoCo) moves only its own tensors.
        trial = {
            n: w - lr * tensors[n].float() if n in tensors else w for n, w in master.outer.weights.items()
        }
        loss = float(master.evaluate(trial))
        entry = master.peers.setdefault(ref.node, {"agreement": 0.0, "rounds": 0, "quarantined": False})
        entry["probe"] = round(loss - base, 5)
        if not loss <= base:  # NaN included
            worse.add(delta_id)
            entry["probe_failures"] = int(entry.get("probe_failures", 0)) + 1
            logger.warning(
                "DiLoCo master: loss probe: delta %s from %s alone raises the validation loss from %.4f to "
                "%.4f; it weighs 0 this round",
                delta_id,
                ref.node,
                base,
                loss,
            )
    return worse
