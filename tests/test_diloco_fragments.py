"""Streaming DiLoCo (distributed.sync.fragments) and overlapped sync (distributed.sync.overlap_steps) in one process:
a real Trainer and Coordinator against a real Master on a directory bus, the master stepping right after
each worker step so every round is deterministic.

What is checked: the partition (deterministic, contiguous, balanced) and the schedule (each fragment
once per H steps at offset p·H/P); the refusals (config, a node with another partition); each upload
carries exactly its fragment's tensors and the peak upload falls by ~P; the master keeps per-fragment
rounds and moves only the fragment a round is about; a late fragment delta counts once, weighted by
its own fragment's staleness, and a replay of it does not; a resume between two fragment syncs keeps
delta ids exactly once; the overlap installs each fragment's global exactly τ steps after its sync
with θ ← G + (θ_now − θ_sync), and the run still learns.
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
from speedtronic.diloco.manifest import build_manifest
from speedtronic.diloco.master import Master
from speedtronic.diloco.master import fragments as master_fragments
from speedtronic.diloco.outer import sync_steps
from speedtronic.diloco.worker import Coordinator, overlap
from speedtronic.engine.build import build_model
from speedtronic.errors import ConfigError, SpeedtronicError

pytestmark = pytest.mark.usefixtures("isolated_env")

BASE = [
    "run.device=cpu",
    "run.eval_every=0",
    "run.log_every=1",
    "logging.hooks=[]",
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=32",
    "data.synthetic=true",
    "data.vocab_size=64",
    "data.num_tokens=20000",
    "data.block_size=16",
    "data.micro_batch_size=4",
    "data.val_batches=0",
    "optimizer.lr=1.0e-2",
    "distributed.enabled=true",
    "distributed.sync.inner_steps=4",
    "distributed.sync.ramp=false",
    "distributed.sync.delta_codec=fp32",
    "distributed.node.poll_interval=0.05",
    "distributed.bus.retry_initial=0.05",
    "distributed.bus.retry_max=0.1",
    "distributed.rounds.max_wait=5",
    "distributed.worker.async_upload=false",
    "distributed.worker.async_global_poll=false",
    "distributed.rounds.min_deltas=1",
    # Install-when-it-arrives (the tests that overlap set overlap_steps themselves, later, which wins).
    "distributed.sync.overlap_steps=0",
    # Fragments of whole tensors: these tests name the tensors of each fragment (the default layout,
    # elements, is tests/test_diloco_fragment_elements.py's).
    "distributed.sync.fragment_layout=layers",
]


def setup_run(
    tmp_path: Path, *extra: str, vocab: int = 64
) -> tuple[Any, DirectoryBus, dict[str, Any], Master]:
    cfg = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'out'}", *extra])
    torch.manual_seed(0)
    model = build_model(cfg, vocab)
    bus = DirectoryBus(str(tmp_path / "bus"))
    bus.create_run()
    manifest = build_manifest(cfg, codec.param_specs(model))
    bus.write_manifest(manifest)
    master = Master(cfg, bus, manifest, codec.snapshot(model), state_dir=tmp_path / "state", momentum=0.5)
    master.start_state()
    return cfg, bus, manifest, master


class Recorder(DirectoryBus):
    """A directory bus that keeps a copy of every delta put on it (the master deletes them)."""

    sent: list[tuple[str, bytes]]

    def put_delta(self, node: str, name: str, data: bytes, *, prune: Any = ()) -> None:
        self.sent.append((name, data))
        super().put_delta(node, name, data, prune=prune)


def recording(bus: DirectoryBus) -> Recorder:
    rec = Recorder(str(bus.root))
    rec.sent = []
    return rec


def stepping_worker(master: Master) -> type[Coordinator]:
    class Worker(Coordinator):
        """The master runs a round right after each worker step: deterministic rounds."""

        installs_at: list[tuple[int, list[int]]]

        def after_step(self, model: Any, *, step: int, tokens: int) -> bool:
            installed = super().after_step(model, step=step, tokens=tokens)
            master.round()
            return installed

        def install_fragments(
            self, model: Any, inner_step: int, g: Any, moved: set[int], fresh: bool = False
        ):
            if moved:
                self.installs_at = [*getattr(self, "installs_at", []), (inner_step, sorted(moved))]
            return super().install_fragments(model, inner_step, g, moved, fresh)

    return Worker


def sync_recorder(base: type[Coordinator], syncs: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> Any:
    """`base`, recording each fragment's last sync: fragment -> (step, the weights at that sync)."""

    class Recorded(base):  # type: ignore[misc, valid-type]
        def queue_delta(self, model: Any, step: int, fragment: int) -> None:
            syncs[fragment] = (step, codec.snapshot(model))
            super().queue_delta(model, step, fragment)

    return Recorded


