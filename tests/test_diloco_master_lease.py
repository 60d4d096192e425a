"""One master per run on a real directory bus: the master lease (a second master is refused, naming the
first; a standby waits and takes over when the lease lapses), the fencing epoch (bumped by every
takeover, carried in head.json and the global's metadata), a master that lost its lease publishes
nothing, a takeover neither loses nor double-applies a delta, and a worker ignores a stale-epoch head."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import ClaimHeld
from speedtronic.diloco.documents import epoch_of
from speedtronic.diloco.master import lease as master_lease
from speedtronic.diloco.master.lease import LeaseLost, MasterHeld, MasterLease
from speedtronic.diloco.worker import Coordinator
from test_diloco_master import Run

TTL = 30.0  # long: a test that needs a lapse shortens that one lease, then waits for it by condition


def lapsed(run: Run, holder: str = "probe/1/x") -> None:
    """Wait until the master lease can be claimed by someone else with the run's lease time (then give it
    back at once). A lease lasts at most one claimer's ttl from its last write (a planted far-future
    one locks no one out), so a probe with a tiny ttl would take a live lease: it asks as a peer would."""
    deadline = time.monotonic() + 30
    while True:
        try:
            claim = run.bus.claim("master", holder, TTL)
            run.bus.release(claim)
            return
        except ClaimHeld:
            assert time.monotonic() < deadline, "the master lease never lapsed"
            time.sleep(0.05)


def head_epoch(run: Run) -> int:
    return epoch_of(run.bus.read_head())


def global_epoch(run: Run) -> int:
    head = run.bus.read_head()
    decoded = codec.decode(run.bus.read_global(head), run.specs, kind="global", max_bytes=1 << 30)
    return decoded.int("epoch", -1)


def shorten(m: object, ttl: float = 0.3) -> None:
    """The master's next renewals last `ttl` seconds: it lapses soon after the last one."""
    m.lease.ttl_s = ttl
    m.lease.renew()


def leased(run: Run, state: str, standby: bool = False) -> object:
    m = run.master_unstarted(state)
    m.take_over(standby)
    return m


@pytest.fixture
def run(tmp_path: Path) -> Run:
    r = Run(tmp_path, f"distributed.master.lease_s={TTL}", "distributed.rounds.min_deltas=1")

    def master_unstarted(state: str = "state"):
        from speedtronic.diloco.master import Master

        return Master(
            r.cfg, r.bus, r.manifest, codec.snapshot(r.model), state_dir=r.tmp_path / state, momentum=0.0
        )

    r.master_unstarted = master_unstarted  # type: ignore[attr-defined]
    return r


def test_a_second_master_is_refused_naming_the_first(run: Run) -> None:
    first = leased(run, "a")
    assert head_epoch(run) == 1 and global_epoch(run) == 1
    head = run.bus.read_head()
    assert head["master"]["holder"] == f"host {socket.gethostname()}, pid {os.getpid()}"
    with pytest.raises(MasterHeld) as refused:
        MasterLease(run.bus, 30.0).acquire(standby=False)
    message = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in message
    assert f"pid {os.getpid()}" in message and "--standby" in message and "lapses in" in message
    assert first.lease.holder.split("/")[2] not in message  # the token's random part is not shown
    metrics = first.metrics()
    assert metrics["epoch"] == 1 and metrics["lease"]["holder"].endswith(f"pid {os.getpid()}")
    assert metrics["lease"]["expires_at"] and metrics["lease"]["ttl_s"] == TTL


