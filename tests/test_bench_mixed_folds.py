"""bench/mixed_folds.py: who is cut off when, what a folded delta may claim, and one small run whose arms
match the twin until the first cut-off and differ after it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _args(**overrides: object) -> argparse.Namespace:
    values = dict(
        workers=4,
        inner_steps=2,
        rounds=6,
        start=2,
        every=3,
        cut=2,
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


def test_cut_offs_rotate_and_rejoin_after_r_sync_points() -> None:
    sys.path.insert(0, str(BENCH))
    from mixed_folds import claimed_rounds, cut_off

    args = _args(rounds=20, start=2, every=4, cut=2)
    assert cut_off(args, 1, 3) == (set(), None)
    assert [cut_off(args, i, 3) for i in (2, 3, 4, 5)] == [
        ({0, 1}, 4),
        ({0, 1}, 4),
        ({0, 1}, 4),
        (set(), None),
    ]
    assert cut_off(args, 6, 3) == ({2, 3}, 8) and cut_off(args, 10, 3) == ({0, 1}, 12)  # in turn, 4 workers
    assert (claimed_rounds("spanned", 4), claimed_rounds("one", 4), claimed_rounds("drop", 4)) == (
        4.0,
        1.0,
        1.0,
    )


def test_a_small_run_matches_the_twin_until_the_first_cut_off() -> None:
    sys.path.insert(0, str(BENCH))
    import torch
    from diloco import Setup
    from mixed_folds import run

    torch.set_num_threads(1)
    args = _args()
    setup = Setup(argparse.Namespace(**vars(args), steps=200, seed=0, text=None))
    twin = run(setup, args, None, 2)
    arms = {rule: run(setup, args, rule, 2) for rule in ("spanned", "one", "drop")}
    for losses in arms.values():
        assert len(losses) == 6 and losses[:2] == twin[:2]  # rounds 0–1: nobody cut off yet
    assert arms["spanned"][3:] != twin[3:] and arms["drop"][3:] != arms["spanned"][3:]  # round 3: the fold
