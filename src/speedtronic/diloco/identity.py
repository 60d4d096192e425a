"""One node id is one worker: the node's lease on the bus, and the default node id.

A worker claims the lease named after its node id (`leases/<node>.json`; the Hub keeps it in the node's
own delta repo, S3 scopes a worker's rights to it, so the lease name *is* the node id) before it reads or
writes anything of that node, renews it on a background thread every ttl/3, and releases it at a clean
close so that a restart can claim it at once. The holder is a token unique to this process
(host/pid/random); messages show its host/pid only.

- A second claimant of a live id is refused at start (ClaimHeld, exit 2) in one line naming --node-id,
  the other holder and when its lease expires.
- A crashed worker's lease (kill -9) expires after ttl and can then be taken over; the newcomer numbers
  its deltas after the master's high-water mark and the node's files on the bus (Coordinator.attach).
  A worker restarted on the same machine and node directory as one that died (its pid gone) takes
  that one's lease back at once (diloco/same_host.py: the directory's flock keeps two live processes
  of one machine off it), instead of waiting a whole lease for a process that no longer exists.
- The lease is renewed every ttl/3. Not renewed within ttl − ttl/6 (a freeze, an outage; the sixth
  absorbs clock skew between machines, which judge expiry by their own clocks), `check()` renews at
  once before any upload, and nothing is uploaded until a renewal answers. A late renewal keeps the
  id only when the bus says the lease it replaced was still this process's own (`Claim.continued`:
  nobody held the id in between); otherwise, on another holder, or after one more ttl of a bus that
  does not answer, the lease is lost: `check()` raises LeaseLost before every upload and the
  coordinator stops on its training thread. A worker never uploads under a name another process may
  have owned.
- The node id "master" is the master's own training node: the master role lease (also named "master"
  on every bus) guards it, so no node lease is claimed for it, and a worker may not use it.

The default node id (no --node-id, no distributed.node.id) is the host name plus a short hash of the
resolved output directory (and checkpoint directory when set): unique per process on one machine with
distinct output directories, and stable across restarts of the same one (so the node resumes its own
checkpoint under `<output_dir>/<node>/`). Two processes with the same output directory get the same id
and the lease refuses the second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import socket
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING

from speedtronic.diloco import same_host
from speedtronic.diloco.bus.base import Bus, BusError, Claim, ClaimHeld, PermissionDenied, TransientBusError
from speedtronic.errors import ConfigError

if TYPE_CHECKING:
    from speedtronic.config import Config

logger = logging.getLogger("speedtronic.diloco")

MASTER_NODE = "master"
_HOLDER: str | None = None


def host_name() -> str:
    """The host name as node ids spell it (letters, digits, `. _ -`)."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return name.strip("-._") or "node"


def default_node_id(cfg: Config) -> str:
    """`<host>-<8 hex>`: the hash of the resolved output directory (and checkpoint.directory when set),
    which names where this node's checkpoints live; at most 64 characters (codec.NODE_RE)."""
    places = [str(Path(cfg.output_dir()).expanduser().resolve())]
    if cfg.checkpoint.directory:
        places.append(str(Path(cfg.checkpoint.directory).expanduser().resolve()))
    digest = hashlib.sha256("\0".join(places).encode()).hexdigest()[:8]
    return f"{host_name()[:55]}-{digest}"


def holder_token() -> str:
    """This process's lease holder: host/pid/random, the same for every lease this process takes."""
    global _HOLDER
    if _HOLDER is None or _HOLDER.split("/")[1:2] != [str(os.getpid())]:  # a fork gets its own
        _HOLDER = f"{host_name()}/{os.getpid()}/{secrets.token_hex(8)}"
    return _HOLDER


def shown_holder(holder: str) -> str:
    """A holder read from the bus, fit to show: its host/pid part only (never what follows), printable."""
    shown = re.sub(r"[^A-Za-z0-9._@:/-]", "?", "/".join(str(holder).split("/")[:2]))[:80]
    return shown or "another process"


class LeaseLost(PermissionDenied):
    """This process may no longer write as its node: another process holds (or may hold) the id now."""


