"""A wait for a global ends once the master has been quiet far beyond its usual round
(diloco/worker/head_pace.py), not after the whole `distributed.worker.global_wait`: a master that is
down, failing over or fenced, or a bus that is out, answers nothing for the length of the fault, and
the waiting worker would idle its whole global_wait at each. The pace itself on a fake clock; the
overlap's wait with a worker whose master is quiet; and a real coordinator, poller and master on a
directory bus whose master stops after a few rounds."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.diloco.worker import Coordinator
from speedtronic.diloco.worker.head_pace import HeadPace
from speedtronic.diloco.worker.overlap import Overlap
from test_diloco_coordinator import BASE, setup_run
from test_diloco_global_wait import _Worker

pytestmark = pytest.mark.usefixtures("isolated_env")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_master_counts_as_stalled_past_one_and_a_half_of_its_median_round() -> None:
    clock = Clock()
    pace = HeadPace(clock)
    assert pace.stalled() is None  # no head seen yet
    for step in range(4):  # three intervals of 2 s: too few to tell
        pace.saw(1, step)
        clock.now += 2.0
    clock.now += 10.0
    assert pace.stalled() is None
    pace.saw(1, 4)  # the fourth interval (12 s): the median of 2, 2, 2, 12 is 2
    clock.now += 2.9
    assert pace.stalled() is None
    pace.saw(1, 4)  # the same head read again is not a round
    clock.now += 0.2
    assert pace.stalled() == "no new global for 3.1s, over 1.5 × the master's usual 2.0s"
    pace.saw(2, 3)  # a takeover's head: a higher epoch, a lower outer step, still a new head
    assert pace.stalled() is None


def test_an_overlap_wait_ends_at_once_when_the_master_is_stalled() -> None:
    class Stalled(_Worker):
        def master_stalled(self) -> str | None:
            return "no new global for 9.0s, over 1.5 × the master's usual 2.0s"

    cfg = load_config(
        None, [*BASE, "distributed.worker.global_wait=600", "distributed.node.poll_interval=0.01"]
    )
    worker, overlap = Stalled(cfg.distributed), Overlap(1, "w1")
    overlap.synced(0, seq=0, step=1)
    overlap.install_due(None, 2, worker)  # polls once (the pace is then current), then trains on
    assert overlap.late and worker.polls == 1 and not overlap.waiting()


def test_a_worker_trains_on_soon_after_its_master_stops_publishing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.sync.overlap_steps=1",  # each sync's global is due one step later
        "distributed.rounds.max_wait=600",
        "distributed.worker.global_wait=120",  # without the pace: two minutes idle after the master stops
    )
    stop = threading.Event()

    def master_loop() -> None:  # answers each delta until outer step 6, then is gone
        while not stop.is_set() and master.outer_step < 6:
            master.round()
            stop.wait(0.01)

    thread = threading.Thread(target=master_loop, daemon=True)
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    thread.start()
    try:
        with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
            result = Trainer(cfg, sync=coordinator, progress=False).train(max_steps=24)
    finally:
        stop.set()
        coordinator.close()
        thread.join(10)
    gave_up = [r.getMessage() for r in caplog.records if "no global answered" in r.getMessage()]
    assert result.steps == 24 and master.outer_step == 6
    assert coordinator.book.outer_step == 6 and coordinator.overlap.late, gave_up
    # The last wait ended on the master's quiet, not on global_wait's two minutes.
    assert gave_up and "no new global for" in gave_up[-1] and "within" not in gave_up[-1], gave_up