def decoded(sent: list[tuple[str, bytes]], specs: dict[str, codec.ParamSpec], count: int) -> list[Any]:
    plan = fragments.Plan(specs, count, 4, False)
    return [codec.decode(data, specs, kind="delta", select=plan.select) for _, data in sent]


# -- the partition and the schedule -------------------------------------------------------------------
def test_the_partition_is_deterministic_contiguous_and_balanced() -> None:
    cfg = load_config(None, BASE)
    specs = codec.param_specs(build_model(cfg, 64))
    shuffled = dict(reversed(list(specs.items())))
    for count in (2, 3, 4):
        groups = fragments.partition(specs, count)
        assert groups == fragments.partition(shuffled, count)  # names and shapes only, not their order
        flat = [n for g in groups for n in g]
        assert sorted(flat) == sorted(specs) and len(flat) == len(set(flat))  # every tensor exactly once
        assert flat == sorted(specs, key=fragments._natural)  # contiguous in layer order
        sizes = [sum(fragments._numel(specs[n]) for n in g) for g in groups]
        assert all(sizes) and max(sizes) <= 1.6 * sum(sizes) / count, sizes
    assert fragments.partition(specs, 2)[0][0].startswith("blocks.0.")  # blocks.0 before blocks.1
    with pytest.raises(SpeedtronicError, match=r"distributed\.sync\.fragments is 999"):
        fragments.partition(specs, 999)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_each_fragment_syncs_once_per_h_steps_at_its_offset(count: int) -> None:
    H, total = 12, 60
    points = fragments.sync_points(total, H, count, False)
    by_fragment: dict[int, list[int]] = {}
    for step in range(1, total + 1):
        p = fragments.fragment_at(step, H, count, False)
        if p is not None:
            by_fragment.setdefault(p, []).append(step)
    assert sorted(s for v in by_fragment.values() for s in v) == points
    for p in range(count):
        offset = p * H // count
        assert by_fragment[p] == list(range(offset or H, total + 1, H)), p
    if count == 1:
        assert points == sync_steps(total, H, False)
        assert fragments.sync_points(total, H, 1, True) == sync_steps(total, H, True)


def test_bad_combinations_are_refused_naming_the_field() -> None:
    cases = {
        "distributed.sync.ramp=true": "distributed.sync.fragments > 1 needs a fixed schedule",
        "distributed.sync.fragments=9": "must be <= distributed.sync.inner_steps",
    }
    for setting, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*BASE, "distributed.sync.fragments=2", setting])
    with pytest.raises(ConfigError, match=r"distributed\.sync\.overlap_steps"):
        load_config(None, [*BASE, "distributed.sync.overlap_steps=4"])


def test_a_node_with_other_fragments_is_refused(tmp_path: Path) -> None:
    cfg, bus, manifest, _ = setup_run(tmp_path, "distributed.sync.fragments=2")
    assert (
        manifest["run"]["fragments"]["count"] == 2
        and manifest["run"]["outer_steps"] == 2 * cfg.max_steps() // 4
    )
    other = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'o'}", "distributed.sync.fragments=1"])
    with pytest.raises(SpeedtronicError, match=r"distributed.sync.fragments is 1 here, but the run syncs 2"):
        Trainer(other, sync=Coordinator(other, bus, "w9", manifest), progress=False).train(max_steps=1)
    tampered = {**manifest, "run": {**manifest["run"], "fragments": {"count": 2, "digest": "sha256:0"}}}
    plan = fragments.Plan.from_config(codec.param_specs(build_model(cfg, 64)), cfg.distributed)
    with pytest.raises(SpeedtronicError, match="splits the model into fragments differently"):
        fragments.check(tampered, plan, "x")


# -- fragments end to end ------------------------------------------------------------------------------
def run_worker(tmp_path: Path, steps: int, *extra: str) -> tuple[Any, Master, Recorder, Any, Any]:
    cfg, bus, manifest, master = setup_run(tmp_path, "checkpoint.enabled=false", *extra)
    rec = recording(bus)
    worker = stepping_worker(master)(cfg, rec, "w1", manifest)
    trainer = Trainer(cfg, sync=worker, progress=False)
    result = trainer.train(max_steps=steps)
    return manifest, master, rec, worker, result