class NodeLease:
    """The lease on one node id, held by this process and renewed on a daemon thread."""

    def __init__(self, bus: Bus, node: str, ttl_s: float, claim: Claim, started: float) -> None:
        self.bus = bus
        self.node = node
        self.ttl_s = float(ttl_s)
        self.margin = self.ttl_s / 6
        self.claim = claim
        self.error: LeaseLost | None = None  # set once lost; read by the coordinator's threads
        self.renewals = 0
        self._lock = threading.Lock()
        self._renewing = threading.Lock()
        self._valid_until = started + self.ttl_s  # monotonic; from before the claim was sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renewer, name=f"diloco-{node}-lease", daemon=True)

    # -- for the coordinator ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise LeaseLost unless this process still holds the lease (call before every write). Past its
        renewal deadline (a freeze, an outage) it renews now, and goes on only if nobody took the id."""
        with self._lock:
            overdue = self.error is None and time.monotonic() > self._valid_until - self.margin
        if overdue:  # renew now, unless a renewal is under way (a stuck bus: never block a write on it)
            self._renew_once(self.ttl_s / 3, self.ttl_s / 12, blocking=False)
        with self._lock:
            if self.error is not None:
                raise self.error
            if time.monotonic() > self._valid_until - self.margin:  # the bus did not answer the renewal
                raise TransientBusError(
                    f"node {self.node}: cannot confirm its lease on {self.bus.url} (the bus does not "
                    "answer); nothing is uploaded until it does"
                )

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> NodeLease:
        self._thread.start()
        return self

    def close(self, release: bool = True) -> None:
        """Stop renewing; with `release` (nothing of this node is still being written) give the lease
        up so that a restart can claim it at once. Otherwise it simply expires."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if not release or self.error is not None:
            return
        try:
            self.bus.release(self.claim)
        except BusError as error:
            logger.warning("DiLoCo node %s: could not release its lease (%s); it expires", self.node, error)

    def _renewer(self) -> None:
        every = self.ttl_s / 3
        retry = max(0.05, min(self.ttl_s / 12, 10.0))
        wait = every
        while not self._stop.wait(wait):
            wait = self._renew_once(every, retry)
            if wait is None:
                return

    def _renew_once(self, every: float, retry: float, blocking: bool = True) -> float | None:
        """One renewal: the seconds until the next one, or None once the lease is lost. A renewal past
        the deadline (the process was frozen, or the bus was down for most of a lease) keeps the lease
        only when the bus says the lease it replaced was still this process's own: then nobody held the
        id in between, and a restart would have cost a whole lease for nothing."""
        if not self._renewing.acquire(blocking=blocking):  # the renewer and a `check`: one at a time
            return retry
        try:
            with self._lock:
                if self.error is not None:
                    return None
                deadline = self._valid_until - self.margin
            started = time.monotonic()
            try:
                claim = self.bus.claim(self.node, self.claim.holder, self.ttl_s)
            except ClaimHeld as held:
                with self._lock:
                    self._lose(f"{shown_holder(held.holder)} holds its lease on {self.bus.url} now")
                return None
            except PermissionDenied as error:
                with self._lock:
                    self._lose(f"cannot renew its lease ({error})")
                return None
            except Exception as error:  # transient (or unforeseen): try again soon, until it would lapse
                with self._lock:  # an outage of up to one more lease may still end with the id ours
                    if time.monotonic() > deadline + self.ttl_s:
                        self._lose(
                            f"its lease on {self.bus.url} was not renewed within {self.ttl_s:g}s (the bus did "
                            "not answer for one more lease)"
                        )
                        return None
                logger.warning("DiLoCo node %s: renewing its lease failed (%s); retrying", self.node, error)
                return retry
            return self._renewed(claim, started, late=time.monotonic() > deadline, every=every)
        finally:
            self._renewing.release()

    def _renewed(self, claim: Claim, started: float, *, late: bool, every: float) -> float | None:
        with self._lock:
            if late and not claim.continued:  # someone may have held the id in between
                self._lose(f"its lease on {self.bus.url} was renewed only after it could have lapsed")
            else:
                if late:
                    logger.warning(
                        "DiLoCo node %s: its lease was renewed late (a freeze or an outage), but no other "
                        "process took the id meanwhile; going on",
                        self.node,
                    )
                self.claim = claim
                self._valid_until = started + self.ttl_s
                self.renewals += 1
                return every
        with suppress(BusError):  # this late renewal holds the id now: give it back, block no successor
            self.bus.release(claim)
        return None

    def _lose(self, why: str) -> None:
        """Record the loss (under the lock) with the one message every write then raises."""
        if self.error is None:
            self.error = LeaseLost(
                f"node {self.node}: {why}; another process may run as {self.node} now, so this one stops "
                "rather than upload under an id it no longer owns (restart it once that process has "
                "ended, or with another --node-id)"
            )
            logger.error("DiLoCo %s", self.error)


