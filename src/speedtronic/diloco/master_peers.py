"""A per-peer score the DiLoCo master keeps: does a node's delta agree with the other nodes'?

Every round with at least two accepted deltas, each node's delta direction u = Δ/‖Δ‖ is compared
with the sum of the *other* nodes' directions (leave-one-out, unweighted, so neither a token claim
nor a norm buys influence over the score): agreement = cos(u_i, Σ_{j≠i} u_j), over the nodes not in
quarantine. A node's score is an exponential moving average of it (weight 0.3 for the newest round,
so a few rounds decide), persisted in the master's state, published in head.json ("peers", for
`hub status`) and metrics.json, next to its rejection counts.

Quarantine (`distributed.defences.quarantine_below`, default 0, off when null): a node whose score falls below the
threshold after at least MIN_ROUNDS scored rounds is quarantined, logged: its deltas are still
received (decoded, checked, counted, its high-water mark moves, they are deleted), but they weigh 0 in
the round. Its agreement is still measured against the others every round, so it recovers, logged,
once its score is back above the threshold + RECOVERY_MARGIN. Quarantine never covers more than a
strict minority of a round's nodes (the worst-scored first): agreement is a vote, and quarantining
everyone would leave nobody to agree with. Deltas the loss probe caught this round are left out of
"the others", so attackers it sees cannot vote. Honest peers agree positively (their
pseudo-gradients share the descent direction); a reversed delta scores near −1, a random one near 0.
The loss probe (`distributed.defences.loss_probe`, on by default where the master has validation data, `probe`)
is the Gauntlet's cheap half: each delta applied
alone to the global model, scored on the master's validation batches; one that makes the loss worse
than not applying it weighs 0 that round.

What this cannot see: an attacker that agrees with the others (a small consistent bias rides along
with an honest direction), and a majority of colluders, who define the "others".
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from speedtronic.diloco import fragments

logger = logging.getLogger("speedtronic.diloco")

ALPHA = 0.3  # weight of the newest round in the score
MIN_ROUNDS = 3  # scored rounds before a node can be quarantined
RECOVERY_MARGIN = 0.1


def active(master: Any, node: str) -> bool:
    return not (master.peers.get(node) or {}).get("quarantined", False)


@torch.no_grad()
def update(
    master: Any, deltas: dict[str, dict[str, torch.Tensor]], probed_worse: set[str] | None = None
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
    live = [n for n in units if active(master, n)]
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
        entry = master.peers.setdefault(node, {"agreement": cosine, "rounds": 0, "quarantined": False})
        entry["agreement"] = round(
            cosine if entry["rounds"] == 0 else (1 - ALPHA) * entry["agreement"] + ALPHA * cosine, 4
        )
        entry["last_agreement"] = round(cosine, 4)
        entry["rounds"] += 1
        scored.append(node)
    _judge(master, scored)


def _judge(master: Any, scored: list[str]) -> None:
    threshold = master.dist.defences.quarantine_below
    entries = {node: master.peers[node] for node in scored}
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


@torch.no_grad()
def probe(master: Any, accepted: dict[str, tuple[Any, ...]]) -> set[str]:
    """The loss probe (`distributed.defences.loss_probe`): ids of this round's deltas that, applied alone at
    the outer lr (θ − η·Δ), raise the master's validation loss above not applying them — at most half of
    the round's, the most harmful first. They are received but weigh 0 this round; each node's latest probe result and its failures are kept in its
    score. Cost: one evaluation of the master's validation batches per delta per round (the loss of
    the current global is the one the master already computed after the last step)."""
    setting = master.dist.defences.loss_probe
    if setting is False or len(accepted) < 1:
        return set()
    if master.evaluate is None:
        if not getattr(master, "_probe_warned", False):
            master._probe_warned = True
            # auto: a master without data is a supported set-up (say so once); true: it was asked for.
            (logger.info if setting == "auto" else logger.warning)(
                "DiLoCo master: the loss probe (distributed.defences.loss_probe=%s) is off: the master has no "
                "validation data (give it data.text_path or a prepared dataset to score deltas)",
                "auto" if setting == "auto" else "true",
            )
        return set()
    # The loss alone: the probe has no use for the run.eval_tasks scores the full evaluation adds.
    score = getattr(master.evaluate, "loss_only", master.evaluate)
    known = master.val_losses[-1] if master.val_losses else None
    base = known[1] if known and known[0] == master.outer_step else float(score(master.outer.weights))
    lr = master.outer.lr
    failed: list[tuple[float, str, str]] = []  # (loss, delta id, node) of the deltas that raise the loss
    probed = 0
    weights = master.outer.weights
    for delta_id, (tensors, _w, _seq, ref, decoded) in accepted.items():
        if not active(master, ref.node):
            continue  # quarantined: it weighs 0 anyway, so its evaluation would buy nothing
        # A fragment's delta (Streaming DiLoCo) moves only its own tensors (or shares of them).
        p = fragments.fragment_of(decoded.meta, master.frags.count)
        current = master.frags.part(p, weights)
        trial = master.frags.merged(p, weights, {n: current[n] - lr * t.float() for n, t in tensors.items()})
        loss = float(score(trial))  # loss only: the task results shown stay the global's
        probed += 1
        entry = master.peers.setdefault(ref.node, {"agreement": 0.0, "rounds": 0, "quarantined": False})
        entry["probe"] = round(loss - base, 5)
        if not loss <= base:  # NaN included
            failed.append((loss, delta_id, ref.node))
    # At most half of the round's deltas, the most harmful first (NaN first). When most deltas fail, the
    # probe is misjudging rather than facing a majority of attackers (which no rule here can stop): on
    # a slow link, stale deltas applied alone to a global the last momentum step overshot all raise the
    # loss, and zeroing them all left the global standing still for rounds (bench/wan.py).
    failed.sort(key=lambda f: (f[0] == f[0], -f[0] if f[0] == f[0] else 0.0))
    cap = probed // 2
    worse: set[str] = set()
    for loss, delta_id, node in failed[:cap]:
        worse.add(delta_id)
        entry = master.peers[node]
        entry["probe_failures"] = int(entry.get("probe_failures", 0)) + 1
        logger.warning(
            "DiLoCo master: loss probe: delta %s from %s alone raises the validation loss from %.4f to "
            "%.4f; it weighs 0 this round",
            delta_id,
            node,
            base,
            loss,
        )
    if len(failed) > cap:
        logger.warning(
            "DiLoCo master: the loss probe found %d of %d deltas raising the validation loss from %.4f; at "
            "most half weigh 0, so %d still count: %s",
            len(failed),
            probed,
            base,
            len(failed) - cap,
            ", ".join(d for _, d, _ in failed[cap:]),
        )
    return worse
