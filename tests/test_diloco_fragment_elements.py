"""Streaming DiLoCo with `distributed.sync.fragment_layout: elements`: fragment p is elements p, p+P, … of
every tensor. A real Trainer and Coordinator against a real Master on a directory bus (the helpers of
tests/test_diloco_fragments.py: the master steps right after each worker step, so every round is
deterministic).

What is checked: the shares cover every element exactly once and are views (writing one writes the
tensor); the refusals (a tensor smaller than P, an unknown layout, a node with the other layout); each
upload carries a 1-D share of every tensor, exactly once per delta id, the peak upload falls by ~P;
a round moves its share of the global and nothing else (momentum included), and a delta shaped for
the other layout is refused; an install takes the moved fragment's share as θ ← G + (θ_now − θ_sync)
and leaves every other element bitwise as it was; a resume between two syncs keeps delta ids
exactly once; and the run learns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.diloco import codec, fragments
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.master import Master
from speedtronic.diloco.worker import Coordinator
from speedtronic.engine.build import build_model
from speedtronic.errors import ConfigError, SpeedtronicError
from test_diloco_fragments import (
    BASE,
    decoded,
    put_tensors,
    recording,
    run_worker,
    setup_run,
    stepping_worker,
    sync_recorder,
)

pytestmark = pytest.mark.usefixtures("isolated_env")

ELEMENTS = ("distributed.sync.fragments=2", "distributed.sync.fragment_layout=elements")


def specs_of_tiny_model() -> dict[str, codec.ParamSpec]:
    return codec.param_specs(build_model(load_config(None, BASE), 64))


def test_element_shares_cover_every_element_exactly_once_and_are_views() -> None:
    specs = specs_of_tiny_model()
    count = 3
    plan = fragments.Plan(specs, count, 12, False, "elements")
    full = {
        n: torch.arange(fragments._numel(s), dtype=torch.float32).reshape(s.shape) for n, s in specs.items()
    }
    for name, spec in specs.items():
        seen = torch.cat([plan.part(p, full)[name] for p in range(count)])
        assert sorted(seen.tolist()) == list(range(fragments._numel(spec))), name  # each element once
    for p in range(count):
        share = plan.part(p, full)
        assert sorted(share) == sorted(specs)  # a share of every tensor
        wanted = plan.select({"fragment": str(p)}, specs)
        assert {n: (tuple(t.shape),) for n, t in share.items()} == {n: (s.shape,) for n, s in wanted.items()}
        view = plan.viewer(p)
        assert view is not None
        assert all(torch.equal(view(full[n]), share[n]) for n in share)
    # merged: a new dict, the share replaced, the input untouched.
    before = {n: t.clone() for n, t in full.items()}
    out = plan.merged(1, full, {n: -torch.ones_like(t) for n, t in plan.part(1, full).items()})
    assert all(torch.equal(full[n], before[n]) for n in full)
    for n in full:
        changed = (out[n] != before[n]).reshape(-1)
        assert changed[1::count].all() and not changed[0::count].any() and not changed[2::count].any(), n
    # A write into a share writes the tensor (the coordinator's accounted += x relies on it).
    plan.part(2, full)[next(iter(full))].fill_(7.0)
    first = next(iter(full))
    assert (full[first].reshape(-1)[2::count] == 7.0).all()
    # The layout is part of the partition's identity; a layers run's manifest entry is unchanged.
    layers = fragments.Plan(specs, count, 12, False)
    assert plan.digest != layers.digest
    assert plan.manifest_entry()["layout"] == "elements" and "layout" not in layers.manifest_entry()
    assert fragments.Plan(specs, 1, 12, False, "elements").layout == "layers"  # P=1: the whole model


def test_element_layout_refusals_name_the_setting() -> None:
    specs = {"a": codec.ParamSpec((8, 4), "float32"), "tiny": codec.ParamSpec((2,), "float32")}
    with pytest.raises(SpeedtronicError, match=r"parameter tiny has only 2 elements.*fragments <= 2"):
        fragments.Plan(specs, 3, 12, False, "elements")
    with pytest.raises(SpeedtronicError, match=r"distributed.sync.fragment_layout 'rows' is not one of"):
        fragments.Plan(specs, 2, 12, False, "rows")
    with pytest.raises(ConfigError, match="fragment_layout"):
        load_config(None, [*BASE, "distributed.sync.fragment_layout=rows"])


def test_a_node_with_the_other_layout_is_refused(tmp_path: Path) -> None:
    _, bus, manifest, _ = setup_run(tmp_path, *ELEMENTS)
    assert manifest["run"]["fragments"]["layout"] == "elements"
    other = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'o'}", "distributed.sync.fragments=2"])
    with pytest.raises(SpeedtronicError, match=r"set distributed.sync.fragment_layout=elements"):
        Trainer(other, sync=Coordinator(other, bus, "w9", manifest), progress=False).train(max_steps=1)


def put_share(
    bus: DirectoryBus, master: Master, seq: int, fragment: int, value: float, full: bool = False
) -> str:
    """A fragment delta of constant `value` (with `full`: whole tensors, the layers layout's shape)."""
    wanted = master.specs if full else master.frags.select({"fragment": str(fragment)}, master.specs)
    return put_tensors(bus, "a", seq, fragment, 0, {n: torch.full(s.shape, value) for n, s in wanted.items()})


def test_an_element_round_moves_its_share_and_nothing_else(tmp_path: Path) -> None:
    _, bus, _, master = setup_run(tmp_path, *ELEMENTS)
    before = {n: t.clone() for n, t in master.outer.weights.items()}
    applied = put_share(bus, master, 0, 1, 0.01)
    assert master.round() and master.fragment_rounds == [0, 1] and master.applied == [applied]
    for n, t in master.outer.weights.items():
        moved = (t != before[n]).reshape(-1)
        assert moved[1::2].all() and not moved[0::2].any(), n  # share 0 bitwise as it was
        momentum = master.outer.momentum_buffers[n].reshape(-1)
        assert (momentum[0::2] == 0).all() and (momentum[1::2] != 0).all(), n
    wrong = put_share(bus, master, 1, 0, 0.01, full=True)
    master.round()
    reasons = {r["id"]: r["reason"] for r in master.rejected}
    assert "has shape" in reasons[wrong] and "expected" in reasons[wrong], reasons
    assert master.fragment_rounds == [0, 1]


def test_element_fragments_sync_in_turn_exactly_once_at_a_pth_of_the_peak(tmp_path: Path) -> None:
    manifest, master, rec, worker, _ = run_worker(tmp_path / "e2", 16, *ELEMENTS)
    specs = codec.specs_from_json(manifest["params"])
    plan = fragments.Plan(specs, 2, 4, False, "elements")
    deltas = [codec.decode(d, specs, kind="delta", select=plan.select) for _, d in rec.sent]
    ids = [f"w1/{name}" for name, _ in rec.sent]
    assert [d.meta["fragment"] for d in deltas] == ["1", "0"] * 4, ids
    for d in deltas:
        p = int(d.meta["fragment"])
        assert {n: tuple(t.shape) for n, t in d.tensors.items()} == {
            n: s.shape for n, s in plan.select({"fragment": str(p)}, specs).items()
        }
    assert master.applied == ids, f"applied {master.applied}\nsent {ids}"  # each exactly once, in order
    assert master.fragment_rounds == [4, 4] and master.outer_step == 8
    _, _, rec1, worker1, _ = run_worker(tmp_path / "p1", 16)
    ratio = worker.uploader.peak_delta_bytes / worker1.uploader.peak_delta_bytes
    print(
        f"\npeak upload per sync: P=1 {worker1.uploader.peak_delta_bytes} B, P=2 elements {worker.uploader.peak_delta_bytes} B"
    )
    assert 0.45 <= ratio <= 0.6, ratio
    assert len(decoded(rec1.sent, specs, 1)) == 4


def test_an_element_install_takes_the_moved_share_and_keeps_the_rest(tmp_path: Path) -> None:
    # Real text (the embedded corpus, byte vocabulary) so that the run has something to learn.
    text = ("checkpoint.enabled=false", "data.synthetic=false", "data.vocab_size=null")
    cfg, bus, manifest, master = setup_run(
        tmp_path, *text, *ELEMENTS, "distributed.sync.overlap_steps=1", vocab=256
    )
    Worker = stepping_worker(master)
    syncs: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    errors: list[float] = []
    partial = 0

    class Checked(sync_recorder(Worker, syncs)):  # type: ignore[misc]
        def install_fragments(
            self, model: Any, inner_step: int, g: Any, moved: set[int], fresh: bool = False
        ) -> None:
            nonlocal partial
            before = codec.snapshot(model)
            super().install_fragments(model, inner_step, g, moved, fresh)
            if fresh or not moved:
                return
            after = codec.snapshot(model)
            partial += len(moved) < 2
            for p in range(2):
                got = self.frags.part(p, after)
                was = self.frags.part(p, before)
                if p in moved:
                    step, at_sync = syncs[p]
                    assert inner_step == step + 1, (p, step, inner_step)
                    g_share, sync_share = self.frags.part(p, g.tensors), self.frags.part(p, at_sync)
                    for n in got:
                        want = g_share[n] + (was[n] - sync_share[n])
                        errors.append(float((got[n] - want).abs().max()))
                        # The node's book-keeping: the anchor's share is the global's, nothing queued.
                        assert torch.equal(self.frags.part(p, self.book.anchor)[n], g_share[n])
                        assert not self.frags.part(p, self.book.accounted)[n].any()
                else:
                    assert all(torch.equal(got[n], was[n]) for n in got), p  # untouched, bitwise

    worker = Checked(cfg, bus, "w1", manifest)
    result = Trainer(cfg, sync=worker, progress=False).train(max_steps=24)
    assert partial >= 5 and errors and max(errors) < 1e-5, (partial, max(errors, default=None))
    assert master.outer_step == len(fragments.sync_points(24, 4, 2, False))
    print(f"\nelements P=2 τ=1: final loss {result.final_loss:.3f}, {partial} share installs")
    assert result.final_loss < 4.6, result  # it learns (5.5 at the first step)


def test_a_resume_between_two_element_syncs_keeps_delta_ids_exactly_once(tmp_path: Path) -> None:
    cfg, bus, manifest, master = setup_run(tmp_path, *ELEMENTS, "checkpoint.every_steps=1")
    rec = recording(bus)
    Worker = stepping_worker(master)
    first = Worker(cfg, rec, "w1", manifest)
    Trainer(cfg, sync=first, progress=False).train(max_steps=7)  # syncs at 2 (f1), 4 (f0), 6 (f1)
    saved = first.state_dict()
    second = Worker(cfg, rec, "w1", manifest)
    trainer = Trainer(cfg, sync=second, progress=False)  # resumes at step 7, between f1@6 and f0@8
    assert trainer.step == 7 and second.numbering.seq == 3 and second.book.fragment_rounds == [1, 1]
    for name, t in saved["accounted"].items():  # θ_sync = anchor − accounted, per share
        assert torch.equal(second.book.accounted[name], t) and torch.equal(
            second.book.anchor[name], saved["anchor"][name]
        )
        assert torch.equal(second.uploader.residual[name], saved["residual"][name])
    trainer.train(max_steps=12)
    ids = [f"w1/{n}" for n, _ in rec.sent]
    assert ids == [f"w1/{codec.delta_name('w1', s)}" for s in range(6)], ids
    assert master.applied == ids and master.fragment_rounds == [3, 3]
