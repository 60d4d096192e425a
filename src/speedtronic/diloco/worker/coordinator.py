"""The worker side of DiLoCo: a `Sync` (engine/sync.py) the Trainer calls after every optimizer step.

It composes owned parts: `Book` (anchor, accounted: the weights against the global, book.py),
`Uploader` (the upload queue, its thread and the error-feedback residual, uploader.py), `Poller` (the head,
its thread and the global waiting to be installed, poller.py), `Overlap` (the late install, overlap.py),
`Numbering` (delta numbers and the master's mark, numbering.py), `Ending` (where this node stops,
ending.py) and the node's lease (diloco/identity.py). The parts talk through their methods; this class
decides when each acts.

At each sync point (every `inner_steps` steps; `sync_ramp`: after 1, 3, 7, …) x = (anchor − θ) − accounted
is queued (Δ has the sign of a gradient: θ_global_at_sync − θ_now); with `fragments` P > 1
(diloco/fragments.py) each sync point is one fragment's and x covers its tensors only. Uploads run on a
thread through a bounded queue (uploader.py; `delta_upload_overflow`: block | drop_oldest | coalesce).
Each delta carries a per-node sequence number in its file name; re-sending the same item (a retry, or a replay after resume
from a checkpoint) yields the same name, which the master has already processed, so nothing is applied
twice. An upload that fails and is confirmed absent from the bus keeps its baseline: its delta is merged
into the next one, which then carries the cumulative delta.

The coordinator owns one uploader and one poller for its life (background.py): a close() that
gives up on a running upload leaves it to finish, and the next train() resumes that same thread, so
the queue's head is never uploaded (and popped) twice.

A poller thread watches head.json; a newer global is decoded and validated there but installed on the
training thread (in `after_step`): θ ← G − u, where u = (anchor − θ) − accounted is the local progress not
yet queued, so no local step is thrown away (per fragment the global moved; with `overlap_steps` τ a synced
fragment's global waits for step sync + τ, overlap.py; a worker much slower than the master's rounds
holds the globals that come between its syncs and takes the newest after its next delta, defer.py);
`after_step` answers True, and the trainer broadcasts the weights to its DDP ranks and resets the
optimizer if the plan says so. The whole state goes
into the training checkpoint (its "sync" part) and comes back on resume.

The run's end: the manifest's `run.outer_steps`. Once this node has installed a global at or past
it (and newer than the one it joined with, so a late joiner's work still counts), its next sync
point is its last: that delta is marked final and `after_step` raises StopTraining, which the
trainer treats as a normal end (final evaluation and checkpoint, queued deltas flushed by close). This
module sees only the model, the step and the token count: never the trainer or its optimizer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from torch import nn

from speedtronic import interrupts
from speedtronic.config.distributed import global_wait_s
from speedtronic.diloco import codec, fragments
from speedtronic.diloco.bus.base import Bus, Head
from speedtronic.diloco.documents import Manifest
from speedtronic.diloco.identity import NodeLease
from speedtronic.diloco.spec import RunSpec
from speedtronic.diloco.worker import state
from speedtronic.diloco.worker.background import Fault
from speedtronic.diloco.worker.book import Book
from speedtronic.diloco.worker.defer import Deferral
from speedtronic.diloco.worker.ending import Ending
from speedtronic.diloco.worker.numbering import Numbering
from speedtronic.diloco.worker.overlap import Global, Overlap
from speedtronic.diloco.worker.poller import Poller
from speedtronic.diloco.worker.prefetch import Prefetch
from speedtronic.diloco.worker.uploader import Uploader
from speedtronic.engine.sync import StopTraining

if TYPE_CHECKING:
    from speedtronic.config import Config

logger = logging.getLogger("speedtronic.diloco")
STOPPING_S = 5.0  # after a signal: the seconds left for the queued deltas' uploads (one try each)


class Coordinator:
    def __init__(
        self,
        config: Config,
        bus: Bus,
        node: str,
        manifest: Manifest | dict[str, Any],
        lease: NodeLease | None = None,
        spec: RunSpec | None = None,
    ) -> None:
        """`spec`: the run's description (diloco/spec.py), computed once by the caller; else from `manifest`."""
        dist = config.distributed
        run = (
            manifest
            if isinstance(manifest, Manifest)
            else Manifest.parse(manifest, f"{bus.url}: manifest.json")
        )
        spec = spec or RunSpec.of_run(run, config)
        self.dist, self.bus, self.node, self.manifest = dist, bus, node, run.to_json()
        self.lease = lease  # this node id's lease (diloco/identity.py): checked before every upload
        # Streaming DiLoCo (diloco/fragments.py): fragment p syncs its own tensors at its own steps.
        self.frags = spec.fragments
        self.fault = Fault()  # what a thread recorded, raised on the training thread
        self.numbering = Numbering(node)
        self.book = Book(node, self.frags)
        self.ending = Ending(self.manifest)
        self.overlap = Overlap(dist.sync.overlap_steps, node)
        self.uploader = Uploader(
            bus,
            node,
            dist,
            self.frags,
            lease=lease,
            fault=self.fault,
            numbering=self.numbering,
            ending=self.ending,
            hold=self._unanswered_while_late,
        )
        self.poller = Poller(
            bus,
            node,
            dist,
            spec,
            fault=self.fault,
            numbering=self.numbering,
            installed=lambda: self.book.outer_step,
            uploaded=lambda: self.uploader.uploaded,
            sent_here=lambda: self.uploader.sent_here,
        )
        # A slow worker's globals between its syncs, held for its next one (defer.py); never with fragments.
        slow_factor = dist.rounds.slow_factor if self.frags.count == 1 else None
        self.deferral = Deferral(node, slow_factor, self.poller.pace)
        # A global taken from the poller by `needs_weights` for the next after_step to install (an
        # FSDP node gathers the weights only for steps that said so: nothing may arrive in between).
        self._staged: Global | None = None
        self._was_asked = False
        self._prefetch: Prefetch | None = None  # the starting head and global, fetched while compiling

    @property
    def outer_step(self) -> int:
        """The outer step of the newest global this node took."""
        return self.book.outer_step

    @property
    def uploaded(self) -> list[str]:
        """This node's deltas on the bus, in upload order."""
        return self.uploader.uploaded

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return state.state_dict(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state.load_state_dict(self, saved)

    # -- the Sync protocol ------------------------------------------------------------------------
    def prefetch(self, model: nn.Module) -> None:
        """Before the model compiles (engine/sync.py `Prefetching`): check it against the run now, and
        start fetching the head and the global a fresh node starts from (prefetch.py)."""
        self._check_model(model)
        if self.book.anchor is None and self._prefetch is None:
            self._prefetch = Prefetch(self.poller)

    def _check_model(self, model: nn.Module) -> None:
        from speedtronic.diloco.manifest import check_manifest

        check_manifest(self.manifest, codec.param_specs(model), self.bus.url)
        fragments.check(self.manifest, self.frags, self.bus.url)

    def _head_and_global(self) -> tuple[Head, Global | None]:
        """The head to join at and, for a fresh node, its global: prefetched, or fetched now."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None:
            return prefetch.result()
        head = self.poller.wait_for_head()
        return head, (self.poller.fetch_global(head) if self.book.anchor is None else None)

    def attach(self, model: nn.Module, *, step: int, tokens: int, final_step: int) -> None:
        """Check the model against the manifest, then start from the run's global model (fresh runs)."""
        self._check_model(model)
        self.book.start_tokens(tokens)
        self.ending.plan(final_step, self.frags.points(final_step))
        head, fetched = self._head_and_global()
        self.poller.note_end(head)  # a run already over: the first step ends this process (after_step)
        self.numbering.join(head)
        if self.numbering.overtaken():
            self._start_over()
        self.numbering.start(self.uploader.own_names() if self.numbering.seq is None else [])
        if self.book.anchor is None:
            self.install_global(
                model, step, fetched if fetched is not None else self.poller.fetch_global(head), fresh=True
            )
        elif self.overlap.waiting():  # resumed inside an overlap: its global is installed at the due step
            self.overlap.resume(self.poller.fetch_global(head))
        self.ending.joined(max(self.book.outer_step, int(head.get("outer_step", -1))))
        logger.info(
            "DiLoCo node %s on %s: outer step %d (the run ends at %s), next delta #%d, %d queued",
            self.node,
            self.bus.url,
            self.book.outer_step,
            self.ending.describe(),
            self.numbering.seq,
            len(self.uploader.queue),
        )

    def _start_over(self) -> None:
        # The master processed deltas this checkpoint never made: a later run of this node sent them
        # and died. Their work is in the global already; resending it renumbered (the checkpoint's
        # anchor predates them) would count it twice. Start over from the global.
        assert self.numbering.seq is not None
        logger.warning(
            "DiLoCo node %s: the master has processed up to #%d, past this checkpoint's #%d: its "
            "progress since is in the global already; starting over from the current global",
            self.node,
            self.numbering.hwm,
            self.numbering.seq - 1,
        )
        self.uploader.forget()
        self.numbering.forget()
        self.book.forget()
        self.overlap.forget()

    def after_step(self, model: nn.Module, *, step: int, tokens: int) -> bool:
        """Install a newer global if one arrived, and at a sync point queue this node's delta;
        True when the model's weights were replaced."""
        self.check_fatal()
        installs = self.book.installs
        self._ensure_threads()
        if not self._was_asked:
            self._stage()
        self._was_asked = False
        incoming, self._staged = self._staged, None
        if incoming is not None and self.deferral.defer(incoming, self.ending.end):
            self.book.take(incoming)  # taken (the poller fetches only newer ones), installed at the sync
        elif incoming is not None:
            self.install_global(model, step, incoming)
        self._stop_if_run_over(installs)
        self.book.count_tokens(tokens)
        fragment = self.frags.at(step)
        if fragment is not None:
            self._sync_point(model, step, fragment, installs)
        self.overlap.install_due(model, step, self)  # overlap_steps > 0: the globals due at this step
        return self.book.installs != installs

    def _stop_if_run_over(self, installs: int) -> None:
        """The head named the run's final global: its master has stopped, so no delta of this node can
        count any more. A node that joined (or resumed into) a finished run, or trained past its end,
        stops here instead of training and waiting for globals that never come."""
        final = self.poller.final
        if final is None:
            return
        self.ending.stopped_early()
        raise StopTraining(
            f"the DiLoCo run is over: its master published the final global ({final.describe()}) and "
            f"stopped; node {self.node} has nothing left to add",
            installed=self.book.installs != installs,
        )

    def _sync_point(self, model: nn.Module, step: int, fragment: int, installs: int) -> None:
        """Queue this fragment's delta; synchronous modes poll and upload now; the run's end stops here."""
        ending = self.ending.reached(self.book.outer_step, step)
        if ending:
            self.ending.last_delta_at(step)  # this delta is this node's last: the master stops waiting for it
        self.queue_delta(model, step, fragment)
        self.deferral.synced()
        held = self.deferral.release()
        if held is not None:  # after the delta: it is labelled with the global it was built on
            self.install_global(model, step, held)
        if not self.dist.worker.async_global_poll:
            self.poller.poll_once()
            self.accept_incoming(model, step)
            self.fault.raise_if_set()  # e.g. the master rejects everything this node sends
        if not self.dist.worker.async_upload:
            self.uploader.drain(deadline=None)
            self.fault.raise_if_set()
        if ending:
            self.ending.stopped_early()
            state.progress(self, step)
            raise StopTraining(
                f"the DiLoCo run's end (outer step {self.ending.end}) was reached (global of outer step "
                f"{self.book.outer_step} installed); node {self.node} sent its final delta",
                installed=self.book.installs != installs,
            )
        self._maybe_wait_for_global(model, step)
        state.progress(self, step)

    def needs_weights(self, step: int) -> bool:
        """Whether `after_step(step)` will read or replace the weights: at a sync point, or to install a
        global that has arrived (taken now, so that no other arrives before that after_step)."""
        self._was_asked = True
        self._stage()
        return self._staged is not None or self.frags.at(step) is not None or self.overlap.due_at(step)

    def _stage(self) -> None:
        incoming = self.poller.take()
        if incoming is not None:
            self._staged = incoming

    def _maybe_wait_for_global(self, model: nn.Module, step: int) -> None:
        """Bounded asynchrony: with max_rounds_ahead set, do not run further ahead of the master."""
        ahead = self.dist.worker.max_rounds_ahead
        sent = self.book.sent_since_install
        if ahead is None or sent <= ahead or step >= self.ending.stop_step:
            return
        if self.overlap.late:  # a wait already gave up and no global came since: no wait again
            self.overlap.gave_up("its deltas", "at once (late)", step)
            return
        deadline = time.monotonic() + global_wait_s(self.dist)
        logger.info("DiLoCo node %s: %d deltas ahead of the global model; waiting for it", self.node, sent)
        why = f"within {global_wait_s(self.dist):.3g}s"
        with self.poller.waiting_for_global():
            while time.monotonic() < deadline and not interrupts.stopping():
                if not self.dist.worker.async_global_poll:
                    self.poller.poll_once()
                if self.accept_incoming(model, step):
                    return
                self.check_fatal()
                stalled = self.master_stalled()
                if stalled is not None:
                    why = f"({stalled})"
                    break
                time.sleep(min(0.1, self.dist.node.poll_interval))
        if interrupts.stopping():  # a SIGTERM: the training loop saves and exits at this step
            return
        self.overlap.gave_up("its deltas", why, step)

    def refresh(self, model: nn.Module, step: int) -> None:
        """While training waits for a global: poll now (synchronous polling), install one that came,
        and raise what a thread recorded."""
        if not self.dist.worker.async_global_poll:
            self.poller.poll_once()
        self.accept_incoming(model, step)
        self.check_fatal()

    def master_stalled(self) -> str | None:
        """Why no global is coming soon: the run is over, or the master quiet far beyond its usual round
        (head_pace.py)."""
        if self.poller.final is not None:
            return "the run is over"
        return self.poller.pace.stalled()

    def delta_marks(self) -> tuple[dict[str, str], int, int]:
        """What the heads said of this node's deltas: the files the master rejected (with why), its
        high-water mark, and the newest head's outer step (the overlap's answered rule)."""
        return self.poller.rejected, self.numbering.hwm, self.poller.head_step

    def _unanswered_while_late(self, seq: int) -> bool:
        """The uploader's hold (uploader.py): no global has come since a wait for one gave up, and
        the master has neither applied nor rejected this node's delta `seq`. Called on the upload thread."""
        if not self.overlap.late:
            return False
        rejected, hwm, _ = self.delta_marks()
        return hwm < seq and codec.delta_name(self.node, seq) not in rejected

    def moved(self, g: Global, fragment: int) -> bool:
        return self.book.moved(g, fragment)

    def waiting_for_global(self) -> contextlib.AbstractContextManager[None]:
        """Training blocks on the bus: the poller polls at the faster cadence meanwhile."""
        return self.poller.waiting_for_global()

    def check_fatal(self) -> None:
        """Raise, on the training thread, what a thread recorded or the lost lease on this node id."""
        self.fault.check(self.lease)

    def close(self) -> None:
        """Flush the upload queue (up to delta_upload_shutdown_timeout) and stop the threads. An upload
        still running then finishes on its own (`join` waits for it); the next train() resumes it.
        After a SIGINT/SIGTERM each queued delta gets one try, for at most STOPPING_S seconds: a
        supervisor kills a process that ignores its signal (systemd: after 90 s)."""
        timeout = self.dist.worker.upload_shutdown_timeout
        if interrupts.stopping():
            timeout = min(timeout, STOPPING_S)
        deadline = time.monotonic() + timeout
        self.stop(deadline)
        self.uploader.thread.join(max(0.0, deadline - time.monotonic()))
        self.poller.thread.join(min(5.0, max(0.0, deadline - time.monotonic())))
        queue = self.uploader.queue
        if queue and self.fault.error is None and not self.dist.worker.async_upload:
            self.uploader.drain(deadline)
        if queue:
            logger.warning(
                "DiLoCo node %s: %d delta(s) not uploaded at shutdown; they are kept in the checkpoint "
                "and sent on resume",
                self.node,
                len(queue),
            )

    def stop(self, deadline: float | None = None) -> None:
        """Ask the threads to end: the uploader once its queue is empty or, past `deadline` (monotonic),
        after its current upload; what is left stays queued (in the checkpoint)."""
        self.uploader.thread.stop(deadline)
        self.poller.thread.stop()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the threads to end (after `stop` or `close`, which a running
        upload can outlast); True when none runs."""
        end = None if timeout is None else time.monotonic() + timeout
        uploader = self.uploader.thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return self.poller.thread.join(None if end is None else max(0.0, end - time.monotonic())) and uploader

    def record_eval(self, meta: dict[str, str]) -> None:
        """The node's latest evaluation (node_eval.Recorder), sent with its next deltas."""
        self.uploader.record_eval(meta)

    # -- the sync ---------------------------------------------------------------------------------
    def queue_delta(self, model: nn.Module, step: int, fragment: int) -> None:
        """At a sync point of `fragment`: number its delta, schedule its late install, queue it."""
        seq = self.numbering.take()
        item = self.book.delta(model, step, fragment, seq)
        self.overlap.synced(fragment, seq, step)  # overlap_steps > 0: install its global at step + τ
        self.uploader.enqueue(item)

    # -- globals ----------------------------------------------------------------------------------
    def accept_incoming(self, model: nn.Module, step: int) -> bool:
        """Install a global the poller brought, if any; True when one was taken."""
        incoming = self.poller.take()
        if incoming is not None:
            self.install_global(model, step, incoming)
        return incoming is not None

    def install_global(self, model: nn.Module, inner_step: int, g: Global, fresh: bool = False) -> None:
        """Take global `g`: every fragment it moved is installed, except those inside their overlap
        (held in the overlap for their due step, overlap.py); a fresh start takes it all."""
        every = range(self.frags.count)
        moved = (
            set(every) if fresh or self.book.anchor is None else {p for p in every if self.book.moved(g, p)}
        )
        if not fresh:  # a synced fragment inside its overlap is installed by the overlap only
            moved -= self.overlap.waiting()
        self.overlap.hold(g)
        self.book.take(g)
        self.install_fragments(model, inner_step, g, moved, fresh=fresh)

    def install_fragments(
        self, model: nn.Module, inner_step: int, g: Global, moved: set[int], fresh: bool = False
    ) -> None:
        """Install `g` for the fragments in `moved` (book.py keeps the local progress not yet queued)."""
        if not moved:
            return
        self.book.install(model, inner_step, g, moved, fresh=fresh)
        assert self.book.anchor is not None
        self.uploader.ensure_residual(self.book.anchor)

    # -- helpers ----------------------------------------------------------------------------------
    def _ensure_threads(self) -> None:
        """Start the uploader and the poller, or resume the ones a timed-out close() left running."""
        if self.dist.worker.async_upload:
            self.uploader.thread.ensure()
        if self.dist.worker.async_global_poll:
            self.poller.thread.ensure()

    def summary(self) -> dict[str, Any]:
        return state.summary(self)
