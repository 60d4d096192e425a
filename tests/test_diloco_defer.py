"""A worker much slower than the master's rounds takes the globals that come between its syncs at its
next sync (diloco/worker/defer.py): its delta is labelled with the global it was built on, so the master
weighs it by its staleness. The rule on fake clocks, then a real coordinator and master on a directory
bus where a faster peer's deltas make the master publish twice between the worker's syncs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from speedtronic import Trainer
from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.worker import Coordinator
from speedtronic.diloco.worker.defer import MIN_SYNCS, Deferral
from speedtronic.diloco.worker.head_pace import HeadPace
from speedtronic.diloco.worker.overlap import Global
from speedtronic.engine.build import build_model
from test_diloco_coordinator import bus_deltas, setup_run
from test_diloco_head_pace import Clock

pytestmark = pytest.mark.usefixtures("isolated_env")


def _global(step: int) -> Global:
    return Global(step, {}, None, -1)


def test_a_worker_defers_only_once_its_own_syncs_are_over_slow_factor_times_the_masters_rounds() -> None:
    clock = Clock()
    heads = HeadPace(clock)
    deferral = Deferral("s0", 2.0, heads, clock)
    for step in range(6):  # a global every 1 s: the master's usual round
        heads.saw(1, step)
        clock.now += 1.0
    assert not deferral.defer(_global(6), end=100)  # no syncs of its own yet: installed as it comes
    for _ in range(MIN_SYNCS + 1):  # a sync every 4 s: 4 x the master's round
        deferral.synced()
        clock.now += 4.0
    assert deferral.slow() == (4.0, 1.0)
    assert deferral.defer(_global(7), end=100) and deferral.defer(_global(8), end=100)
    assert not deferral.defer(_global(100), end=100)  # the run's end is installed at once
    assert deferral.deferred == 2 and deferral.release() == _global(8)  # the newest held
    assert deferral.release() is None
    assert Deferral("s0", None, heads, clock).slow() is None  # slow_factor null: never
    steady = Deferral("f0", 2.0, heads, clock)
    for _ in range(MIN_SYNCS + 1):  # a sync every 1.5 s: in step with the master, within the factor
        steady.synced()
        clock.now += 1.5
    assert steady.slow() is None and not steady.defer(_global(9), end=None)


def _peer_delta(bus: DirectoryBus, seq: int, base: int) -> None:
    """A faster peer's small delta (node f0) on global `base`."""
    manifest = bus.read_manifest()
    assert manifest is not None
    g = torch.Generator().manual_seed(seq)
    specs = codec.specs_from_json(manifest["params"])
    tensors = {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in specs.items()}
    meta = {"kind": "delta", "node": "f0", "seq": str(seq), "local_step": str(2 * (seq + 1))}
    meta.update(base_outer_step=str(base), tokens="64", final="0")
    bus.put_delta("f0", codec.delta_name("f0", seq), codec.encode(tensors, "fp32", meta))


@pytest.mark.parametrize("slow", [True, False], ids=["slow", "in-step"])
def test_the_globals_between_a_slow_workers_syncs_are_installed_after_its_delta(
    tmp_path: Path, slow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, bus, _, master = setup_run(
        tmp_path,
        "run.max_steps=16",  # the run ends at outer step 4: globals 1 and 2 are not its end
        "distributed.sync.inner_steps=4",
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.worker.async_global_poll=false",
        "distributed.rounds.min_deltas=1",
    )

    class Worker(Coordinator):
        def after_step(self, model, *, step, tokens):
            if step in (2, 3):  # the peer's delta makes the master publish a global between our syncs
                _peer_delta(bus, step - 2, master.outer_step)
                master.round()
                self.poller.poll_once()  # what the poller's thread would bring
            return super().after_step(model, step=step, tokens=tokens)

    worker = Worker(cfg, bus, "s0", bus.read_manifest())
    if slow:  # its pace on the fake clocks is the first test's; here the wiring around it
        worker.deferral.slow = lambda: (4.0, 1.0)  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        Trainer(cfg, sync=worker).train(max_steps=4)
    assert master.outer_step == 2
    sent = [d for d in bus_deltas(bus, codec.param_specs(build_model(cfg, 64))) if d.meta["node"] == "s0"]
    assert len(sent) == 1
    installs = [r.getMessage() for r in caplog.records if "s0: installed global model" in r.getMessage()]
    if slow:  # built on outer step 0, which it trained all 4 steps on; outer step 2 installed after it
        assert sent[0].meta["base_outer_step"] == "0" and worker.summary()["globals_deferred"] == 2
        assert installs[-1].endswith("of outer step 2 at inner step 4"), installs
        assert not any("at inner step 2" in m or "at inner step 3" in m for m in installs), installs
    else:  # each global installed as it came: the delta says outer step 2
        assert sent[0].meta["base_outer_step"] == "2" and worker.summary()["globals_deferred"] == 0
        assert any(m.endswith("of outer step 1 at inner step 2") for m in installs), installs
    assert worker.book.anchor_steps == [2]
