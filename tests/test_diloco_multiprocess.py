"""DiLoCo end to end: separate master and worker processes (the real CLI) training the reference model
on tinyshakespeare, over a directory bus and over the Hub bus against the loopback Hub server.

Each test builds the run's report (tests/swarm_harness.py) and asserts exactly-once on delta ids:
no delta applied twice, every delta a worker uploaded applied (none rejected: these are honest
nodes), nothing valid left on the bus; and the global model's validation loss goes down. Counts that
load can change (a resumed node may send one delta more; a slow node can make a round more) are
asserted as the protocol bounds them, not as the numbers of one lucky run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import swarm_harness
from speedtronic.diloco import codec
from swarm_harness import TEXT, Procs, Report, Swarm, supported, token, wait_until, write_config

pytestmark = pytest.mark.slow
# Other tests drive processes with these (the harness's; kept importable from here).
__all__ = [
    "TEXT",
    "Procs",
    "assert_exactly_once",
    "assert_loss_went_down",
    "procs",
    "wait_until",
    "write_config",
]


@pytest.fixture
def text() -> Path | None:
    """tinyshakespeare from ../shared when it is there; else None: the embedded copy of the same corpus."""
    return TEXT if TEXT.exists() else None


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.kill_all()


def assert_exactly_once(master: dict[str, Any], *workers: dict[str, Any]) -> None:
    """Exactly once from `--json` summaries alone (for tests that drive processes by hand): every delta
    the workers report uploaded applied once, nothing else applied, nothing rejected. The swarm tests
    use swarm_harness.assert_exactly_once on a whole report (bus, killed processes, leftovers)."""
    sent: dict[str, list[str]] = {}
    for w in workers:
        sent.setdefault(w["node"], []).extend(f"{w['node']}/{n}" for n in w["uploaded"])
    report = Report(sent, {}, list(master["applied"]), list(master["rejected"]), [], {})
    swarm_harness.assert_exactly_once(report)
    assert master["rejected"] == [], report.lists()


def assert_loss_went_down(master: dict[str, Any]) -> None:
    """The global model's validation loss fell over the run (a tiny model learns fast on this corpus)."""
    losses = [v["val_loss"] for v in master["global_val_loss"]]
    assert len(losses) >= 3, losses
    assert losses[-1] < losses[0] - 0.5, losses


def test_master_and_two_workers_over_a_directory_bus_with_the_master_killed(
    tmp_path: Path, text: Path | None, swarm: Swarm
) -> None:
    """The master trains too (three contributors per round); it is SIGKILLed after the first outer step
    and restarted: its outer loop resumes from its saved state, its training from its checkpoint."""
    cfg = write_config(tmp_path, text, min_deltas=3)
    master = swarm.master(cfg)
    w1, w2 = swarm.worker(cfg, "w1"), swarm.worker(cfg, "w2")
    wait_until(lambda: swarm.outer_step() >= 1, what="the first outer step")
    swarm.kill(master)
    killed_at = swarm.outer_step()
    master = swarm.restart(master)
    report = swarm.report(master)
    print("\n" + report.table())
    rm, r1 = report.master, swarm.result(w1)
    # 20 steps / H=5: four deltas per node, one per node in a round, so at least 4 rounds; once a node
    # has sent its final delta a round needs one delta fewer (master.expected), so a node that ends
    # first (timing) leaves rounds of fewer deltas at the end. The killed master's node resumes from
    # its last checkpoint and numbers on past what it had sent, so it may send one delta more than
    # four (issue 23 saw 13 applied where 12 were expected): exactly-once is what must hold.
    assert killed_at < 4 <= rm["outer_step"] <= len(rm["applied"]), (killed_at, rm["outer_step"])
    assert "resumed state at outer step" in swarm.log(master) and "resumed from" in swarm.log(master)
    assert rm["worker"]["node"] == "master"
    swarm_harness.assert_exactly_once(report, allow_left=False)
    assert rm["rejected"] == [], rm["rejected"]  # honest nodes: whole, finite deltas
    nodes = report.nodes()
    assert nodes["w1"]["applied"] == nodes["w2"]["applied"] == 4, report.table()  # never killed: 20 / 5
    assert nodes["master"]["applied"] >= 4, report.table()
    assert_loss_went_down(rm)
    assert r1["outer_step"] >= 1 and r1["bytes_sent"] > 0  # max_rounds_ahead=1: w1 waited for a global
    assert "inner step 10 · outer step" in swarm.log(w1)  # progress: inner/outer step, last sync, bytes
    assert list((tmp_path / "bus" / "deltas" / "w1").glob("*.safetensors")) == []  # processed: deleted
    assert swarm.result(w2)["node"] == "w2"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_worker_of_two_ranks_over_a_directory_bus(
    tmp_path: Path, text: Path | None, swarm: Swarm, strategy: str
) -> None:
    """Inside a machine the ranks train with DDP or FSDP; rank 0 alone talks to the bus. Under DDP it
    broadcasts the global weights it installs; under FSDP its deltas come from the gathered whole
    weights and what it installs is scattered to the shards. The master only aggregates here."""
    # 15 steps, H=5: with max_rounds_ahead=1 the worker must install a global before its third delta.
    cfg = write_config(tmp_path, text, max_steps=15, min_deltas=1, master_trains=False, strategy=strategy)
    master = swarm.master(cfg)
    worker = swarm.worker(cfg, "w1", ranks=2)
    report = swarm.report(master)
    rw, rm = swarm.result(worker), report.master
    swarm_harness.assert_exactly_once(report, allow_left=False)
    assert rm["rejected"] == []  # whole, finite deltas
    # One node, never killed: its three deltas (15 / H), one per round, so one outer step each.
    assert rw["node"] == "w1" and rw["steps"] == 15 and len(rw["uploaded"]) == 3
    assert rm["outer_step"] == len(rm["applied"]) == 3, report.lists()
    assert rw["tokens"] == 15 * 2 * 8 * 64  # two ranks' micro-batches per step
    assert rw["strategy"] == strategy
    assert_loss_went_down(rm)
    # Beyond the initial install (outer step 0), rank 0 installed a newer global and broadcast it.
    assert re.search(r"installed global model of outer step [1-9]", swarm.log(worker))


