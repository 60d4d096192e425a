"""The DiLoCo master: a background outer loop that turns deltas on the bus into new global models.

One round: list the deltas on the bus; ignore (and log once) files from nodes that are not listed
collaborators; reject (log naming the file, then delete) bad names, parse errors, checksum, shape,
dtype, non-finite, oversized, too-stale, replayed, out-of-bounds and norm-outlier deltas (claims and
norms: checks.py, each rule a named check run by pipeline.py); take the oldest pending
delta of each node — one per node, so one node's backlog never fills a round meant for several (a
rejected one does not take the slot: the node's next is read in the same round) —
and once the round is ready, average them weighted by tokens × staleness weight (or robustly:
`distributed.defences.aggregation`, outer.aggregate), take a Nesterov step, and publish.

Who a round waits for and until when (rounds.py): the live members — the collaborator list is
re-read from the manifest while running — until all have a delta, or a quorum has and a grace learnt
from the arrival history has passed, or `max_wait` (`min_deltas`, when set, replaces the rule). While
it waits, the master logs which nodes it has and which it waits on, and until when.

Peers are untrusted. A rejected file never moves any state: the per-node high-water mark ("hwm",
what workers prune by and number from) moves only when a delta is applied; a rejected file is
remembered by name and version (DeltaRef.etag) so it is not read again. Replays are recognised by
the payload checksum of every applied delta, whatever the file is called. A delta is also bounded
without any history: its norm may not exceed `outlier_factor` × the global weights' norm, so even a
run's first delta cannot blow up the model; its token claim is clipped to the node's plan.

The run's end: `manifest.run.outer_steps`. Past it a node's deltas count up to its share (one per outer
step of the run, what an honest node sends, and a quarter more for redone syncs) and are refused beyond; the master stops when nothing valid is
pending and every node it knows has finished (sent its final delta), left (silent past its liveness
window; never heard from, once the end is out) or is done (refused past the end) — or when nothing
has arrived for `max_wait`; it says why, and publishes as final the best global of the run by
held-out loss when that beats the last one (end.py). A new global with a non-finite weight or loss,
or an exploding loss, is refused: the previous one stays (`refusal`). One whose loss rose over
outer.RISE is first taken again without the momentum, and the lower of the two stays (`_without_momentum`).

Streaming DiLoCo (`distributed.sync.fragments` P > 1, diloco/fragments.py): each delta carries one
fragment's tensors; a round takes one fragment (the one furthest behind when nodes are out of phase,
the others stay pending) and steps only its tensors, with its own momentum and round count; staleness
is counted in that fragment's rounds; head.json lists each fragment's round.

Stale-delta policy (outer.staleness_weight): a delta built on global s−k counts 1/(1+k) of its tokens;
with k > `max_staleness` it is rejected — a final one too, which still marks its node finished. A round
steps at its freshest delta's weight (pipeline.freshness): in full with one delta built on the current
global, 1/(1+k) when every delta is k rounds behind (a burst after an outage: nodes that built on one
global, split by the quorum, no longer step it once per split).

Crash safety: the master's state — fp32 global weights, outer momentum, outer step, the set of
applied delta ids and the per-node high-water mark of processed sequence numbers — is one
safetensors file written atomically *before* the new global is published and the processed deltas
are deleted. After a crash the round is either not applied at all (redone from the deltas still on
the bus) or applied and recorded (its deltas are recognised by id and sequence number, deleted, and
never applied again). On start the master adopts a newer global from the bus if there is one.
State is saved as safetensors + JSON metadata, never pickled (state.py).

One master per run (lease.py): the master holds the bus lease "master", renewed between polls
and before every publish, under a fencing epoch carried in every head and global; every publish names
the head it replaces (`Bus.publish(expected=)`). A master that lost its lease, or finds the run advanced
by another, writes nothing and stops with an error.

The operator view: one status document (report.status: applied, rejected with reasons,
pending, finished, last seen, in total and per node, the round rule at work, the epoch and lease, and
why the run ended) is written as `metrics.json` next to its state after every poll that changed
something (and at least every 30 s), and published in head.json under "status" with every head (once
more on stop if it changed), which `hub status` shows as it is.

The poll interval: `distributed.node.poll_interval`, stretched by the bus to fit its request budget
(`Bus.poll_delay`: on the Hub, polls spend at most half the token's requests per window, and the
next outer step waits for the run repo's commit budget); stretching is logged once per change.

The parts (each owns its state; `Master` composes them and runs the round): Ledger (ledger.py: the
run's record), StateFile (state.py), Fence (lease.py: lease and epochs), Rounds (rounds.py), Peers
(peers.py), Report (report.py), FragmentState (fragments.py), RunEnd (end.py) and the Pipeline of
checks (pipeline.py, checks.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.diloco import codec, fragments
from speedtronic.diloco.bus.base import Bus, BusError, DeltaRef, Head, HeadMoved, PermissionDenied
from speedtronic.diloco.documents import Manifest
from speedtronic.diloco.global_update import Encoded
from speedtronic.diloco.manifest import now
from speedtronic.diloco.master import momentum, pipeline, report
from speedtronic.diloco.master.broadcast import Broadcast
from speedtronic.diloco.master.checks import Context, Delta, DeltaCheck, plugin_checks
from speedtronic.diloco.master.end import Best, IdLeases, Liveness, RunEnd, final_line, rejected_final
from speedtronic.diloco.master.fragments import FragmentState
from speedtronic.diloco.master.lease import Fence, LeaseLost, MasterLease
from speedtronic.diloco.master.ledger import Ledger
from speedtronic.diloco.master.peers import Peers
from speedtronic.diloco.master.rounds import Rounds
from speedtronic.diloco.master.state import Durable, StateFile
from speedtronic.diloco.outer import RISE, OuterOptimizer, Saved, momentum_feed
from speedtronic.diloco.spec import RunSpec, one_rank_round
from speedtronic.errors import SpeedtronicError
from speedtronic.retry import RetryPolicy

if TYPE_CHECKING:
    from speedtronic.config import Config

logger = logging.getLogger("speedtronic.diloco")
TAKEOVER_ATTEMPTS = 3
BACKLOG_WALK = 16  # a node's pending deltas read in one round while each is rejected (_receive)
Evaluate = Callable[[dict[str, torch.Tensor]], float]


@dataclass
class Limits:
    """What one delta may be: at most `max_bytes` on the wire, claiming at most `max_tokens` a round;
    `round_tokens`: a one-rank node's round (spec.one_rank_round; 0: unknown)."""

    max_bytes: int
    max_tokens: int
    round_tokens: int = 0


