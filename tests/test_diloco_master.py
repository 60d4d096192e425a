"""The master's rounds on a real directory bus with real safetensors deltas: validation with log lines
naming the rejected file, unlisted nodes, poisoned deltas, staleness, and crash safety (nothing applied
twice after a crash at the commit point; a newer remote global adopted on restart)."""

from __future__ import annotations

import logging
import math
import statistics
import threading
from pathlib import Path

import pytest
import torch

from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import DeltaRef
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.manifest import build_manifest
from speedtronic.diloco.master import Master
from speedtronic.engine.build import build_model
from speedtronic.errors import TransientBusError

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "data.block_size=16"]


class Run:
    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.cfg = load_config(None, [*TINY, "distributed.node.poll_interval=0.05", *extra])
        torch.manual_seed(0)
        self.model = build_model(self.cfg, 256)
        self.specs = codec.param_specs(self.model)
        self.bus = DirectoryBus(str(tmp_path / "bus"))
        self.bus.create_run()
        self.manifest = build_manifest(self.cfg, self.specs)
        self.bus.write_manifest(self.manifest)
        self.tmp_path = tmp_path

    def master(self, state: str = "state") -> Master:
        m = Master(
            self.cfg,
            self.bus,
            self.manifest,
            codec.snapshot(self.model),
            state_dir=self.tmp_path / state,
            momentum=0.0,
        )
        m.start_state()
        return m

    def delta(self, node: str, seq: int, scale: float = 1e-3, base: int = 0, **meta: str) -> str:
        g = torch.Generator().manual_seed(hash((node, seq)) % 2**31)
        tensors = {n: torch.randn(s.shape, generator=g) * scale for n, s in self.specs.items()}
        header = {
            "kind": "delta",
            "node": node,
            "seq": str(seq),
            "local_step": "4",
            "base_outer_step": str(base),
            "tokens": "64",
            **meta,
        }
        name = codec.delta_name(node, seq)
        self.bus.put_delta(node, name, codec.encode(tensors, "fp32", header))
        return f"{node}/{name}"

    def raw(self, node: str, name: str, data: bytes) -> None:
        (self.bus.root / "deltas" / node).mkdir(parents=True, exist_ok=True)
        (self.bus.root / "deltas" / node / name).write_bytes(data)