@pytest.mark.usefixtures("restore_secrets", "isolated_env")
def test_master_and_two_workers_over_the_hub_with_faults(tmp_path: Path, text: Path | None) -> None:
    swarm = Swarm(tmp_path, "hub")
    try:
        _hub_run(tmp_path, text, swarm)
    finally:
        swarm.close()


def _hub_run(tmp_path: Path, text: Path | None, swarm: Swarm) -> None:
    server = swarm.server
    assert server is not None
    # Enough retries (~14 s of backoff) to ride out the 503s, the hung requests and the 3 s outage below
    # together, whenever they start (8 was not always enough for a worker starting into all three). A short
    # node-id lease where this tree has one: alice's restart after kill -9 is refused until it expires.
    cfg = write_config(
        tmp_path,
        text,
        max_steps=15,
        request_timeout=2.0,
        retry_attempts=16,
        # The client's commit budget is not what this test is about (tests/test_diloco_hub_swarm.py
        # is): the default, 128 per hour, allows a burst of 12 and then one commit per 33 s, which
        # made the master wait twice that long at the end of the run.
        hub_commit_budget=2000,
        # ...and that wait was what kept the master up until alice was back: once the run's end is
        # reached, a node silent past its liveness window has left. alice's restart (refused until
        # her 20 s lease expires, then starting torch) must land within the master's stay after the
        # end, so it is set, not left to the throttle.
        late_join_wait=60.0,
        **supported(node_lease_s=20.0),
    )
    swarm.init(cfg)
    assert swarm.head() is not None and swarm.outer_step() == 0
    for user in ("alice", "bob"):
        assert swarm.add_collaborator(user)["granted_read_access"] is True
    master = swarm.master(cfg, "--no-train")
    alice, bob = swarm.worker(cfg, "alice"), swarm.worker(cfg, "bob")

    def alice_repo() -> dict[str, bytes]:
        with server.state.lock:
            known = "alice/dl-run-deltas" in server.state.repos
        return server.files("alice/dl-run-deltas") if known else {}

    def alice_sent() -> int:
        """The highest delta number in alice's repo (each upload prunes the processed ones)."""
        names = [p.rsplit("/", 1)[1] for p in alice_repo() if p.startswith("deltas/alice/")]
        return max((codec.parse_delta_name(n)[1] for n in names), default=-1)

    # Worker killed mid-upload: alice's second delta lands, but the answer never reaches her. (Her
    # delta repo's commits are its README, which carries the run's tag, her lease on her node id, its
    # renewals, and her deltas: counted by the files, not the commits.)
    wait_until(lambda: alice_sent() >= 0, what="alice's first delta")
    server.hang_after_next(1, 60, match="alice/dl-run-deltas/commit")
    wait_until(lambda: alice_sent() >= 1, what="alice's second delta")
    swarm.kill(alice)
    server.clear_faults()
    # The Hub misbehaves while training goes on: 503s, hung requests, then down for a while (the
    # sleeps are the faults' durations, not waits for something to happen).
    server.fail_next(6, 503)
    server.hang_next(2, 4.0)
    alice = swarm.restart(alice, until_accepted=300)
    time.sleep(2.0)
    server.stop()
    time.sleep(3.0)
    server.start()

    report = swarm.report(master)
    print("\n" + report.table())
    rm = report.master
    assert "resumed from" in swarm.log(alice)
    swarm_harness.assert_exactly_once(report, allow_left=False)
    assert rm["rejected"] == [], rm["rejected"]
    # 15 steps / H=5: the run ends at outer step 3. A round takes at most one delta per node, and
    # alice resumed from a checkpoint may send one more delta than three, so a round more is allowed
    # (issue 23 saw 4 where 3 was expected); never more rounds than deltas.
    assert 3 <= rm["outer_step"] <= len(rm["applied"]), report.lists()
    assert report.nodes()["bob"]["applied"] == 3, report.table()  # never killed: 15 / 5
    assert_loss_went_down(rm)
    warnings = swarm.log(master) + swarm.log(bob) + swarm.log(alice)
    assert "HTTP 503" in warnings or "retrying" in warnings
    # hub status reports the outer step and each collaborator's latest delta and lag
    st = swarm.cli("hub", "status", swarm.repo)
    assert st["outer_step"] == rm["outer_step"]
    nodes = {c["node"]: c for c in st["collaborators"]}
    alice_last = max(int(i.split("--")[1].split(".")[0]) for i in rm["applied"] if i.startswith("alice/"))
    assert nodes["alice"]["latest_applied_seq"] == alice_last >= 2 and nodes["bob"]["lag"] is not None
    for life in swarm.lives.values():
        log = swarm.log(life)
        assert token("owner") not in log and token("alice") not in log and token("bob") not in log
