"""A step the momentum carries too far (diloco/outer.py, diloco/master/core.py `_without_momentum`): the
master's real outer loop on a real directory bus and real safetensors deltas. When a new global's val
loss rises over RISE × the last one's, the same round is taken once more without the momentum, and the
global with the lower loss is kept (and published, with μ 0 in its momentum chain where it was the plain
one); a step whose plain retry is no better stands."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.master import Master
from speedtronic.diloco.master.core import EXPLODE
from speedtronic.diloco.master.momentum import rebuild
from speedtronic.diloco.outer import RISE, OuterOptimizer
from test_diloco_master import Run
from test_diloco_rules import send
from test_diloco_run_end import Scripted, master

SETTINGS = (
    "distributed.defences.loss_probe=false",
    "distributed.sync.outer_momentum_warmup=0",  # μ at full strength from the first round
    "distributed.master.collaborators=[w0]",
)


def momentum_master(run: Run, evaluate: Callable[[dict[str, torch.Tensor]], float]) -> Master:
    return master(run, evaluate, momentum=0.8, lr=0.7)


def test_a_step_the_momentum_carries_past_the_valley_is_taken_again_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loss: the squared distance to a target; e = θ0 − target. Round 1 brings Δ = e: with η 0.7, μ 0.8
    the global lands at target − 0.26·e. Round 2 brings the delta that points back to the target from
    there and a little past (Δ = −0.336·e); the momentum still holds +0.8·e, so the Nesterov step lands
    at target − 0.285·e (loss ×1.2: under EXPLODE, so it was published before). Without the momentum,
    θ − η·Δ lands at target − 0.025·e, which is kept and published."""
    run = Run(tmp_path, *SETTINGS)
    start = codec.snapshot(run.model)
    g = torch.Generator().manual_seed(0)
    target = {n: t + torch.randn(t.shape, generator=g) * 1e-2 for n, t in start.items()}
    e = {n: start[n] - target[n] for n in start}

    def evaluate(weights: dict[str, torch.Tensor]) -> float:
        return float(sum(((weights[n] - target[n]) ** 2).sum() for n in weights))

    m = momentum_master(run, evaluate)
    size = evaluate(start)
    send(run, "w0", 0, e, 0)
    assert m.round() is True
    assert evaluate(m.outer.weights) == pytest.approx(0.26**2 * size, rel=1e-3)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        send(run, "w0", 1, {n: -0.336 * t for n, t in e.items()}, 1)
        assert m.round() is True
    lines = [r.getMessage() for r in caplog.records if "with its momentum raises" in r.getMessage()]
    assert len(lines) == 1 and "taken (the momentum restarts from this round)" in lines[0], lines
    assert m.outer_step == 2
    kept = evaluate(m.outer.weights)
    assert kept == pytest.approx(0.0248**2 * size, rel=1e-2), kept / size
    before, risen = (float(x) for x in re.findall(r"loss (\S+) → (\S+) ", lines[0])[0])
    assert RISE < risen / before < EXPLODE, lines  # a rise the refusal of an exploding step lets through
    assert [loss for _, loss in m.val_losses][-1] == pytest.approx(kept)
    for name, buffer in m.outer.momentum_buffers.items():  # restarted from the round: m = Δ̄
        torch.testing.assert_close(buffer, -0.336 * e[name], rtol=1e-5, atol=1e-7)
    head = run.bus.read_head()
    assert head is not None and head["outer_step"] == 2 and head["momentum"]["mu"] == 0.0, head
    published = codec.decode(run.bus.read_global(head), m.specs, kind="global", max_bytes=10**8).tensors
    assert evaluate(published) == pytest.approx(kept, rel=1e-6)


def test_a_step_whose_plain_retry_is_no_better_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Scripted losses: start 5.0, round 1 4.0, round 2 4.5 with the momentum (over RISE × 4.0), 4.8
    without it: the step with the momentum is kept, its weights and its loss; a rise under RISE is no
    retry at all (round 3: 4.6, one evaluation)."""
    evaluate = Scripted([5.0, 4.0, 4.5, 4.8, 4.6])
    run = Run(tmp_path, *SETTINGS)
    m = momentum_master(run, evaluate)
    run.delta("w0", 0, base=0)
    assert m.round() is True
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        run.delta("w0", 1, base=1)
        assert m.round() is True
        first, retry = evaluate.seen[2], evaluate.seen[3]
        assert any(not torch.equal(first[n], retry[n]) for n in first)
        assert all(torch.equal(first[n], m.outer.weights[n]) for n in first)  # the momentum's step stays
        assert RISE * 4.0 < 4.5 and RISE * 4.5 > 4.6
        run.delta("w0", 2, base=2)
        assert m.round() is True
    lines = [r.getMessage() for r in caplog.records if "with its momentum raises" in r.getMessage()]
    assert len(lines) == 1 and "4.0000 → 4.5000" in lines[0] and "no better" in lines[0], lines
    assert [loss for _, loss in m.val_losses] == [5.0, 4.0, 4.5, 4.6]
    assert len(evaluate.seen) == 5
    head = run.bus.read_head()
    assert head is not None and head["outer_step"] == 3 and head["momentum"]["mu"] == pytest.approx(0.8)


def test_a_standby_recovers_the_momentum_a_plain_step_restarted() -> None:
    """The momentum a standby rebuilds from the published globals (master/momentum.py) after a plain
    step is the one the master holds: μ 0 in the chain for that step, so the step's update is its round."""
    g = torch.Generator().manual_seed(1)
    outer = OuterOptimizer({"w": torch.randn(4, 3, generator=g)}, lr=0.7, momentum=0.8)
    globals_ = [{"w": outer.weights["w"].clone()}]
    mus = []
    for plain in (False, False, True, False):
        outer.step({"w": torch.randn(4, 3, generator=g)}, plain=plain)
        globals_.append({"w": outer.weights["w"].clone()})
        mus.append(outer.last_mu)
    assert mus == [0.8, 0.8, 0.0, 0.8]
    rebuilt = rebuild(globals_[2:], mus[2:], 0.7)  # from the global before the plain step on
    assert rebuilt is not None
    torch.testing.assert_close(rebuilt["w"], outer.momentum_buffers["w"], rtol=1e-5, atol=1e-6)
