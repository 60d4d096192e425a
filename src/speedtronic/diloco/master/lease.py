"""One master per run: the master's lease on the bus, its fencing epoch, the hot standby, and the
workers' side of the fence.

The lease. `speedtronic master` claims the bus lease "master" (`Bus.claim`; on the Hub it lives in the
run repo) with a holder token unique to the process (host/pid/random; messages show host and pid) for
`distributed.master.lease_s` seconds, default the bus's `Bus.master_lease_s`: 60 s on a directory or
S3, where a renewal is one tiny write, so a dead master is replaced within a minute; 600 s on the Hub,
where every renewal is a run-repo commit (18 an hour of the ~128 the Hub allows, leaving the rest for
outer steps). The master renews it from its loop every third of the ttl (between polls: `idle`; a
failed renewal is retried until the lease would lapse) and before every publish (`ensure`). A renewal
that finds another holder stops the master with LeaseLost before it writes anything.

A second master on a live lease is refused at once (MasterHeld, exit 2, one line naming the holder and
when its lease lapses) unless started with `--standby`: then it waits, saying for whom, and claims the
lease when it lapses (`Bus.claim` lets exactly one claimer win).

The fencing epoch: after claiming the lease a master reads the head and takes epoch = the head's epoch
+ 1; its first act is a conditional publish (`Bus.publish(expected=)`) of a head carrying that epoch,
its takeover head. Heads only move by conditional publishes, so along the run's heads the epoch never
decreases, two masters that both read epoch e cannot both publish e + 1 (one gets HeadMoved), and an
old master's next publish fails because the head it names is gone. Every head ("epoch") and every
global's metadata carry it. Workers remember the highest epoch seen and ignore (log once) a head or
global from a lower one (worker/feedback.py: EpochFence).

A master restarted on the state directory of one that died on this host (its pid gone) releases that
one's lease and takes the run at once instead of waiting for it to lapse; the directory's lock (flock,
held while the process lives) keeps two live masters of one machine off one state directory (the
second is refused, a --standby one waits for the lock).

Takeover without losing or double-applying a delta: the newcomer starts from its own saved state if it
has one and the bus head is of that state's lineage (its epoch is not newer than the state's), else it
adopts the bus's global, high-water marks ("hwm": what was processed) and finished nodes. Deltas are
deleted only after the publish that includes them, so a round the old master applied but never
published is still on the bus and is applied again — by the newcomer, once; the old master's state
may list it, but no published global ever included it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from speedtronic.diloco import same_host
from speedtronic.diloco.bus.base import Bus, BusError, Claim, ClaimHeld, Head, PermissionDenied
from speedtronic.diloco.documents import epoch_of
from speedtronic.errors import SpeedtronicError

logger = logging.getLogger("speedtronic.diloco")
LEASE = "master"
LOCK_FILE = "master.lock"
HOLDER_FILE = "master_holder.json"  # the lease holder of the master that last ran on this state directory


class LeaseLost(SpeedtronicError):
    """This master no longer holds the run's lease: it stops without publishing."""


class MasterHeld(SpeedtronicError):
    """Another live master holds the run's lease (a usage mistake: exit 2)."""

    exit_code = 2


def _host() -> str:
    return ("".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname()) or "host")[:40]


def holder_token() -> str:
    """host/pid/random (at most 60 characters, which every bus shows whole): unique to this process,
    even for two masters on one machine."""
    return f"{_host()}/{os.getpid()}/{secrets.token_hex(4)}"


def predecessor(state_dir: Path, holder: str, wait: bool = False) -> tuple[str | None, Any]:
    """The lease holder of the master that last ran on `state_dir`, when it was a process of this host
    that is gone (killed, crashed): a master restarted there takes its lease back at once instead of
    waiting for it to lapse (diloco/same_host.py). Also returns the state directory's lock, held for
    the process' life, so no two live masters of one machine share a state directory (refused:
    MasterHeld, or with `wait`, a standby's, waited for). Records `holder` as the directory's master."""
    try:
        lock = same_host.lock_directory(state_dir, LOCK_FILE)
    except same_host.DirectoryHeld:
        if not wait:
            raise MasterHeld(
                f"{state_dir}: another master process on this machine runs on this state directory; stop "
                "it, or give this one its own distributed.master.state_dir (or run.output_dir)"
            ) from None
        logger.info("DiLoCo master (standby): waiting for the master running on %s to end", state_dir)
        lock = same_host.lock_directory(state_dir, LOCK_FILE, wait=True)
    if lock is None:  # no flock here: no predecessor is trusted
        return None, None
    return same_host.gone_predecessor(state_dir, HOLDER_FILE, holder), lock


