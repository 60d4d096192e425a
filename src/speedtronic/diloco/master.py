"""The DiLoCo master: a background outer loop that turns deltas on the bus into new global models.

One round: list the deltas on the bus; ignore (and log once) files from nodes that are not listed
collaborators; reject (log naming the file, then delete) bad names, parse errors, checksum, shape,
dtype, non-finite, oversized, too-stale, replayed, out-of-bounds and norm-outlier deltas (claims and
norms: master_checks.py); take the oldest pending
delta of each node — one per node, so one node's backlog never fills a round meant for several —
and once the round is ready, average them weighted by tokens × staleness weight (or robustly:
`distributed.defences.aggregation`, outer.aggregate), take a Nesterov step, and publish.

Who a round waits for and until when (master_rounds.py): the live members — the collaborator list is
re-read from the manifest while running — until all have a delta, or a quorum has and a grace learnt
from the arrival history has passed, or `max_wait` (`min_deltas`, when set, replaces the rule). While
it waits, the master logs which nodes it has and which it waits on, and until when.

Peers are untrusted. A rejected file never moves any state: the per-node high-water mark ("hwm",
what workers prune by and number from) moves only when a delta is applied; a rejected file is
remembered by name and version (DeltaRef.etag) so it is not read again. Replays are recognised by
the payload checksum of every applied delta, whatever the file is called. A delta is also bounded
without any history: its norm may not exceed `outlier_factor` × the global weights' norm, so even a
run's first delta cannot blow up the model; its token claim is clipped to the node's plan.

The run's end: `manifest.run.outer_steps`. The master keeps applying valid deltas after it (a late
joiner's work counts) and stops when nothing valid is pending and every node it knows has finished
(sent its final delta) or left (silent past its liveness window), or when nothing has arrived for
`max_wait`; it says why, and publishes as final the best recent global by held-out loss when that
beats the last one (master_end.py).

Streaming DiLoCo (`distributed.sync.fragments` P > 1, diloco/fragments.py): each delta carries one
fragment's tensors; a round takes one fragment (the one furthest behind when nodes are out of phase,
the others stay pending) and steps only its tensors, with its own momentum and round count; staleness
is counted in that fragment's rounds; head.json lists each fragment's round.

Stale-delta policy (outer.staleness_weight): a delta built on global s−k counts 1/(1+k) of its tokens;
with k > `max_staleness` it is rejected — a final one too, which still marks its node finished.

Crash safety: the master's state — fp32 global weights, outer momentum, outer step, the set of
applied delta ids and the per-node high-water mark of processed sequence numbers — is one
safetensors file written atomically *before* the new global is published and the processed deltas
are deleted. After a crash the round is either not applied at all (redone from the deltas still on
the bus) or applied and recorded (its deltas are recognised by id and sequence number, deleted, and
never applied again). On start the master adopts a newer global from the bus if there is one.
State is saved as safetensors + JSON metadata, never pickled (master_state.py).

One master per run (master_lease.py): the master holds the bus lease "master", renewed between polls
and before every publish, under a fencing epoch carried in every head and global; every publish names
the head it replaces (`Bus.publish(expected=)`). A master that lost its lease, or finds the run advanced
by another, writes nothing and stops with an error.

The operator view: one status document (master_report.status: applied, rejected with reasons,
pending, finished, last seen, in total and per node, the round rule at work, the epoch and lease, and
why the run ended) is written as `metrics.json` next to its state after every poll that changed
something (and at least every 30 s), and published in head.json under "status" with every head (once
more on stop if it changed), which `hub status` shows as it is.

The poll interval: `distributed.node.poll_interval`, stretched by the bus to fit its request budget
(`Bus.poll_delay`: on the Hub, polls spend at most half the token's requests per window, and the
next outer step waits for the run repo's commit budget); stretching is logged once per change.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco import (
    codec,
    fragments,
    master_end,
    master_lease,
    master_peers,
    master_report,
    master_rounds,
)
from speedtronic.diloco import master_checks as checks
from speedtronic.diloco.bus.base import Bus, BusError, DeltaRef, Head, HeadMoved, PermissionDenied
from speedtronic.diloco.manifest import delta_token_bound, now
from speedtronic.diloco.master_state import STATE_FILE, load_state, publish_own, save_state
from speedtronic.diloco.node_eval import read as read_node_eval
from speedtronic.diloco.outer import OuterOptimizer, staleness_weight
from speedtronic.errors import SpeedtronicError
from speedtronic.retry import RetryPolicy

logger = logging.getLogger("speedtronic.diloco")
METRICS_FILE = "metrics.json"


class Master:
    def __init__(
        self,
        config: Any,
        bus: Bus,
        manifest: dict[str, Any],
        initial: dict[str, torch.Tensor],
        *,
        state_dir: str | Path,
        momentum: float,
        lr: float = 1.0,
        evaluate: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        dist = config.distributed
        self.dist = dist
        self.bus = bus
        self.manifest = manifest
        self.specs = codec.specs_from_json(manifest["params"])
        # Streaming DiLoCo (diloco/fragments.py): each fragment's rounds counted on their own.
        self.frags = fragments.Plan.from_config(self.specs, dist)
        fragments.check(manifest, self.frags, "DiLoCo master")
        self.fragment_rounds = [0] * self.frags.count
        self.held_bytes: dict[str, bytes] = {}  # "id@etag" -> a delta held back for its peers
        self.last_read: dict[str, bytes] = {}  # what this round read (fragments.fetch, hold_back)
        self.state_path = Path(state_dir) / STATE_FILE
        self.metrics_path = Path(state_dir) / METRICS_FILE
        listed = list(dist.master.collaborators) or list(manifest.get("collaborators") or {})
        self.allowed: set[str] | None = set(listed) or None
        self.min_deltas = dist.rounds.min_deltas or (len(listed) if listed else 1)
        self.max_bytes = (
            int(dist.defences.max_delta_mb * 1e6)
            if dist.defences.max_delta_mb
            else (int(1.5 * codec.wire_bytes(self.specs, "fp32")) + (1 << 20))
        )
        self.evaluate = evaluate
        self.outer = OuterOptimizer(initial, lr, momentum, dist.sync.outer_momentum_warmup)
        self.outer_step = 0
        self.applied: list[str] = []
        self.rejected: list[dict[str, str]] = []
        self.rejected_versions: set[str] = set()  # "id@etag" of files rejected and not deletable
        self.checksums: dict[str, str] = {}  # payload checksum -> id of the applied delta
        self.finished: set[str] = set()  # nodes whose last applied delta was marked final
        self.hwm: dict[str, int] = {}
        self.nodes: dict[str, dict[str, Any]] = {}  # node -> last applied {seq, outer_step, at}
        self.norm_history: list[list[Any]] = []  # [node, norm] of recent candidates (master_checks.py)
        self.max_tokens = delta_token_bound(manifest, config)
        self.val_losses: list[tuple[int, float]] = []
        self._ignored: set[str] = set()
        self.clock = clock  # monotonic seconds; a test drives rounds with its own clock
        self._heard: dict[str, float] = {}  # node -> clock time its latest delta was first seen
        self._last_arrival = clock()
        self._last_wait_log = 0.0
        self.pending_count = 0  # valid-looking deltas waiting after the latest round
        self.min_deltas_set = dist.rounds.min_deltas is not None
        self.silent: set[str] = set()  # listed nodes that send nothing (the master when it does not train)
        self.per_node: dict[str, dict[str, int]] = {}  # node -> {applied, rejected, bytes}
        self.bytes_in = 0
        self.polls = 0
        self.poll_cost = 1.0  # requests per poll (moving average, from the bus when it counts them)
        self.poll_delay_s = dist.node.poll_interval
        self.waiting: dict[str, Any] = {}  # what the current round waits for, and until when
        self._metrics_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # The head this master last read or published: its next publish must replace exactly that
        # one (Bus.publish(expected=)), so a second master on the run is noticed, not merged.
        self.head: Head | None = None
        self.published: list[list[Any]] = []  # [outer step, global path] it published (master_state.py)
        self.feedback: dict[str, dict[str, Any]] = {}  # node -> rejections in a row, latest reasons
        self.feedback_due = False
        self.peers: dict[str, dict[str, Any]] = {}  # node -> agreement score, quarantine
        self.feedback_every_s = float(dist.defences.rejection_feedback_s)
        self._published_at = 0.0
        self.stepped_at: float | None = None  # this process's latest outer step (self.clock())
        self.lease, self.epoch, self.state_epoch = None, 0, 0  # master_lease.py: lease, fencing epochs
        self.rounds = master_rounds.Rounds(self)  # membership, arrivals, the open round
        self.best: master_end.Best | None = None  # the best recent global, for the final pick
        self.final: dict[str, Any] | None = None  # the final pick, once the run is over (head.json)
        self.end_reason: str | None = None
        self.rounds_done, self._started = 0, self.clock()

    # -- state ------------------------------------------------------------------------------------
    def save_state(self) -> None:
        save_state(self)

    def load_state(self) -> bool:
        return load_state(self)

    def start_state(self) -> None:
        """Load local state, adopt a newer remote global, and make sure the bus shows the current one."""
        had_state = self.load_state()
        head = self.head = self.bus.read_head()  # what this master's next publish expects to replace
        remote = int(head["outer_step"]) if head else -1
        if head is not None and (remote > self.outer_step or not had_state or master_lease.newer(self, head)):
            data = self.bus.read_global(head)
            decoded = codec.decode(data, self.specs, kind="global", max_bytes=self.max_bytes * 2)
            self.outer.weights = decoded.tensors
            self.outer.reset_momentum()
            self.published = []  # adopted: what the bus holds is not known to be this master's
            self.outer_step = remote
            self.fragment_rounds = fragments.head_rounds(head, self.frags.count) or self.fragment_rounds
            for node, seq in (head.get("hwm") or {}).items():
                self.hwm[node] = max(self.hwm.get(node, -1), int(seq))
            self.nodes.update(head.get("nodes") or {})
            logger.log(
                logging.WARNING if had_state else logging.INFO,
                "DiLoCo master: adopted the global of outer step %d from the bus%s",
                remote,
                " (momentum reset)" if had_state else "",
            )
            self.save_state()
        elif remote < self.outer_step or head is None:
            self.save_state()
            self.publish()
        # After a restart, nodes that contributed before count as just heard from: a round waits for
        # them (up to max_wait) instead of going ahead with whichever node happens to be first.
        self._heard = dict.fromkeys(self.nodes, self.clock())
        if self.evaluate is not None and not self.val_losses:
            self.val_losses.append((self.outer_step, float(self.evaluate(self.outer.weights))))
        if self.val_losses and self.val_losses[-1][0] == self.outer_step:
            master_end.remember(self, float(self.val_losses[-1][1]))

    def global_bytes(self) -> bytes:
        meta = {"kind": "global", "outer_step": str(self.outer_step), "node": "master"}
        meta["epoch"] = str(self.epoch)  # the fencing epoch (master_lease.py)
        return codec.encode(self.outer.weights, "fp32", meta)

    def publish(self) -> None:
        head = {
            "format": codec.FORMAT_VERSION,
            "outer_step": self.outer_step,
            "updated_at": now(),
            "hwm": self.hwm,
            "nodes": self.nodes,
            "applied_total": len(self.applied),
            "rejected": {n: c["rejected"] for n, c in self.per_node.items() if c["rejected"]},
            # The latest rejected files: `hub status` does not count them as pending where the
            # master cannot delete them (a collaborator's own repo).
            "rejected_ids": sorted({r["id"] for r in self.rejected[-200:]}),
            # Per node: rejections in a row since its last applied delta, and the latest reasons.
            "rejections": self.feedback,
            "peers": self.peers,  # agreement score and quarantine (master_peers.py)
            **fragments.head_entry(self),  # each fragment's round (Streaming DiLoCo; none for P=1)
            **master_lease.head_facts(self),  # fencing epoch, finished nodes, the lease
            "round": self.rounds.report,  # who the next round waits for, until when (master_rounds.py)
            **({"final": self.final} if self.final else {}),  # the run is over (master_end.py)
            "status": master_report.status(self),  # what metrics.json says; `hub status` shows it
        }
        try:
            master_lease.ensure(self)  # still the run's master (LeaseLost: nothing is published)
            self.head = publish_own(self, self.global_bytes(), head)  # prunes only its own globals
        except HeadMoved as error:
            raise SpeedtronicError(
                f"DiLoCo master: {self.bus.url}: another master advanced the run ({error}); this one stops "
                "without publishing outer step "
                f"{self.outer_step} — run one master per run (its state stays in {self.state_path})"
            ) from None
        self.feedback_due, self._published_at = False, time.monotonic()
        logger.info("DiLoCo master: published outer step %d to %s", self.outer_step, self.bus.url)

    # -- one round ----------------------------------------------------------------------------------
    def _reject(self, ref: DeltaRef, reason: str, doomed: list[DeltaRef]) -> None:
        """Log and forget a bad file. It moves no node's state (no high-water mark, no history): only
        its name and version are remembered, so the same bytes are not read again."""
        logger.warning("DiLoCo master: rejected delta %s from %s: %s", ref.name, ref.node, reason)
        self.rejected.append({"id": ref.id, "reason": reason})
        self.rejected_versions.add(f"{ref.id}@{ref.etag}")
        self._count(ref.node, "rejected")
        master_report.note_rejection(self, ref.node, ref.name, reason)
        doomed.append(ref)

    def _count(self, node: str, what: str, n: int = 1) -> None:
        entry = self.per_node.setdefault(node, {"applied": 0, "rejected": 0, "bytes": 0})
        entry[what] += n

    def expected(self, pending: set[str]) -> tuple[int, set[str]]:
        """(how many nodes a round needs, the nodes it expects): master_rounds.py."""
        expected = self.rounds.nodes(self, pending, self.clock())[0]
        return (
            max(1, self.min_deltas - len(self.finished)) if self.min_deltas_set else len(expected)
        ), expected

    def round(self) -> bool:
        """Poll once; run an outer step when the round is ready. True when a step was taken."""
        self.rounds.refresh(self)  # membership follows the manifest
        spent = self.bus.requests_spent()
        refs = self.bus.list_deltas(None if self.allowed is None else {n: {} for n in self.allowed})
        self.polls += 1
        if spent is not None:
            cost = (self.bus.requests_spent() or spent) - spent
            self.poll_cost = 0.8 * self.poll_cost + 0.2 * cost
        doomed: list[DeltaRef] = []
        pending: dict[str, list[tuple[int, DeltaRef]]] = {}
        applied = set(self.applied)
        for ref in refs:
            if f"{ref.id}@{ref.etag}" in self.rejected_versions:
                continue  # rejected before but not deletable here (a collaborator's own repo)
            if self.allowed is not None and ref.node not in self.allowed:
                if ref.id not in self._ignored:
                    self._ignored.add(ref.id)
                    logger.warning(
                        "DiLoCo master: ignoring delta %s from unlisted node %s", ref.name, ref.node
                    )
                continue
            try:
                node, seq = codec.parse_delta_name(ref.name)
                if node != ref.node:
                    raise codec.Rejected(f"named for node {node!r} but published by {ref.node!r}")
            except codec.Rejected as error:
                self._reject(ref, str(error), doomed)
                continue
            if ref.id in applied or seq <= self.hwm.get(node, -1):
                doomed.append(ref)  # processed before (a replay, or a crash before the delete)
                continue
            try:
                checks.check_sequence(seq, self.hwm.get(node, -1))
            except codec.Rejected as error:
                self._reject(ref, str(error), doomed)
                continue
            pending.setdefault(node, []).append((seq, ref))
        self.rounds.arrivals(self, pending)
        self.pending_count = sum(len(v) for v in pending.values())
        self.pending_refs = [ref for items in pending.values() for _, ref in items]  # for the status
        chosen = [min(items, key=lambda i: i[0]) for items in pending.values()]
        ready = self.rounds.ready(self, set(pending))
        stepped = False
        if ready and chosen:
            stepped = self._apply(chosen, doomed)
            settled = {ref.id for ref in doomed}  # applied or rejected in this round
            self.pending_count -= sum(ref.id in settled for _, ref in chosen)
        elif doomed:
            self.save_state()  # remembers rejected versions
        if (
            not stepped
            and self.feedback_due
            and time.monotonic() - self._published_at >= self.feedback_every_s
        ):
            self.publish()  # the same global, with a head that tells the rejected nodes why
        if doomed:
            try:
                self.bus.delete_deltas(doomed)
            except BusError as error:
                logger.warning("DiLoCo master: could not delete processed deltas (%s); will retry", error)
        return stepped

    def _apply(self, chosen: list[tuple[int, DeltaRef]], doomed: list[DeltaRef]) -> bool:
        accepted: dict[str, tuple[dict[str, torch.Tensor], float, int, DeltaRef, codec.Decoded]] = {}
        # No history needed: a pseudo-gradient larger than `outlier_factor` × the model is an attack.
        global_norm = codec.norm(self.outer.weights)
        bound = self.dist.defences.outlier_factor * global_norm
        candidates: dict[str, tuple[str, float]] = {}  # every finite delta of the round: the norm history
        seen: dict[str, str] = {}
        # Oldest on the bus first: of two identical payloads in one round, the later one is the copy (a
        # copier must read the original first). Seen in the same poll, which is the copy is unknown: both
        # are accepted and the payload counts once (`twins` weigh 0), so copying a pending delta under
        # a name that sorts first neither gets the original rejected nor adds weight.
        first_seen = self.rounds.seen_at
        chosen = sorted(chosen, key=lambda c: (first_seen.get(c[1].id, 0.0), c[1].id))
        twins: set[str] = set()
        claims: dict[str, int] = {}  # id -> the tokens its delta counts for (clipped to the plan)
        for seq, ref in chosen:
            verified: codec.Decoded | None = None  # once it passed the checks of who sent it
            try:
                data = fragments.fetch(self, ref)  # a delta held back last round is not read twice
                decoded = codec.decode(
                    data, self.specs, kind="delta", max_bytes=self.max_bytes, select=self.frags.select
                )
                if decoded.meta.get("node") != ref.node:
                    raise codec.Rejected(f"metadata names node {decoded.meta.get('node')!r}")
                checksum = decoded.meta["checksum"]
                first = self.checksums.get(checksum)
                if first is not None:
                    raise codec.Rejected(f"replay: the same payload as {first}")
                twin = seen.get(checksum)
                if twin is not None and first_seen.get(twin, 0.0) < first_seen.get(ref.id, 0.0):
                    raise codec.Rejected(f"replay: a copy of {twin}, which was on the bus first")
                checks.check_local_step(decoded)
                verified = decoded  # from here on a rejection judges the content, not the sender
                base = decoded.int("base_outer_step", -1)
                frag = fragments.fragment_of(decoded.meta, self.frags.count)
                stale = fragments.staleness(self, decoded, frag)
                weight = staleness_weight(stale, self.dist.rounds.max_staleness)
                if weight is None:
                    raise codec.Rejected(
                        f"stale: built on outer step {base}, the run is at {self.outer_step}"
                        + (f" (fragment {frag}: {stale} rounds behind)" if self.frags.count > 1 else "")
                    )
                size = fragments.scaled_norm(self, codec.norm(decoded.tensors), frag)
                candidates[ref.id] = (ref.node, size)
                if size > bound:
                    raise codec.Rejected(
                        f"norm {size:.3g} is over {self.dist.defences.outlier_factor:g}× the global weights' norm"
                    )
                tokens = checks.clip_tokens(
                    ref.node,
                    decoded.int("tokens", 1),
                    self.max_tokens,
                    seq,
                    self.hwm.get(ref.node, -1),
                    stale,
                    ref.id,
                )
                if twin is not None:
                    twins.add(ref.id)
                seen.setdefault(checksum, ref.id)
                accepted[ref.id] = (decoded.tensors, tokens * weight, seq, ref, decoded)
                claims[ref.id] = tokens
            except codec.Rejected as error:
                self._reject(ref, str(error), doomed)
                if verified is not None:  # a final delta rejected for its content still ends its node
                    master_end.rejected_final(self, ref, verified)
            except PermissionDenied:
                raise
            except BusError as error:
                logger.warning(
                    "DiLoCo master: could not read %s (%s); it stays for the next round", ref.id, error
                )
        # Streaming DiLoCo: nodes out of phase bring deltas of different fragments; the round takes the
        # fragment that is furthest behind and the others wait, pending, for their peers (fragments.py).
        for delta_id in fragments.hold_back(self, accepted):
            del accepted[delta_id], candidates[delta_id]
        within = {i: c for i, c in candidates.items() if i in accepted}
        bad = checks.norm_outliers(
            self.norm_history,
            within,
            self.dist.defences.outlier_factor,
            global_norm,
            self.dist.defences.norm_floor,
        )
        for delta_id, reason in bad.items():
            _, _, _, ref, decoded = accepted.pop(delta_id)
            self._reject(ref, reason, doomed)
            master_end.rejected_final(self, ref, decoded)
        # Every candidate enters the history, rejected or not: rejecting cannot starve the reference.
        self.norm_history = checks.remember(self.norm_history, candidates)
        if not accepted:
            self.save_state()
            return False
        if self.dist.defences.aggregation == "clipped_mean":
            # Claims clipped like norms: no claim above the round's (lower) median. The plan's bound
            # leaves room for a node of MAX_NODE_RANKS ranks, so a one-rank attacker could otherwise
            # claim 8× an honest peer's weight (bench/attacks.py, "tokens"). Equal claims: no change.
            cap = sorted(claims[i] for i in accepted)[(len(accepted) - 1) // 2]
            for i, (t, w, seq, ref, decoded) in list(accepted.items()):
                if claims[i] > cap:
                    accepted[i] = (t, w * cap / claims[i], seq, ref, decoded)
                    claims[i] = cap  # what the node is credited with, in head.json too
        frag_of = {i: fragments.fragment_of(d.meta, self.frags.count) for i, (*_, d) in accepted.items()}
        # Quarantined nodes' deltas, and those the loss probe finds harmful, are received but weigh 0;
        # the probe goes first so that the deltas it caught do not vote in the agreement scores.
        worse = master_peers.probe(self, accepted)
        caught = {accepted[i][3].node for i in worse}
        for p in sorted(set(frag_of.values())):  # agreement is measured among deltas of one fragment
            master_peers.update(
                self, {r.node: t for i, (t, _, _, r, _) in accepted.items() if frag_of[i] == p}, caught
            )
        live = [
            (t, w, frag_of[i])
            for i, (t, w, _, r, _) in accepted.items()
            if master_peers.active(self, r.node) and i not in worse and i not in twins
        ]
        if live:
            fragments.aggregate_step(self, live)  # per fragment: its own aggregate and outer step
            self.outer_step += 1
            self.stepped_at = self.clock()  # master_report.next_poll: the next round may come soon
        for delta_id, (_, _, seq, ref, decoded) in accepted.items():
            self.applied.append(delta_id)
            self.checksums[decoded.meta["checksum"]] = delta_id
            self.hwm[ref.node] = max(self.hwm.get(ref.node, -1), seq)
            self.nodes[ref.node] = {
                "seq": seq,
                "outer_step": self.outer_step,
                "at": now(),
                "tokens": self.nodes.get(ref.node, {}).get("tokens", 0) + claims[delta_id],  # as bounded
                # The node's own latest evaluation, untrusted and validated (diloco/node_eval.py).
                "eval": read_node_eval(decoded.meta) or self.nodes.get(ref.node, {}).get("eval"),
            }
            # A final delta says the node is done; a later one (a rejoin) makes it active again.
            (self.finished.add if decoded.meta.get("final") == "1" else self.finished.discard)(ref.node)
            self._count(ref.node, "applied")
            master_report.note_applied(self, ref.node)
        self.rounds.closed(self, {ref.node: i for i, (_, _, _, ref, _) in accepted.items()})
        if self.evaluate is not None and live:
            loss = float(self.evaluate(self.outer.weights))
            self.val_losses.append((self.outer_step, loss))
            master_end.remember(self, loss)
        self.save_state()  # the commit point: from here on these deltas count as applied
        doomed.extend(item[3] for item in accepted.values())
        logger.info(
            "DiLoCo master: outer step %d from %s%s%s",
            self.outer_step,
            ", ".join(sorted(accepted)),
            f" ({len(accepted) - len(live)} quarantined, probed worse or duplicates, weighing 0)"
            if len(live) < len(accepted)
            else "",
            f" · global val loss {self.val_losses[-1][1]:.4f}" if self.evaluate is not None else "",
        )
        self.publish()
        if self.dist.bus.squash_every and self.outer_step % self.dist.bus.squash_every == 0:
            try:
                self.bus.compact()
            except BusError as error:
                logger.warning("DiLoCo master: could not squash history (%s)", error)
        return bool(live)

    # -- the background loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="diloco-master", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        backoff = RetryPolicy.from_config(self.dist.bus).backoff()
        while not self._stop.is_set():
            try:
                stepped = self.round()
                self.rounds_done += 1  # the end needs a round that started after it (master_end.wait)
                backoff.reset()
            except PermissionDenied as error:
                self.error = error
                logger.error("DiLoCo master: %s", error)
                return
            except BusError as error:  # the bus is down: keep trying, with backoff
                delay = backoff.next_delay()
                logger.warning("DiLoCo master: round failed (%s); retrying in %.0fs", error, delay)
                self._stop.wait(delay)
                continue
            except SpeedtronicError as error:  # another master advanced the run: stop, said once
                self.error = error
                logger.error("%s", error)
                return
            except Exception as error:
                self.error = error
                logger.exception("DiLoCo master: outer loop failed")
                return
            self.write_metrics(force=stepped)
            if not stepped:
                master_lease.idle(self, master_report.next_poll(self))  # renews the lease between polls

    def metrics(self) -> dict[str, Any]:
        return master_report.metrics(self)

    def write_metrics(self, force: bool = False) -> None:
        """metrics.json in the state directory, for operators and dashboards (atomically replaced)."""
        if not force and time.monotonic() - self._metrics_at < 30.0 and self.polls > 1:
            return
        self._metrics_at = time.monotonic()
        try:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.metrics_path, (json.dumps(self.metrics(), indent=1) + "\n").encode())
        except OSError as error:
            logger.warning("DiLoCo master: could not write %s (%s)", self.metrics_path, error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        master_report.publish_final(self)  # head.json's status ends equal to metrics.json
        self.write_metrics(force=True)

    def wait(self, end: int, idle_s: float, linger_s: float | None = None, busy: Any = None) -> str:
        """Block until the run is over, stop the outer loop, publish the final pick; why it ended
        (master_end.wait: every node finished or left, or idle for `idle_s`)."""
        return master_end.wait(self, end, idle_s, linger_s, busy)

    def progress_line(
        self, end: int, unfinished: list[str], idle_left: float, ended_at: float | None, linger_s: float
    ) -> str:
        """What the master waits for and until when, in one line."""
        return master_report.progress_line(self, end, unfinished, idle_left, ended_at, linger_s)

    def summary(self) -> dict[str, Any]:
        return {
            "outer_step": self.outer_step,
            "applied": list(self.applied),
            "rejected": list(self.rejected),
            "finished": sorted(self.finished),
            "end_reason": self.end_reason,  # why the run ended (master_end.py)
            "final": self.final,  # which global was published as the final one, and its val loss
            "per_node": {n: dict(c) for n, c in self.per_node.items()},
            "bytes_in": self.bytes_in,
            "polls": self.polls,
            "metrics": str(self.metrics_path),
            "global_val_loss": [{"outer_step": s, "val_loss": v} for s, v in self.val_losses],
            "state": str(self.state_path),
        }


def run_end(manifest: dict[str, Any], config: Any) -> int:
    """The outer step that ends the run: the manifest's `run.outer_steps`, else the config's plan."""
    end = (manifest.get("run") or {}).get("outer_steps")
    return int(end) if isinstance(end, int) and end > 0 else planned_rounds(config)


def planned_rounds(config: Any) -> int:
    dist = config.distributed
    count = getattr(dist.sync, "fragments", 1)
    return max(
        1, len(fragments.sync_points(config.max_steps(), dist.sync.inner_steps, count, dist.sync.ramp))
    )
