"""`distributed.worker.global_wait`: how long a worker waits for the global that answers its delta
before it trains on (diloco/worker/overlap.py, coordinator.py). With a short wait a worker keeps
training through a bus outage or a master failover — its deltas keep coming, each a round staler —
where the default (rounds.max_wait) would idle it for minutes. Real coordinator, real directory bus,
a master that publishes nothing."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.config.distributed import global_wait_s
from speedtronic.diloco import codec
from speedtronic.diloco.worker import Coordinator
from speedtronic.diloco.worker.overlap import Global, Overlap
from test_diloco_coordinator import BASE, setup_run

pytestmark = pytest.mark.usefixtures("isolated_env")


def test_the_wait_defaults_to_max_wait_and_never_exceeds_it() -> None:
    def wait(*sets: str) -> float:
        return global_wait_s(load_config(None, [*BASE, *sets]).distributed)

    assert wait("distributed.rounds.max_wait=600") == 600.0
    assert wait("distributed.rounds.max_wait=600", "distributed.worker.global_wait=5") == 5.0
    assert wait("distributed.rounds.max_wait=3", "distributed.worker.global_wait=5") == 3.0


def test_a_worker_with_a_short_global_wait_trains_on_when_no_global_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, bus, manifest, _ = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.sync.overlap_steps=1",  # each sync's global is due one step later
        "distributed.rounds.max_wait=600",  # without global_wait: ten minutes at every due step
        "distributed.worker.global_wait=0.3",
    )
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    try:
        with caplog.at_level(logging.DEBUG, logger="speedtronic.diloco"):
            result = Trainer(cfg, sync=coordinator, progress=False).train(max_steps=8)
    finally:
        coordinator.close()
    gave_up = [r.getMessage() for r in caplog.records if "no global answered" in r.getMessage()]
    assert result.steps == 8
    # Due at steps 3, 5 and 7: the first waits 0.3 s and gives up; no global came since, so the
    # others train on at once (a master that is down would cost a whole wait at every sync).
    assert len(gave_up) == 1 and "within 0.3s of step 3" in gave_up[0], gave_up
    assert coordinator.overlap.late
    on_at_once = [r.getMessage() for r in caplog.records if "still no global" in r.getMessage()]
    assert [m.rsplit("step ", 1)[1] for m in on_at_once] == ["5 trains on", "7 trains on"], on_at_once
    # Every delta was sent all the same, one per sync (the master applies them later, staler).
    assert coordinator.uploaded == [codec.delta_name("w1", s) for s in range(4)], coordinator.uploaded
    # The one wait is what the worker reports as time blocked on globals (its summary and progress
    # line): its 0.3 s, not a due step's or the later syncs' (they trained on at once).
    waited = coordinator.summary()["waited_for_global_s"]
    assert 0.3 <= waited < 0.3 + 5, waited
    progress = [r.getMessage() for r in caplog.records if "· inner step" in r.getMessage()]
    assert progress and progress[-1].endswith(f"· waited {coordinator.poller.waited_s:.1f}s for globals"), (
        progress
    )


class _Worker:
    """The Installer protocol (overlap.py) of a worker whose deltas nothing answers; counts its polls."""

    node = "w1"

    def __init__(self, dist: object) -> None:
        self.dist = dist
        self.polls = 0

    def delta_marks(self) -> tuple[set[str], int, int]:
        return set(), -1, 0

    def moved(self, g: Global, fragment: int) -> bool:
        return True

    def install_fragments(self, model: object, inner_step: int, g: Global, moved: set[int]) -> None:
        raise AssertionError("nothing answers this worker's deltas")

    def waiting_for_global(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def refresh(self, model: object, step: int) -> None:
        self.polls += 1

    def master_stalled(self) -> str | None:  # a master whose pace says nothing (too few rounds seen)
        return None


def test_a_late_worker_waits_again_once_a_global_comes() -> None:
    cfg = load_config(
        None, [*BASE, "distributed.worker.global_wait=0.2", "distributed.node.poll_interval=0.01"]
    )
    worker, overlap = _Worker(cfg.distributed), Overlap(1, "w1")
    overlap.synced(0, seq=0, step=1)
    overlap.install_due(None, 2, worker)  # waits (polling) the whole 0.2 s, then trains on
    assert overlap.late and worker.polls > 0 and not overlap.waiting()
    before = worker.polls
    overlap.synced(0, seq=1, step=3)
    overlap.install_due(None, 4, worker)  # late: no wait, no poll
    assert worker.polls == before and overlap.late and not overlap.waiting()
    overlap.hold(
        Global(outer_step=1, tensors={}, rounds=None, hwm=-1)
    )  # a global came (not this node's answer)
    assert not overlap.late
    overlap.synced(0, seq=2, step=5)
    overlap.install_due(None, 6, worker)  # waits again
    assert worker.polls > before and overlap.late
