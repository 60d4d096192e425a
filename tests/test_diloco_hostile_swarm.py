"""Hostile peers against real processes: the master and the workers are the real CLI; the attacker is
this test, writing well-formed deltas of its own node into the directory bus (what a listed
collaborator can do). The in-process checks are in test_diloco_hostile.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from swarm_harness import TEXT, Swarm, assert_exactly_once, wait_until, write_config

pytestmark = pytest.mark.slow


def test_tiny_deltas_first_do_not_lock_real_workers_out(tmp_path: Path, swarm: Swarm) -> None:
    """Issue 24's lock-out: three 1e-6-scale deltas from one node before the workers start. Before the
    fix every honest delta after them was rejected as a norm outlier and the workers still exited 0."""
    # min_deltas 1: each tiny delta is a round of its own. late_join_wait: the run's end can come from
    # one worker's deltas alone (timing); the master then still waits for the other's.
    cfg = write_config(
        tmp_path, TEXT if TEXT.exists() else None, max_steps=20, min_deltas=1, late_join_wait=30.0
    )
    bus_dir = tmp_path / "bus"
    master = swarm.master(cfg, "--no-train")
    outer_step = swarm.outer_step
    wait_until(lambda: outer_step() >= 0, what="the master's first global")
    bus = DirectoryBus(str(bus_dir))
    manifest = bus.read_manifest()
    assert manifest is not None
    specs = codec.specs_from_json(manifest["params"])
    g = torch.Generator().manual_seed(0)
    for seq in range(3):
        tiny = {n: torch.randn(s.shape, generator=g) * 1e-6 for n, s in specs.items()}
        meta = {
            "kind": "delta",
            "node": "tiny",
            "seq": str(seq),
            "local_step": str(5 * (seq + 1)),
            "base_outer_step": str(outer_step()),
            "tokens": "64",
            "final": "1" if seq == 2 else "0",  # so the master does not wait for more from it
        }
        bus.put_delta("tiny", codec.delta_name("tiny", seq), codec.encode(tiny, "fp32", meta))
        # Applied (its high-water mark moves) even where the loss probe weighs it 0 and no step is made.
        wait_until(lambda s=seq: swarm.hwm("tiny") >= s, what=f"tiny delta {seq} applied")
    w1, w2 = swarm.worker(cfg, "w1"), swarm.worker(cfg, "w2")
    report = swarm.report(master, extra=[f"tiny/{codec.delta_name('tiny', s)}" for s in range(3)])
    print("\n" + report.table())
    rm = report.master
    assert_exactly_once(report, allow_left=False)
    assert report.all_sent and rm["rejected"] == [], rm["rejected"]  # no honest delta rejected
    assert sum(a.startswith("tiny/") for a in rm["applied"]) == 3
    losses = [v["val_loss"] for v in rm["global_val_loss"]]
    assert losses[-1] < min(losses[:4]) - 0.1, losses  # the workers' progress reached the global model
    assert "the master rejected" not in swarm.log(w1) + swarm.log(w2)


def test_a_worker_whose_deltas_are_all_rejected_exits_non_zero_saying_why(
    tmp_path: Path, swarm: Swarm
) -> None:
    """A master that refuses every delta (a size limit below any delta): the worker reads the reasons
    from head.json, logs them, and exits with an error after max_consecutive_rejections (1 here)."""
    # rejection_feedback_s: the master republishes head.json with the reasons within a second of a
    # poll that rejects, not a minute (the default): the test waits on the worker learning them.
    cfg = write_config(
        tmp_path,
        TEXT if TEXT.exists() else None,
        max_steps=20,
        max_consecutive_rejections=1,
        rejection_feedback_s=1.0,
    )
    master = swarm.master(cfg, "--no-train", "--set", "distributed.defences.max_delta_mb=0.0001")
    worker = swarm.worker(cfg, "w1")
    assert swarm.wait_exit(worker, 240) != 0
    log = swarm.log(worker)
    assert "the master rejected w1--00000000.safetensors" in log and "size limit" in log, log[-3000:]
    # One poll may bring several rejections (the master tells at most every rejection_feedback_s).
    assert re.search(r"error: DiLoCo: node w1: the master rejected its last \d+ deltas", log), log[-3000:]
    swarm.kill(master)
    # Exactly once with a worker that gave up: everything it sent was rejected (with the size reason)
    # or is still on the bus; nothing was applied.
    report = swarm.report(master)
    print("\n" + report.table())
    assert_exactly_once(report)
    assert report.applied == [] and report.rejected, report.lists()
    assert all("size limit" in r["reason"] for r in report.rejected), report.rejected
