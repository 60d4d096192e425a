"""Streaming DiLoCo with real processes (`speedtronic master` + `speedtronic worker` on a directory bus):
the model in two fragments synced in turn (the shipped layout, elements: each fragment every other
element of every tensor), with overlapped installs, and a worker SIGKILLed between two fragment syncs
and restarted from its checkpoint.

Asserted: every delta id exactly once (tests/swarm_harness.py; on failure the full lists are printed),
each node sending one delta per fragment sync point, the master's per-fragment rounds adding up to its
outer steps, the largest upload about half a whole-model delta, and the global model learning.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from speedtronic.diloco import codec
from swarm_harness import Swarm, assert_exactly_once, supported, text_path, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_env")]

MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32}
DATA = {"block_size": 32, "micro_batch_size": 4, "val_batches": 2}


def whole_delta_bytes(config: Path) -> int:
    from speedtronic.config import load_config
    from speedtronic.diloco import codec
    from speedtronic.engine.build import build_model

    cfg = load_config(config, [])
    return codec.wire_bytes(codec.param_specs(build_model(cfg, 256)), cfg.distributed.sync.delta_codec)


def test_two_fragments_with_overlap_sync_in_turn_exactly_once(tmp_path: Path, swarm: Swarm) -> None:
    # 16 steps at H=4 in 2 fragments: sync points 2, 4, …, 16 (fragment 1 at 2, 6, …; fragment 0 at
    # 4, 8, …): up to 8 deltas per node, each global installed one step after its sync (overlap_steps 1).
    # min_deltas 2: every round waits for both nodes. Without it the master (training too) closes its first
    # rounds alone while w1 still imports torch under load, and a w1 that joins late sends fewer deltas.
    cfg = write_config(
        tmp_path, text_path(), 16, MODEL, DATA, inner_steps=4, fragments=2, overlap_steps=1, min_deltas=2
    )
    master = swarm.master(cfg)
    worker = swarm.worker(cfg, "w1")
    report = swarm.report(master)
    rm, rw = report.master, swarm.result(worker)
    print("\n" + report.table())
    assert_exactly_once(report, allow_left=False)
    for summary in (rw, rm["worker"]):
        # Numbered without a gap, but for the deltas a node folded into a later one while the master
        # had not answered (a wait for a global that gave up under CI's load: the folded one's number
        # is not sent); a node behind the other may stop a sync or two early, once the run's end
        # (outer step 8) is reached (its last delta then says final).
        node, sent = summary["node"], summary["uploaded"]
        parsed = [codec.parse_delta_name(name) for name in sent]
        seqs = [seq for _, seq in parsed]
        assert all(owner == node for owner, _ in parsed) and seqs == sorted(set(seqs)), sent
        assert len(sent) + summary["folded"] + summary["dropped"] == seqs[-1] + 1, (sent, summary["folded"])
        assert seqs[-1] + 1 >= 6, sent
        assert summary["fragments"] == 2
    head = swarm.head()
    assert head is not None and head["fragments"]["count"] == 2
    rounds = head["fragments"]["rounds"]
    # Each outer step stepped one fragment (nodes out of phase wait for their peers: fragments.hold_back);
    # a final pick of an earlier global moves both in one step.
    assert min(rounds) >= 2 and sum(rounds) <= rm["outer_step"] + 1, (rounds, rm["outer_step"])
    whole = whole_delta_bytes(cfg)
    for summary in (rw, rm["worker"]):
        peak = summary["peak_delta_bytes"]
        print(f"{summary['node']}: peak upload {peak} B, a whole-model delta {whole} B ({peak / whole:.2f})")
        assert peak < 0.6 * whole, (peak, whole)
    losses = [v["val_loss"] for v in rm["global_val_loss"]]
    assert losses[-1] < losses[0], losses
    assert "installed global model of outer step" in swarm.log(worker) and "(fragment " in swarm.log(worker)


def test_a_worker_killed_between_fragment_syncs_resumes_exactly_once(tmp_path: Path, swarm: Swarm) -> None:
    # H=6 in 2 fragments: syncs at 3 (fragment 1), 6 (fragment 0), 9, 12, …; checkpoints every 5 steps.
    # w1 is killed once it has saved step 10, so the resumed life starts between two fragment syncs.
    lease = supported(node_lease_s=6.0)  # a SIGKILLed node's id is free again soon
    # min_deltas 2: every round waits for w1 (the master trains too). With 1, the master's node, started
    # first, reached the run's end alone under CI's load: w1 installed it, ended at its sync of step 9
    # and was killed after it had exited (resumed at step 9, a sync step).
    cfg = write_config(
        tmp_path,
        text_path(),
        24,
        MODEL,
        DATA,
        inner_steps=6,
        fragments=2,
        min_deltas=2,
        late_join_wait=60.0,
        **lease,
    )
    master = swarm.master(cfg)
    worker = swarm.worker(cfg, "w1")
    swarm.wait_log(worker, r"checkpoint step 10 ")
    killed = swarm.kill(worker)
    assert killed.rc == -9, swarm.log(killed)[-3000:]  # killed while training, not after its end
    again = swarm.restart(killed, until_accepted=120)
    report = swarm.report(master)
    print("\n" + report.table())
    assert_exactly_once(report, allow_left=False)
    match = swarm.wait_log(again, r"resumed from \S+ at step (\d+)")
    assert int(match[1]) % 3 != 0, match[0]  # between two fragment syncs (every 3 steps)
    rm = report.master
    head = swarm.head()
    # One fragment per outer step (a final pick of an earlier global moves both: one step, +1 each).
    rounds = head["fragments"]["rounds"] if head else []
    assert min(rounds) >= 2 and sum(rounds) <= rm["outer_step"] + 1, (rounds, rm["outer_step"])
    w1 = sorted(i for i in rm["applied"] if i.startswith("w1/"))
    assert len(w1) == len(set(w1)) and len(w1) >= 4, w1


def test_the_shipped_overlap_installs_each_global_one_step_after_its_sync(
    tmp_path: Path, swarm: Swarm
) -> None:
    """The shipped overlap_steps (1): a worker never runs ahead of the master. Each global is installed
    at the inner step after the sync it answers, however slow the master is, so no delta is built on
    an old global (bench/late_globals.py: every step of lag costs; unbounded, the outer momentum
    diverged over a slow link, bench/wan.py)."""
    import re

    import yaml

    # min_deltas 2: every round waits for w1 (up to max_wait). Without it the master, training too, closed
    # its first rounds alone while w1 was still starting under CI's load, and w1 joined at outer step 2
    # with two syncs left (CI: uploaded ['w1--00000000…', 'w1--00000001…']).
    cfg = write_config(tmp_path, text_path(), 16, MODEL, DATA, inner_steps=4, min_deltas=2)
    doc = yaml.safe_load(cfg.read_text())
    del doc["distributed"]["sync"]["overlap_steps"]  # the harness pins 0 for its run-ahead swarms
    cfg.write_text(yaml.safe_dump(doc))
    master = swarm.master(cfg)
    worker = swarm.worker(cfg, "w1")
    report = swarm.report(master)
    rm, rw = report.master, swarm.result(worker)
    print("\n" + report.table())
    assert_exactly_once(report, allow_left=False)
    installs = [
        (int(step), int(at))
        for step, at in re.findall(
            r"installed global model of outer step (\d+) at inner step (\d+)", swarm.log(worker)
        )
    ]
    # At inner step 0 a worker installs the newest global it finds (a late joiner's may already be past
    # outer step 0: the master trains too); every later install answers one of its syncs.
    later = [(s, at) for s, at in installs if at > 0]
    assert later and all(at % 4 == 1 for _, at in later), installs  # sync at 4k, installed at 4k + 1
    assert len(rw["uploaded"]) >= 3, rw["uploaded"]
    losses = [v["val_loss"] for v in rm["global_val_loss"]]
    assert losses[-1] < losses[0], losses