def test_fragments_sync_in_turn_and_the_master_moves_only_the_synced_fragment(tmp_path: Path) -> None:
    manifest, master, rec, worker, _ = run_worker(tmp_path / "p2", 16, "distributed.sync.fragments=2")
    specs = codec.specs_from_json(manifest["params"])
    plan = fragments.Plan(specs, 2, 4, False)
    deltas = decoded(rec.sent, specs, 2)
    ids = [f"w1/{name}" for name, _ in rec.sent]
    # Steps 2, 6, 10, 14 sync fragment 1; 4, 8, 12, 16 fragment 0.
    assert [d.meta["fragment"] for d in deltas] == ["1", "0"] * 4, ids
    assert [int(d.meta["local_step"]) for d in deltas] == [2, 4, 6, 8, 10, 12, 14, 16]
    for d in deltas:
        assert sorted(d.tensors) == sorted(plan.groups[int(d.meta["fragment"])])  # its own tensors only
    assert master.applied == ids, f"applied {master.applied}\nsent {ids}"  # each exactly once, in order
    assert master.fragment_rounds == [4, 4] and master.outer_step == 8
    head = rec.read_head()
    assert head is not None and head["fragments"] == {"count": 2, "rounds": [4, 4]}

    # The peak upload falls by about P (the partition is balanced to within the tensor sizes).
    _, _, rec1, worker1, _ = run_worker(tmp_path / "p1", 16)
    assert worker1.uploader.peak_delta_bytes == max(len(d) for _, d in rec1.sent)
    ratio = worker.uploader.peak_delta_bytes / worker1.uploader.peak_delta_bytes
    print(
        f"\npeak upload per sync: P=1 {worker1.uploader.peak_delta_bytes} B, P=2 {worker.uploader.peak_delta_bytes} B ({ratio:.2f})"
    )
    assert 0.45 <= ratio <= 0.6, ratio
    # The same bytes over the run in all (twice the syncs, each half the size).
    assert abs(worker.uploader.bytes_sent - worker1.uploader.bytes_sent) / worker1.uploader.bytes_sent < 0.05


def test_a_round_steps_only_its_fragments_tensors(tmp_path: Path) -> None:
    _, bus, _, master = setup_run(tmp_path, "distributed.sync.fragments=2")
    plan = master.frags
    put(bus, master, "a", 0, 1, fragment_round=0, value=0.01)
    before = {n: t.clone() for n, t in master.outer.weights.items()}
    assert master.round() and master.fragment_rounds == [0, 1]
    for n, t in master.outer.weights.items():
        moved = not torch.equal(t, before[n])
        assert moved == (n in plan.groups[1]), n  # fragment 0 untouched, bitwise
        if n in plan.groups[0]:
            assert torch.equal(master.outer.momentum_buffers[n], torch.zeros_like(t))


def put(
    bus: DirectoryBus,
    master: Master,
    node: str,
    seq: int,
    fragment: int,
    *,
    fragment_round: int,
    value: float,
    tensors_of: int | None = None,
) -> str:
    """A fragment delta of constant `value` as a worker would send it (with `tensors_of`: the tensors
    of another fragment than the one it claims)."""
    group = master.frags.groups[fragment if tensors_of is None else tensors_of]
    x = {n: torch.full(master.specs[n].shape, value) for n in group}
    return put_tensors(bus, node, seq, fragment, fragment_round, x)


def put_tensors(
    bus: DirectoryBus, node: str, seq: int, fragment: int, fragment_round: int, x: dict[str, torch.Tensor]
) -> str:
    """Fragment delta `x` of `node`'s sequence number `seq` on the bus, as a worker would send it."""
    meta = {
        "kind": "delta",
        "node": node,
        "seq": str(seq),
        "local_step": str(4 * (seq + 1)),
        "base_outer_step": "0",
        "tokens": "64",
        "final": "0",
        "fragment": str(fragment),
        "fragment_round": str(fragment_round),
    }
    name = codec.delta_name(node, seq)
    bus.put_delta(node, name, codec.encode(x, "fp32", meta))
    return f"{node}/{name}"


