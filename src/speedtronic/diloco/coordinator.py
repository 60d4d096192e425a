"""The worker side of DiLoCo: a `Sync` (engine/sync.py) the Trainer calls after every optimizer step.

Book-keeping (all fp32 CPU tensors keyed by unique parameter):
  anchor     θ_global of the last installed global model (the last sync)
  accounted  the part of (anchor − θ) already handed to the upload queue since that sync
  residual   int8/bf16 rounding error not yet delivered (error feedback)

At each sync point (every `inner_steps` steps; `sync_ramp`: after 1, 3, 7, …) x = (anchor − θ) − accounted
is queued (Δ has the sign of a gradient: θ_global_at_sync − θ_now); with `fragments` P > 1
(diloco/fragments.py) each sync point is one fragment's and x covers its tensors only. Uploads run on a
thread through a bounded queue (`delta_upload_overflow`: block | drop_oldest | coalesce). Each delta carries
a per-node sequence number in its file name; re-sending the same item (a retry, or a replay after resume
from a checkpoint) yields the same name, which the master has already processed, so nothing is applied
twice. An upload that fails and is confirmed absent from the bus keeps its baseline: its delta is merged
into the next one, which then carries the cumulative delta.

The coordinator owns one uploader and one poller for its life (diloco/background.py): a close() that
gives up on a running upload leaves it to finish, and the next train() resumes that same thread, so
the queue's head is never uploaded (and popped) twice.

A poller thread watches head.json; a newer global is decoded and validated there but installed on the
training thread (in `after_step`): θ ← G − u, where u = (anchor − θ) − accounted is the local progress not
yet queued, so no local step is thrown away (per fragment the global moved; with `overlap_steps` τ a synced
fragment's global waits for step sync + τ, diloco/overlap.py); `after_step` answers True, and the trainer
broadcasts the weights to its DDP ranks and resets the optimizer if the plan says so. The whole state goes
into the training checkpoint (its "sync" part) and comes back on resume.

The run's end: the manifest's `run.outer_steps`. Once this node has installed a global at or past
it (and newer than the one it joined with, so a late joiner's work still counts), its next sync
point is its last: that delta is marked final and `after_step` raises StopTraining, which the
trainer treats as a normal end (final evaluation and checkpoint, queued deltas flushed by close). This module sees
only the model, the step and the token count: never the trainer, its optimizer or its config.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from speedtronic.config.distributed import wait_poll_s
from speedtronic.diloco import codec, fragments, master_lease, master_report, overlap, worker_state
from speedtronic.diloco.background import Background
from speedtronic.diloco.bus.base import Bus, BusError, Head, PermissionDenied
from speedtronic.diloco.identity import NodeLease
from speedtronic.diloco.overlap import Global
from speedtronic.diloco.upload_item import Item, zeros
from speedtronic.engine.sync import StopTraining
from speedtronic.errors import SpeedtronicError
from speedtronic.retry import RetryPolicy

logger = logging.getLogger("speedtronic.diloco")

# Hub requests one poll of a worker makes (head.json's metadata and its bytes); the faster polls of a
# waiting worker are paced to it within the bus's request budget (bus.poll_delay).
POLL_COST = 2.0


class Coordinator:
    def __init__(
        self, config: Any, bus: Bus, node: str, manifest: dict[str, Any], lease: NodeLease | None = None
    ) -> None:
        dist = config.distributed
        self.lease = lease  # this node id's lease (diloco/identity.py): checked before every upload
        self.dist = dist
        self.bus, self.node = bus, node
        self.specs = codec.specs_from_json(manifest["params"])
        self.H = dist.sync.inner_steps
        self.outer_step = -1
        self.seq: int | None = None
        self.anchor: dict[str, torch.Tensor] | None = None
        self.accounted: dict[str, torch.Tensor] = {}
        self.residual: dict[str, torch.Tensor] = {}
        self.queue: deque[Item] = deque()
        self.tokens_since = 0
        self.bytes_sent = 0
        self.uploaded: list[str] = []
        self.dropped = 0
        self.hwm = -1
        self.last_sync: float | None = None
        self.max_global_bytes = int(1.5 * codec.wire_bytes(self.specs, "fp32")) + (1 << 20)
        self._cond = threading.Condition()
        self._incoming: Global | None = None
        # A global taken from the poller by `needs_weights` for the next after_step to install (an
        # FSDP node gathers the weights only for steps that said so: nothing may arrive in between).
        self._staged: Global | None = None
        # Streaming DiLoCo (diloco/fragments.py): fragment p syncs its own tensors at its own steps;
        # per fragment, the round and outer step of the global installed for it. Overlap
        # (diloco/overlap.py): synced fragments waiting for their due step, the newest global held.
        self.frags = fragments.Plan.from_config(self.specs, dist)
        self.fragment_rounds = [-1] * self.frags.count
        self.anchor_steps = [-1] * self.frags.count
        self.pending = overlap.Pending(dist.sync.overlap_steps)
        self.latest: Global | None = None
        self.head_step = -1  # the newest head's outer step seen
        self.peak_delta_bytes = 0  # the largest delta this node uploaded (Streaming DiLoCo's point)
        self._was_asked = False
        self._fatal: BaseException | None = None
        self.waiting_on_global = 0  # training waits for a global (under _cond): the poller polls faster
        self._up = Background(f"diloco-{node}-upload", self._uploader, self._cond)
        self._poll = Background(f"diloco-{node}-poll", self._poller, self._cond)
        self._last_tokens = 0
        self._own: set[str] = set()
        self.sent_since_install = 0
        self.installs = 0
        self._stop_step = 0  # the last step this process trains (the trainer's plan says, at attach)
        self.manifest = manifest
        # The run's end (manifest run.outer_steps) and this node's last sync point before it stops (set
        # at attach): its final delta says so; once it is applied the master stops waiting for this node.
        self.end = (manifest.get("run") or {}).get("outer_steps")
        self.final_step: int | None = None
        self.joined_at: int | None = None  # the outer step of the global this process started from
        self.ended_early = False
        self.rejected_own: dict[str, str] = {}  # own uploaded file -> why the master rejected it
        self.epochs = master_lease.EpochFence(node)  # heads and globals of a lower master epoch: ignored
        self.eval_meta: dict[str, str] = {}  # the node's latest eval, sent with its deltas (node_eval.py)

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return worker_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        worker_state.load_state_dict(self, state)

    # -- the Sync protocol ------------------------------------------------------------------------
    def attach(self, model: nn.Module, *, step: int, tokens: int, final_step: int) -> None:
        """Check the model against the manifest, then start from the run's global model (fresh runs)."""
        from speedtronic.diloco.manifest import check_manifest

        check_manifest(self.manifest, codec.param_specs(model), self.bus.url)
        fragments.check(self.manifest, self.frags, self.bus.url)
        self._last_tokens = tokens
        self._stop_step = final_step
        points = self.frags.points(final_step)
        self.final_step = points[-1] if points else None
        head = self._wait_for_head()
        self.hwm = int((head.get("hwm") or {}).get(self.node, -1))
        if self.seq is not None and self.hwm >= self.seq:
            # The master processed deltas this checkpoint never made: a later run of this node sent
            # them and died. Their work is in the global already; resending it renumbered (the
            # checkpoint's anchor predates them) would count it twice. Start over from the global.
            logger.warning(
                "DiLoCo node %s: the master has processed up to #%d, past this checkpoint's #%d: its "
                "progress since is in the global already; starting over from the current global",
                self.node,
                self.hwm,
                self.seq - 1,
            )
            with self._cond:
                self.queue.clear()
            self.seq, self.anchor, self.accounted, self.residual = None, None, {}, {}
            self.pending.due = {}
        if self.seq is None:
            # Number after the master's mark and after our own unprocessed files, but never after a
            # file far beyond the mark: that is garbage someone dropped, not ours.
            own = [codec.parse_delta_name(n)[1] for n in self._own_names()]
            self.seq = max([self.hwm, *(s for s in own if s <= self.hwm + codec.SEQ_WINDOW)]) + 1
        if self.anchor is None:
            self._install(model, step, self._fetch_global(head), fresh=True)
        elif self.pending.due:  # resumed inside an overlap: its global is installed at the due step
            self.latest = self._fetch_global(head)
        self.joined_at = max(self.outer_step, int(head.get("outer_step", -1)))
        logger.info(
            "DiLoCo node %s on %s: outer step %d (the run ends at %s), next delta #%d, %d queued",
            self.node,
            self.bus.url,
            self.outer_step,
            self.end if self.end is not None else "?",
            self.seq,
            len(self.queue),
        )

    def after_step(self, model: nn.Module, *, step: int, tokens: int) -> bool:
        """Install a newer global if one arrived, and at a sync point queue this node's delta;
        True when the model's weights were replaced."""
        self._check_fatal()
        installs = self.installs
        self._ensure_threads()
        if not self._was_asked:
            self._stage()
        self._was_asked = False
        incoming, self._staged = self._staged, None
        if incoming is not None:
            self._install(model, step, incoming)
        self.tokens_since += tokens - self._last_tokens
        self._last_tokens = tokens
        fragment = self.frags.at(step)
        if fragment is not None:
            ending = self._run_over(step)
            if ending:
                self.final_step = step  # this delta is this node's last: the master stops waiting for it
            self._boundary(model, step, fragment)
            if not self.dist.worker.async_global_poll:
                self._poll_once()
                self.accept_incoming(model, step)
                if self._fatal is not None:  # e.g. the master rejects everything this node sends
                    raise SpeedtronicError(f"DiLoCo: {self._fatal}") from None
            if not self.dist.worker.async_upload:
                self._drain(deadline=None)
                if self._fatal is not None:
                    raise SpeedtronicError(f"DiLoCo: {self._fatal}") from None
            if ending:
                self.ended_early = True
                self._progress(step)
                raise StopTraining(
                    f"the DiLoCo run's end (outer step {self.end}) was reached (global of outer step "
                    f"{self.outer_step} installed); node {self.node} sent its final delta",
                    installed=self.installs != installs,
                )
            self._maybe_wait_for_global(model, step)
            self._progress(step)
        overlap.install_due(self, model, step)  # overlap_steps > 0: the globals due at this step
        return self.installs != installs

    def needs_weights(self, step: int) -> bool:
        """Whether `after_step(step)` will read or replace the weights: at a sync point, or to install a
        global that has arrived (taken now, so that no other arrives before that after_step)."""
        self._was_asked = True
        self._stage()
        return self._staged is not None or self.frags.at(step) is not None or bool(self.pending.ready(step))

    def _stage(self) -> None:
        incoming = self._take_incoming()
        if incoming is not None:
            self._staged = incoming

    def _run_over(self, step: int) -> bool:
        """True when the run's end has been reached since this node joined, before its own last step."""
        return (
            isinstance(self.end, int)
            and self.outer_step >= self.end
            and self.joined_at is not None
            and self.outer_step > self.joined_at
            and step < self._stop_step
        )

    def _maybe_wait_for_global(self, model: nn.Module, step: int) -> None:
        """Bounded asynchrony: with max_rounds_ahead set, do not run further ahead of the master."""
        ahead = self.dist.worker.max_rounds_ahead
        if ahead is None or self.sent_since_install <= ahead or step >= self._stop_step:
            return
        deadline = time.monotonic() + self.dist.rounds.max_wait
        logger.info(
            "DiLoCo node %s: %d deltas ahead of the global model; waiting for it",
            self.node,
            self.sent_since_install,
        )
        with self.waiting_for_global():
            while time.monotonic() < deadline:
                if not self.dist.worker.async_global_poll:
                    self._poll_once()
                if self.accept_incoming(model, step):
                    return
                self._check_fatal()
                time.sleep(min(0.1, self.dist.node.poll_interval))
        logger.warning(
            "DiLoCo node %s: no new global within %.0fs; training on", self.node, self.dist.rounds.max_wait
        )

    def _check_fatal(self) -> None:
        """Raise, on the training thread, what a thread recorded or the lost lease on this node id."""
        if self._fatal is None and self.lease is not None:
            self._fatal = self.lease.error
        if self._fatal is not None:
            raise SpeedtronicError(f"DiLoCo: {self._fatal}") from None

    def close(self) -> None:
        """Flush the upload queue (up to delta_upload_shutdown_timeout) and stop the threads. An upload
        still running then finishes on its own (`join` waits for it); the next train() resumes it."""
        deadline = time.monotonic() + self.dist.worker.upload_shutdown_timeout
        self.stop(deadline)
        self._up.join(max(0.0, deadline - time.monotonic()))
        self._poll.join(min(5.0, max(0.0, deadline - time.monotonic())))
        if self.queue and self._fatal is None and not self.dist.worker.async_upload:
            self._drain(deadline)
        if self.queue:
            logger.warning(
                "DiLoCo node %s: %d delta(s) not uploaded at shutdown; they are kept in the checkpoint "
                "and sent on resume",
                self.node,
                len(self.queue),
            )

    def stop(self, deadline: float | None = None) -> None:
        """Ask the threads to end: the uploader once its queue is empty or, past `deadline` (monotonic),
        after its current upload; what is left stays queued (in the checkpoint)."""
        self._up.stop(deadline)
        self._poll.stop()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the threads to end (after `stop` or `close`, which a running
        upload can outlast); True when none runs."""
        end = None if timeout is None else time.monotonic() + timeout
        uploader = self._up.join(None if end is None else max(0.0, end - time.monotonic()))
        return self._poll.join(None if end is None else max(0.0, end - time.monotonic())) and uploader

    # -- the sync ---------------------------------------------------------------------------------
    def _boundary(self, model: nn.Module, step: int, fragment: int) -> None:
        assert self.anchor is not None
        share = self.frags.part  # the fragment's tensors (P=1: all; "elements": strided views)
        anchor, now, accounted = (
            share(fragment, d) for d in (self.anchor, codec.snapshot(model), self.accounted)
        )
        x = {n: anchor[n] - now[n] - accounted[n] for n in anchor}
        for n in x:
            accounted[n] += x[n]  # in place: a view writes self.accounted's tensor
        assert self.seq is not None
        base = self.anchor_steps[fragment]
        item = Item(self.seq, x, base, step, self.tokens_since, fragment, self.fragment_rounds[fragment])
        self.pending.synced(fragment, self.seq, step)  # overlap_steps > 0: install its global at step + τ
        self.seq += 1
        self.sent_since_install += 1
        self.tokens_since = 0
        self._enqueue(item)

    def _enqueue(self, item: Item) -> None:
        policy = self.dist.worker.upload_overflow
        with self._cond:
            tail = self.queue[-1] if self.queue else None
            if tail is not None and tail.failed and not tail.in_flight and tail.fragment == item.fragment:
                # The last upload failed and is not on the bus: the new delta carries it too.
                item.merge(tail)
                self.queue.pop()
            # The queue size counts deltas waiting; the one the uploader holds is not one of them.
            while sum(not i.in_flight for i in self.queue) >= self.dist.worker.upload_queue_size:
                if policy == "block" and self.dist.worker.async_upload and self._up.live:
                    self._cond.wait(1.0)
                    if self._fatal is not None:
                        raise SpeedtronicError(f"DiLoCo: {self._fatal}") from None
                    continue
                idle = [i for i in self.queue if not i.in_flight]
                same = [i for i in idle if i.fragment == item.fragment]  # deltas of one fragment merge
                if policy == "coalesce" and same:
                    item.merge(same[-1])
                    self.queue.remove(same[-1])
                elif idle:  # drop_oldest (and block without an uploader)
                    self.queue.remove(idle[0])
                    self.dropped += 1
                    logger.warning(
                        "DiLoCo node %s: upload queue full, dropped delta #%d", self.node, idle[0].seq
                    )
                else:
                    break
            self.queue.append(item)
            self._cond.notify_all()

    def _encode(self, item: Item) -> tuple[bytes, dict[str, torch.Tensor]]:
        residual = self.frags.part(item.fragment, self.residual)
        y = {n: t + residual[n] for n, t in item.x.items()}
        received = codec.roundtrip(y, self.dist.sync.delta_codec)
        meta = {
            "kind": "delta",
            "node": self.node,
            "seq": str(item.seq),
            "local_step": str(item.local_step),
            "base_outer_step": str(item.base),
            "tokens": str(item.tokens),
            "final": "1" if item.local_step == self.final_step else "0",
            **self.eval_meta,
        }
        if self.frags.count > 1:  # which fragment, and its round in the global the delta was built on
            meta.update(fragment=str(item.fragment), fragment_round=str(item.fragment_round))
        return codec.encode(y, self.dist.sync.delta_codec, meta), {n: y[n] - received[n] for n in y}

    def _upload_head(self) -> bool:
        """Try to upload the oldest queued delta once; True when it is on the bus."""
        with self._cond:
            if not self.queue:
                return True
            item = self.queue[0]
            if item.in_flight:
                return False  # another call is uploading it: one delta is never sent twice at once
            item.in_flight = True
            if item.encoded is None:
                item.encoded = self._encode(item)
            data, residual = item.encoded
            prune = [n for n in self._processed_own()]
        name = codec.delta_name(self.node, item.seq)
        landed: bool | None = False
        try:
            try:
                if self.lease is not None:
                    self.lease.check()  # LeaseLost (a PermissionDenied): never upload under a lost id
                self.bus.put_delta(self.node, name, data, prune=prune)
                landed = True
            except PermissionDenied:
                raise
            except BusError as error:
                try:
                    landed = self.bus.delta_exists(self.node, name)
                except BusError:
                    landed = None
                if not landed:
                    logger.warning("DiLoCo node %s: upload of %s failed (%s)", self.node, name, error)
                    with self._cond:
                        item.failed = landed is False  # confirmed absent: may merge into the next
                    return False
        finally:
            # One critical section: between "no longer in flight" and the pop nothing may drop, merge or
            # replace the item. Only the item this call uploaded is popped, and only while it is still
            # the head (a checkpoint loaded meanwhile replaced the queue: its copy is sent again under the
            # same name, which the master ignores).
            with self._cond:
                item.in_flight = False
                if landed and self.queue and self.queue[0] is item:
                    # A fragment's delta: its share of the residual only.
                    self.residual = self.frags.merged(item.fragment, self.residual, residual)
                    self.queue.popleft()
                    self.bytes_sent += len(data)
                    self.peak_delta_bytes = max(self.peak_delta_bytes, len(data))
                    self.uploaded.append(name)
                    self.last_sync = time.time()
                if landed:
                    self._own.update([name])
                    self._own.difference_update(prune)
                self._cond.notify_all()
        return True

    def _drain(self, deadline: float | None) -> None:
        backoff = RetryPolicy.from_config(self.dist.bus).backoff()
        while self.queue and (deadline is None or time.monotonic() < deadline):
            try:
                ok = self._upload_head()
            except PermissionDenied as error:
                self._fatal = error
                return
            if ok:
                backoff.reset()
                continue
            if deadline is None and not self.dist.worker.async_upload:
                return  # synchronous mode: try again at the next boundary
            delay = backoff.next_delay()
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))

    def _uploader(self) -> None:
        backoff = RetryPolicy.from_config(self.dist.bus).backoff()
        # Ends once stopped with the queue empty, or past the shutdown deadline (the rest stays queued).
        while self._up.wait_for_work(lambda: bool(self.queue)):
            try:
                ok = self._upload_head()
            except PermissionDenied as error:
                self._fatal = error
                return
            except Exception as error:  # a bug must not silently stop uploads: report on the training thread
                self._fatal = error
                return
            if ok:
                backoff.reset()
            else:
                with self._cond:
                    self._cond.wait(backoff.next_delay())

    # -- globals ----------------------------------------------------------------------------------
    def _wait_for_head(self) -> Head:
        return worker_state.wait_for_head(self)

    def _fetch_global(self, head: Head) -> Global:
        data = self.bus.read_global(head)  # as of the head's version, never a newer global
        decoded = codec.decode(data, self.specs, kind="global", max_bytes=self.max_global_bytes)
        self.epochs.check(head, decoded)
        step = decoded.int("outer_step", -1)
        if step != int(head["outer_step"]):
            raise codec.Rejected(f"global file says outer step {step}, head says {head['outer_step']}")
        hwm = int((head.get("hwm") or {}).get(self.node, -1))
        return Global(step, decoded.tensors, fragments.head_rounds(head, self.frags.count), hwm)

    def _poll_once(self) -> None:
        try:
            head = self.bus.read_head()
            if head is None or not self.epochs.admit(head):  # none yet, or a stale master's (logged once)
                return
            self.hwm = int((head.get("hwm") or {}).get(self.node, self.hwm))
            self.head_step = max(self.head_step, int(head["outer_step"]))
            self._check_rejections(head)
            if self.seq is not None and self.hwm >= self.seq:  # numbers at or below it would be refused
                logger.warning(
                    "DiLoCo node %s: the master is at #%d; numbering on from there", self.node, self.hwm
                )
                self.seq = self.hwm + 1
            newest = self._incoming[0] if self._incoming else self.outer_step
            if int(head["outer_step"]) > newest:
                fetched = self._fetch_global(head)
                with self._cond:
                    self._incoming = fetched
        except PermissionDenied as error:
            self._fatal = error
        except (BusError, codec.Rejected) as error:
            logger.warning("DiLoCo node %s: polling %s failed (%s)", self.node, self.bus.url, error)

    def _check_rejections(self, head: Head) -> None:
        """Log why the master rejected this node's own deltas; stop after too many in a row."""
        for name, reason in master_report.own_rejections(head, self.node, self.uploaded, self.rejected_own):
            logger.warning("DiLoCo node %s: the master rejected %s: %s", self.node, name, reason)
        streak = master_report.rejection_streak(self.rejected_own, self.hwm)
        limit = self.dist.worker.max_consecutive_rejections
        if limit is not None and len(streak) >= limit and self._fatal is None:
            self._fatal = SpeedtronicError(
                f"node {self.node}: the master rejected its last {len(streak)} deltas (the latest, "
                f"{streak[-1]}: {self.rejected_own[streak[-1]]}); stopping instead of training on for "
                "nothing — fix the cause, or raise distributed.worker.max_consecutive_rejections"
            )

    def _poller(self) -> None:
        # While training waits for a global the interval is distributed.node.wait_poll_interval (within the
        # bus's request budget): the wait is idle compute, and the global that ends it is usually one
        # master round away. Asked of the bus here, not under the condition `sleep` holds.
        while True:
            wait = self.bus.poll_delay(wait_poll_s(self.dist.node), POLL_COST)
            if not self._poll.sleep(
                self.dist.node.poll_interval,
                sooner=lambda wait=wait: wait if self.waiting_on_global else None,
            ):
                return
            self._poll_once()

    @contextlib.contextmanager
    def waiting_for_global(self) -> Iterator[None]:
        """Training blocks on the bus (overlap's due step, max_rounds_ahead): the poller wakes now and
        polls at the faster cadence until the block ends."""
        with self._cond:
            self.waiting_on_global += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self.waiting_on_global -= 1

    def _take_incoming(self) -> Global | None:
        with self._cond:
            incoming, self._incoming = self._incoming, None
        # A poll that overlapped an install (or a staged one) may bring that global again: not twice.
        return incoming if incoming is not None and incoming[0] > self.outer_step else None

    def accept_incoming(self, model: nn.Module, step: int) -> bool:
        """Install a global the poller brought, if any; True when one was taken."""
        incoming = self._take_incoming()
        if incoming is not None:
            self._install(model, step, incoming)
        return incoming is not None

    def _install(self, model: nn.Module, inner_step: int, g: Global, fresh: bool = False) -> None:
        """Take global `g`: every fragment it moved is installed, except those inside their overlap
        (held in `latest` for their due step, diloco/overlap.py); a fresh start takes it all."""
        every = range(self.frags.count)
        moved = set(every) if fresh or self.anchor is None else {p for p in every if self.moved(g, p)}
        if not fresh:  # a synced fragment inside its overlap is installed by overlap.install_due only
            moved -= set(self.pending.due)
        self.latest = g if self.pending.tau > 0 else None
        self.outer_step = g.outer_step
        self.install_fragments(model, inner_step, g, moved, fresh=fresh)

    def moved(self, g: Global, fragment: int) -> bool:
        """Whether global `g` moved `fragment` past what this node installed for it (a head without
        fragment rounds, P=1: any newer global moves the whole model)."""
        if g.rounds is not None:
            return g.rounds[fragment] > self.fragment_rounds[fragment]
        return g.outer_step > self.anchor_steps[fragment]

    @torch.no_grad()
    def install_fragments(
        self, model: nn.Module, inner_step: int, g: Global, moved: set[int], fresh: bool = False
    ) -> None:
        """θ ← G + (θ_now − θ_at_sync) for the tensors of the fragments in `moved` (overlap.merge): the
        local progress not yet queued is kept, so no local step is thrown away."""
        if not moved:
            return
        tensors = g.tensors
        whole = len(moved) == self.frags.count
        names = list(tensors) if whole else [n for p in sorted(moved) for n in self.frags.groups[p]]
        params = codec.unique_params(model)
        # "elements" fragments, some moved: each tensor takes the moved fragments' shares only.
        shares = self.frags.layout == "elements" and not whole and self.anchor is not None and not fresh
        if self.anchor is None or fresh:
            for name, p in params.items():
                p.copy_((tensors[name] - torch.zeros_like(tensors[name])).to(p.device, p.dtype))
            self.anchor, self.accounted = {}, {}
        elif shares:
            self._install_shares(model, params, tensors, moved)
        else:
            now = codec.snapshot(model)
            for name in names:
                new = overlap.merge(tensors[name], now[name], self.anchor[name], self.accounted[name])
                params[name].copy_(new.to(params[name].device, params[name].dtype))
        if not shares:
            for name in names:
                self.anchor[name] = tensors[name].clone()
                self.accounted[name] = torch.zeros_like(self.anchor[name])
        if not self.residual:
            self.residual = zeros(self.anchor)
        for p in moved:
            self.anchor_steps[p] = g.outer_step
            self.fragment_rounds[p] = g.rounds[p] if g.rounds is not None else g.outer_step
        self.installs += 1  # after_step reports a change, so the trainer broadcasts and resets its optimizer
        self.sent_since_install = 0
        self.last_sync = time.time()
        logger.info(
            "DiLoCo node %s: installed global model of outer step %d at inner step %d%s",
            self.node,
            g.outer_step,
            inner_step,
            "" if whole else f" (fragment {', '.join(map(str, sorted(moved)))})",
        )

    def _install_shares(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        tensors: dict[str, torch.Tensor],
        moved: set[int],
    ) -> None:
        """install_fragments for "elements" fragments, some but not all moved: each moved share merged
        on its own (the same rule, elementwise), its anchor and accounted reset to the global's share."""
        assert self.anchor is not None
        share = self.frags.part
        now = codec.snapshot(model)
        for p in sorted(moved):
            g, cur, anchor, accounted = (share(p, d) for d in (tensors, now, self.anchor, self.accounted))
            for name in g:
                cur[name].copy_(overlap.merge(g[name], cur[name], anchor[name], accounted[name]))
                anchor[name].copy_(g[name])
                accounted[name].zero_()
        for name, param in params.items():
            param.copy_(now[name].to(param.device, param.dtype))

    # -- helpers ----------------------------------------------------------------------------------
    def _own_names(self) -> list[str]:
        try:
            names = [n for n in self.bus.list_own_deltas(self.node) if codec.DELTA_NAME_RE.match(n)]
        except BusError as error:
            logger.warning("DiLoCo node %s: cannot list own deltas (%s)", self.node, error)
            names = []
        self._own = set(names)
        return names

    def _processed_own(self) -> list[str]:
        return sorted(n for n in self._own if codec.parse_delta_name(n)[1] <= self.hwm)

    def _ensure_threads(self) -> None:
        """Start the uploader and the poller, or resume the ones a timed-out close() left running."""
        if self.dist.worker.async_upload:
            self._up.ensure()
        if self.dist.worker.async_global_poll:
            self._poll.ensure()

    def _progress(self, step: int) -> None:
        worker_state.progress(self, step)

    def summary(self) -> dict[str, Any]:
        return worker_state.summary(self)