def shown(holder: str) -> str:
    """A holder token as messages show it: "host H, pid P" (read from the bus: shown, never trusted)."""
    clean = "".join(c if c.isprintable() else "?" for c in str(holder))
    parts = clean.split("/")
    if len(parts) >= 2 and parts[1].isdigit():
        return f"host {parts[0][:64]}, pid {parts[1][:10]}"
    return repr(clean[:80])


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


class MasterLease:
    """The lease "master" on one bus, held by this process."""

    def __init__(self, bus: Bus, ttl_s: float, holder: str | None = None) -> None:
        self.bus = bus
        self.ttl_s = float(ttl_s)
        self.holder = holder or holder_token()
        self.claim: Claim | None = None
        self.renewed_at = 0.0  # monotonic time of the latest successful claim or renewal
        self.lost = False
        self.took_over: dict[str, Any] | None = None  # where this master started: outer step, hwm
        self.lock: IO[str] | None = (
            None  # the state directory's lock (`predecessor`), held while the process lives
        )

    def acquire(
        self, standby: bool = False, stop: threading.Event | None = None, predecessor: str | None = None
    ) -> Claim:
        """Claim the lease; held by a live master: refuse (MasterHeld), or as a standby wait until it
        lapses (or `stop`, a threading.Event, is set: then MasterHeld too). Held by `predecessor` (this
        state directory's dead master): released, then claimed."""
        said, said_at, delay = "", 0.0, 0.5
        while True:
            try:
                return self._claim()
            except ClaimHeld as held:
                who, left = shown(held.holder), max(0.0, held.expires_in)
                if predecessor is not None and held.holder == predecessor:
                    logger.warning(
                        "DiLoCo master: the run's lease is held by this state directory's previous master "
                        "(%s), which is gone; taking it back",
                        who,
                    )
                    self.bus.release(Claim(LEASE, predecessor, 0.0))
                    predecessor = None
                    continue
                if not standby:
                    raise MasterHeld(
                        f"{self.bus.url}: another master runs this run ({who}; its lease lapses in "
                        f"{left:.0f}s unless renewed); stop it, or start this one with --standby to take "
                        "over when its lease lapses"
                    ) from None
                if who != said or time.monotonic() - said_at >= 60.0:
                    logger.info(
                        "DiLoCo master (standby): the run %s is held by the master on %s (its lease lapses in "
                        "%.0fs unless renewed); waiting to take over",
                        self.bus.url,
                        who,
                        left,
                    )
                    said, said_at = who, time.monotonic()
                delay = min(max(left + 0.1, 0.2), self.ttl_s / 3)
            except PermissionDenied:
                raise
            except BusError as error:  # the bus is down: keep trying (a standby waits anyway)
                logger.warning("DiLoCo master: could not claim the run's lease (%s); retrying", error)
                delay = min(max(delay * 2, 0.5), max(1.0, self.ttl_s / 3))
            if stop is not None and stop.wait(delay):
                raise MasterHeld(f"{self.bus.url}: stopped while waiting for the master lease")
            if stop is None:
                time.sleep(delay)

    def _claim(self) -> Claim:
        started = time.monotonic()  # the claim's expiry counts from no earlier than this
        self.claim = self.bus.claim(LEASE, self.holder, self.ttl_s)
        self.renewed_at = started
        return self.claim

    def renew(self) -> None:
        """Renew now; LeaseLost when another master holds it (TransientBusError: try again)."""
        if self.lost:
            raise LeaseLost(f"{self.bus.url}: this master lost the run's lease; it publishes nothing")
        lapsed = self.claim is not None and time.time() > self.claim.expires_at
        try:
            self._claim()
        except ClaimHeld as held:
            self.lost = True
            raise LeaseLost(
                f"DiLoCo master: {self.bus.url}: lost the run's lease to the master on {shown(held.holder)}; "
                "this one stops without publishing"
            ) from None
        if lapsed:  # nobody took it meanwhile (a claim of a lapsed lease by another would have won)
            logger.warning("DiLoCo master: the run's lease had lapsed before its renewal; renewed")

    def hold(self, lock: IO[str] | None) -> None:
        """Keep the state directory's lock (`predecessor`) for the process' life."""
        self.lock = lock

    def record_takeover(self, facts: dict[str, Any]) -> None:
        self.took_over = facts

    def retry_soon(self) -> None:
        """A renewal failed on a bus error: try again within a second (or a tenth of the ttl)."""
        self.renewed_at = time.monotonic() - self.ttl_s / 3 + min(1.0, self.ttl_s / 10)

    def due_in(self) -> float:
        """Seconds until the next renewal (every third of the ttl)."""
        return self.renewed_at + self.ttl_s / 3 - time.monotonic()

    def release(self) -> None:
        if self.claim is None or self.lost:
            return
        try:
            self.bus.release(self.claim)
        except BusError as error:
            logger.warning(
                "DiLoCo master: could not release the run's lease (%s); it lapses by itself", error
            )
        self.claim = None

    def facts(self) -> dict[str, Any]:
        """Who holds the lease and until when, as head.json and metrics.json show it."""
        expires = self.claim.expires_at if self.claim is not None else None
        return {
            "holder": shown(self.holder),
            "expires_at": _iso(expires) if expires is not None else None,
            "ttl_s": self.ttl_s,
        }


