"""bench/stale_rounds.py: each rule's outer step on a round of stale deltas, and one small run whose
arms match the twin until the first window of late globals and differ inside it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _outer(momentum: float = 0.8):
    from speedtronic.diloco.outer import OuterOptimizer

    outer = OuterOptimizer({"w": torch.zeros(3)}, lr=1.0, momentum=momentum)
    outer.step({"w": torch.ones(3)})  # m = 1: a momentum to feed, cut or keep
    return outer


def test_each_rule_steps_a_round_one_step_behind() -> None:
    sys.path.insert(0, str(BENCH))
    from stale_rounds import outer_step

    mean = {"w": torch.full((3,), 2.0)}
    results = {}
    for rule in ("full", "scaled", "cut", "freeze"):
        outer = _outer()
        before = outer.weights["w"].clone()
        outer_step(outer, mean, stale=1, rule=rule)
        results[rule] = (before - outer.weights["w"])[0].item(), outer.momentum_buffers["w"][0].item()
        assert outer.momentum == 0.8  # a rule that cuts the momentum puts it back after the round
    assert results["full"] == pytest.approx((2 + 0.8 * 2.8, 2.8))  # m = 0.8·1 + 2; θ −= Δ̄ + μ·m
    assert results["scaled"] == pytest.approx((1 + 0.8 * 1.8, 1.8))  # Δ̄ × 1/2
    assert results["cut"] == pytest.approx((1 + 0.3 * 1.3, 1.3))  # μ = 0.8 − 1/2
    assert results["freeze"] == pytest.approx((1.0, 1.0))  # no momentum in the step; m as it was
    fresh = _outer()
    outer_step(fresh, mean, stale=0, rule="freeze")  # a fresh round steps as shipped, whatever the rule
    assert fresh.momentum_buffers["w"][0].item() == pytest.approx(2.8)
    with pytest.raises(SystemExit, match="unknown rule"):
        outer_step(_outer(), mean, stale=1, rule="nope")


def test_a_small_run_matches_the_twin_until_the_first_window() -> None:
    sys.path.insert(0, str(BENCH))
    from diloco import Setup
    from stale_rounds import run, summarise

    torch.set_num_threads(1)
    args = argparse.Namespace(
        workers=3, inner_steps=2, rounds=8, start=3, every=4, window=2, lag=3, probe=True,
        n_layer=1, n_head=2, d_model=16, block=16, batch=2, lr=3e-3, val_batches=2,
    )  # fmt: skip
    setup = Setup(argparse.Namespace(**vars(args), steps=16, seed=0, text=None))
    twin = run(setup, args, None)
    scaled, full = run(setup, args, "scaled"), run(setup, args, "full")
    assert len(twin) == 8 and scaled[:4] == twin[:4] == full[:4]  # globals come late from round 3 on
    assert scaled[4:] != twin[4:] and full[4:] != scaled[4:]  # round 4's deltas are a step behind
    excess = [a - b for a, b in zip(full, twin, strict=True)]
    peak, tail = summarise(excess, args)  # windows at rounds 3 and 7, each to the run's end
    assert peak == pytest.approx((max(excess[3:8]) + excess[7]) / 2) and tail == pytest.approx(
        sum(excess) / 8
    )