def test_a_standby_takes_over_when_the_lease_lapses_with_a_new_epoch(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    first = leased(run, "a")
    delta = run.delta("w1", 0)
    assert first.round() is True and first.outer_step == 1
    got: dict[str, object] = {}

    def standby() -> None:
        got["master"] = leased(run, "b", standby=True)

    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        thread = threading.Thread(target=standby)
        thread.start()
        # The standby waits while the first master's lease lives ...
        deadline = time.monotonic() + 30
        while "waiting to take over" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert thread.is_alive() and head_epoch(run) == 1
        # ... and takes over once the first one stops renewing (a crash: nothing released).
        shorten(first)
        thread.join(60)
    second = got["master"]
    assert second.epoch == 2 and head_epoch(run) == 2 and global_epoch(run) == 2
    assert second.outer_step == 1 and second.hwm == {"w1": 0} and second.applied == []
    assert second.lease.took_over == {"epoch": 2, "outer_step": 1, "hwm": {"w1": 0}}
    assert "waiting to take over" in caplog.text and f"pid {os.getpid()}" in caplog.text
    # The first master finds out at its next renewal, and publishes nothing.
    before = run.bus.read_head()
    with pytest.raises(LeaseLost, match="lost the run's lease"):
        first.publish()
    assert run.bus.read_head().version == before.version
    run.delta("w1", 1)
    assert second.round() is True and second.applied == ["w1/w1--00000001.safetensors"]
    assert delta not in second.applied and head_epoch(run) == 2


def test_a_master_that_lost_its_lease_publishes_nothing_and_the_newcomer_applies_its_round_once(
    run: Run,
) -> None:
    first = leased(run, "a")
    ids = [run.delta("w1", 0), run.delta("w2", 0)]
    shorten(first)
    lapsed(run)  # the first master stopped renewing (paused, partitioned) ...
    second = leased(run, "b")  # ... and another master took the run over
    before = run.bus.read_head()
    assert before["epoch"] == 2
    with pytest.raises(LeaseLost):
        first.round()  # applied in its own state (its commit point), then refused to publish
    assert sorted(first.applied) == sorted(ids)
    head = run.bus.read_head()
    assert head.version == before.version and head["outer_step"] == 0 and head["hwm"] == {}
    assert sorted(p.name for p in (run.bus.root / "deltas").rglob("*.safetensors")) == sorted(
        i.split("/")[1] for i in ids
    )  # nothing deleted: the deltas were never in a published global
    assert second.round() is True and sorted(second.applied) == sorted(ids) and second.outer_step == 1
    assert run.bus.read_head()["hwm"] == {"w1": 0, "w2": 0}
    assert list((run.bus.root / "deltas").rglob("*.safetensors")) == []
    # The first master's loop stops too, on its own, at the renewal between polls.
    first._stop.clear()
    first.start()
    first._thread.join(30)
    assert isinstance(first.error, LeaseLost) and not first._thread.is_alive()


def test_a_restarted_master_adopts_the_bus_when_another_master_published_since(run: Run) -> None:
    """Its state and the bus at the same outer step, but the bus's of a newer epoch: the bus wins."""
    first = leased(run, "a")
    run.delta("w1", 0)
    assert first.round() is True
    run.delta("w1", 1)
    shorten(first)
    lapsed(run)
    other = leased(run, "b")  # epoch 2, from the bus's outer step 1
    with pytest.raises(LeaseLost):
        first.round()  # its state: outer step 2 with w1's second delta, never published
    run.delta("w2", 0)
    assert other.round() is True and other.outer_step == 2, (other.applied, other.rejected)
    weights = {n: t.clone() for n, t in other.outer.weights.items()}
    other.lease.release()
    first.lease.lock.close()  # the first master's process ended
    again = leased(run, "a")  # its state says outer step 2 of epoch 1; the bus has epoch 2's step 2
    assert again.epoch == 3 and again.outer_step == 2 and again.hwm == {"w1": 1, "w2": 0}, (
        other.applied,
        other.rejected,
    )
    assert all(torch.equal(again.outer.weights[n], weights[n]) for n in weights)


def test_a_worker_ignores_a_head_and_global_of_a_stale_epoch(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    first = leased(run, "a")
    worker = Coordinator(run.cfg, run.bus, "w1", run.manifest)
    worker.book.outer_step = 0
    first.lease.release()
    second = leased(run, "b")
    run.delta("w1", 0)
    assert second.round() is True
    worker.poller.poll_once()
    assert worker.poller.epochs.highest == 2 and worker.poller.incoming[0] == 1 and worker.numbering.hwm == 0
    worker.poller.incoming = None
    worker.book.outer_step = 1
    # The old master, fenced out, still writes (an older version without the conditional publish).
    first.ledger.outer_step, first.ledger.hwm = 5, {"w1": 7}
    head = {"format": codec.FORMAT_VERSION, "outer_step": 5, "hwm": {"w1": 7}, "epoch": 1}
    run.bus.publish(first.global_files().full, head)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        worker.poller.poll_once()
        worker.poller.poll_once()
    assert worker.poller.incoming is None and worker.numbering.hwm == 0 and worker.outer_step == 1
    assert caplog.text.count("ignoring a head of master epoch 1") == 1
    # A global whose metadata is of an older epoch than its head is refused too.
    with pytest.raises(codec.Rejected, match="master epoch 1"):
        worker.poller.epochs.check(
            {"epoch": 2}, codec.decode(first.global_files().full, run.specs, kind="global")
        )


def test_a_master_restarted_on_its_state_directory_takes_its_dead_predecessors_lease_at_once(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process of this host that is gone (killed with kill -9, say), which held the lease
    token = f"{socket.gethostname()[:40]}/{dead.pid}/deadbeef"
    run.bus.claim("master", token, TTL)
    state = run.tmp_path / "a"
    state.mkdir()
    (state / master_lease.HOLDER_FILE).write_text(json.dumps({"holder": token}))
    with pytest.raises(MasterHeld):  # another state directory: its lease is not this one's to take
        leased(run, "b")
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        restarted = leased(run, "a")
    assert "which is gone; taking it back" in caplog.text and restarted.epoch == 1
    assert json.loads((state / master_lease.HOLDER_FILE).read_text())["holder"] == restarted.lease.holder
    # A second live master on the same state directory of this machine is refused (its lock).
    with pytest.raises(MasterHeld, match="runs on this state directory"):
        leased(run, "a")


def test_a_publish_renews_the_lease_only_when_its_renewal_is_due(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renewed within the last third of its ttl, the lease has two thirds of it left: a publish then
    pays no second commit for it (on the Hub a renewal is one), and one that is due still renews."""
    m = leased(run, "a")
    claims: list[float] = []
    real_claim = run.bus.claim

    def counted(name: str, holder: str, ttl_s: float):
        claims.append(ttl_s)
        return real_claim(name, holder, ttl_s)

    monkeypatch.setattr(run.bus, "claim", counted)
    run.delta("w1", 0)
    assert m.round() is True and m.outer_step == 1
    m.publish()
    assert claims == []  # both publishes inside the renewal period: no renewal
    m.lease.renewed_at -= TTL / 3 + 1  # the renewal is due: the next publish renews first
    before = m.lease.claim.expires_at
    m.publish()
    assert claims == [TTL] and m.lease.claim.expires_at > before and m.lease.due_in() > 0
    m.publish()
    assert claims == [TTL]


def test_a_restarted_master_forgets_the_round_it_committed_but_never_published(run: Run) -> None:
    """Found by the 30-minute S3 chaos soak (a 500 storm): a master lost its lease between its commit
    point and its publish; the master that took over published nothing new before it stopped too; the
    first one's slot restarted on its saved state. Its takeover head must carry the bus's marks, not its
    own: with its own, the workers took the unpublished round's deltas as applied, pruned the files,
    and no global ever held them (7 lost). Here the deltas are applied again, once."""
    first = leased(run, "a")
    ids = [run.delta("w1", 0), run.delta("w2", 0)]
    shorten(first)
    lapsed(run)
    second = leased(run, "b")  # epoch 2 at outer step 0
    with pytest.raises(LeaseLost):
        first.round()  # committed in its own state (outer step 1), never published
    assert sorted(first.applied) == sorted(ids)
    second.lease.release()  # the second master stops before a round of its own
    first.lease.lock.close()  # the first master's process ended
    again = leased(run, "a")  # epoch 3, on the first one's state (outer step 1) and the bus (step 0)
    assert again.epoch == 3 and again.outer_step == 0 and again.hwm == {}, again.applied
    assert run.bus.read_head()["hwm"] == {}  # the takeover head tells no worker its delta was applied
    assert again.round() is True and sorted(again.applied) == sorted(ids) and again.outer_step == 1
    assert run.bus.read_head()["hwm"] == {"w1": 0, "w2": 0} and again.rejected == [], again.rejected
