"""A DiLoCo worker's upload queue and the thread that empties it (`distributed.worker.async_upload`).

Each sync point's delta is queued as an `Item`; the uploader sends the oldest first, adding the
error-feedback residual (the int8/bf16 rounding error not yet delivered) when it encodes it. The queue is
bounded (`delta_upload_queue_size`; when full, `delta_upload_overflow`: block | drop_oldest | coalesce).
An upload that fails and is confirmed absent from the bus keeps its baseline: the next delta of its
fragment merges it and carries the cumulative delta. Only the item an upload sent is popped, and only
while it is still the head, so no delta is sent twice at once or popped twice.

While the master does not answer (`hold`, the coordinator's rule: no global has come since a wait for
one gave up, and this node's newest delta on the bus is not processed yet) the uploader keeps at most
that one delta on the bus: the next ones wait in the queue and fold into one (whatever
`delta_upload_overflow` says), sent once the master answers. A master failing over or a bus that is
down then costs the worker no training time (a full queue no longer blocks it) and leaves the next
master one fresh delta per node, not a backlog that goes stale one round at a time.

This object owns the queue, the residual and the upload counters; one `Background` thread per life of
the worker (diloco/worker/background.py). A PermissionDenied (or a bug) on the thread is left in the
worker's `Fault` and raised on the training thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from speedtronic import interrupts
from speedtronic.diloco import codec, fragments
from speedtronic.diloco.bus.base import Bus, BusError, PermissionDenied
from speedtronic.diloco.worker.background import Background, Fault
from speedtronic.diloco.worker.ending import Ending
from speedtronic.diloco.worker.numbering import Numbering
from speedtronic.diloco.worker.upload_item import Item, zeros
from speedtronic.retry import RetryPolicy

if TYPE_CHECKING:
    from speedtronic.config.distributed import DistributedConfig
    from speedtronic.diloco.identity import NodeLease

logger = logging.getLogger("speedtronic.diloco")


class Uploader:
    def __init__(
        self,
        bus: Bus,
        node: str,
        dist: DistributedConfig,
        frags: fragments.Plan,
        *,
        lease: NodeLease | None,
        fault: Fault,
        numbering: Numbering,
        ending: Ending,
        hold: Callable[[int], bool] | None = None,
    ) -> None:
        self.bus, self.node, self.dist, self.frags = bus, node, dist, frags
        self.lease, self.fault, self.numbering, self.ending = lease, fault, numbering, ending
        # hold(seq of the newest delta on the bus): whether the master has not answered it while no
        # global comes (the coordinator's rule); then new deltas wait and fold instead of being sent.
        self.hold = hold or (lambda seq: False)
        self.folded = 0  # deltas folded into a later one while the master did not answer
        self._cond = threading.Condition()  # guards the queue, the residual and the counters below
        self.queue: deque[Item] = deque()
        self.residual: dict[str, torch.Tensor] = {}
        self.bytes_sent = 0
        self.peak_delta_bytes = 0  # the largest delta this node uploaded (Streaming DiLoCo's point)
        self.uploaded: list[str] = []
        self.sent_here: set[str] = set()  # uploaded by this process (not restored from a checkpoint)
        self.dropped = 0
        self.last_upload: float | None = None
        self.eval_meta: dict[str, str] = {}  # the node's latest eval, sent with its deltas (node_eval.py)
        self._own: set[str] = set()  # this node's delta files on the bus, as far as it knows
        self.thread = Background(f"diloco-{node}-upload", self._run, self._cond)

    # -- the queue --------------------------------------------------------------------------------
    def enqueue(self, item: Item) -> None:
        """Queue a delta; a full queue blocks, drops its oldest or merges (`delta_upload_overflow`)."""
        with self._cond:
            tail = self.queue[-1] if self.queue else None
            if tail is not None and tail.failed and not tail.in_flight and tail.fragment == item.fragment:
                # The last upload failed and is not on the bus: the new delta carries it too.
                item.merge(tail)
                self.queue.pop()
            if self._holding():
                self._fold_into(item)
            # The queue size counts deltas waiting; the one the uploader holds is not one of them.
            while sum(not i.in_flight for i in self.queue) >= self.dist.worker.upload_queue_size:
                if not self._make_room(item):
                    break
            self.queue.append(item)
            self._cond.notify_all()

    def _holding(self) -> bool:
        """Under the condition: whether the master has not answered this node's newest delta sent or
        being sent while no global comes (then deltas wait in the queue and fold)."""
        seq = self._newest_out()
        return seq is not None and self.hold(seq)

    def _newest_out(self) -> int | None:
        """Under the condition: the seq of this node's newest delta on the bus, or of the head still
        being tried (an upload that failed and may have landed: unanswered all the same)."""
        if self.queue and self._tried(self.queue[0]):
            return self.queue[0].seq
        return codec.parse_delta_name(self.uploaded[-1])[1] if self.uploaded else None

    @staticmethod
    def _tried(item: Item) -> bool:
        """Whether an upload of `item` has begun (it may be on the bus: it never folds)."""
        return item.in_flight or item.encoded is not None

    def _fold_into(self, item: Item) -> None:
        """Under the condition: merge the newest waiting delta of `item`'s fragment into it."""
        same = [i for i in self.queue if not self._tried(i) and i.fragment == item.fragment]
        if not same:
            return
        item.merge(same[-1])
        self.queue.remove(same[-1])
        self.folded += 1
        logger.info(
            "DiLoCo node %s: the master has not answered delta #%s yet; delta #%d folded into #%d (%d tokens)",
            self.node,
            self._newest_out(),
            same[-1].seq,
            item.seq,
            item.tokens,
        )

    def _make_room(self, item: Item) -> bool:
        """Under the condition: wait, merge or drop one item for `item`; False when nothing can go."""
        policy = self.dist.worker.upload_overflow
        if policy == "block" and self.dist.worker.async_upload and self.thread.live:
            self._cond.wait(1.0)
            self.fault.raise_if_set()
            return True
        idle = [i for i in self.queue if not i.in_flight]
        same = [i for i in idle if i.fragment == item.fragment]  # deltas of one fragment merge
        if policy == "coalesce" and same:
            item.merge(same[-1])
            self.queue.remove(same[-1])
        elif idle:  # drop_oldest (and block without an uploader)
            self.queue.remove(idle[0])
            self.dropped += 1
            logger.warning("DiLoCo node %s: upload queue full, dropped delta #%d", self.node, idle[0].seq)
        else:
            return False
        return True

    def record_eval(self, meta: dict[str, str]) -> None:
        """The node's latest evaluation summary, sent in every later delta's metadata."""
        self.eval_meta = meta

    def ensure_residual(self, anchor: dict[str, torch.Tensor]) -> None:
        """Zero error feedback, shaped like `anchor`, unless some is already carried."""
        with self._cond:
            if not self.residual:
                self.residual = zeros(anchor)

    def forget(self) -> None:
        """Drop the queue and the residual (the worker starts over from the current global)."""
        with self._cond:
            self.queue.clear()
        self.residual = {}

    # -- uploading --------------------------------------------------------------------------------
    def encode(self, item: Item) -> tuple[bytes, dict[str, torch.Tensor]]:
        """The wire bytes of `item` plus its fragment's residual, and the new residual (what the codec
        rounded away)."""
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
            "final": "1" if self.ending.is_final(item.local_step) else "0",
            **self.eval_meta,
        }
        if self.frags.count > 1:  # which fragment, and its round in the global the delta was built on
            meta.update(fragment=str(item.fragment), fragment_round=str(item.fragment_round))
        return codec.encode(y, self.dist.sync.delta_codec, meta), {n: y[n] - received[n] for n in y}

    def upload_head(self) -> bool:
        """Try to upload the oldest queued delta once; True when it is on the bus."""
        with self._cond:
            if not self.queue:
                return True
            item = self.queue[0]
            if item.in_flight:
                return False  # another call is uploading it: one delta is never sent twice at once
            item.in_flight = True
            if item.encoded is None:
                item.encoded = self.encode(item)
            data, residual = item.encoded
            prune = self.numbering.processed(self._own)
        name = codec.delta_name(self.node, item.seq)
        landed: bool | None = False
        try:
            landed = self._put(item, name, data, prune)
            if not landed:
                return False
        finally:
            self._settle(item, name, landed, data, residual, prune)
        return True

    def _put(self, item: Item, name: str, data: bytes, prune: list[str]) -> bool | None:
        """Put one delta; True when it is on the bus, False when confirmed absent, None when unknown."""
        try:
            if self.lease is not None:
                self.lease.check()  # LeaseLost (a PermissionDenied): never upload under a lost id
            self.bus.put_delta(self.node, name, data, prune=prune)
            return True
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
            return landed

    def _settle(
        self,
        item: Item,
        name: str,
        landed: bool | None,
        data: bytes,
        residual: dict[str, torch.Tensor],
        prune: list[str],
    ) -> None:
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
                self.sent_here.add(name)
                self.last_upload = time.time()
            if landed:
                self._own.update([name])
                self._own.difference_update(prune)
            self._cond.notify_all()

    def drain(self, deadline: float | None) -> None:
        """Upload on the calling thread until the queue is empty or `deadline` (monotonic) has passed;
        without a deadline in synchronous mode, one try (again at the next sync point)."""
        backoff = RetryPolicy.from_config(self.dist.bus).backoff()
        while self.queue and (deadline is None or time.monotonic() < deadline):
            try:
                ok = self.upload_head()
            except PermissionDenied as error:
                self.fault.set(error)
                return
            if ok:
                backoff.reset()
                continue
            if deadline is None and not self.dist.worker.async_upload:
                return  # synchronous mode: try again at the next boundary
            delay = backoff.next_delay()
            if interrupts.wait(
                delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            ):
                return  # a signal: what is left stays queued (in the checkpoint)

    def _run(self) -> None:
        backoff = RetryPolicy.from_config(self.dist.bus).backoff()
        # Ends once stopped with the queue empty, or past the shutdown deadline (the rest stays queued).
        while self.thread.wait_for_work(lambda: bool(self.queue)):
            if self._held():
                continue
            try:
                ok = self.upload_head()
            except PermissionDenied as error:
                self.fault.set(error)
                return
            except Exception as error:  # a bug must not silently stop uploads: report on the training thread
                self.fault.set(error)
                return
            if ok:
                backoff.reset()
            else:
                with self._cond:  # once stopping, never past the shutdown deadline
                    self._cond.wait(self.thread.capped(backoff.next_delay()))

    def _held(self) -> bool:
        """For the thread: while the master has not answered (`hold`), wait a poll interval and say
        True; never once asked to stop (close() sends what is queued)."""
        with self._cond:
            if self.thread.stopping or not self._holding():
                return False
            if self.queue and self._tried(self.queue[0]):
                return False  # the head's upload goes on: it is the one delta out
            self._cond.wait(self.dist.node.poll_interval)
            return True

    def own_names(self) -> list[str]:
        """This node's delta files on the bus (listed now; remembered for pruning)."""
        try:
            names = [n for n in self.bus.list_own_deltas(self.node) if codec.DELTA_NAME_RE.match(n)]
        except BusError as error:
            logger.warning("DiLoCo node %s: cannot list own deltas (%s)", self.node, error)
            names = []
        self._own = set(names)
        return names

    # -- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            queue = [
                {
                    "seq": i.seq,
                    "x": dict(i.x),
                    "base": i.base,
                    "local_step": i.local_step,
                    "tokens": i.tokens,
                    "fragment": i.fragment,
                    "fragment_round": i.fragment_round,
                }
                for i in self.queue
            ]
        return {
            "residual": dict(self.residual),
            "queue": queue,
            "bytes_sent": self.bytes_sent,
            "uploaded": list(self.uploaded[-1000:]),
            "peak_delta_bytes": self.peak_delta_bytes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residual = dict(state["residual"])
        with self._cond:  # an uploader left running by a timed-out close() pops only its own item
            self.queue = deque(
                Item(
                    q["seq"],
                    dict(q["x"]),
                    q["base"],
                    q["local_step"],
                    q["tokens"],
                    fragment=int(q.get("fragment", 0)),
                    fragment_round=int(q.get("fragment_round", -1)),
                )
                for q in state["queue"]
            )
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.uploaded = list(state.get("uploaded", []))
        self.peak_delta_bytes = int(state.get("peak_delta_bytes", 0))
