"""A master that takes over recovers the outer momentum and its warm-up clock from the last globals.

Before, every adoption of the bus's global reset the Nesterov buffer to 0 and restarted the momentum
warm-up (a 30-minute soak: 16 failovers, a fifth of the rounds with a cold or ramping momentum).
diloco/master/momentum.py rebuilds it from the globals the previous master's head chains back to.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hub_server import HubServer
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Head
from speedtronic.diloco.master import Master, momentum
from speedtronic.diloco.outer import OuterOptimizer
from test_diloco_hub_bus import make_run, server  # noqa: F401 (the loopback Hub fixture)
from test_diloco_master import Run
from test_diloco_rounds import NO_SLOW, POLL, Clock, master

pytestmark = pytest.mark.usefixtures("isolated_env")


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.square().sum()) for t in tensors.values()))


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return _norm({n: a[n] - b[n] for n in a}) / _norm(b)


def test_rebuild_recovers_nesterov_momentum_from_consecutive_weights() -> None:
    """Nesterov with the warm-up, 12 steps of random deltas: the buffer rebuilt from the last 5
    weights is the optimizer's own within (μ/(1+μ))^4 of its size; from 2 weights, within μ/(1+μ)."""
    g = torch.Generator().manual_seed(0)
    outer = OuterOptimizer({"w": torch.randn(64, 8, generator=g), "b": torch.zeros(8)}, 0.7, 0.8, warmup=10)
    history, mus = [], []
    for _ in range(12):
        history.append({n: t.clone() for n, t in outer.weights.items()})
        outer.step({n: torch.randn(t.shape, generator=g) * 0.01 + 0.01 for n, t in outer.weights.items()})
        mus.append(outer.last_mu)
    history.append({n: t.clone() for n, t in outer.weights.items()})
    rebuilt = momentum.rebuild(history[-5:], mus[-4:], 0.7)
    assert rebuilt is not None and _gap(rebuilt, outer.momentum_buffers) < (0.8 / 1.8) ** 4
    rough = momentum.rebuild(history[-2:], mus[-1:], 0.7)
    assert rough is not None and _gap(rough, outer.momentum_buffers) < 0.8 / 1.8
    # A step that left a tensor alone (a Streaming DiLoCo fragment) leaves its momentum alone too.
    outer.step({"w": torch.randn(64, 8, generator=g) * 0.01})
    kept = momentum.rebuild(
        [history[-3], history[-2], history[-1], outer.weights], [mus[-2], mus[-1], outer.last_mu], 0.7
    )
    assert kept is not None and _gap(kept, outer.momentum_buffers) < 0.8 / 1.8


def _master(run: Run, clock: Clock, state: str) -> Master:
    return master(run, clock, state, momentum=0.8)


def _rounds(run: Run, clock: Clock, m: Master, nodes: str, count: int) -> None:
    """`count` rounds of one delta from each of `nodes`, 5 s apart."""
    for seq in range(count):
        clock.t += 5
        for node in nodes:
            run.delta(node, seq, base=m.outer_step)
        assert m.round() is True


def test_a_standby_takes_over_with_the_masters_momentum_and_round_count(tmp_path: Path) -> None:
    """Real master rounds on a directory bus, then a master with an empty state directory adopts the
    bus's global: its buffer is the first master's within a few percent, its warm-up clock the same,
    and the next outer step from the same deltas lands where the first master's would have."""
    run = Run(tmp_path, *POLL, NO_SLOW)
    clock = Clock()
    first = _master(run, clock, "first")
    _rounds(run, clock, first, "abc", 8)
    head = run.bus.read_head()
    assert head is not None and len(head["momentum"]["chain"]) == 4, head["momentum"]
    standby = _master(run, clock, "standby")
    assert standby.outer_step == 8 and standby.outer.steps == first.outer.steps == 8
    assert _gap(standby.outer.momentum_buffers, first.outer.momentum_buffers) < 0.05
    assert standby.outer.last_mu == first.outer.last_mu > 0
    # Its takeover head carries the chain on: a second takeover right after recovers as well.
    again = _master(run, clock, "again")
    assert _gap(again.outer.momentum_buffers, first.outer.momentum_buffers) < 0.05


def test_a_chain_that_cannot_be_read_leaves_the_momentum_reset(tmp_path: Path) -> None:
    """A tampered chain (an unknown path, a step gap, a bad μ) recovers nothing it cannot read: the
    buffer is reset, as before, and the adoption still happens."""
    run = Run(tmp_path, *POLL, NO_SLOW)
    clock = Clock()
    first = _master(run, clock, "first")
    _rounds(run, clock, first, "ab", 4)
    head = run.bus.read_head()
    assert head is not None
    links, steps = momentum.parse_chain(head)
    assert [x.step for x in links] == [0, 1, 2, 3, 4] and steps == 4  # step 0: the first global
    bad = Head({**head, "momentum": {**head["momentum"], "chain": [[3, "global/../../etc/passwd", "", 0.5]]}})
    assert momentum.recover(run.bus, bad, first.outer.weights, first.specs, 1 << 20, 0.7) is None
    gap = Head({**head, "momentum": {**head["momentum"], "chain": [[1, "global/x", "", 0.5]]}})
    assert [x.step for x in momentum.parse_chain(gap)[0]] == [4]
    wrong = Head({**head, "momentum": {"steps": "many", "mu": 7, "chain": "no"}})
    assert momentum.parse_chain(wrong) == ([], None)


def test_the_chain_reads_older_globals_at_their_commits_on_the_hub(server: HubServer) -> None:  # noqa: F811
    """The Hub keeps one global path and overwrites it each step: the chain names each global with
    the commit it was published at, and the momentum is recovered from the repo's history."""
    bus = make_run(server)
    g = torch.Generator().manual_seed(1)
    outer = OuterOptimizer({"w": torch.randn(16, 4, generator=g)}, 0.7, 0.8, warmup=3)
    specs = {"w": codec.ParamSpec((16, 4), "float32")}
    chain: list[momentum.Link] = []
    for step in range(6):
        if step:
            outer.step({"w": torch.randn(16, 4, generator=g) * 0.01 + 0.02})
        head = {"outer_step": step, "momentum": momentum.head_entry(outer, chain[-4:])}
        new = bus.publish(
            codec.encode(outer.weights, "fp32", {"kind": "global", "outer_step": str(step)}), head
        )
        chain.append(momentum.Link(step, str(new["global"]), new.version, outer.last_mu))
    found = momentum.recover(bus, bus.read_head(), outer.weights, specs, 1 << 20, 0.7)
    assert found is not None, "nothing recovered"
    buffers, steps, used = found
    assert used == 5 and steps == 5 and _gap(buffers, outer.momentum_buffers) < 0.05
