"""One node id is one worker (diloco/identity.py) on a real directory bus: a node claims its lease,
renews it on a thread, refuses a second claimant in one exit-2 line, loses it to a process that took
it over (and then never uploads), gives it up when renewals stop for too long, can be taken over once a
crashed holder's lease has expired, and releases it at a clean close; the default node id is stable
per output directory; a coordinator resumed from a checkpoint older than its files on the bus numbers
after them."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import ClaimHeld, TransientBusError
from speedtronic.diloco.bus.directory import LOCK_FILE, DirectoryBus
from speedtronic.diloco.identity import (
    LeaseLost,
    NodeLease,
    claim_node,
    default_node_id,
    holder_token,
    shown_holder,
)
from speedtronic.diloco.worker import Coordinator
from speedtronic.errors import SpeedtronicError
from test_diloco_coordinator import BASE, setup_run

pytestmark = pytest.mark.usefixtures("isolated_env")
OTHER = "otherhost/4242/0123456789abcdef"  # another process's holder token (host/pid/random)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def stored(bus: DirectoryBus, node: str) -> dict | None:
    path = bus.root / "leases" / f"{node}.json"
    return json.loads(path.read_text()) if path.exists() else None


def lease_of(bus: DirectoryBus, node: str, ttl: float, **kw: object) -> NodeLease:
    lease = claim_node(bus, node, ttl, **kw)  # type: ignore[arg-type]
    assert lease is not None
    return lease


def test_claim_renew_refuse_release(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "run"))
    lease = lease_of(bus, "w1", 0.9)
    try:
        first = stored(bus, "w1")
        assert first is not None and first["holder"] == holder_token()
        assert holder_token().split("/")[:2] == [shown_holder(holder_token()).split("/")[0], str(os.getpid())]
        wait_until(lambda: lease.renewals >= 3, "three renewals")  # every ttl/3
        renewed = stored(bus, "w1")
        assert renewed is not None and renewed["expires_at"] > first["expires_at"]
        lease.check()  # still ours
        # A second process claiming the live id is refused: exit 2, one line naming --node-id, the
        # holder's host/pid (never its random part) and when the lease expires.
        with pytest.raises(ClaimHeld) as refused:
            claim_node(DirectoryBus(str(tmp_path / "run")), "w1", 0.9, holder=OTHER)
        message = str(refused.value)
        assert refused.value.exit_code == 2 and "\n" not in message
        assert "--node-id w1" in message and "expires in" in message
        host, pid, secret = holder_token().split("/")
        assert f"{host}/{pid}" in message and secret not in message
        assert refused.value.holder == f"{host}/{pid}"
    finally:
        lease.close()
    assert stored(bus, "w1") is None  # released at a clean close: a restart claims at once
    again = lease_of(DirectoryBus(str(tmp_path / "run")), "w1", 5.0, holder=OTHER)
    assert stored(bus, "w1")["holder"] == OTHER
    again.close()


def test_default_id_refusal_says_to_use_another_output_directory(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "run"))
    lease = lease_of(bus, "box-12345678", 30.0, holder=OTHER)
    try:
        with pytest.raises(ClaimHeld, match=r"--node-id .*another output directory"):
            claim_node(bus, "box-12345678", 30.0, where="default")
    finally:
        lease.close()


def test_an_expired_lease_is_taken_over_and_the_old_holder_stops(tmp_path: Path) -> None:
    """A crashed holder (renewals stop, nothing released) keeps the id until its lease expires; then a
    newcomer takes it over, and the old holder, should it wake up, finds the id taken and stops."""
    bus = DirectoryBus(str(tmp_path / "run"))
    crashed = lease_of(bus, "w1", 1.5, holder=OTHER)
    crashed.close(release=False)  # as kill -9: the lease stays on the bus until it expires
    with pytest.raises(ClaimHeld) as refused:
        claim_node(bus, "w1", 1.5)
    assert 0 < refused.value.expires_in <= 1.5 and "otherhost/4242" in str(refused.value)
    wait_until(lambda: stored(bus, "w1")["expires_at"] < time.time(), "the crashed holder's lease to expire")
    newcomer = lease_of(bus, "w1", 1.5)
    try:
        assert stored(bus, "w1")["holder"] == holder_token()
    finally:
        newcomer.close()


def test_a_lease_taken_by_another_process_is_lost_and_checked_before_writes(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "run"))
    lease = lease_of(bus, "w1", 0.9)
    try:
        # Another process owns the id now (as after this one was suspended past its lease).
        bus.release(lease.claim)
        bus.claim("w1", OTHER, 30.0)
        wait_until(lambda: lease.error is not None, "the renewer to notice")
        with pytest.raises(LeaseLost, match="otherhost/4242 holds its lease") as lost:
            lease.check()
        assert "0123456789abcdef" not in str(lost.value)
    finally:
        lease.close()
    assert stored(bus, "w1")["holder"] == OTHER  # a lost lease is never released by its old holder


def test_a_stuck_bus_blocks_uploads_and_a_late_renewal_nobody_interrupted_keeps_the_id(
    tmp_path: Path,
) -> None:
    """While the run's lock is held (a stuck shared filesystem) no renewal can land: once the lease
    could have lapsed, `check()` refuses every write (a transient error: nothing uploads) without
    blocking on the stuck bus. The renewal that lands late finds the lease still this process's own
    (nobody could claim it meanwhile): the id is kept, writes go on, no restart is needed."""
    bus = DirectoryBus(str(tmp_path / "run"))
    lease = lease_of(bus, "w1", 1.2)
    fd = os.open(bus.root / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(TransientBusError, match="cannot confirm its lease"):
            wait_until(lambda: lease.check() is not None, "the lease to lapse")  # check() raises first
        assert lease.error is None
    finally:
        os.close(fd)  # the blocked renewal now lands, late
    wait_until(lambda: lease.renewals >= 1, "the late renewal")
    lease.check()  # kept: the lease it replaced was its own
    assert lease.error is None and stored(bus, "w1")["holder"] == holder_token()
    lease.close()
    lease_of(bus, "w1", 5.0, holder=OTHER).close()  # released at close: free for a successor at once


def test_a_late_renewal_after_another_process_held_the_id_is_lost_and_given_back(tmp_path: Path) -> None:
    """Frozen past its lease while another process took the id and left again: the late renewal
    cannot tell what was written meanwhile under the name, so the lease counts as lost (every write
    raises LeaseLost) and the renewal it did land is given back."""
    bus = DirectoryBus(str(tmp_path / "run"))
    lease = lease_of(bus, "w1", 30.0)
    lease._stop.set()  # as a frozen process: the renewer does not run
    lease._thread.join(5.0)
    lease._valid_until -= 60.0  # its deadline is long past
    bus.release(lease.claim)
    bus.release(bus.claim("w1", OTHER, 30.0))  # the other process ended cleanly: no lease on the bus at all
    with pytest.raises(LeaseLost, match="renewed only after it could have lapsed"):
        lease.check()
    assert stored(bus, "w1") is None  # the late renewal was given back
    with pytest.raises(LeaseLost):
        lease.check()
    lease.close()


def test_a_late_renewal_of_its_own_lease_keeps_the_id(tmp_path: Path) -> None:
    """Frozen past its lease (SIGSTOP, a long GC pause) with nobody claiming the id: the first write
    after waking renews at once and goes on."""
    bus = DirectoryBus(str(tmp_path / "run"))
    lease = lease_of(bus, "w1", 30.0)
    lease._stop.set()
    lease._thread.join(5.0)
    lease._valid_until -= 60.0
    lease.check()
    assert lease.error is None and lease.renewals == 1 and stored(bus, "w1")["holder"] == holder_token()
    lease.close()


def test_the_master_node_needs_no_node_lease(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "run"))
    assert claim_node(bus, "master", 5.0, where="master") is None  # the master role lease guards it
    assert not (bus.root / "leases" / "master.json").exists()


def test_default_node_id_is_stable_per_output_directory(tmp_path: Path) -> None:
    def node(*sets: str) -> str:
        return default_node_id(load_config(None, list(sets)))

    a = node(f"run.output_dir={tmp_path / 'a'}")
    assert a == node(f"run.output_dir={tmp_path / 'a'}")  # a restart of the same directory
    assert a == node(f"run.output_dir={tmp_path / 'x' / '..' / 'a'}")  # resolved
    assert a != node(f"run.output_dir={tmp_path / 'b'}")  # another directory, another process
    assert a != node(f"run.output_dir={tmp_path / 'a'}", f"checkpoint.directory={tmp_path / 'ck'}")
    assert codec.NODE_RE.match(a) and len(a) <= 64


def test_a_coordinator_with_a_lost_lease_uploads_nothing(tmp_path: Path) -> None:
    cfg, bus, manifest, _ = setup_run(tmp_path, "checkpoint.enabled=false")
    lease = lease_of(bus, "w1", 30.0)
    bus.release(lease.claim)
    bus.claim("w1", OTHER, 30.0)  # taken over before the first upload
    # The renewer's next tick (run here, not waited for: no timing luck) finds the id taken.
    assert lease._renew_once(10.0, 1.0) is None and lease.error is not None
    coordinator = Coordinator(cfg, bus, "w1", manifest, lease=lease)
    try:
        with pytest.raises(SpeedtronicError, match="no longer owns"):
            # the next step (or upload) stops training
            Trainer(cfg, sync=coordinator, progress=False).train(max_steps=400)
    finally:
        lease.close()
    assert coordinator.uploaded == [] and bus.list_own_deltas("w1") == []


def test_a_newcomer_numbers_after_the_nodes_files_on_the_bus(tmp_path: Path) -> None:
    """A process that takes over a node id without its checkpoint (another machine, a lost disk) knows
    only the bus: it numbers after the node's files there and never sends other deltas under their
    names. (One that resumes the node's checkpoint replays the deltas sent since under the same names,
    which the master applies once: that work was done before the crash.)"""
    sync = ["checkpoint.enabled=false", "distributed.worker.async_upload=false"]
    cfg, bus, manifest, _ = setup_run(tmp_path, *sync, "distributed.worker.async_global_poll=false")
    Trainer(cfg, sync=Coordinator(cfg, bus, "w1", manifest), progress=False).train(max_steps=4)
    before = {n: (bus.root / "deltas" / "w1" / n).read_bytes() for n in bus.list_own_deltas("w1")}
    assert sorted(before) == [codec.delta_name("w1", s) for s in range(2)], sorted(before)
    elsewhere = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'out2'}", *sync])
    newcomer = Coordinator(elsewhere, bus, "w1", manifest)
    Trainer(elsewhere, sync=newcomer, progress=False).train(max_steps=4)
    assert newcomer.uploaded == [codec.delta_name("w1", s) for s in (2, 3)], (
        sorted(before),
        newcomer.uploaded,
    )
    for name, data in before.items():  # never overwritten under the same name
        assert (bus.root / "deltas" / "w1" / name).read_bytes() == data, name