class Master:
    def __init__(
        self,
        config: Config,
        bus: Bus,
        manifest: Manifest | dict[str, Any],
        initial: dict[str, torch.Tensor],
        *,
        state_dir: str | Path,
        momentum: float,
        lr: float = 1.0,
        evaluate: Evaluate | None = None,
        clock: Callable[[], float] = time.monotonic,
        checks: list[DeltaCheck] | None = None,
        spec: RunSpec | None = None,
    ) -> None:
        """`checks`: extra delta checks after the built-in ones (default: those plugins registered).
        `spec`: the run's description (diloco/spec.py), computed once by the caller; else from `manifest`."""
        dist = self.dist = config.distributed
        self.bus, self.clock, self.evaluate = bus, clock, evaluate  # clock: monotonic s; tests drive it
        run = (
            manifest
            if isinstance(manifest, Manifest)
            else Manifest.parse(manifest, "DiLoCo master: manifest.json")
        )
        spec = spec or RunSpec.of_run(run, config)
        self.specs = dict(spec.specs)
        fragments.check(run.to_json(), spec.fragments, "DiLoCo master")  # Streaming DiLoCo (fragments.py)
        self.fragments = FragmentState(spec.fragments)
        listed = list(dist.master.collaborators) or list(run.collaborators)
        min_deltas = dist.rounds.min_deltas or (len(listed) if listed else 1)
        self.rounds = Rounds(dist, bus, clock, set(listed) or None, min_deltas)  # membership, arrivals
        max_bytes = (
            int(dist.defences.max_delta_mb * 1e6) if dist.defences.max_delta_mb else spec.max_global_bytes
        )
        self.limits = Limits(max_bytes, spec.max_delta_tokens, one_rank_round(config, spec.max_delta_tokens))
        self.outer = OuterOptimizer(initial, lr, momentum, dist.sync.outer_momentum_warmup)
        self.ledger = Ledger()
        # Each global's files: full, and its int8 update where global_codec asks (broadcast.py).
        self.store = StateFile(state_dir, Broadcast(dist.sync.global_codec, bus.supports_updates, bus.url))
        self.fence = Fence()  # the lease and fencing epochs (lease.py)
        self.peers = Peers(dist.defences.quarantine_below)  # agreement scores, quarantine (peers.py)
        self.report = report.Report(dist, state_dir)
        # The run's last outer step is known once `wait` is asked to end it there (launch.py: after the
        # master's own training, if it trains); before that, work past any end counts.
        # A silent node restarting still holds its id: the end reads its lease (end.py IdLeases).
        self.end = RunEnd(
            clock(), None, float(dist.rounds.late_join_wait or 0.0), IdLeases(bus.lease_left, clock)
        )
        self.pipeline = pipeline.Pipeline(plugin_checks() if checks is None else checks)
        # The head this master last read or published: its next publish must replace exactly that
        # one (Bus.publish(expected=)), so a second master on the run is noticed, not merged.
        self.head: Head | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- read-only views (tests, launch.py, the CLI's summary) --------------------------------------------
    @property
    def outer_step(self) -> int:
        return self.ledger.outer_step

    @property
    def applied(self) -> list[str]:
        return self.ledger.applied_ids

    @property
    def rejected(self) -> list[dict[str, str]]:
        return self.ledger.rejected

    @property
    def hwm(self) -> dict[str, int]:
        return self.ledger.hwm

    @property
    def finished(self) -> set[str]:
        return self.ledger.finished

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        return self.ledger.val_losses

    @property
    def frags(self) -> fragments.Plan:
        return self.fragments.plan

    @property
    def fragment_rounds(self) -> list[int]:
        return self.fragments.rounds

    @property
    def allowed(self) -> set[str] | None:
        return self.rounds.allowed

    @property
    def pending_count(self) -> int:
        return self.rounds.pending_count

    @property
    def waiting(self) -> dict[str, Any]:
        return self.rounds.waiting

    @property
    def epoch(self) -> int:
        return self.fence.epoch

    @property
    def lease(self) -> MasterLease | None:
        return self.fence.lease

    @property
    def published(self) -> list[list[Any]]:
        return self.store.published

    @property
    def best(self) -> Best | None:
        return self.end.best

    @property
    def final(self) -> dict[str, Any] | None:
        return self.end.final

    @property
    def norm_history(self) -> list[list[Any]]:
        return self.pipeline.norms.entries

    @property
    def metrics_path(self) -> Path:
        return self.report.metrics_path

    @property
    def state_path(self) -> Path:
        return self.store.path

    # -- state ------------------------------------------------------------------------------------
    def _durable(self) -> Durable:
        return Durable(
            self.outer, self.ledger, self.pipeline.norms, self.peers, self.report, self.rounds, self.fragments
        )

    def save_state(self) -> None:
        self.store.save(self._durable(), self.fence.epoch)

    def load_state(self) -> bool:
        epoch = self.store.load(self._durable())
        if epoch is not None:
            self.fence.loaded(epoch)
        return epoch is not None

    def start_state(self) -> None:
        """Load local state, adopt a newer remote global, and make sure the bus shows the current one."""
        had_state = self.load_state()
        head = self.head = self.bus.read_head()  # what this master's next publish expects to replace
        remote = int(head["outer_step"]) if head else -1
        if head is not None and (remote > self.outer_step or not had_state or self.fence.newer(head)):
            self._adopt(head, remote, had_state)
        elif remote < self.outer_step or head is None:
            self.save_state()
            self.publish()
        # After a restart, nodes that contributed before count as just heard from: a round waits for
        # them (up to max_wait) instead of going ahead with whichever node happens to be first.
        self.rounds.restarted(self.ledger.nodes)
        # The global this master starts from, evaluated unless its loss is known (a standby that adopted
        # the bus's global held the loss of an older one, which its takeover head showed as the global's).
        if self.evaluate is not None and self.ledger.last_loss(self.outer_step) is None:
            self.ledger.loss(self.outer_step, float(self.evaluate(self.outer.weights)))
        loss = self.ledger.last_loss(self.outer_step)
        if loss is not None:
            self.end.remember(self.outer_step, loss, self.outer.weights)

    def _adopt(self, head: Head, remote: int, had_state: bool) -> None:
        data = self.bus.read_global(head)
        decoded = codec.decode(data, self.specs, kind="global", max_bytes=self.limits.max_bytes * 2)
        self.outer.adopt(decoded.tensors)
        how, links = momentum.adopt(self.bus, head, self.outer, self.specs, self.limits.max_bytes * 2)
        self.store.forget_published(links)  # adopted: what the bus holds is not known to be this master's
        self.ledger.adopt(head, remote)
        self.fragments.adopt(head)
        logger.log(
            logging.WARNING if had_state and how == "momentum reset" else logging.INFO,
            "DiLoCo master: adopted the global of outer step %d from the bus (%s)",
            remote,
            how,
        )
        self.save_state()

    def take_over(self, standby: bool = False, stop: threading.Event | None = None) -> None:
        """Claim the run's lease (as a standby: wait for it), then start the master from its saved state
        and the bus under a new epoch, announced by a conditional publish of its takeover head."""
        ttl = self.dist.master.lease_s or self.bus.master_lease_s
        self.fence.claim(self.bus, ttl, self.store.path.parent, standby, stop)
        for attempt in range(1, TAKEOVER_ATTEMPTS + 1):
            self.fence.next_epoch(self.bus.read_head())
            self.start_state()
            head = self.head or {}
            if int(head.get("outer_step", -1)) == self.outer_step:
                finished = head.get("finished")
                self.ledger.finish_all(
                    {n for n in finished if isinstance(n, str)} if isinstance(finished, list) else set()
                )
            if self.fence.published(self.head):
                break  # start_state published already (the bus was behind this master's state)
            try:
                self.publish()
                break
            except LeaseLost:
                raise
            except SpeedtronicError as error:  # another publish came first: start again from the bus
                if attempt == TAKEOVER_ATTEMPTS:
                    raise
                logger.warning(
                    "DiLoCo master: takeover publish failed (%s); starting again from the bus", error
                )
        self.fence.took_over(self.outer_step, self.ledger.hwm)
        logger.info("DiLoCo master: master epoch %d at outer step %d", self.fence.epoch, self.outer_step)

    def global_files(self) -> Encoded:
        """The global's files for this outer step (the final global: exactly the weights picked)."""
        meta = {"kind": "global", "outer_step": str(self.outer_step), "node": "master"}
        meta["epoch"] = str(self.fence.epoch)  # the fencing epoch (lease.py)
        return self.store.global_files(
            self.outer.weights, self.outer_step, meta, exact=self.end.final is not None
        )

    def _head(self) -> dict[str, Any]:
        ledger = self.ledger
        return {
            "format": codec.FORMAT_VERSION,
            "outer_step": ledger.outer_step,
            "updated_at": now(),
            "hwm": ledger.hwm,
            "nodes": ledger.nodes,
            "applied_total": len(ledger.applied_ids),
            "rejected": {n: c["rejected"] for n, c in ledger.per_node.items() if c["rejected"]},
            # The latest rejected files: `hub status` does not count them as pending where the
            # master cannot delete them (a collaborator's own repo).
            "rejected_ids": sorted({r["id"] for r in ledger.rejected[-200:]}),
            # Per node: rejections in a row since its last applied delta, and the latest reasons.
            "rejections": self.report.feedback,
            "peers": self.peers.scores,  # agreement score and quarantine (peers.py)
            **self.fragments.head_entry(),  # each fragment's round (Streaming DiLoCo; none for P=1)
            **self.fence.head_facts(ledger.finished),  # fencing epoch, finished nodes, the lease
            "round": self.rounds.report,  # who the next round waits for, until when (rounds.py)
            **({"final": self.end.final} if self.end.final else {}),  # the run is over (end.py)
            # The round count and the last globals, from which a master that takes over recovers the
            # outer momentum (momentum.py).
            "momentum": momentum.head_entry(self.outer, self.store.links_before(ledger.outer_step)),
            "status": self.status(),  # what metrics.json says; `hub status` shows it
        }

    def publish(self) -> None:
        head = self._head()
        try:
            self.fence.ensure()  # still the run's master (LeaseLost: nothing is published)
            files = self.global_files()
            if self.store.broadcast.updates:  # workers keep the global they fetch: the next update's base
                head["global_updates"] = True
            if files.update is not None:
                head["update_from"] = self.outer_step - 1
            self.head = self.store.publish_own(self.bus, files, head, self.head)
        except HeadMoved as error:
            raise SpeedtronicError(
                f"DiLoCo master: {self.bus.url}: another master advanced the run ({error}); this one stops "
                "without publishing outer step "
                f"{self.outer_step} — run one master per run (its state stays in {self.store.path})"
            ) from None
        self.report.published()
        logger.info("DiLoCo master: published outer step %d to %s", self.outer_step, self.bus.url)

    # -- one round ----------------------------------------------------------------------------------
    def _reject(self, rejection: pipeline.Rejection, doomed: list[DeltaRef]) -> None:
        """Log and forget a bad file. It moves no node's state (no high-water mark, no history): only
        its name and version are remembered, so the same bytes are not read again. A final delta
        rejected for its content still ends its node (end.py)."""
        ref, reason, check = rejection.delta.ref, rejection.reason, rejection.check
        logger.warning(
            "DiLoCo master: rejected delta %s from %s by %s: %s", ref.name, ref.node, check, reason
        )
        self.ledger.reject(ref, reason, check)
        self.report.note_rejection(ref.node, ref.name, reason)
        doomed.append(ref)
        if check == "after_end":
            self.end.refused_after_end(ref.node)  # the end does not wait for it
        if rejection.content:
            rejected_final(self.ledger, ref.name, ref.node, rejection.delta.meta)

    def context(self) -> Context:
        """What the checks may read, for one poll or round."""
        return Context(
            specs=self.specs,
            plan=self.fragments.plan,
            settings=self.dist,
            ledger=self.ledger,
            peers=self.peers,
            weights=self.outer.weights,
            fragment_rounds=self.fragments.rounds,
            max_bytes=self.limits.max_bytes,
            max_tokens=self.limits.max_tokens,
            round_tokens=self.limits.round_tokens,
            lr=self.outer.lr,
            evaluate=self.evaluate,
            first_seen=self.rounds.seen_at,
            spans=self.rounds.spans,
            run_end=self.end.last_step,
            round_nodes=len(self.rounds.expected),
            late_open=self.end.late_open(self.clock(), self.outer_step),
        )

    def _list(self, doomed: list[DeltaRef]) -> dict[str, list[tuple[int, DeltaRef]]]:
        """Poll the bus: the pending deltas per node, screened by the listing checks."""
        spent = self.bus.requests_spent()
        allowed = self.rounds.allowed
        refs = self.bus.list_deltas(None if allowed is None else {n: {} for n in allowed})
        self.report.polled(None if spent is None else (self.bus.requests_spent() or spent) - spent)
        pending: dict[str, list[tuple[int, DeltaRef]]] = {}
        context = self.context()
        for ref in refs:
            if self.ledger.was_rejected(ref):
                continue  # rejected before but not deletable here (a collaborator's own repo)
            if self.rounds.unlisted(ref):
                continue
            rejection = self.pipeline.screen(Delta(ref, -1), context, "name")
            if rejection is not None:
                self._reject(rejection, doomed)
                continue
            seq = codec.parse_delta_name(ref.name)[1]
            if self.ledger.processed(ref, seq):
                doomed.append(ref)  # processed before (a replay, or a crash before the delete)
                continue
            rejection = self.pipeline.screen(Delta(ref, seq), context, "sequence")
            if rejection is not None:
                self._reject(rejection, doomed)
                continue
            pending.setdefault(ref.node, []).append((seq, ref))
        return pending

    def round(self) -> bool:
        """Poll once; run an outer step when the round is ready. True when a step was taken."""
        # Membership follows the manifest: re-read when due, or at once on a sign of a new collaborator.
        self.rounds.refresh(self.bus.unclaimed_sources())
        doomed: list[DeltaRef] = []
        pending = self._list(doomed)
        if self.rounds.arrivals(pending):
            self.report.heard(self.clock())  # report.next_poll learns when a round's deltas start to come
        self.rounds.pending(pending)
        queues = {node: sorted(items, key=lambda i: i[0]) for node, items in pending.items()}
        cannot = {n for n in pending if not self.peers.active(n)} | self.end.done
        ready = self.rounds.ready(
            set(pending), self.outer_step, self.ledger.finished, self.report.poll_delay_s, cannot
        )
        stepped = False
        if ready and queues:
            stepped = self._apply(queues, doomed, set(pending))
            self.rounds.settled({ref.id for ref in doomed}, [ref for q in queues.values() for _, ref in q])
        elif doomed:
            self.save_state()  # remembers rejected versions
        if not stepped and (self.store.unpublished or self.report.republish_due()):
            self.publish()  # a publish that failed, or the same global with a head that tells rejected nodes why
        doomed = [ref for ref in doomed if ref.id not in self.store.unpublished]  # until published
        if doomed:
            try:
                self.bus.delete_deltas(doomed)
            except BusError as error:
                logger.warning("DiLoCo master: could not delete processed deltas (%s); will retry", error)
        return stepped

    def _receive(
        self, queues: dict[str, list[tuple[int, DeltaRef]]], doomed: list[DeltaRef], context: Context
    ) -> list[Delta]:
        """Read and check each node's oldest pending delta (decode → the delta checks); the accepted
        ones, at most one per node. A node whose oldest is rejected has its next one read in the same
        round (up to BACKLOG_WALK): a backlog that went stale while the master could not see it (a
        joiner listed late, a master failing over) is rejected in one round and its newest delta
        counts now, where one rejection a round made each next one staler (a soak's joiner: 7 in a row)."""
        first_seen = self.rounds.seen_at
        # Oldest on the bus first: of two identical payloads in one round, the later one is the copy.
        order = sorted(queues.values(), key=lambda q: (first_seen.get(q[0][1].id, 0.0), q[0][1].id))
        accepted: list[Delta] = []
        kept = self.rounds.take_kept()
        heads = [queue[0][1] for queue in order]  # each node's oldest: read first, so all at once
        pipeline.prefetch(heads, self.fragments, self.bus, self.limits.max_bytes, self.ledger, kept)
        for queue in order:
            for seq, ref in queue[:BACKLOG_WALK]:
                delta = self._read(seq, ref, kept)
                if delta is None:
                    break  # unreadable now: it and the node's later ones stay for the next round
                if self.pipeline.receive(delta, context, lambda r: self._reject(r, doomed)):
                    accepted.append(delta)
                    break
        return accepted

    def _read(self, seq: int, ref: DeltaRef, kept: dict[str, bytes]) -> Delta | None:
        """One pending delta's bytes (None, logged, when the bus cannot give them now)."""
        try:
            data = pipeline.read(ref, self.fragments, self.bus, self.limits.max_bytes, self.ledger, kept)
        except PermissionDenied:
            raise
        except BusError as error:
            logger.warning(
                "DiLoCo master: could not read %s (%s); it stays for the next round", ref.id, error
            )
            return None
        return Delta(ref, seq, data)

    def _apply(
        self, queues: dict[str, list[tuple[int, DeltaRef]]], doomed: list[DeltaRef], have: set[str]
    ) -> bool:
        """decode → checks → weigh → aggregate → outer step → record → commit → publish."""
        context = self.context()
        accepted = self._receive(queues, doomed, context)
        # Streaming DiLoCo: nodes out of phase bring deltas of different fragments; the round takes the
        # fragment that is furthest behind and the others wait, pending, for their peers (fragments.py).
        held = set(self.fragments.hold_back(accepted))
        accepted = [d for d in accepted if d.id not in held]
        for delta_id in held:
            context.hold(delta_id)
        if self._waits_on(accepted, context, have):
            self.rounds.keep({f"{d.id}@{d.ref.etag}": d.data for d in accepted})
            return False
        accepted = self.pipeline.judge_round(accepted, context, lambda r: self._reject(r, doomed))
        if not accepted:
            self.save_state()
            return False
        live = pipeline.weigh(accepted, self.fragments.count, context)
        fresh = pipeline.freshness(accepted, self.fragments.count)
        if live and not self._step(live, pipeline.folds(accepted, self.ledger), fresh):
            for delta in accepted:
                delta.zero("refused_step")  # consumed, but the global they made was not kept
            live = []
        if live:
            self.pipeline.kept(accepted, context)  # their norms are the outlier check's reference
        self._untrusted(accepted)
        pipeline.record(accepted, self.ledger, self.report, self.rounds)
        self.save_state()  # the commit point: from here on these deltas count as applied
        doomed.extend(d.ref for d in accepted)
        self.store.applied({d.ref.id for d in accepted})
        pipeline.log_step(
            self.outer_step, accepted, len(live), self.ledger.last_loss() if self.evaluate else None
        )
        self.publish()
        if self.dist.bus.squash_every and self.outer_step % self.dist.bus.squash_every == 0:
            try:
                self.bus.compact()
            except BusError as error:
                logger.warning("DiLoCo master: could not squash history (%s)", error)
        return bool(live)

    def _waits_on(self, accepted: list[Delta], context: Context, have: set[str]) -> bool:
        """Whether the round, ready by its count, must wait on: once the deltas that would weigh 0
        (quarantined, caught by the loss probe, held back or rejected) are left out, its quorum or
        `min_deltas` is not met (rounds.py). A round at max_wait closes all the same."""
        if self.rounds.closes_by in ("max_wait", "none_can_weigh"):
            return False
        complete = not self.rounds.expected - have  # every node the round expects is in it
        cannot = self.pipeline.cannot_weigh(accepted, context, complete)
        weighs = {d.node for d in accepted} - cannot
        if not cannot:
            return False  # every delta read weighs: the count the round closed on stands
        # A node whose final delta is in this round sends no other: like a finished node it is not
        # waited for, and min_deltas counts it off (a quarantined honest node's last delta left a
        # round waiting max_wait for a delta that weighs and could not come).
        ending = {d.node for d in accepted if d.meta.get("final") == "1"}
        ready = self.rounds.ready(
            have, self.outer_step, self.ledger.finished | ending, self.report.poll_delay_s, have - weighs
        )
        if not ready and self.rounds.first_wait(f"{self.outer_step}:{sorted(cannot)}:{sorted(weighs)}"):
            logger.info(
                "DiLoCo master: outer step %d waits on: %s would weigh 0, so the deltas that weigh (%s) do not "
                "fill its quorum yet",
                self.outer_step + 1,
                ", ".join(sorted(cannot)),
                ", ".join(sorted(weighs)) or "none",
            )
        return not ready

    def _step(
        self,
        live: list[tuple[dict[str, torch.Tensor], float, int]],
        spans: list[tuple[int, float]],
        fresh: dict[int, float],
    ) -> bool:
        """Aggregate and take the outer step, then keep it — or refuse it (the previous global stays,
        logged) when the new global has a non-finite weight or validation loss, or a loss more than
        EXPLODE × the previous global's (a hostile majority's vote, or a diverging run). A step whose
        loss rose over RISE × the previous one's is first taken again without the momentum
        (`_without_momentum`). `fresh`: each fragment's step scale (pipeline.freshness)."""
        outer = self.outer
        saved, rounds = outer.save(), self.fragments.snapshot()
        self.fragments.step(outer, live, self.dist.defences.aggregation, self.outer_step, spans, fresh=fresh)
        self._log_fold(spans)
        self._log_stale(fresh)
        finite = self._finite()
        loss = float(self.evaluate(outer.weights)) if finite and self.evaluate is not None else None
        previous = self.ledger.last_loss(self.outer_step)
        if finite and self._overshot(loss, previous):
            loss = self._without_momentum(live, spans, fresh, saved, loss, previous)
        why = refusal(finite, loss, previous)
        if why is not None:
            outer.put_back(saved)
            self.fragments.restore(rounds)
            logger.warning(
                "DiLoCo master: refused outer step %d: %s; the global of outer step %d stays",
                self.outer_step + 1,
                why,
                self.outer_step,
            )
            return False
        self.ledger.step()
        self.report.stepped(self.clock())  # report.next_poll: the next round may come soon
        if loss is not None:
            self.ledger.loss(self.outer_step, loss)
            self.end.remember(self.outer_step, loss, outer.weights)
        return True

    def _log_fold(self, spans: list[tuple[int, float]]) -> None:
        folded = max((r for r, w in spans if w > 0), default=1)
        if folded > 1 and self.fragments.count <= 1:
            ratio = self.outer.update_ratio()
            logger.info(
                "DiLoCo master: outer step %d takes deltas folded over up to %d sync points; the momentum "
                "takes %.2f of the round%s",
                self.outer_step + 1,
                folded,
                momentum_feed(self.outer.last_mu, spans),
                "" if ratio is None else f"; it moves the global {ratio:.1f}× the median of the steps before",
            )

    def _log_stale(self, fresh: dict[int, float]) -> None:
        scale = min(fresh.values(), default=1.0)
        if scale < 1.0:
            logger.info(
                "DiLoCo master: outer step %d: every delta of the round was built on a global %d step(s) old, "
                "whose progress those steps already carried in part: it steps %.2f of the outer lr",
                self.outer_step + 1,
                round(1 / scale) - 1,
                scale,
            )

    def _overshot(self, loss: float | None, previous: float | None) -> bool:
        """Whether the step just taken, with momentum, raised the loss over RISE × the last global's
        (or to a non-finite one): the momentum may have carried the global past the valley."""
        if loss is None or previous is None or not math.isfinite(previous) or previous <= 0:
            return False
        if self.fragments.count > 1 or self.outer.last_mu <= 0:
            return False  # Streaming DiLoCo's fragments step on their own momentum; μ 0 has none to drop
        return not loss <= RISE * previous

    def _without_momentum(
        self,
        live: list[tuple[dict[str, torch.Tensor], float, int]],
        spans: list[tuple[int, float]],
        fresh: dict[int, float],
        before: Saved,
        loss: float,
        previous: float,
    ) -> float:
        """The same round once more from `before`, without the momentum (θ − η·Δ̄; the momentum restarts
        from this round: outer.py); the global with the lower loss stays, and its loss is returned. Only
        for a plain run (`_overshot`), whose fragment round the step sets the same either way."""
        outer = self.outer
        first = outer.save()
        outer.put_back(before)
        self.fragments.step(
            outer, live, self.dist.defences.aggregation, self.outer_step, spans, plain=True, fresh=fresh
        )
        evaluate = self.evaluate
        retried = float(evaluate(outer.weights)) if evaluate is not None and self._finite() else math.nan
        kept = retried < loss or (not math.isfinite(loss) and math.isfinite(retried))
        logger.warning(
            "DiLoCo master: outer step %d with its momentum raises the validation loss %.4f → %.4f (over "
            "%g×); without the momentum: %.4f, %s",
            self.outer_step + 1,
            previous,
            loss,
            RISE,
            retried,
            "taken (the momentum restarts from this round)" if kept else "no better: the step with it stands",
        )
        if kept:
            return retried
        outer.put_back(first)
        return loss

    def _finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in self.outer.weights.values())

    def _untrusted(self, accepted: list[Delta]) -> None:
        """Say loudly when every live node's delta weighed 0 (quarantined, probed out, step refused)."""
        report = self.rounds.report
        live = set(report.get("live") or ()) - self.ledger.finished - self.end.done
        weighed = {d.node for d in accepted if not d.zeroed}
        seen = {d.node for d in accepted}
        self.end.only_untrusted(sorted(live) if live and live <= seen and not weighed else None)

    def _evaluate(self) -> float | None:
        if self.evaluate is None:
            return None
        loss = float(self.evaluate(self.outer.weights))
        self.ledger.loss(self.outer_step, loss)
        self.end.remember(self.outer_step, loss, self.outer.weights)
        return loss

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
                self.end.round_done()  # the end needs a round that started after it (wait)
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
                self._idle()

    def _idle(self) -> None:
        """Wait for the next poll, renewing the lease between polls (a lost lease stops the loop)."""
        error = self.fence.idle(self._stop, self.next_poll())
        if error is not None:
            self.error = error
            self._stop.set()

    def next_poll(self) -> float:
        """Seconds to the next poll (report.Report.next_poll)."""
        since = self.report.since_step(self.clock())
        return self.report.next_poll(self.bus, self.rounds.pending_count, since)

    def status(self) -> dict[str, Any]:
        """The status document (report.status): metrics.json and head.json's "status"."""
        return report.status(
            report.Sources(
                self.ledger,
                self.rounds,
                self.peers,
                self.fence,
                self.end,
                self.report,
                self.bus,
                self.rounds.pending_refs,
                self.rounds.pending_count,
                self.evaluate,
            )
        )

    def metrics(self) -> dict[str, Any]:
        return self.status()

    def write_metrics(self, force: bool = False) -> None:
        """metrics.json in the state directory, for operators and dashboards (atomically replaced)."""
        self.report.write_metrics(self.status, force)
        for watch in self.report.watchers:  # the user's trackers (tracking.py)
            watch(self)

    def stop(self) -> None:
        self._halt()
        self._publish_final_status()  # head.json's status ends equal to metrics.json
        self.write_metrics(force=True)

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _publish_final_status(self) -> None:
        """On stop: publish the head once more when the counts in the published status are not the
        master's latest (rejections or arrivals after the last outer step), so `hub status` ends equal to
        metrics.json. Never after an error (another master, no permission): nothing is published then."""
        if self.error is not None or self.head is None:
            return
        if report.unchanged(self.head.get("status") or {}, self.status()):
            return
        try:
            self.publish()
        except (BusError, SpeedtronicError) as error:
            logger.warning("DiLoCo master: could not publish the final status (%s)", error)

    # -- the run's end (end.py) ---------------------------------------------------------------------------
    def _liveness(self) -> Liveness:
        wait = self.dist.rounds.never_heard_wait
        never = float(self.dist.rounds.max_wait if wait is None else wait)
        return Liveness(
            self.rounds,
            self.ledger,
            never,
            self.report.poll_delay_s,
            self.end.started,
            self.end.done,
            self.end.untrusted_only,
            self.end.id_leases if self.end.past(self.outer_step) else None,
        )

    def wait(
        self, end: int, idle_s: float, linger_s: float | None = None, busy: Callable[[], bool] | None = None
    ) -> str:
        """Block until the run is over (end.py; while `busy()` is true, keep waiting regardless); then
        stop the outer loop, publish the final pick and return why the run ended."""
        linger_s = 0.0 if linger_s is None else linger_s
        self.end.ends_at(end, linger_s)
        last, last_change = self.outer_step, self.clock()
        last_log = self.clock()
        confirm: int | None = None  # rounds done when the end was first seen
        while self._thread is not None and self._thread.is_alive():
            now, live = self.clock(), self._liveness()
            if self.outer_step != last:
                last, last_change = self.outer_step, now
            ended_at = self.end.reached(now, self.outer_step)
            # Deltas that cannot weigh are no news: a swarm of only such nodes idles out.
            quiet = now - (
                last_change if self.end.untrusted_only else max(last_change, self.rounds.last_arrival)
            )
            left = live.left(now, ended_at is not None and now - ended_at >= linger_s)
            unfinished = live.unfinished(left)
            # Deltas of nodes refused past the end hold nothing: they are refused whenever read.
            pending = self.rounds.pending_except(self.end.done)
            if busy is None or not busy():
                over = ended_at is not None and now - ended_at >= linger_s and pending == 0 and not unfinished
                # pending_count is from the latest poll: the end needs one that *started* after the end
                # was seen (two rounds done since: the one in progress then may have listed before).
                confirm = (self.end.rounds_done if confirm is None else confirm) if over else None
                if over and confirm is not None and self.end.rounds_done >= confirm + 2:
                    return self._finish(live.done_reason(left), end, complete=True)
                # Pending deltas are always settled by a round (applied or rejected); give them longer.
                if quiet > idle_s * (3 if pending else 1):
                    return self._finish(live.idle_reason(quiet, end, now, pending), end, complete=False)
            if now - last_log >= max(30.0, self.dist.node.poll_interval):
                last_log = now
                logger.info(
                    "DiLoCo master: %s",
                    self.progress_line(end, unfinished, idle_s - quiet, ended_at, linger_s),
                )
            time.sleep(min(0.5, self.dist.node.poll_interval))
        return self.end.ended(f"the outer loop stopped: {self.error}" if self.error else "stopped")

    def progress_line(
        self, end: int, unfinished: list[str], idle_left: float, ended_at: float | None, linger_s: float
    ) -> str:
        """What the master waits for and until when, in one line."""
        return report.progress_line(
            self.outer_step,
            end,
            self.rounds.pending_count,
            self.rounds.waiting,
            self.report.poll_delay_s,
            unfinished,
            idle_left,
            ended_at,
            linger_s,
        )

    def _finish(self, reason: str, end: int, *, complete: bool) -> str:
        """Stop the outer loop, publish the final pick, and say why the run ended (one log line)."""
        self._halt()
        self.end.ended(reason)
        final = self._pick_final(reason)
        logger.log(
            logging.INFO if complete else logging.WARNING,
            "DiLoCo master: %s at outer step %d (end %d): %s; %d deltas applied, %d rejected; %s",
            "run complete" if complete else "stopping",
            self.outer_step,
            end,
            reason,
            len(self.ledger.applied_ids),
            len(self.ledger.rejected),
            final_line(final),
        )
        return reason

    def _pick_final(self, reason: str) -> dict[str, Any]:
        """Evaluate the last global, publish the run's best one as final when it is better, and record
        the pick (head.json "final")."""
        step = self.outer_step
        loss: float | None = None
        if self.evaluate is not None:
            loss = self.ledger.last_loss(step)
            if loss is None:
                loss = self._evaluate()
        final: dict[str, Any] = {
            "outer_step": step,
            "from_outer_step": step,
            "val_loss": loss,
            "last_val_loss": loss,
            "chosen": "last",
            "reason": reason,
        }
        best = self.end.better(step, loss)
        if best is not None:
            self.outer.restore(best.weights)  # momentum reset: the old direction no longer applies
            self.store.broadcast.forget()  # the final global is sent whole anyway (exact)
            self.ledger.step()
            # Every fragment moved (Streaming DiLoCo): a worker still running installs all of it.
            self.fragments.advance_all()
            self.ledger.loss(self.outer_step, best.val_loss)
            final.update(
                outer_step=step + 1, from_outer_step=best.outer_step, val_loss=best.val_loss, chosen="best"
            )
        self.end.picked(final)
        try:
            self.save_state()  # the commit point, as for any outer step
            self.publish()
        except (BusError, OSError) as error:
            logger.warning("DiLoCo master: could not publish the final global (%s)", error)
        except SpeedtronicError as error:  # another master advanced the run: this one says so and stops
            self.error = error
            logger.error("%s", error)
        return final

    def summary(self) -> dict[str, Any]:
        ledger = self.ledger
        return {
            "outer_step": ledger.outer_step,
            "applied": list(ledger.applied_ids),
            "rejected": list(ledger.rejected),
            "finished": sorted(ledger.finished),
            "end_reason": self.end.reason,  # why the run ended (end.py)
            "final": self.end.final,  # which global was published as the final one, and its val loss
            "per_node": {n: dict(c) for n, c in ledger.per_node.items()},
            "bytes_in": ledger.bytes_in,
            "polls": self.report.polls,
            "metrics": str(self.report.metrics_path),
            "global_val_loss": [{"outer_step": s, "val_loss": v} for s, v in ledger.val_losses],
            "state": str(self.store.path),
            **self.fence.summary(),  # the epoch, the lease, where this master took over
        }


EXPLODE = 1.5  # a new global's val loss above this × the previous one's is refused


def refusal(finite: bool, loss: float | None, previous: float | None) -> str | None:
    """Why a new global is refused (None: kept): a non-finite weight or loss, or an exploding loss."""
    if not finite:
        return "the new global has non-finite weights"
    if loss is None:
        return None
    if not math.isfinite(loss):
        return f"the new global's validation loss is {loss}"
    if previous is not None and math.isfinite(previous) and loss > EXPLODE * previous:
        return (
            f"the new global's validation loss {loss:.4f} is over {EXPLODE:g}× the last one's {previous:.4f}"
        )
    return None


def planned_rounds(config: Config) -> int:
    dist = config.distributed
    count = getattr(dist.sync, "fragments", 1)
    return max(
        1, len(fragments.sync_points(config.max_steps(), dist.sync.inner_steps, count, dist.sync.ramp))
    )
