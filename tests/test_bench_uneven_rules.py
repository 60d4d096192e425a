"""bench/uneven_rules.py: the round's mean by each rule on hand-made deltas, and one small run whose arms
start from the same weights and differ once the slow workers' deltas come in."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_each_rule_makes_a_rounds_mean() -> None:
    sys.path.insert(0, str(BENCH))
    from uneven_rules import projected, round_mean

    full, short = {"w": torch.tensor([4.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}
    items = [(full, 20, 0), (short, 5, 0)]
    # Stretched x4 to a round's (norm 4, the full one's), weighed by tokens: (20·Δf + 5·4·Δs) / 25.
    assert round_mean(items, 20, "mean", [])["w"].tolist() == pytest.approx([3.2, 0.8])
    assert round_mean(items, 20, "shipped", [])["w"].tolist() == pytest.approx([3.2, 0.8])
    # Unstretched, the clip's cap is the lower median norm, the short delta's 1: the full one cut to 1.
    assert round_mean(items, 20, "unstretched", [])["w"].tolist() == pytest.approx([0.8, 0.2])
    # A delta 3 outer steps behind weighs 1/4 (shipped), 1/2 (sqrt) or 1 (flat).
    stale = [(full, 20, 0), (short, 20, 3)]
    assert round_mean(stale, 20, "mean", [])["w"].tolist() == pytest.approx([3.2, 0.2])
    assert round_mean(stale, 20, "sqrt", [])["w"][1].item() == pytest.approx(1 / 3)
    # Its share along the progress made since its global goes; a share against it stays.
    done = {"w": torch.tensor([1.0, 1.0])}
    assert projected({"w": torch.tensor([2.0, 0.0])}, done)["w"].tolist() == pytest.approx([1.0, -1.0])
    assert projected({"w": torch.tensor([-2.0, 0.0])}, done)["w"].tolist() == pytest.approx([-2.0, 0.0])


def test_a_small_run_differs_from_two_fast_workers_once_the_slow_ones_send() -> None:
    sys.path.insert(0, str(BENCH))
    from diloco import Setup
    from uneven_rules import run

    torch.set_num_threads(1)
    args = argparse.Namespace(
        inner_steps=4, rounds=6, schedule=3, n_layer=1, n_head=2, d_model=16, block=16, batch=2, lr=3e-3,
        val_batches=2,
    )  # fmt: skip
    setup = Setup(argparse.Namespace(**vars(args), steps=72, seed=0, text=None))
    fast2 = run(setup, args, "fast2")
    assert len(fast2) == 6 and fast2 == run(setup, args, "fast2")  # seeded: the same curve twice
    stale = run(setup, args, "stale:shipped")  # the slow workers' first delta comes with round 4
    assert stale[:3] == fast2[:3] and stale[3] != fast2[3]
    short = run(setup, args, "h:shipped")  # theirs every round
    assert short[0] != fast2[0]
    assert run(setup, args, "h:shipped+wall") != short  # their LR schedule in wall time moves them


def test_an_unknown_arm_or_rule_is_a_usage_error() -> None:
    import subprocess

    for arm in ("stale:typo", "fast3", "h:shipped,nope:mean"):
        done = subprocess.run(
            [sys.executable, str(BENCH / "uneven_rules.py"), "--arms", arm], capture_output=True, text=True
        )
        assert done.returncode == 2 and "unknown arm" in done.stderr, (arm, done.stderr[-500:])
