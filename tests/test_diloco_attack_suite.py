"""Issue 24's attack suite, CI-sized: real `speedtronic master` and `speedtronic worker` processes on a
directory bus, 2 honest workers and 2 hostile ones (bench/hostile_worker.py: the real worker CLI with
its deltas transformed before upload), one run per attack, against a clean run of the 2 honest workers.

The shipped defaults throughout, with `min_deltas` the honest workers (bench/attacks.py: deltas the
defences weigh 0 do not count toward it, so a round waits for the honest deltas). Two hostile peers of four defeat anything that votes (a coordinate-wise
median, the agreement score: the colluders are half the "others"), so what holds here is the mechanism
that does not vote, the loss probe (`distributed.defences.loss_probe: auto`, on since the master has validation
batches): each delta applied alone to the global model, on the master's validation batches; quarantine
(`quarantine_below: 0`) may take at most one node of four and must never take an honest one. What
each run must show:
- no honest delta rejected, every honest delta applied exactly once, no honest delta probed worse (the
  probe's false positives, measured: honest deltas weighed 0 / honest deltas, goal under 5%);
- collude (both send the reverse of the last round's global progress, at their honest norm): every
  hostile delta weighs 0 (the probe);
- tokens (the reversed delta claiming 10^12 tokens): every claim clipped to the plan, logged, and
  every hostile delta weighs 0 (the probe);
- replay (both re-send w1's pending deltas as their own): every hostile delta is rejected as a copy of
  w1's or, seen in the same poll as the original, counted once with it (weighs 0); w1's never rejected;
- the last global's val loss: replay within 3% of the clean run (timing moves a clean run by well
  under 1%: a global can arrive at a different inner step); collude and tokens within 15%. Their
  first round is the probe's blind spot: at the initial plateau a reversed delta applied alone barely
  moves the loss (measured: +0.016, or below zero), so it passes, and 2 reversed of 4 cancel that
  round under clipped_mean; every later round weighs them 0, but the run stays that round behind
  (measured 10% at 4 rounds; bench/attacks.py has the 8-worker figures).
The full suite (8 workers, every attack, the shipped defaults) is bench/attacks.py.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from attacks import Run, summarize  # noqa: E402

pytestmark = pytest.mark.slow

SETTINGS = argparse.Namespace(
    steps=20, inner_steps=5, n_layer=2, d_model=64, block=64, batch=8, val_batches=4
)
SETS: list[str] = []  # the shipped defaults
ROUNDS = SETTINGS.steps // SETTINGS.inner_steps
TOLERANCE = {"replay": 1.03, "collude": 1.15, "tokens": 1.15}


def run(folder: Path, honest: int, hostile: int, attack: str) -> tuple[dict[str, Any], Run]:
    folder.mkdir(parents=True)
    r = Run(folder, SETTINGS, honest, hostile, attack, SETS)
    try:
        r.launch()
        workers = {n: r.result(n, 300) for n in r.honest + r.hostile}  # waits on each process' exit
        master = r.result("master", 300)
    finally:
        r.kill()
    row = summarize(r, master, workers)
    row["uploaded"] = {n: len(w["uploaded"]) for n, w in workers.items()}
    return row, r


ROUND = re.compile(
    r"master: outer step \d+ from (.+?)(?: \(\d+ [^)]*weighing 0\))? · global val loss ([\d.]+)"
)


def harmless_hostile(log: str) -> set[str]:
    """The attackers' deltas allowed to weigh, read from the master's log: each one's first (the blind
    spot above), and those of a round whose global's validation loss fell that the probe did not name.
    Under load the attackers' first deltas can make a round of their own; their next "reverse of the
    last progress" then reverses their own first step, and alone it lowers the loss: the probe rightly
    lets it weigh. A hostile delta that weighed in a round whose loss rose is never allowed."""
    probed = set(re.findall(r"loss probe: delta (h\d/\S+) from", log))
    allowed: set[str] = set()
    previous: float | None = None
    for names, loss in ROUND.findall(log):
        hostile = {d for d in names.split(", ") if d.startswith("h")}
        allowed |= {d for d in hostile if re.fullmatch(r"h\d/h\d--0+\.safetensors", d)}
        if previous is not None and float(loss) < previous:
            allowed |= hostile - probed
        previous = float(loss)
    return allowed


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    row, r = run(tmp_path_factory.mktemp("clean") / "clean", 2, 0, "clean")
    assert row["honest_rejected"] == 0 and row["exactly_once"], row
    assert row["zeroed_total"] == 0, r.log("master")[-3000:]  # no honest delta probed worse
    assert row["honest_zeroed_by_probe"] == 0 and row["honest_applied"] > 0, row
    losses = row["val_losses"]
    assert row["outer_step"] >= ROUNDS and losses[-1] < losses[0] - 0.5, losses
    return row


@pytest.mark.parametrize("attack", ["collude", "tokens", "replay"])
def test_two_hostile_workers_of_four_cannot_steer_the_run(
    tmp_path: Path, clean: dict[str, Any], attack: str
) -> None:
    row, r = run(tmp_path / attack, 2, 2, attack)
    log = r.log("master")
    assert row["honest_rejected"] == 0, row["honest_rejected_reasons"]
    assert row["exactly_once"], row["problems"]
    # The probe's false positives: an honest delta whose round has moved on (it lands one global late,
    # so the progress it carries is partly in the global already) can read worse alone. Which polls the
    # deltas land in depends on the machine's load: at most one of a run's honest deltas; over many
    # (bench/attacks.py, 108 honest deltas) the rate is the figure held under 5%.
    probed = re.findall(r"loss probe: delta (w\d/\S+)", log)
    assert row["honest_zeroed_by_probe"] <= 1 and len(probed) <= 1, (probed, row)
    assert not re.search(r"quarantined node w\d", log), "an honest node was quarantined"
    sent = row["uploaded"]["h1"] + row["uploaded"]["h2"]
    # The end does not wait for a node whose deltas cannot weigh (quarantined): an attacker may be cut
    # short by its last delta. A replayer may fall further behind: it copies w1's files from the bus,
    # and under load the master can process and delete one before the capture's next look, so that
    # replayer waits for w1's next delta (bench/hostile_worker.py: Capture) and ends a round short more.
    least = 2 * ROUNDS - (4 if attack == "replay" else 2)
    assert least <= sent <= 2 * ROUNDS, row["uploaded"]
    if attack in ("collude", "tokens"):
        # Received, counted as applied (their hwm moves), and from the second round on they weigh 0.
        assert row["hostile_rejected"] == 0 and row["hostile_applied"] == sent, row
        # Every round but the first: probed worse, or quarantined (then it is not probed at all) — past the
        # run's end too, where an attacker's delta may land in a round of its own (the probe's "at most
        # half" let it weigh there until 2026-12-05: every delta probed worse past the end weighs 0).
        # Exempt: each attacker's first delta (the blind spot above), and one the probe let weigh in a
        # round that lowered the loss (harmless_hostile says when that happens).
        allowed = harmless_hostile(log)
        assert row["zeroed_total"] >= sent - len(allowed), f"exempt: {sorted(allowed)}\n{log[-20000:]}"
        assert row["zeroed_by_probe"] >= 1, log[-3000:]
    if attack == "tokens":
        clipped = re.findall(r"delta h\d/\S+ from h\d claims 1000000000000 tokens, more than its plan", log)
        assert len(clipped) == sent, log[-3000:]
    if attack == "replay":
        reasons = row["hostile_rejections"]
        # A copy of w1's delta, or of the other attacker's copy of it (seen earlier in that round).
        assert all(re.match(r"replay: (a copy of|the same payload as) (w1|h\d)/", x) for x in reasons), (
            reasons
        )
        twins = row["zeroed_total"] - row["zeroed_by_probe"]  # same poll as w1's: applied, weighing 0
        # None weighs: every hostile delta applied was a twin. The end waits for the honest nodes only, so
        # each attacker's last delta may come after it and stay on the bus, never applied.
        assert row["hostile_applied"] == twins, (row, log[-3000:])
        left = sent - row["hostile_rejected"] - row["hostile_applied"]
        assert 0 <= left <= 2, (row, log[-3000:])
    losses = row["val_losses"]
    # Never up after the first round until the run's end (level where a round's deltas all weighed 0:
    # the global stands). Past it, late deltas may still move it, and the run ends on its best global.
    assert all(b <= a for a, b in itertools.pairwise(losses[1 : ROUNDS + 1])), str(losses)
    assert row["final_val_loss"] <= min(losses) + 1e-9, (row["final_val_loss"], str(losses))
    assert row["last_val_loss"] <= clean["last_val_loss"] * TOLERANCE[attack], (losses, clean["val_losses"])
    print(
        f"\n{attack}: last val loss {row['last_val_loss']:.4f} (clean {clean['last_val_loss']:.4f}); hostile "
        f"{row['hostile_rejected']} rejected, {row['hostile_applied']} applied, {row['zeroed_total']} weighed 0; "
        f"probe false positives {row['honest_zeroed_by_probe']}/{row['honest_applied']} honest deltas"
    )