def test_a_late_fragment_counts_once_weighted_by_its_own_fragments_staleness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights: list[list[float]] = []  # each fragment aggregate's (Δ, weight) weights, in order
    real = master_fragments.aggregate
    monkeypatch.setattr(
        master_fragments,
        "aggregate",
        lambda items, method: weights.append([w for _, w in items]) or real(items, method),
    )
    _, bus, _, master = setup_run(
        tmp_path, "distributed.sync.fragments=2", "distributed.rounds.max_staleness=2"
    )
    groups = master.frags.groups
    put(bus, master, "a", 0, 0, fragment_round=0, value=0.010)
    assert master.round()
    put(bus, master, "a", 1, 1, fragment_round=0, value=0.011)
    assert master.round()
    put(bus, master, "a", 2, 0, fragment_round=1, value=0.012)
    assert master.round() and master.fragment_rounds == [2, 1] and master.outer_step == 3
    # b's fragment-1 delta, built on the first global, arrives after the master moved on: fragment 1
    # moved once since, so it is 1 round stale (not 3, the outer steps since) and counts at 1/2 next
    # to a's fresh fragment-1 delta in the same round.
    w = {n: t.clone() for n, t in master.outer.weights.items()}
    late = put(bus, master, "b", 0, 1, fragment_round=0, value=0.02)
    put(bus, master, "a", 3, 1, fragment_round=1, value=0.013)
    assert master.round() and master.fragment_rounds == [2, 2] and master.outer_step == 4
    assert master.applied.count(late) == 1
    assert sorted(weights[-1]) == [32.0, 64.0], weights  # 64 tokens each: × 1/(1+1) and × 1
    assert all(torch.equal(master.outer.weights[n], w[n]) for n in groups[0])
    # The same file again (a replay after a crash) and the same payload renamed: neither counts.
    again = put(bus, master, "b", 0, 1, fragment_round=0, value=0.02)
    copy = put(bus, master, "b", 1, 1, fragment_round=0, value=0.02)
    master.round()
    master.round()
    assert again == late and master.applied.count(late) == 1 and copy not in master.applied
    reasons = {r["id"]: r["reason"] for r in master.rejected}
    assert "replay" in reasons[copy], reasons
    # Past max_staleness for its fragment: rejected, saying which fragment and how far behind.
    for seq, r in ((4, 2), (5, 3), (6, 4)):
        put(bus, master, "a", seq, 1, fragment_round=r, value=0.01 + seq / 1000)
        master.round()
    assert master.fragment_rounds == [2, 5]
    stale = put(bus, master, "b", 2, 1, fragment_round=1, value=0.021)
    master.round()
    reasons = {r["id"]: r["reason"] for r in master.rejected}
    assert "fragment 1: 4 rounds behind" in reasons[stale], reasons
    # A delta carrying another fragment's tensors than the one it names is refused, by name.
    wrong = put(bus, master, "b", 3, 1, fragment_round=5, value=0.022, tensors_of=0)
    master.round()
    reasons = {r["id"]: r["reason"] for r in master.rejected}
    assert "tensor names do not match" in reasons[wrong], reasons
    print(f"\napplied {master.applied}\nrejected {master.rejected}")


def test_a_resume_between_two_fragment_syncs_keeps_delta_ids_exactly_once(tmp_path: Path) -> None:
    cfg, bus, manifest, master = setup_run(
        tmp_path, "distributed.sync.fragments=2", "checkpoint.every_steps=1"
    )
    rec = recording(bus)
    Worker = stepping_worker(master)
    first = Worker(cfg, rec, "w1", manifest)
    Trainer(cfg, sync=first, progress=False).train(max_steps=7)  # syncs at 2 (f1), 4 (f0), 6 (f1)
    saved = first.state_dict()
    assert saved["seq"] == 3 and saved["fragment_rounds"] == [1, 1] and saved["fragments"] == 2
    second = Worker(cfg, rec, "w1", manifest)
    trainer = Trainer(cfg, sync=second, progress=False)  # resumes at step 7, between f1@6 and f0@8
    assert trainer.step == 7 and second.numbering.seq == 3 and second.book.fragment_rounds == [1, 1]
    for name, t in saved["accounted"].items():  # the sync snapshots θ_sync = anchor − accounted
        assert torch.equal(second.book.accounted[name], t) and torch.equal(
            second.book.anchor[name], saved["anchor"][name]
        )
    trainer.train(max_steps=12)
    ids = [f"w1/{n}" for n, _ in rec.sent]
    assert ids == [f"w1/{codec.delta_name('w1', s)}" for s in range(6)], ids
    specs = codec.specs_from_json(manifest["params"])
    assert [d.meta["fragment"] for d in decoded(rec.sent, specs, 2)] == ["1", "0"] * 3
    assert master.applied == ids and master.fragment_rounds == [3, 3]