# -- the master's side ----------------------------------------------------------------------------------
class Fence:
    """The master's lease (None until it claims one: tests run a master without) and fencing epochs:
    the epoch it publishes under and the one its saved state was written under."""

    def __init__(self) -> None:
        self.lease: MasterLease | None = None
        self.epoch = 0
        self.state_epoch = 0

    def claim(
        self, bus: Bus, ttl: float, state_dir: Path, standby: bool, stop: threading.Event | None = None
    ) -> MasterLease:
        """Claim the run's lease (as a standby: wait for it); a dead predecessor's is taken back."""
        lease = self.lease = MasterLease(bus, ttl)
        before, lock = predecessor(state_dir, lease.holder, wait=standby)
        lease.hold(lock)
        lease.acquire(standby, stop, before)
        logger.info(
            "DiLoCo master: holds the run's lease on %s (%s; %.0fs, renewed every %.0fs)",
            bus.url,
            shown(lease.holder),
            ttl,
            ttl / 3,
        )
        return lease

    def next_epoch(self, head: Head | None) -> None:
        """Take the epoch after the head's (a takeover)."""
        self.epoch = epoch_of(head) + 1

    def published(self, head: Head | None) -> bool:
        """Whether `head` already carries this master's epoch (its takeover head is out)."""
        return epoch_of(head) >= self.epoch

    def newer(self, head: Head | None) -> bool:
        """Whether `head` was published by a master that took over after this master's state was saved:
        then the bus, not the state, is the run (start_state adopts it even at a lower outer step)."""
        return epoch_of(head) > self.state_epoch

    def loaded(self, epoch: int) -> None:
        self.state_epoch = epoch

    def took_over(self, outer_step: int, hwm: dict[str, int]) -> None:
        if self.lease is not None:
            self.lease.record_takeover({"epoch": self.epoch, "outer_step": outer_step, "hwm": dict(hwm)})

    def ensure(self) -> None:
        """Before a publish: renew the lease when its renewal is due (LeaseLost when another master holds
        it). Renewed within the last third of its ttl, it has at least two thirds of its ttl left — no other
        master can hold it — so the publish does not pay a second commit for it; the head's compare-and-swap
        and the fencing epoch guard the publish in any case."""
        lease = self.lease
        if lease is not None and (lease.lost or lease.due_in() <= 0):
            lease.renew()

    def idle(self, stop: threading.Event, delay: float) -> BaseException | None:
        """The loop's wait between polls (`stop`: a threading.Event), in slices so that the lease is
        renewed every third of its ttl. A lost lease ends the wait with the error (the loop stops)."""
        lease = self.lease
        end = time.monotonic() + delay
        while not stop.is_set():
            if lease is not None and lease.due_in() <= 0:
                try:
                    lease.renew()
                except (LeaseLost, PermissionDenied) as error:
                    logger.error("%s", error)
                    return error
                except BusError as error:  # retried at the next slice, while the lease lasts
                    logger.warning("DiLoCo master: could not renew the run's lease (%s); retrying", error)
                    lease.retry_soon()
            left = end - time.monotonic()
            if left <= 0:
                return None
            stop.wait(left if lease is None else max(0.01, min(left, lease.due_in())))
        return None

    def head_facts(self, finished: set[str]) -> dict[str, Any]:
        """What head.json carries for takeovers and operators: the epoch, the finished nodes, the lease."""
        lease = self.lease
        return {
            "epoch": self.epoch,
            "finished": sorted(finished),
            **({"master": lease.facts()} if lease is not None else {}),
        }

    def report(self) -> dict[str, Any]:
        """metrics.json's epoch and lease."""
        return {"epoch": self.epoch, "lease": self.lease.facts() if self.lease is not None else None}

    def summary(self) -> dict[str, Any]:
        """What `speedtronic master --json` adds: the epoch, the lease, and where this master took over
        (its outer step and high-water marks: what the run had published before it)."""
        return {**self.report(), "took_over": self.lease.took_over if self.lease is not None else None}

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


# -- the workers' side -------------------------------------------------------------------------------