def test_bad_deltas_are_rejected_with_a_log_line_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=2", "distributed.defences.max_delta_mb=0.2")
    m = run.master()
    good = [run.delta("w1", 0), run.delta("w2", 0)]
    good_bytes = (run.bus.root / "deltas" / "w1" / "w1--00000000.safetensors").read_bytes()
    run.raw("trunc", "trunc--00000000.safetensors", good_bytes[: len(good_bytes) // 3])
    flipped = bytearray(good_bytes)
    flipped[-3] ^= 0x55
    run.raw("corrupt", "corrupt--00000000.safetensors", bytes(flipped))
    nan = {n: torch.zeros(s.shape) for n, s in run.specs.items()}
    next(iter(nan.values())).view(-1)[0] = float("inf")
    run.raw("nan", "nan--00000000.safetensors", codec.encode(nan, "fp32", {"kind": "delta", "node": "nan"}))
    wrong = {n: torch.zeros(2, 2) for n in run.specs}
    run.raw(
        "shape",
        "shape--00000000.safetensors",
        codec.encode(wrong, "fp32", {"kind": "delta", "node": "shape"}),
    )
    big = {n: torch.zeros(s.shape) for n, s in run.specs.items()}
    run.raw(
        "big",
        "big--00000000.safetensors",
        codec.encode(big, "fp32", {"kind": "delta", "node": "big", "pad": "x" * 300_000}),
    )
    run.raw("named", "evil.safetensors", good_bytes)
    run.raw("named", "named--1.safetensors", good_bytes)
    run.raw("thief", "w1--00000007.safetensors", good_bytes)  # w1's name, published by another node
    run.delta("poison", 0, scale=1e-1)  # 100× the others' norm

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is True
    assert sorted(m.applied) == sorted(good) and m.outer_step == 1
    reasons = {r["id"]: r["reason"] for r in m.rejected}
    expected = {
        "trunc/trunc--00000000.safetensors": "truncated|not a valid",
        "corrupt/corrupt--00000000.safetensors": "checksum|not a valid",
        "nan/nan--00000000.safetensors": "non-finite",
        "shape/shape--00000000.safetensors": "shape",
        "big/big--00000000.safetensors": "size limit",
        "named/evil.safetensors": "bad file name",
        "named/named--1.safetensors": "bad file name",
        "thief/w1--00000007.safetensors": "named for node 'w1'",
        "poison/poison--00000000.safetensors": "norm outlier",
    }
    assert set(reasons) == set(expected)
    import re

    for delta_id, pattern in expected.items():
        assert re.search(pattern, reasons[delta_id]), (delta_id, reasons[delta_id])
        name = delta_id.split("/")[1]
        assert any(name in r.getMessage() and "rejected" in r.getMessage() for r in caplog.records), name
    # Processed files (applied and rejected) are gone from the bus.
    assert run.bus.list_deltas(None) == []


def test_unlisted_nodes_are_ignored_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = Run(tmp_path, "distributed.master.collaborators=[w1]", "distributed.rounds.min_deltas=1")
    m = run.master()
    applied = run.delta("w1", 0)
    run.delta("mallory", 0)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is True
        m.round()
    assert m.applied == [applied]
    lines = [r.getMessage() for r in caplog.records if "unlisted node mallory" in r.getMessage()]
    assert len(lines) == 1 and "mallory--00000000.safetensors" in lines[0]


def test_stale_deltas_are_down_weighted_then_rejected(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.rounds.max_staleness=1")
    m = run.master()
    m.ledger.outer_step = 3  # as if three rounds had happened
    run.delta("w1", 0, base=2)  # staleness 1: weight 1/2, accepted
    run.delta("w2", 0, base=0)  # staleness 3: rejected
    assert m.round() is True
    assert m.applied == ["w1/w1--00000000.safetensors"]
    assert "stale" in m.rejected[0]["reason"] and m.rejected[0]["id"].startswith("w2/")


def test_a_stale_backlog_is_rejected_in_one_round_and_its_newest_delta_counts(tmp_path: Path) -> None:
    """A node's deltas that went stale while the master could not see them (a joiner listed late): each
    rejection does not take the node's place in the round; its next pending delta is read at once. One
    rejection a round made every next one staler (a Hub soak's joiner: 7 in a row, then it stopped)."""
    run = Run(tmp_path, "distributed.rounds.min_deltas=2", "distributed.rounds.max_staleness=2")
    m = run.master()
    m.ledger.outer_step = 6
    backlog = [run.delta("j1", seq, base=seq) for seq in range(4)]  # staleness 6, 5, 4, 3: rejected
    fresh = run.delta("j1", 4, base=5)  # staleness 1: counts
    other = run.delta("w1", 0, base=6)
    assert m.round() is True, m.rejected
    assert sorted(m.applied) == sorted([fresh, other])
    assert [r["id"] for r in m.rejected] == backlog and all("stale" in r["reason"] for r in m.rejected)
    assert m.ledger.mark("j1") == 4 and m.outer_step == 7


def test_a_crash_after_the_commit_point_applies_nothing_twice(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=2")
    m = run.master()
    ids = [run.delta("w1", 0), run.delta("w2", 0)]

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("killed between saving state and publishing")

    m.bus = DirectoryBus(str(run.bus.root))
    m.bus.publish = crash  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        m.round()
    # The deltas are still on the bus and the bus still shows outer step 0; the state says 1.
    assert len(run.bus.list_deltas(None)) == 2 and run.bus.read_head()["outer_step"] == 0
    restarted = run.master()
    assert restarted.outer_step == 1 and sorted(restarted.applied) == sorted(ids)
    assert run.bus.read_head()["outer_step"] == 1  # the lost publish is redone on start
    assert restarted.round() is False
    assert sorted(restarted.applied) == sorted(ids) and restarted.outer_step == 1
    assert run.bus.list_deltas(None) == []  # recognised as processed and deleted, not applied again
    for n, t in m.outer.weights.items():
        assert torch.equal(restarted.outer.weights[n], t)


def test_a_crash_before_the_commit_point_redoes_the_round_once(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=2")
    m = run.master()
    ids = [run.delta("w1", 0), run.delta("w2", 0)]
    m.save_state = lambda: (_ for _ in ()).throw(KeyboardInterrupt())  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        m.round()
    restarted = run.master()
    assert restarted.outer_step == 0 and restarted.applied == []
    assert restarted.round() is True
    assert sorted(restarted.applied) == sorted(ids) and restarted.outer_step == 1


def test_restart_adopts_a_newer_global_from_the_bus(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    first = run.master("state-a")
    other = run.master("state-b")  # e.g. the state directory of a replacement machine
    for seq in range(3):
        run.delta("w1", seq)
        assert other.round() is True
    assert other.outer_step == 3 and first.outer_step == 0
    again = run.master("state-a")
    assert again.outer_step == 3 and again.hwm["w1"] == 2
    for n, t in other.outer.weights.items():
        assert torch.equal(again.outer.weights[n], t)
    run.delta("w1", 1)  # a replay of something the other master applied: not applied again
    assert again.round() is False and again.outer_step == 3


def test_the_master_prunes_only_the_globals_it_published(tmp_path: Path) -> None:
    """Issue 24: junk named like globals made the master prune the global it had just published. It now
    tracks what it published (in its state, across restarts) and prunes only those, keeping the newest
    5 (KEEP_GLOBALS: a standby recovers the momentum from them); a master that adopts the run prunes
    nothing older."""
    import os

    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    gdir = run.bus.root / "global"
    junk = [f"outer_9999999{n}.safetensors" for n in (7, 8, 9)]
    for name in junk:
        (gdir / name).write_bytes(b"junk")
    os.mkfifo(gdir / "outer_99999996.safetensors")

    def own() -> list[str]:
        return sorted(p.name for p in gdir.iterdir() if p.name.startswith("outer_0"))

    m = run.master()  # publishes outer step 0 (no head yet): its own
    for seq in range(6):
        run.delta("w1", seq, base=m.outer_step)
        assert m.round() is True
        assert (run.bus.root / run.bus.read_head()["global"]).is_file()  # the head names a real file
    assert own() == [f"outer_{s:08d}.safetensors" for s in (2, 3, 4, 5, 6)]
    assert [s for s, _ in m.published] == [2, 3, 4, 5, 6]
    again = run.master()  # a restart with its state: it still knows what it wrote
    assert again.published == m.published
    run.delta("w1", 6, base=6)
    assert again.round() is True and own() == [f"outer_{s:08d}.safetensors" for s in (3, 4, 5, 6, 7)]
    adopter = run.master("fresh-state")  # a standby or a restart without state: adopts, knows nothing
    assert adopter.published == [] and adopter.outer_step == 7
    for seq in range(7, 13):
        run.delta("w1", seq, base=adopter.outer_step)
        assert adopter.round() is True
    # Its own newest 5 (9-13); 8 was its own too and is pruned; 3-7 were the other master's: left.
    assert own() == [f"outer_{s:08d}.safetensors" for s in (3, 4, 5, 6, 7, 9, 10, 11, 12, 13)]
    assert all((gdir / name).read_bytes() == b"junk" for name in junk)
    assert (gdir / "outer_99999996.safetensors").is_fifo()
    assert run.bus.read_head()["global"] == "global/outer_00000013.safetensors"


def test_a_round_downloads_its_deltas_side_by_side(tmp_path: Path) -> None:
    """Each node's oldest delta is downloaded at once (pipeline.prefetch), not one after another: on the
    Hub four downloads in a row were 0.23 s of a 1.5-s round. A bus whose get_delta waits until all three
    are in flight (a barrier; one after another it would break) still gives a round that applies each
    delta once, each read once; a download that fails there is read again by the round."""
    run = Run(tmp_path, "distributed.rounds.min_deltas=3")
    m = run.master()
    barrier = threading.Barrier(3, timeout=20)
    calls: list[str] = []
    original = run.bus.get_delta

    def get_delta(ref: DeltaRef, max_bytes: int) -> bytes:
        calls.append(ref.id)
        barrier.wait()
        return original(ref, max_bytes)

    run.bus.get_delta = get_delta  # type: ignore[method-assign]
    ids = [run.delta(node, 0) for node in ("w1", "w2", "w3")]
    assert m.round() is True and sorted(m.applied) == sorted(ids)
    assert sorted(calls) == sorted(ids)

    failed: list[str] = []

    def flaky(ref: DeltaRef, max_bytes: int) -> bytes:
        if ref.node == "w2" and not failed:
            failed.append(ref.id)
            raise TransientBusError("w2's download timed out")
        return original(ref, max_bytes)

    run.bus.get_delta = flaky  # type: ignore[method-assign]
    again = [run.delta(node, 1, base=1) for node in ("w1", "w2", "w3")]
    assert (
        m.round() is True
        and sorted(m.applied[-3:]) == sorted(again)
        and failed == ["w2/w2--00000001.safetensors"]
    )


def test_a_folded_delta_feeds_the_momentum_what_its_rounds_would_have(tmp_path: Path) -> None:
    """A worker the master did not answer folds its next sync points into its newest delta (seq jumps
    past its mark). The outer step applies it whole, but the momentum takes c(r)·Δ, what r rounds of Δ/r
    would have left in it (outer.momentum_feed), not r rounds' displacement as one round's: fed whole,
    a 20-s bus outage's folds raised a soak's loss 2.03 → 2.79 over 12 rounds. An unfolded round is
    bit-for-bit the plain Nesterov rule."""
    from speedtronic.diloco.outer import momentum_feed

    g = torch.Generator().manual_seed(7)
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    first, second = (
        {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in run.specs.items()} for _ in range(2)
    )

    def master_after(seq: int, state: str) -> Master:
        for node_seq, tensors, base in ((0, first, 0), (seq, second, 1)):
            header = {"kind": "delta", "node": "w1", "seq": str(node_seq), "local_step": "4"}
            header |= {"base_outer_step": str(base), "tokens": "64"}
            name = codec.delta_name("w1", node_seq)
            run.bus.put_delta("w1", name, codec.encode(tensors, "fp32", header))
            if node_seq == 0:
                m = Master(
                    run.cfg,
                    run.bus,
                    run.manifest,
                    codec.snapshot(run.model),
                    state_dir=tmp_path / state,
                    momentum=0.8,
                )
                m.start_state()
            assert m.round() is True, (seq, m.rejected)
        return m

    plain = master_after(1, "plain")
    run.bus = DirectoryBus(str(tmp_path / "bus2"))
    run.bus.create_run()
    run.bus.write_manifest(run.manifest)
    folded = master_after(6, "folded")
    mu = plain.outer.last_mu
    assert folded.outer.last_mu == mu and 0 < mu < 1
    c = momentum_feed(mu, [(6, 1.0)])
    assert abs(c - (1 - mu**6) / (6 * (1 - mu))) < 1e-12 and c < 1
    for name, d in second.items():
        m1 = first[name]  # after round one (momentum 0 before it): m = Δ1
        m_plain = plain.outer.momentum_buffers[name]
        assert torch.equal(m_plain, m1.mul(mu).add_(d))  # the plain rule, exactly
        assert torch.allclose(m_plain - folded.outer.momentum_buffers[name], (1 - c) * d, atol=1e-9)
        step_gap = plain.outer.weights[name] - folded.outer.weights[name]
        assert torch.allclose(step_gap, -plain.outer.lr * mu * (1 - c) * d, atol=1e-6)  # fp32 weights


def test_momentum_feed_is_one_unless_a_delta_is_folded() -> None:
    from speedtronic.diloco.outer import momentum_feed

    assert momentum_feed(0.8, []) == momentum_feed(0.8, [(1, 3.0), (1, 1.0)]) == 1.0
    assert momentum_feed(0.0, [(11, 1.0)]) == 1.0  # no momentum: nothing to feed
    assert abs(momentum_feed(0.8, [(11, 1.0)]) - 0.41550) < 1e-4
    # Weighted by the deltas' weight; a zero-weight delta counts for nothing.
    mixed = momentum_feed(0.8, [(1, 3.0), (11, 1.0), (50, 0.0)])
    assert abs(mixed - (3 * 1.0 + 0.41550) / 4) < 1e-4


def test_the_outer_step_measures_its_update_against_the_steps_before() -> None:
    """`update_ratio`: the latest step's |θ_before − θ_after| over the median of the steps before it
    (the master's log line for a folded round says how far that round moved the global)."""
    from speedtronic.diloco.outer import OuterOptimizer

    g = torch.Generator().manual_seed(3)
    outer = OuterOptimizer({"w": torch.randn(8, 4, generator=g), "b": torch.zeros(4)}, 0.7, 0.8, warmup=3)
    assert outer.update_ratio() is None
    moved = []
    for scale in (1.0, 1.0, 2.0, 1.0, 5.0):
        before = {n: t.clone() for n, t in outer.weights.items()}
        outer.step({n: torch.randn(t.shape, generator=g) * 1e-2 * scale for n, t in before.items()})
        moved.append(math.sqrt(sum(float((before[n] - outer.weights[n]).square().sum()) for n in before)))
        assert abs(outer.update_norms[-1] - moved[-1]) <= 1e-4 * moved[-1]  # fp32 weights
    ratio = outer.update_ratio()
    assert ratio is not None and abs(ratio - moved[-1] / statistics.median(moved[:-1])) < 1e-4
    assert ratio > 1.5  # the last delta was 5× the others
