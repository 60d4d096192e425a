"""A worker whose master does not answer keeps one delta on the bus and folds the rest into one
(diloco/worker/uploader.py, `hold`): a real Trainer, a real directory bus, the master in this process,
silent until the test lets it step."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from speedtronic import Trainer
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import TransientBusError
from speedtronic.diloco.worker import Coordinator
from test_diloco_coordinator import block_uploads, bus_deltas, setup_run

pytestmark = pytest.mark.usefixtures("isolated_env")

LATE = [
    "checkpoint.enabled=false",
    "distributed.sync.overlap_steps=1",  # the shipped value: the worker waits for its answer…
    "distributed.worker.global_wait=0.3",  # …briefly, then trains on ("late")
    "distributed.worker.upload_shutdown_timeout=5",
]
TOKENS_PER_DELTA = 2 * 4 * 16  # inner_steps × micro batch × block


class Recording(Coordinator):
    """Records the bus and the queue at given steps (inside training, before close() flushes)."""

    def __init__(self, *args, at: dict[int, object], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at, self.seen = at, {}

    def after_step(self, model, *, step, tokens):
        installed = super().after_step(model, step=step, tokens=tokens)
        if step in self.at:
            self.uploader.thread.join(0.5)  # let a running upload land (the thread holds or idles)
            with self.uploader._cond:
                queue = [(i.seq, i.tokens) for i in self.uploader.queue]
            self.seen[step] = (sorted(r.name for r in self.bus.list_deltas(None)), queue)
            action = self.at[step]
            if callable(action):
                action()
        return installed


def test_while_the_master_is_silent_the_next_deltas_fold_into_one_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    cfg, bus, manifest, master = setup_run(tmp_path, *LATE)
    global0 = {n: t.clone() for n, t in master.outer.weights.items()}
    worker = Recording(cfg, bus, "w1", manifest, at={10: None})
    trainer = Trainer(cfg, sync=worker, progress=False)
    trainer.train(max_steps=10)  # sync points 2, 4, 6, 8, 10; no global ever answers #0
    names, queue = worker.seen[10]
    assert names == ["w1--00000000.safetensors"], names  # one delta on the bus, not five
    assert queue == [(4, 4 * TOKENS_PER_DELTA)], queue  # #1–#4 wait as one delta
    assert worker.summary()["folded"] == 3
    # close() sends what waits; together the two deltas are the whole progress, exactly (fp32 codec)
    deltas = bus_deltas(bus, codec.specs_from_json(manifest["params"]))
    assert [d.int("seq") for d in deltas] == [0, 4]
    assert [d.int("tokens") for d in deltas] == [TOKENS_PER_DELTA, 4 * TOKENS_PER_DELTA]
    assert [d.meta["base_outer_step"] for d in deltas] == ["0", "0"]
    now = codec.snapshot(trainer.raw_model)
    for name in global0:
        total = sum(d.tensors[name] for d in deltas)
        assert torch.allclose(total, global0[name] - now[name], atol=1e-6), name


def test_the_masters_answer_ends_the_hold_and_every_delta_is_applied_once(tmp_path: Path) -> None:
    cfg, bus, manifest, master = setup_run(tmp_path, *LATE)
    # At step 8 the master comes back: it applies #0 and publishes; once the worker has installed that
    # global, it sends what it folded meanwhile as one delta, then, not at close().
    worker = Recording(cfg, bus, "w1", manifest, at={8: master.round, 14: None})
    Trainer(cfg, sync=worker, progress=False).train(max_steps=16)
    names_at_8, queue_at_8 = worker.seen[8]
    assert names_at_8 == ["w1--00000000.safetensors"] and [s for s, _ in queue_at_8] == [3]
    sent = worker.summary()["uploaded"]
    folded = codec.parse_delta_name(sent[1])[1]
    assert sent[0] == codec.delta_name("w1", 0) and folded >= 3, sent
    assert sent[1] in worker.seen[14][0], (sent, worker.seen[14])  # sent during training
    assert not {codec.delta_name("w1", s) for s in range(1, folded)} & set(sent), sent
    for _ in range(6):  # the master takes what is left, a delta of this node per round
        master.round()
    applied = [i.split("/")[-1] for i in master.ledger.applied_ids]  # ids are node/name
    assert sorted(applied) == sorted(sent) and len(applied) == len(set(applied)), (applied, sent)


def test_an_upload_still_retrying_counts_as_unanswered_so_the_next_deltas_fold(tmp_path: Path) -> None:
    # The master answered #0, then the bus fails the next uploads in a way the worker cannot confirm
    # (the upload errs and so does the check): #1 stays the queue's head, retried. It is this node's
    # newest delta out and unanswered, so the deltas after it fold instead of filling the queue (with
    # the shipped size 2 and `block`, training would stop until the bus came back).
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        *LATE,
        "distributed.bus.retry_initial=0.05",
        "distributed.bus.retry_max=0.2",
        "distributed.node.poll_interval=0.1",
    )
    real_exists, aside = bus.delta_exists, tmp_path / "w1-aside"

    def unknown(node: str, name: str) -> bool:
        raise TransientBusError("the check fails too: the upload may or may not have landed")

    def break_bus() -> None:
        (bus.root / "deltas" / "w1").rename(aside)  # #0 is there: a file takes the directory's place
        block_uploads(bus, "w1")
        bus.delta_exists = unknown

    def mend_bus() -> None:
        if aside.exists():
            (bus.root / "deltas" / "w1").unlink()
            aside.rename(bus.root / "deltas" / "w1")
        bus.delta_exists = real_exists

    safety = threading.Timer(30, mend_bus)  # the old code blocks at step 8: it must not hang the suite
    safety.start()
    # The master answers #0 at step 2 (the worker installs it at step 3); then the bus breaks.
    worker = Recording(cfg, bus, "w1", manifest, at={2: master.round, 3: break_bus, 10: mend_bus})
    try:
        Trainer(cfg, sync=worker, progress=False).train(max_steps=12)
    finally:
        safety.cancel()
    _, queue_at_10 = worker.seen[10]
    # #1 still retried at the head; #2–#4 wait as one delta (the old code blocked with #1, #2, #3)
    assert queue_at_10 == [(1, TOKENS_PER_DELTA), (4, 3 * TOKENS_PER_DELTA)], queue_at_10
    sent = worker.summary()["uploaded"]
    assert worker.summary()["folded"] >= 2
    # after #0 (answered), every token of the 12 steps is on the bus once: nothing lost, none twice
    after_0 = [d for d in bus_deltas(bus, codec.specs_from_json(manifest["params"])) if d.int("seq") > 0]
    assert sum(d.int("tokens") for d in after_0) == 5 * TOKENS_PER_DELTA, [d.meta for d in after_0]
    for _ in range(6):
        master.round()
    applied = [i.split("/")[-1] for i in master.ledger.applied_ids]
    assert sorted(applied) == sorted(sent) and len(applied) == len(set(applied)), (applied, sent)
