"""bench/pool.py: pooling bench/diloco.py --json results over seeds, on synthetic result files (the
arithmetic of the issue's "pooled over 4 seeds", and that a defaults row pools with the same settings
run as a sweep arm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import pool  # noqa: E402

ARGS = {"n_layer": 4, "d_model": 128, "steps": 300, "inner_steps": 12, "workers": 4}


def write_run(path: Path, seed: int, corpora: dict[str, tuple[float, float, list[Any]]]) -> Path:
    results = [
        {"corpus": name, "single": single, "dp": dp, "rows": [["(a) single worker", single, 0], *rows]}
        for name, (single, dp, rows) in corpora.items()
    ]
    path.write_text(json.dumps({"args": {**ARGS, "seed": seed}, "results": results}))
    return path


def test_pooled_gap_weighs_each_seed_by_its_gap_and_names_arms_by_their_settings(tmp_path: Path) -> None:
    defaults_09 = "(c) DiLoCo defaults lr 0.7 mu 0.90 warm10 H 12 int8 clipped_mean"
    sweep_09 = "    sweep lr 0.7 mu 0.90 H 12 int8 warm10"
    sweep_08 = "    sweep lr 0.7 mu 0.80 H 12 int8 warm10"
    a = write_run(
        tmp_path / "a.json",
        0,
        {"text": (3.0, 2.0, [[defaults_09, 2.5, 1], [sweep_08, 2.2, 1], ["(a') one worker", 3.1, 1]])},
    )
    # seed 1: the old defaults as a sweep arm (the shipped defaults moved to mu 0.8 in between)
    b = write_run(
        tmp_path / "b.json",
        1,
        {
            "text": (
                2.2,
                2.0,
                [
                    [sweep_09, 2.2, 1],
                    ["(c) DiLoCo defaults lr 0.7 mu 0.80 warm10 H 12 int8 clipped_mean", 2.0, 1],
                ],
            )
        },
    )
    table = pool.pool([a, b])["4x128 S=300 H=12 k=4"]
    mu09 = table["lr 0.7 mu 0.90 warm10 H 12 int8"]["text"]
    # pooled: single 2.6, DP 2.0, arm 2.35 -> 0.25 / 0.6; per seed 50% and 0%
    assert mu09["pooled"] == pytest.approx(0.25 / 0.6)
    assert mu09["seeds"] == {0: pytest.approx(0.5), 1: pytest.approx(0.0)}
    mu08 = table["lr 0.7 mu 0.80 warm10 H 12 int8"]["text"]
    assert mu08["pooled"] == pytest.approx((2.6 - 2.1) / 0.6)
    assert table["control k=1"]["text"]["seeds"] == {0: pytest.approx(-0.1)}  # one seed ran it

    # A later run of seed 0 against --known baselines adds an arm and keeps seed 0's others.
    c = write_run(
        tmp_path / "c.json", 0, {"text": (3.0, 2.0, [["    sweep lr 0.7 mu 0.70 H 12 int8 warm10", 2.4, 1]])}
    )
    merged = pool.pool([a, b, c])["4x128 S=300 H=12 k=4"]
    assert merged["lr 0.7 mu 0.70 warm10 H 12 int8"]["text"]["seeds"] == {0: pytest.approx(0.6)}
    assert merged["lr 0.7 mu 0.90 warm10 H 12 int8"] == table["lr 0.7 mu 0.90 warm10 H 12 int8"]

    shown = subprocess.run(
        [sys.executable, str(BENCH / "pool.py"), str(a), str(b)], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("lr 0.7 mu 0.90"))
    assert "42% (2)" in line and "50% / 0%" in line, shown.stdout


def test_streaming_rows_pool_by_fragments_overlap_and_layout(tmp_path: Path) -> None:
    rows = [["(f) streaming P=4 tau=1", 2.6, 1], ["(f) streaming P=4 tau=1 elements", 2.4, 1]]
    a = write_run(tmp_path / "a.json", 0, {"text": (3.0, 2.0, rows)})
    b = write_run(tmp_path / "b.json", 1, {"text": (2.5, 2.0, [[r[0], r[1] - 0.3, 1] for r in rows])})
    table = pool.pool([a, b])["4x128 S=300 H=12 k=4"]
    layers, elements = table["streaming P=4 tau=1"]["text"], table["streaming P=4 tau=1 elements"]["text"]
    # pooled: single 2.75, DP 2.0; layers 2.45 -> 0.3 / 0.75, elements 2.25 -> 0.5 / 0.75
    assert layers["pooled"] == pytest.approx(0.3 / 0.75) and elements["pooled"] == pytest.approx(0.5 / 0.75)
    assert elements["seeds"] == {0: pytest.approx(0.6), 1: pytest.approx(0.8)}
