"""`distributed.worker.global_wait`: how long a worker waits for the global that answers its delta
before it trains on (diloco/worker/overlap.py, coordinator.py). With a short wait a worker keeps
training through a bus outage or a master failover — its deltas keep coming, each a round staler —
where the default (rounds.max_wait) would idle it for minutes. Real coordinator, real directory bus,
a master that publishes nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.config.distributed import global_wait_s
from speedtronic.diloco import codec
from speedtronic.diloco.worker import Coordinator
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
        with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
            result = Trainer(cfg, sync=coordinator, progress=False).train(max_steps=8)
    finally:
        coordinator.close()
    gave_up = [r.getMessage() for r in caplog.records if "no global answered" in r.getMessage()]
    assert result.steps == 8
    assert len(gave_up) == 3 and "within 0.3s" in gave_up[0], gave_up  # due at steps 3, 5 and 7
    # Every delta was sent all the same, one per sync (the master applies them later, staler).
    assert coordinator.uploaded == [codec.delta_name("w1", s) for s in range(4)], coordinator.uploaded
