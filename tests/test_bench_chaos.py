"""bench/chaos.py at CI size: a master, a hot standby and 4 paced workers on a directory bus for 3 minutes,
a fault every 15 s from 15 s after the first outer step — up to seven, one of each kind the directory bus
has (the deck holds each kind once; seed 1 draws kill -9 of the master first, then the bus remounted
read-only for 20 s, then kill -9 of a worker, SIGSTOP of a worker past its lease, a worker joining, one
leaving, SIGSTOP of the master past its lease; how many fit depends on how fast the swarm starts). The
fault-free twin is left out here (the bench's figures need it; this test checks what must hold whatever
the timing).

Asserted: every delta id sent or seen on the bus is in one published round, rejected with a reason, or
left on the bus (none lost, none in two published rounds); the standby took over after the master's
kill -9 and took an outer step; no older epoch published after a takeover (the frozen master was fenced
and exited); the global's loss went down, also on the bench's own 256-batch scoring of the global
at the window's end. On failure the bench's lists are printed.
"""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import bench_env

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "chaos.py"


def test_chaos_soak_ci_size_keeps_every_delta_exactly_once(tmp_path: Path) -> None:
    env = bench_env()
    args = ["--minutes", "3", "--every", "15", "--workers", "4", "--bus", "file", "--seed", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args, "--no-twin", "--json", "--out", str(tmp_path / "soak")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    faults = result["faults"]
    lists = (
        f"faults: {json.dumps(faults, indent=1)}\nlost: {result['lost_ids']}\n"
        f"applied twice: {result['applied_twice_ids']}\nsent {result['deltas_sent']}, applied "
        f"{result['deltas_applied']}, rejected {result['deltas_rejected']}, left {result['deltas_left_on_bus']}\n"
        f"failovers: {result.get('failovers')}\n{done.stderr[-3000:]}"
    )
    print(json.dumps({k: v for k, v in result.items() if k not in ("faults",)}, indent=1))
    deck = ["kill_master", "bus_down", "kill_worker", "stop_worker", "join", "leave", "stop_master"]
    kinds = [f["kind"] for f in faults]  # the first deck in its seeded order; a second one may follow
    assert kinds[: len(deck)] == deck[: len(kinds)] and len(faults) >= 2, lists
    assert result["deltas_sent"] > 0 and result["deltas_applied"] > 0, lists
    assert result["deltas_lost"] == 0, lists
    assert result["deltas_applied_twice"] == 0, lists
    killed = [f for f in faults if f["kind"] == "kill_master" and not f.get("skipped") and not f.get("error")]
    if killed:  # drawn and applied: the standby took over and stepped
        rows = [r for r in result["failovers"] if r["kind"] == "kill_master"]
        assert rows and all(r["failover_s"] is not None for r in rows), lists
    assert result["stale_publishes"] == 0, lists
    # The workers' own accounts of time blocked on globals (their progress lines) are read: a master
    # killed or a bus down makes them wait, whatever else the run does.
    assert result["waited_for_global_s"] > 0 and 0 < result["waited_share"] < 1, lists
    assert result["outer_steps"] > 0 and result["final_val_loss"] < result["first_val_loss"], lists
    # The global at the window's end, scored on 256 validation batches (the head's loss is the master's 2).
    assert result["scored_val_batches"] == 256, lists
    assert result["final_val_loss_scored"] < result["first_val_loss"], lists


def test_worker_capacity_counts_the_workers_the_schedule_leaves() -> None:
    """Of 4 workers over 100 s: one leaves at 50 (−50 s), one is frozen 10→30 (−20 s), one is killed
    at 60 and rejoins at 70 (−10 s), a joiner comes at 80 (+20 s); outages and master faults take
    nothing. (400 − 50 − 20 − 10 + 20) / 400 = 0.85."""
    sys.path.insert(0, str(BENCH.parent))
    from chaos import worker_capacity

    faults = [
        {"t": 10.0, "kind": "stop_worker", "target": "w1", "end": 30.0},
        {"t": 40.0, "kind": "bus_down", "target": "file", "end": 60.0},
        {"t": 45.0, "kind": "kill_master", "target": "ma", "end": 50.0},
        {"t": 50.0, "kind": "leave", "target": "w2", "end": 50.2},
        {"t": 60.0, "kind": "kill_worker", "target": "w3", "end": 65.0, "rejoined_at": 70.0},
        {"t": 80.0, "kind": "join", "target": "j1", "end": 80.0},
    ]
    assert worker_capacity(faults, 4, 100.0) == pytest.approx(0.85)
    assert worker_capacity([], 4, 100.0) == 1.0
    # ... and the 0.15 it lacks, by the kinds that took it: the freeze 20 s, the leaver 50, the kill
    # 10, less the joiner's 20 (of 400 worker-seconds).
    from chaos import capacity_lost_by_fault

    assert capacity_lost_by_fault(faults, 4, 100.0) == {
        "leave": 0.125,
        "stop_worker": 0.05,
        "kill_worker": 0.025,
        "join": -0.05,
    }
    assert sum(capacity_lost_by_fault(faults, 4, 100.0).values()) == pytest.approx(0.15)


def test_steps_short_by_fault_splits_the_shortfall_by_the_fault_before_it() -> None:
    """Four workers, the twin's at 1 step/s each. A worker stopped 10–30 s trains nothing then (the
    schedule's, not counted); after the stop the three others train at half speed for 10 s (20 steps
    short, counted to stop_worker); a bus outage at 40 s lets them all train faster (8 steps ahead:
    a negative share); a leaver at 50 s is the schedule's again."""
    sys.path.insert(0, str(BENCH.parent))
    from chaos import steps_short_by_fault

    twin = [4.0] * 100
    soak = [4.0] * 10 + [3.0] * 20 + [2.0] * 10 + [4.8] * 10 + [3.0] * 50
    faults = [
        {"t": 10.0, "kind": "stop_worker", "target": "w1", "back": 30.0},
        {"t": 40.0, "kind": "bus_down", "target": "s3", "end": 60.0},
        {"t": 50.0, "kind": "leave", "target": "w2", "end": 50.2},
    ]
    assert steps_short_by_fault(faults, soak, twin, 4, 100.0) == {
        "stop_worker": {"faults": 1, "steps": 20, "share": 0.05},
        "start": {"faults": 0, "steps": 0, "share": 0.0},
        "leave": {"faults": 1, "steps": 0, "share": 0.0},
        "bus_down": {"faults": 1, "steps": -8, "share": -0.02},
    }
    assert steps_short_by_fault(faults, [], twin, 4, 100.0) == {}


def test_worker_time_counts_waits_by_their_reason_and_the_steps_and_wait_each_life_had() -> None:
    """Two lives of w0 (the second resumed at step 20; its last line after the window) and a master
    whose log is not a worker's."""
    sys.path.insert(0, str(BENCH.parent))
    from types import SimpleNamespace

    from chaos import worker_time

    status = (
        "2026-12-05T23:{} INFO speedtronic.diloco: DiLoCo node w0 · inner step {} · outer step 1 · last sync"
        " 2s ago · sent 0.01 MB in 1 deltas · 0 queued · waited {}s for globals"
    )
    gave_up = "2026-12-05T23:07:00 WARNING speedtronic.diloco: DiLoCo node w0: no global answered fragment(s) 0 {} of step 31"
    logs = {
        "w0": [status.format("06:00", 10, 0.0), gave_up.format("within 4s"), status.format("06:10", 40, 4.2)],
        "w0.2": [
            status.format("07:00", 30, 0.5),
            gave_up.format("(no new global for 3.9s, over 1.5 × the master's usual 2.5s)"),
            gave_up.format("within 4s"),
            status.format("07:20", 90, 8.1),
            status.format("09:00", 130, 20.0),  # after the window's end
        ],
        "ma": [status.format("06:00", 0, 0.0), status.format("06:30", 500, 9.0), gave_up.format("within 4s")],
    }
    until = datetime.datetime.fromisoformat("2026-12-05T23:08:00").timestamp()
    lives = {name: SimpleNamespace(name=name, role="master" if name == "ma" else "worker") for name in logs}
    t0 = datetime.datetime.fromisoformat("2026-12-05T23:05:00").timestamp()
    swarm = SimpleNamespace(lives=lives, log=lambda life: "\n".join(logs[life.name]), t0=t0)
    per_s = [0.0] * 180  # the window's seconds: w0 trains 30 steps in 60–70 s, w0.2 60 in 120–140 s
    per_s[60:70], per_s[120:140] = [3.0] * 10, [3.0] * 20
    assert worker_time(swarm, until) == {
        "waits_given_up": {"global_wait": 2, "master_quiet": 1},
        "inner_steps_trained": (40 - 10) + (90 - 30),
        "waited_for_global_s": 4.2 + 8.1,  # each life's total by the window's end
        "inner_steps_per_s": per_s,
    }


def test_the_loss_gap_from_tokens_alone_follows_the_twins_curve() -> None:
    """A twin whose loss falls by 0.1 per doubling of tokens (3.0 at 1,000, 2.9 at 2,000): a soak that
    applied 1,000 tokens where the twin applied 2,000 owes 3.0 / 2.9 − 1 = 3.45% to the tokens alone;
    one that applied as many owes nothing; the curve's first half and points past the twin's final
    tokens are not fitted."""
    sys.path.insert(0, str(BENCH.parent))
    from chaos import loss_gap_from_tokens

    curve = [{"tokens": t, "val_loss": 3.0 - 0.1 * math.log2(t / 1000)} for t in range(1000, 2001, 100)]
    curve += [{"tokens": 10, "val_loss": 9.0}, {"tokens": 5000, "val_loss": 0.1}, {"tokens": 1500}]
    assert loss_gap_from_tokens(curve, 1000, 2000) == pytest.approx(3.0 / 2.9 - 1, abs=1e-4)
    assert loss_gap_from_tokens(curve, 2000, 2000) == 0.0
    assert loss_gap_from_tokens(curve[:2], 1000, 2000) is None  # too few points
    assert loss_gap_from_tokens(curve, 1000, None) is None


def test_the_rise_after_a_fault_is_the_highest_loss_after_it_over_the_last_before() -> None:
    """A storm at t=100 (last loss before it 2.0, highest within 45 s 2.1: +0.1; a point at 150 is past
    the window); a kill at 200 after which the loss only falls (−0.05); a fault with no loss in the 10 s
    before it is not counted; two faults of one kind average."""
    sys.path.insert(0, str(BENCH.parent))
    from chaos import rise_after_faults

    curve = [
        {"t": 95, "val_loss": 2.0},
        {"t": 110, "val_loss": 2.1},
        {"t": 120, "val_loss": 2.05},
        {"t": 150, "val_loss": 3.0},
        {"t": 198, "val_loss": 2.0},
        {"t": 210, "val_loss": 1.95},
        {"t": 300, "val_loss": 1.9},
        {"t": 305},
    ]
    faults = [
        {"t": 100, "kind": "storm"},
        {"t": 200, "kind": "kill_worker"},
        {"t": 260, "kind": "kill_worker"},  # nothing in the 10 s before it
        {"t": 400, "kind": "join"},  # nothing after it
    ]
    assert rise_after_faults(curve, faults) == {"kill_worker": -0.05, "storm": 0.1}
    faults.append({"t": 205, "kind": "storm"})  # last before 2.0 (t=198), highest after 1.95 (t=210): −0.05
    assert rise_after_faults(curve, faults)["storm"] == pytest.approx(0.025)
    assert rise_after_faults([], faults) == {}


def test_goodput_that_weighed_leaves_out_the_deltas_the_probe_weighed_0_in_each_arm() -> None:
    """0.95 retained; the soak's probe weighed 40 of 1,000 deltas 0, the twin's 5 of 1,000: of what
    weighed, 0.95 × 0.96 / 0.995. No twin deltas: no figure."""
    sys.path.insert(0, str(BENCH.parent))
    from chaos import weighing_retained

    run = {"deltas_applied": 1000, "probe_weighed_0": 40}
    assert weighing_retained(0.95, run, {"deltas_applied": 1000, "probe_weighed_0": 5}) == round(
        0.95 * 0.96 / 0.995, 4
    )
    assert weighing_retained(0.95, run, {"deltas_applied": 0}) is None
    assert weighing_retained(None, run, {"deltas_applied": 1000}) is None
