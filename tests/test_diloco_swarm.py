"""DiLoCo runs with real CLI processes over a directory bus that peers have tampered with, and a
collaborator that joins late.

The bus is seeded with attacks before the master starts (a node directory symlinked outside the
bus, a symlinked delta, a FIFO and a directory named like deltas, garbage under a huge sequence
number for the late worker's node); the master trains alone, reaches the run's end, and a worker
started only then still has every delta applied. Nothing outside the bus changes, the garbage is
rejected with a logged reason, and `hub status` shows nothing pending at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarm_harness import Swarm, assert_exactly_once, wait_until, write_config
from test_diloco_attacks import tree_digest

pytestmark = pytest.mark.slow


def test_a_late_joiner_counts_on_a_tampered_bus(tmp_path: Path, swarm: Swarm) -> None:
    from speedtronic.diloco.launch import run_status

    # late_join_wait: the late worker must start (import torch) and send within it; 30 s was not
    # always enough with four test workers on two cores.
    cfg = write_config(tmp_path, None, max_steps=10, late_join_wait=60.0, max_wait=60.0)
    bus_dir = tmp_path / "bus"
    deltas = bus_dir / "deltas"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim--00000000.safetensors").write_bytes(b"precious")
    (outside / "keep.txt").write_text("keep me")
    deltas.mkdir(parents=True)
    (deltas / "victim").symlink_to(outside, target_is_directory=True)
    (deltas / "w2").mkdir()
    (deltas / "w2" / "w2--00000000.safetensors").symlink_to(outside / "keep.txt")
    (deltas / "w3").mkdir()
    os.mkfifo(deltas / "w3" / "w3--00000000.safetensors")
    (deltas / "w4" / "w4--00000000.safetensors").mkdir(parents=True)
    (deltas / "w1").mkdir()
    (deltas / "w1" / "w1--99999999.safetensors").write_bytes(b"garbage" * 64)
    before = tree_digest(outside)

    master = swarm.master(cfg)
    # 10 steps / H=5: the run ends at outer step 2, which the master reaches on its own deltas.
    wait_until(lambda: swarm.outer_step() >= 2, what="the master's own two outer steps")
    worker = swarm.worker(cfg, "w1")
    report = swarm.report(master, extra=["w1/w1--99999999.safetensors"])
    rw, rm = swarm.result(worker), report.master
    print("\n" + report.table())

    assert_exactly_once(report, allow_left=False)
    assert rw["uploaded"] == ["w1--00000000.safetensors", "w1--00000001.safetensors"]
    master_deltas = {f"master/{n}" for n in rm["worker"]["uploaded"]}
    assert sorted(rm["applied"]) == sorted(master_deltas | {f"w1/{n}" for n in rw["uploaded"]})
    assert [r["id"] for r in rm["rejected"]] == ["w1/w1--99999999.safetensors"]
    assert rm["outer_step"] >= 3 and rm["finished"] == ["master", "w1"]
    assert "run complete at outer step" in swarm.log(master)
    assert tree_digest(outside) == before  # nothing outside the bus read, changed or deleted
    status = run_status(swarm.repo, None)
    assert all(c["pending"] == [] and c["new_on_bus"] == [] for c in status["collaborators"]), status
    print(f"\nlate joiner: {len(rm['applied'])} deltas applied, {len(rm['rejected'])} rejected")