def test_a_resume_inside_an_overlap_installs_at_the_due_step(tmp_path: Path) -> None:
    """Killed (well: stopped, checkpoint at every step) right after fragment 1's sync at step 6, whose
    global is due at step 7 (overlap_steps 1): the resumed node installs it at step 7, exactly once."""
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        "distributed.sync.fragments=2",
        "distributed.sync.overlap_steps=1",
        "checkpoint.every_steps=1",
    )
    rec = recording(bus)
    Worker = stepping_worker(master)
    first = Worker(cfg, rec, "w1", manifest)
    Trainer(cfg, sync=first, progress=False).train(max_steps=6)
    assert first.state_dict()["overlap"] == [[1, 2, 7]]  # fragment 1, delta #2, due at step 7
    second = Worker(cfg, rec, "w1", manifest)
    trainer = Trainer(cfg, sync=second, progress=False)
    assert trainer.step == 6 and second.overlap.pending.due == {1: (2, 7)}
    trainer.train(max_steps=12)
    assert second.installs_at[0] == (7, [1]), second.installs_at  # the first thing it installs
    assert [s for s, _ in second.installs_at] == [7, 9, 11], second.installs_at
    ids = [f"w1/{n}" for n, _ in rec.sent]
    assert ids == [f"w1/{codec.delta_name('w1', s)}" for s in range(6)] and master.applied == ids, ids


# -- overlap ---------------------------------------------------------------------------------------------
def test_the_overlap_merge_keeps_the_local_progress() -> None:
    g = torch.tensor([1.0, 2.0, 3.0])
    at_sync = torch.tensor([0.5, 0.5, 0.5])
    now = torch.tensor([0.75, 0.25, 1.5])
    anchor = torch.tensor([0.0, 1.0, 2.0])
    accounted = anchor - at_sync  # what the sync queued: θ_sync = anchor − accounted
    out = overlap.merge(g, now, anchor, accounted)
    assert torch.allclose(out, g + (now - at_sync))
    assert torch.equal(overlap.merge(g, anchor, anchor, torch.zeros(3)), g)  # no progress: the global itself


@pytest.mark.parametrize("count,tau", [(2, 1), (1, 2)])
def test_overlap_installs_each_global_tau_steps_late_with_the_correction(
    tmp_path: Path, count: int, tau: int
) -> None:
    # Real text (the embedded corpus, byte vocabulary): the random synthetic tokens teach nothing.
    text = ("checkpoint.enabled=false", "data.synthetic=false", "data.vocab_size=null")
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        *text,
        f"distributed.sync.fragments={count}",
        f"distributed.sync.overlap_steps={tau}",
        vocab=256,
    )
    Worker = stepping_worker(master)
    checks: list[tuple[int, float]] = []

    syncs: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}

    class Checked(sync_recorder(Worker, syncs)):  # type: ignore[misc]
        def install_fragments(
            self, model: Any, inner_step: int, g: Any, moved: set[int], fresh: bool = False
        ):
            before = codec.snapshot(model)
            super().install_fragments(model, inner_step, g, moved, fresh)
            if fresh:
                return
            after = codec.snapshot(model)
            for p in moved:
                step, at_sync = syncs[p]
                assert inner_step == step + tau, (p, step, inner_step)
                for n in self.frags.groups[p]:
                    want = g.tensors[n] + (before[n] - at_sync[n])
                    checks.append((p, float((after[n] - want).abs().max())))

    worker = Checked(cfg, bus, "w1", manifest)
    result = Trainer(cfg, sync=worker, progress=False).train(max_steps=24)
    assert checks and max(err for _, err in checks) < 1e-5, checks
    installed = [s for s, _ in worker.installs_at]
    offsets = fragments.offsets(4, count)
    expected = sorted(s + tau for s in range(1, 24) if s % 4 in offsets and s + tau <= 24)
    assert installed[1:] == expected, worker.installs_at  # the first is the fresh start
    assert master.outer_step == len(fragments.sync_points(24, 4, count, False))
    # It learns (5.5 at the first step), about as well as the same run installing globals at once.
    cfg0, bus0, manifest0, master0 = setup_run(
        tmp_path / "t0", *text, f"distributed.sync.fragments={count}", vocab=256
    )
    plain = Trainer(cfg0, sync=stepping_worker(master0)(cfg0, bus0, "w1", manifest0), progress=False).train(
        max_steps=24
    )
    print(
        f"\nP={count}: final loss {result.final_loss:.3f} with overlap τ={tau}, {plain.final_loss:.3f} without"
    )
    assert result.final_loss < 4.6 and result.final_loss < plain.final_loss + 0.25, (result, plain)
