"""A DiLoCo worker's view of the run's head: the thread that polls head.json (`async_global_poll`), and
the newest global it fetched, decoded and validated, waiting for the training thread to install it.

It also reads what the head says about this node: the master's high-water mark of its deltas (the
numbering follows it), the newest outer step, the master's epoch (a head or global of a lower epoch comes
from a master that lost the run and is ignored), and why the master rejected this node's own deltas
(too many in a row stop the worker: `max_consecutive_rejections`). Every membership_refresh_s it re-reads
manifest.json: a node the owner removed from the collaborators stops with the refusal it would get at
start, instead of waiting max_wait at every sync for a master that ignores it. While training waits for a global
(overlap's due step, max_rounds_ahead) it polls at the faster `wait_poll_interval`, within the bus's
request budget. It notes when each newer head arrived (head_pace.py): a wait for a global ends early
once the master has been quiet for much longer than its usual round, and a head that names the run's
final global (the master has stopped) ends the worker's training.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from speedtronic.config.distributed import wait_poll_s
from speedtronic.diloco import codec, fragments, global_update
from speedtronic.diloco.bus.base import Bus, BusError, Head, PermissionDenied
from speedtronic.diloco.documents import DocumentError, FinalPick, HeadDoc, Manifest, epoch_of, not_listed
from speedtronic.diloco.worker.background import Background, Fault
from speedtronic.diloco.worker.feedback import EpochFence, own_rejections, rejection_streak
from speedtronic.diloco.worker.head_pace import HeadPace
from speedtronic.diloco.worker.numbering import Numbering
from speedtronic.diloco.worker.overlap import Global
from speedtronic.errors import SpeedtronicError

if TYPE_CHECKING:
    import torch

    from speedtronic.config.distributed import DistributedConfig
    from speedtronic.diloco.spec import RunSpec

logger = logging.getLogger("speedtronic.diloco")

# Hub requests one poll of a worker makes (head.json's metadata and its bytes); the faster polls of a
# waiting worker are paced to it within the bus's request budget (bus.poll_delay).
POLL_COST = 2.0
MIN_MEMBERSHIP_S = 1.0  # manifest re-reads at most this often, whatever membership_refresh_s says


class Poller:
    def __init__(
        self,
        bus: Bus,
        node: str,
        dist: DistributedConfig,
        spec: RunSpec,
        *,
        fault: Fault,
        numbering: Numbering,
        installed: Callable[[], int],
        uploaded: Callable[[], list[str]],
        sent_here: Callable[[], set[str]] | None = None,
    ) -> None:
        self.bus, self.node, self.dist, self.specs = bus, node, dist, dict(spec.specs)
        self.fragment_count = spec.fragments.count
        self.fault, self.numbering = fault, numbering
        self.installed = installed  # the outer step of the newest global the worker took
        self.uploaded = uploaded  # this node's uploads (the uploader's): whose rejections are ours
        self.sent_here = sent_here  # those this process sent: only their rejections stop it
        self.max_global_bytes = spec.max_global_bytes
        self.epochs = EpochFence(node)  # heads and globals of a lower master epoch: ignored
        self.head_step = -1  # the newest head's outer step seen
        self.pace = HeadPace()  # when newer heads arrived: a wait for a global ends once the master is quiet
        self.final: FinalPick | None = None  # the run is over: its master published the final global
        self.rejected: dict[str, str] = {}  # own uploaded file -> why the master rejected it
        self._bad_heads: set[str] = set()  # versions of heads that did not parse (logged once each)
        self._membership_at = time.monotonic()  # the manifest was read at start (launch.py)
        self._cond = threading.Condition()  # guards `incoming` and `waiting`
        self.incoming: Global | None = None
        # The newest global fetched: where the next one's int8 update starts (global_update.py); and
        # how the globals came, for the worker's summary.
        self.base: global_update.Published | None = None
        # "skipped": whole reads because the head's update starts from a global this node never fetched
        # (two steps published between its polls: a busy machine), the reads after its first one explains.
        self.reads = {"full": 0, "update": 0, "bytes": 0, "skipped": 0}
        self.waiting = 0  # training waits for a global (under the condition): the poller polls faster
        self.waited_s = 0.0  # seconds training spent blocked on a global, all waits together
        self._blocked_at = 0.0  # when the current block began (while `waiting`)
        self.thread = Background(f"diloco-{node}-poll", self._run, self._cond)

    def wait_for_head(self) -> Head:
        """The run's head, once the master has published one (SpeedtronicError past max_wait)."""
        deadline = time.monotonic() + self.dist.rounds.max_wait
        while True:
            head = self.read_head()
            if head is not None:
                return head
            if time.monotonic() > deadline:
                raise SpeedtronicError(
                    f"{self.bus.url}: no global model was published within {self.dist.rounds.max_wait:.0f}s"
                )
            time.sleep(min(self.dist.node.poll_interval, 1.0))

    def read_head(self) -> Head | None:
        """The bus's head, if it parses (diloco/documents.py): a head with a field of the wrong type or
        sign is a master's bug or someone else's file, logged once per version and read as no head."""
        head = self.bus.read_head()
        if head is None:
            return None
        try:
            HeadDoc.parse(head, f"{self.bus.url}: head.json")
        except DocumentError as error:
            if head.version not in self._bad_heads:
                self._bad_heads.add(head.version)
                logger.warning("DiLoCo node %s: ignoring a head that does not parse: %s", self.node, error)
            return None
        return head

    def fetch_global(self, head: Head) -> Global:
        """The global `head` names: rebuilt from its update where it offers one from the global fetched
        last, else read whole. As of the head's version, never a newer global; never more bytes than the
        run's model can be."""
        step = int(head["outer_step"])
        tensors = self._rebuild(head, step)
        if tensors is None:
            data = self.bus.read_global_capped(head, self.max_global_bytes)
            decoded = codec.decode(data, self.specs, kind="global", max_bytes=self.max_global_bytes)
            self._check_file(head, decoded, step)
            tensors = decoded.tensors
            self._count("full", len(data))
        # Kept (a copy of the model) only where the master sends updates: the next one starts from it.
        self.base = global_update.Published(step, tensors) if head.get("global_updates") is True else None
        hwm = self.numbering.head_mark(head, -1)
        return Global(step, tensors, fragments.head_rounds(head, self.fragment_count), hwm)

    def _check_file(self, head: Head, decoded: codec.Decoded, step: int) -> None:
        """A global or update file of the head's master epoch (or newer) and outer step."""
        self.epochs.check(head, decoded)
        if decoded.int("outer_step", -1) != step:
            raise codec.Rejected(
                f"global file says outer step {decoded.meta.get('outer_step')}, head says {step}"
            )

    def _rebuild(self, head: Head, step: int) -> dict[str, torch.Tensor] | None:
        """The head's global from its int8 update and the global fetched last, when the head offers an
        update from exactly that global; None (the caller reads the full file) otherwise, logged when an
        offered update did not apply."""
        base = self.base
        if base is None or not head.get("update"):
            return None
        if head.get("update_from") != base.step:
            self.reads["skipped"] += 1
            return None
        try:
            data = self.bus.read_update_capped(head, self.max_global_bytes)
            tensors, decoded = global_update.apply(data, base, self.specs, step, self.max_global_bytes)
            self._check_file(head, decoded, step)
        except PermissionDenied:
            raise
        except (BusError, codec.Rejected) as error:
            logger.warning(
                "DiLoCo node %s: the update to outer step %d did not apply (%s); reading the whole global",
                self.node,
                step,
                error,
            )
            return None
        self._count("update", len(data))
        return tensors

    def _count(self, how: str, nbytes: int) -> None:
        self.reads[how] += 1
        self.reads["bytes"] += nbytes

    def poll_once(self) -> None:
        """Read the head once; fetch its global when it is newer than the newest global taken and than
        the one already waiting."""
        try:
            head = self.read_head()
            if head is None or not self.epochs.admit(head):  # none yet, or a stale master's (logged once)
                return
            self.numbering.observe(head)
            self.note_end(head)
            self.pace.saw(epoch_of(head), int(head["outer_step"]))
            self.head_step = max(self.head_step, int(head["outer_step"]))
            self._check_rejections(head)
            self.numbering.catch_up()  # numbers at or below the master's mark would be refused
            newest = self.incoming[0] if self.incoming else self.installed()
            if int(head["outer_step"]) > newest:
                fetched = self.fetch_global(head)
                with self._cond:
                    self.incoming = fetched
        except PermissionDenied as error:
            self.fault.set(error)
        except (BusError, codec.Rejected) as error:
            logger.warning("DiLoCo node %s: polling %s failed (%s)", self.node, self.bus.url, error)
        self.check_membership()

    def note_end(self, head: Head) -> None:
        """Whether the head says the run is over (its "final" pick): the master has stopped, and no
        delta this node sends will be applied. `read_head` has validated the head."""
        final = head.get("final")
        if final is not None and self.final is None:
            self.final = FinalPick.model_validate(final)

    def check_membership(self) -> None:
        """Every membership_refresh_s: re-read manifest.json; a node no longer listed stops (the fault:
        PermissionDenied, worded as the refusal at start). An unreadable manifest changes nothing."""
        if self.dist.node.role == "master":  # the master's own training node: never listed, the run's own
            return
        now = time.monotonic()
        if now - self._membership_at < max(self.dist.master.membership_refresh_s, MIN_MEMBERSHIP_S):
            return
        self._membership_at = now
        try:
            raw = self.bus.read_manifest()
            manifest = None if raw is None else Manifest.parse(raw, f"{self.bus.url}: manifest.json")
        except PermissionDenied as error:
            self.fault.set(error)
            return
        except (BusError, DocumentError) as error:  # the next re-read may find it whole
            logger.warning("DiLoCo node %s: re-reading the manifest failed (%s)", self.node, error)
            return
        if manifest is not None and not manifest.lists(self.node):
            self.fault.set(not_listed(self.bus.url, self.node, removed=True))

    def _check_rejections(self, head: Head) -> None:
        """Log why the master rejected this node's own deltas; stop after too many in a row."""
        for name, reason in own_rejections(head, self.node, self.uploaded(), self.rejected):
            logger.warning("DiLoCo node %s: the master rejected %s: %s", self.node, name, reason)
        streak = rejection_streak(
            self.rejected, self.numbering.hwm, None if self.sent_here is None else self.sent_here()
        )
        limit = self.dist.worker.max_consecutive_rejections
        if limit is not None and len(streak) >= limit and self.fault.error is None:
            self.fault.set(
                SpeedtronicError(
                    f"node {self.node}: the master rejected its last {len(streak)} deltas (the latest, "
                    f"{streak[-1]}: {self.rejected[streak[-1]]}); stopping instead of training on for "
                    "nothing — fix the cause, or raise distributed.worker.max_consecutive_rejections"
                )
            )

    def take(self) -> Global | None:
        """The global waiting to be installed, if it is newer than the newest taken; nothing waits after."""
        with self._cond:
            incoming, self.incoming = self.incoming, None
        # A poll that overlapped an install (or a staged one) may bring that global again: not twice.
        return incoming if incoming is not None and incoming[0] > self.installed() else None

    @contextlib.contextmanager
    def waiting_for_global(self) -> Iterator[None]:
        """Training blocks on the bus (overlap's due step, max_rounds_ahead): the poller wakes now and
        polls at the faster cadence until the block ends; its seconds add to `waited_s`."""
        with self._cond:
            if not self.waiting:
                self._blocked_at = time.monotonic()
            self.waiting += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self.waiting -= 1
                if not self.waiting:
                    self.waited_s += time.monotonic() - self._blocked_at

    def _run(self) -> None:
        # While training waits for a global the interval is distributed.node.wait_poll_interval (within the
        # bus's request budget): the wait is idle compute, and the global that ends it is usually one
        # master round away. Asked of the bus here, not under the condition `sleep` holds.
        while True:
            wait = self.bus.poll_delay(wait_poll_s(self.dist.node), POLL_COST)
            if not self.thread.sleep(
                self.dist.node.poll_interval, sooner=lambda wait=wait: wait if self.waiting else None
            ):
                return
            self.poll_once()
