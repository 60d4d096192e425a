"""The coordinator's background threads across train() calls, on a real directory bus whose uploads (or
polls) wait at a gate the test opens: a close() that times out on a running upload leaves that one
uploader running, the next train() takes it up again instead of starting a second one beside it, and so
every delta reaches the bus exactly once, in order, and nothing of the local progress is lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic import Trainer
from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.worker import Coordinator
from test_diloco_coordinator import bus_deltas, setup_run

pytestmark = pytest.mark.usefixtures("isolated_env")


class GatedBus(DirectoryBus):
    """A real directory bus on which uploads (`put_delta`) and head reads (`read_head`) from threads
    other than the training thread wait at a gate until the test opens it."""

    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self.gate = threading.Event()
        self.lock = threading.Condition()
        self.parked = 0  # calls waiting at the gate now
        self.busiest = 0  # the most calls in progress at once
        self.busy = 0
        self.puts: list[str] = []  # the uploads that completed, in order

    def _pass_gate(self) -> bool:
        if threading.current_thread() is threading.main_thread():
            return False
        with self.lock:
            self.parked += 1
            self.busy += 1
            self.busiest = max(self.busiest, self.busy)
            self.lock.notify_all()
        self.gate.wait(60)
        with self.lock:
            self.parked -= 1
        return True

    def _leave(self, gated: bool) -> None:
        with self.lock:
            self.busy -= gated

    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        gated = self._pass_gate()
        try:
            super().put_delta(node, name, data, prune=prune)
            with self.lock:
                self.puts.append(name)
        finally:
            self._leave(gated)

    def read_head(self) -> dict[str, Any] | None:
        gated = self._pass_gate()
        try:
            return super().read_head()
        finally:
            self._leave(gated)

    def wait_parked(self, thread_name: str) -> int:
        """Until every live thread named `thread_name` waits at the gate; how many there are."""
        deadline = time.monotonic() + 60
        with self.lock:
            while True:
                live = sum(t.name == thread_name and t.is_alive() for t in threading.enumerate())
                if live and self.parked >= live:
                    return live
                assert time.monotonic() < deadline, f"{thread_name}: {live} threads, {self.parked} parked"
                self.lock.wait(0.02)


class Gatekeeper:
    """A training hook: at `wait_at` it waits until the node's threads of that kind are all parked at
    the gate; at `open_at` it opens the gate (first calling `before_open`)."""

    def __init__(self, bus: GatedBus, thread_name: str, wait_at: int, open_at: int | None = None) -> None:
        self.bus, self.thread_name, self.wait_at, self.open_at = bus, thread_name, wait_at, open_at
        self.seen: list[int] = []

    def on_step_end(self, payload: dict[str, Any]) -> None:
        if payload["step"] == self.wait_at:
            self.seen.append(self.bus.wait_parked(self.thread_name))
        if payload["step"] == self.open_at:
            self.bus.gate.set()


def test_an_upload_outliving_close_is_resumed_not_duplicated(tmp_path: Path) -> None:
    cfg, _, manifest, master = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.worker.async_global_poll=false",
        "distributed.worker.upload_shutdown_timeout=0.05",  # the first close gives up on the upload
    )
    global0 = {n: t.clone() for n, t in master.outer.weights.items()}
    bus = GatedBus(tmp_path / "bus")
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    trainer = Trainer(cfg, sync=coordinator, progress=False)
    first = Gatekeeper(bus, "diloco-w1-upload", wait_at=2)
    trainer.events.add("gate", first)
    trainer.train(max_steps=2)  # delta #0 (step 2) is being uploaded when close() gives up on it
    assert (
        first.seen == [1]
        and coordinator.uploaded == []
        and [i.seq for i in coordinator.uploader.queue] == [0]
    )

    # The second train() ends with a generous flush; at step 5 (delta #1 queued at step 4) the test
    # waits until every uploader is parked at the gate, then opens it.
    coordinator.dist = cfg.distributed.model_copy(
        update={"worker": cfg.distributed.worker.model_copy(update={"upload_shutdown_timeout": 60.0})}
    )
    second = Gatekeeper(bus, "diloco-w1-upload", wait_at=5, open_at=5)
    trainer.events.add("gate", second)
    trainer.train(max_steps=6)  # deltas #1 (step 4) and #2 (step 6)

    names = [codec.delta_name("w1", seq) for seq in range(3)]
    on_bus = sorted(bus.list_own_deltas("w1"))
    report = (
        f"uploaders parked at step 5: {second.seen}; puts {bus.puts}; uploaded {coordinator.uploaded}; "
        f"on the bus {on_bus}; left queued {[i.seq for i in coordinator.uploader.queue]}; "
        f"most uploads at once {bus.busiest}"
    )
    assert second.seen == [1], report  # the same uploader, resumed: never a second one beside it
    assert bus.puts == names and coordinator.uploaded == names and on_bus == names, report
    assert not coordinator.uploader.queue and bus.busiest == 1, report
    # No local progress lost: the deltas sum to θ_global − θ_now exactly (fp32 codec, no new global).
    now = codec.snapshot(trainer.raw_model)
    deltas = bus_deltas(bus, codec.specs_from_json(manifest["params"]))
    for name in global0:
        total = sum(d.tensors[name] for d in deltas)
        assert torch.allclose(total, global0[name] - now[name], atol=1e-6), (name, report)
    assert coordinator.join(30), "the uploader did not end after close()"


def test_a_poll_outliving_close_is_resumed_not_duplicated(tmp_path: Path) -> None:
    cfg, _, manifest, _ = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.worker.upload_shutdown_timeout=0.05",
    )
    bus = GatedBus(tmp_path / "bus")
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    trainer = Trainer(cfg, sync=coordinator, progress=False)
    trainer.events.add("gate", Gatekeeper(bus, "diloco-w1-poll", wait_at=2))
    trainer.train(max_steps=2)  # the poller is waiting on the bus when close() stops it
    second = Gatekeeper(bus, "diloco-w1-poll", wait_at=5, open_at=5)
    trainer.events.add("gate", second)
    trainer.train(max_steps=6)
    assert second.seen == [1] and bus.busiest == 1, f"pollers {second.seen}, most at once {bus.busiest}"
    assert coordinator.join(30), "the poller did not end after close()"


def test_a_global_already_installed_is_not_installed_again(tmp_path: Path) -> None:
    """A poll that overlapped an install can bring the same global once more: it is not installed twice."""
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.worker.async_global_poll=false",
    )
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    trainer = Trainer(cfg, sync=coordinator, progress=False)
    trainer.train(max_steps=1)
    assert coordinator.book.installs == 1
    before = codec.snapshot(trainer.raw_model)
    coordinator.poller.incoming = (coordinator.outer_step, dict(master.outer.weights))
    installed = coordinator.after_step(trainer.raw_model, step=3, tokens=trainer.tokens_seen)  # no sync point
    coordinator.close()
    assert installed is False and coordinator.book.installs == 1
    after = codec.snapshot(trainer.raw_model)
    assert all(torch.equal(before[n], after[n]) for n in before)