# Where a node id came from -> (how the refusal names it, what to do about it).
_FIXES = {
    "--node-id": ("--node-id", "give this worker another --node-id"),
    "distributed.node.id": (
        "--node-id",
        "give this worker another --node-id (this one is distributed.node.id)",
    ),
    "default": (
        "--node-id",
        "this is the default id of this host and output directory: give this worker a --node-id of its "
        "own, or use another output directory",
    ),
    "master": ("distributed.node.id", "set another distributed.node.id for the master's own training node"),
}


NODE_LOCK = "node.lock"  # in the node's directory: held while a worker process runs on it
NODE_HOLDER_FILE = "node_holder.json"  # the lease holder of the worker that last ran on it


def node_directory_lock(node_dir: Path, node: str, where: str) -> tuple[str | None, IO[str] | None]:
    """Take the node directory's lock for this process's life, and the lease holder of the worker that
    last ran there if it was a process of this host that is gone (its lease is taken back at once).
    Another live worker process of this machine on the directory: refused (ClaimHeld, exit 2)."""
    try:
        lock = same_host.lock_directory(node_dir, NODE_LOCK)
    except same_host.DirectoryHeld:
        label, fix = _FIXES.get(where, _FIXES["--node-id"])
        who = same_host.recorded_holder(node_dir, NODE_HOLDER_FILE)
        raise ClaimHeld(
            f"{label} {node}: another worker process on this machine ({shown_holder(who or '')}) runs as "
            f"{node} in {node_dir}; {fix}, or stop that process"
        ) from None
    if lock is None:
        return None, None
    return same_host.gone_predecessor(node_dir, NODE_HOLDER_FILE, holder_token()), lock


def claim_node(
    bus: Bus,
    node: str,
    ttl_s: float,
    *,
    where: str = "--node-id",
    holder: str | None = None,
    predecessor: str | None = None,
) -> NodeLease | None:
    """Claim `node`'s lease and start renewing it; None for the master's own node "master" (the
    master role lease guards it). A live lease of another process raises ClaimHeld (exit 2) in one
    line; `where` says where the id came from: "--node-id", "distributed.node.id", "default" (a worker)
    or "master" (the master's own training node under another id). A lease held by `predecessor` (this
    node directory's dead process: `node_directory_lock`) is released and claimed at once."""
    if node == MASTER_NODE:
        return None
    holder = holder or holder_token()  # another holder: tests playing a second process
    started = time.monotonic()
    try:
        claim = _claim_over(bus, node, holder, ttl_s, predecessor)
    except ClaimHeld as held:
        label, fix = _FIXES.get(where, _FIXES["--node-id"])
        raise ClaimHeld(
            f"{label} {node}: this node id is in use on {bus.url} by {shown_holder(held.holder)} (its lease "
            f"expires in {held.expires_in:.0f}s); {fix}, or start it again once that lease has expired",
            holder=shown_holder(held.holder),
            expires_in=held.expires_in,
        ) from None
    logger.info(
        "DiLoCo node %s: holds its lease on %s for %gs (renewed every %.3gs)", node, bus.url, ttl_s, ttl_s / 3
    )
    return NodeLease(bus, node, ttl_s, claim, started).start()


def _claim_over(bus: Bus, node: str, holder: str, ttl_s: float, predecessor: str | None) -> Claim:
    try:
        return bus.claim(node, holder, ttl_s)
    except ClaimHeld as held:
        if predecessor is None or held.holder != predecessor:
            raise
    logger.warning(
        "DiLoCo node %s: its lease is held by the previous process on this node directory (%s), which is "
        "gone; taking it back",
        node,
        shown_holder(predecessor),
    )
    bus.release(Claim(node, predecessor, 0.0))
    return bus.claim(node, holder, ttl_s)


def check_worker_node(node: str, where: str) -> None:
    """A worker may not run as "master": that id is the master's own training node."""
    if node == MASTER_NODE:
        raise ConfigError(
            f"{where}: the node id 'master' belongs to the master's own training node; give this worker "
            "another --node-id"
        )
