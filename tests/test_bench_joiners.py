"""bench/joiners.py: a joiner's schedule under each rule, and one small run whose arms match the twin
until the first joiner comes and differ after it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _args(**overrides: object) -> argparse.Namespace:
    values = dict(
        workers=3,
        inner_steps=2,
        rounds=6,
        start=2,
        every=3,
        n_layer=1,
        n_head=2,
        d_model=16,
        block=16,
        batch=2,
        lr=3e-3,
        val_batches=2,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_a_joiners_factor_under_each_rule() -> None:
    sys.path.insert(0, str(BENCH))
    from joiners import joiner_factor

    def run(step: int) -> float:
        return 1.0 - step / 1000

    fresh = joiner_factor("fresh", run, at=500, warmup=100)
    aligned = joiner_factor("aligned", run, at=500, warmup=100)
    short = joiner_factor("aligned40", run, at=500, warmup=100)
    assert [fresh(j) for j in (0, 50)] == [run(0), run(50)]  # its own step 0
    assert aligned(0) == run(500) / 100 and aligned(99) == run(599) and aligned(200) == run(700)
    assert short(0) == run(500) / 40 and short(39) == run(539)


def test_a_small_run_matches_the_twin_until_the_first_joiner() -> None:
    sys.path.insert(0, str(BENCH))
    import torch
    from diloco import Setup
    from joiners import run

    torch.set_num_threads(1)
    args = _args()
    setup = Setup(argparse.Namespace(**vars(args), steps=12, seed=0, text=None))
    twin = run(setup, args, None)
    arms = {rule: run(setup, args, rule) for rule in ("fresh", "aligned")}
    for losses in arms.values():
        assert len(losses) == 6 and losses[:2] == twin[:2]  # rounds 0–1: nobody replaced yet
    assert arms["fresh"][2:] != twin[2:] and arms["aligned"][2:] != arms["fresh"][2:]  # round 2: a joiner
