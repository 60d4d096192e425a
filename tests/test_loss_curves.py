"""Refactors keep losses identical: the seeded fp32 loss curves of tests/loss_curves.py, bitwise.

A change that moves them must say so and why, and re-record them (`python tests/loss_curves.py
--record`). On a CPU whose instruction set has no record, fp32 kernels may round differently, so the
curves are compared to another machine's within a relative 1e-4 instead, and the test says so.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loss_curves


@pytest.mark.parametrize("name", sorted(loss_curves.RUNS))
def test_seeded_fp32_loss_curve_is_unchanged(name: str, tmp_path: Path) -> None:
    if "muon" in name and loss_curves.profile_is_forced():
        pytest.skip("Muon iterates in bf16 only on native-bf16 CPUs: its curves are recorded per real CPU")
    records = loss_curves.load_records()
    assert records, f"{loss_curves.RECORD_FILE} is missing; record it with tests/loss_curves.py --record"
    curve = loss_curves.run_curve(name, tmp_path)
    assert len(curve) == loss_curves.STEPS
    mine = records.get(loss_curves.capability())
    if mine is not None:
        expected = [float.fromhex(x) for x in mine[name]]
        changed = [
            (step + 1, e, g) for step, (e, g) in enumerate(zip(expected, curve, strict=True)) if e != g
        ]
        assert not changed, f"{name}: loss curve moved at (step, recorded, now) {changed[:3]}"
        return
    # Another instruction set: the same computation, rounded differently by its kernels.
    reference = next(iter(records.values()))
    expected = [float.fromhex(x) for x in reference[name]]
    assert all(math.isclose(e, g, rel_tol=1e-4) for e, g in zip(expected, curve, strict=True)), (
        f"{name}: loss curve differs from the recorded one beyond fp32 kernel differences: {curve}"
    )
    pytest.skip(
        f"no bitwise record for CPU capability {loss_curves.capability()}; matched another machine's "
        "within 1e-4 (record this one with tests/loss_curves.py --record)"
    )
