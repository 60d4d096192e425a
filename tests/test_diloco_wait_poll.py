"""distributed.node.wait_poll_interval: while a node waits on the bus it polls faster than poll_interval.

A worker whose training waits for the global that answers its delta (overlap_steps, the shipped 1) is
idle compute, and the global is usually one master round away; a master whose round has some deltas
waits for the rest, which come close together. Before, both slept a whole poll_interval (30 s by
default) between polls, so each round lost about one interval on average. On a real directory bus,
with a real Trainer and master; the worker's wait would outlast max_wait (20 s) at the old cadence
(poll_interval 30 s), so the test cannot pass by luck of timing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.config.distributed import wait_poll_s
from speedtronic.diloco.worker import Coordinator
from speedtronic.errors import ConfigError
from test_diloco_coordinator import BASE, setup_run
from test_diloco_master import Run

pytestmark = pytest.mark.usefixtures("isolated_env")


def test_the_wait_interval_defaults_to_a_fifth_of_the_poll_interval_and_never_exceeds_it() -> None:
    assert (
        wait_poll_s(load_config(None, [*BASE, "distributed.node.poll_interval=30"]).distributed.node) == 6.0
    )
    pinned = load_config(
        None, [*BASE, "distributed.node.poll_interval=1", "distributed.node.wait_poll_interval=0.2"]
    )
    pinned = pinned.distributed
    assert wait_poll_s(pinned.node) == 0.2
    with pytest.raises(ConfigError, match=r"distributed\.node\.wait_poll_interval"):
        load_config(
            None, [*BASE, "distributed.node.poll_interval=1", "distributed.node.wait_poll_interval=2"]
        )


def test_a_worker_waiting_for_its_global_polls_at_the_wait_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",  # the delta is on the bus when its sync step ends
        "distributed.sync.overlap_steps=1",  # the global of the sync at step 2 is due at step 3
        "distributed.node.poll_interval=30",
        "distributed.node.wait_poll_interval=0.05",
        "distributed.rounds.max_wait=20",
    )
    stop = threading.Event()

    def eager_master() -> None:  # a master that steps as soon as a delta lands
        while not stop.is_set():
            master.round()
            stop.wait(0.02)

    thread = threading.Thread(target=eager_master, daemon=True)
    thread.start()
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    try:
        with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
            Trainer(cfg, sync=coordinator, progress=False).train(max_steps=4)
    finally:
        stop.set()
        thread.join(10)
        coordinator.close()
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "no global answered" in line], lines  # never gave up waiting
    assert any("installed global model of outer step 1 at inner step 3" in line for line in lines), lines
    assert coordinator.poller.waiting == 0  # the wait ended, and with it the faster cadence


def test_a_master_whose_round_has_deltas_polls_at_the_wait_interval(tmp_path: Path) -> None:
    run = Run(
        tmp_path,
        "distributed.node.poll_interval=30",
        "distributed.master.collaborators=[w1,w2]",
        "distributed.rounds.initial_grace=60",
        "distributed.rounds.max_wait=600",
    )
    m = run.master()
    assert m.round() is False and m.next_poll() == 30  # nothing arrived: the configured interval
    run.delta("w1", 0)
    assert m.round() is False and m.waiting["waiting_on"] == ["w2"]
    assert m.next_poll() == 6.0  # the round has a delta and waits for w2's: a fifth of it
    run.delta("w2", 0)
    assert m.round() is True and m.outer_step == 1
    assert m.next_poll() == 6.0  # a new round, nothing in it yet, but it may come at any moment
    m.report.stepped_at -= 30
    assert m.next_poll() == 30  # an interval after the step: the configured interval


def test_for_one_interval_after_an_outer_step_the_master_polls_at_the_wait_interval(tmp_path: Path) -> None:
    """The next round's deltas may come at any moment after a step (as soon as the nodes have
    installed the global and run H steps); sleeping a whole poll_interval then left each round waiting
    for the master (a third of a round at 30 Mbit/s in bench/wan.py). One interval on: the usual cadence."""
    run = Run(tmp_path, "distributed.node.poll_interval=30", "distributed.master.collaborators=[w1,w2]")
    m = run.master()
    now = [1000.0]
    m.clock = lambda: now[0]
    assert m.round() is False and m.next_poll() == 30  # no step yet, nothing pending
    run.delta("w1", 0)
    run.delta("w2", 0)
    assert m.round() is True and m.outer_step == 1 and m.pending_count == 0
    assert m.next_poll() == 6.0
    now[0] += 29.0
    assert m.next_poll() == 6.0  # still within the interval after the step
    now[0] += 2.0
    assert m.next_poll() == 30  # past it: nothing came, nothing is pending


def test_a_master_of_short_rounds_polls_at_the_wait_interval_throughout(tmp_path: Path) -> None:
    """Rounds of a few poll intervals (bench/wan.py: 1.5 s at poll_interval 0.5 s): the next round's
    deltas land together, just past the interval after the step, and the usual cadence found them a
    quarter of a second late. Once the master's recent rounds are at most SHORT_ROUND_POLLS intervals
    long, it polls at the wait interval between steps; long rounds keep the usual cadence."""
    from speedtronic.diloco.master.report import SHORT_ROUND_POLLS

    run = Run(tmp_path, "distributed.node.poll_interval=30", "distributed.master.collaborators=[w1,w2]")
    m = run.master()
    now = [1000.0]
    m.clock = lambda: now[0]

    def rounds(count: int, gap: float) -> None:
        for _ in range(count):
            now[0] += gap
            seq = m.outer_step
            run.delta("w1", seq, base=seq)
            run.delta("w2", seq, base=seq)
            assert m.round() is True

    rounds(4, 30.0 * SHORT_ROUND_POLLS + 1)  # long rounds: the usual cadence an interval after a step
    now[0] += 31.0
    assert m.next_poll() == 30
    rounds(4, 30.0 * SHORT_ROUND_POLLS - 1)  # short ones (the median of the last 16 gaps turns)
    rounds(6, 30.0 * SHORT_ROUND_POLLS - 1)
    # Each round's deltas came 299 s after the step before: until one interval before that, nothing
    # can come, and the usual cadence finds an early one soon enough (quiet_left); then the wait interval.
    now[0] += 31.0
    assert m.next_poll() == 30
    now[0] += 30.0 * SHORT_ROUND_POLLS - 1 - 31.0 - 30.0 - 10.0
    assert m.next_poll() == 10.0  # the last slow poll lands where the quiet ends
    now[0] += 10.0
    assert m.next_poll() == 6.0


def test_the_quiet_after_a_step_is_learnt_from_when_rounds_began_to_come(tmp_path: Path) -> None:
    """Report.quiet_left: nothing before 3 rounds are known; then until one interval before the second
    earliest first arrival of the last FIRST_ARRIVALS rounds (one early straggler is not enough to undo
    it, two are); only a round's first new delta after the step counts."""
    from speedtronic.diloco.master.report import FIRST_ARRIVALS

    run = Run(tmp_path, "distributed.node.poll_interval=30", "distributed.master.collaborators=[w1,w2]")
    report = run.master().report
    t = 0.0

    def round_of(first: float, *later: float) -> None:
        nonlocal t
        report.stepped(t)
        for offset in (first, *later):
            report.heard(t + offset)
        t += 300.0

    round_of(200.0, 210.0)
    round_of(220.0)
    assert report.quiet_left(0.0, 30.0) == 0.0  # two rounds known: not yet
    round_of(210.0, 215.0, 290.0)
    assert list(report.first_arrivals) == [200.0, 220.0, 210.0]  # a round's first only
    assert report.quiet_left(0.0, 30.0) == 210.0 - 30.0
    assert report.quiet_left(100.0, 30.0) == 80.0 and report.quiet_left(185.0, 30.0) == 0.0
    round_of(1.0)  # a straggler of the round before, seen just after a step
    assert report.quiet_left(0.0, 30.0) == 200.0 - 30.0
    round_of(2.0)
    assert report.quiet_left(0.0, 30.0) == 0.0  # two early rounds: the wait interval throughout
    for _ in range(FIRST_ARRIVALS):
        round_of(250.0)
    assert report.quiet_left(0.0, 30.0) == 250.0 - 30.0  # they age out
