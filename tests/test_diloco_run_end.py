"""How a DiLoCo run ends (diloco/master/end.py), with the master's real outer loop on a real directory
bus and real safetensors deltas: a stale final delta still ends its node (a forged or corrupt one does
not), the master ends when every node finished or left and says why (summary, metrics.json, head.json,
log line), and the final global is the best recent one by held-out loss when the last is worse — which a
worker still running installs like any newer global. One real-process run: a listed collaborator that
never starts does not keep the run from ending, and when it starts after the end it stops at once."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.master import Master
from speedtronic.diloco.worker import Coordinator
from test_diloco_master import Run


class Scripted:
    """An evaluator whose losses the test sets: one per call, in order; it records the weights it saw.
    Its runs pin distributed.defences.loss_probe=false: the probe's evaluations would take scripted losses."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = list(losses)
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, weights: dict[str, torch.Tensor]) -> float:
        self.seen.append({n: t.clone() for n, t in weights.items()})
        return self.losses[len(self.seen) - 1]


def master(
    run: Run,
    evaluate: Callable[[dict[str, torch.Tensor]], float] | None = None,
    momentum: float = 0.0,
    lr: float = 1.0,
) -> Master:
    m = Master(
        run.cfg,
        run.bus,
        run.manifest,
        codec.snapshot(run.model),
        state_dir=run.tmp_path / "state",
        momentum=momentum,
        lr=lr,
        evaluate=evaluate,
    )
    m.start_state()
    return m


def run_to_end(m: Master, end: int, idle_s: float = 120.0, linger_s: float = 0.0) -> str:
    """The master's loop on its thread, and `wait` as launch.run_master calls it."""
    m.start()
    try:
        return m.wait(end, idle_s=idle_s, linger_s=linger_s)
    finally:
        m.stop()


def test_a_stale_final_delta_ends_its_node_but_a_forged_one_does_not(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.rounds.max_staleness=1")
    m = master(run)
    m.ledger.outer_step = 3  # as if three rounds had happened
    stale = run.delta("w1", 0, base=0, final="1")  # staleness 3 > 1: rejected from the mean
    assert m.round() is False
    assert [r["id"] for r in m.rejected] == [stale] and "stale" in m.rejected[0]["reason"]
    assert m.finished == {"w1"} and m.hwm == {} and m.outer_step == 3  # no state moved but the end

    # Planted under w2's name: metadata naming another node, a corrupt payload, a replay of an applied
    # payload. Each is rejected and none ends w2.
    tensors = {n: torch.full(s.shape, 1e-3) for n, s in run.specs.items()}
    meta = {"kind": "delta", "seq": "0", "local_step": "4", "base_outer_step": "0", "final": "1"}
    run.raw("w2", codec.delta_name("w2", 0), codec.encode(tensors, "fp32", {**meta, "node": "mallory"}))
    assert m.round() is False and "metadata names node" in m.rejected[-1]["reason"]
    corrupt = bytearray(codec.encode(tensors, "fp32", {**meta, "node": "w2", "seq": "1"}))
    corrupt[-3] ^= 0x55
    run.raw("w2", codec.delta_name("w2", 1), bytes(corrupt))
    assert m.round() is False and "checksum" in m.rejected[-1]["reason"]
    applied = run.delta("w2", 2, base=3)
    payload = codec.decode((run.bus.root / "deltas" / applied).read_bytes(), run.specs, kind="delta")
    assert m.round() is True and m.applied == [applied] and m.finished == {"w1"}
    replay = {**meta, "node": "w2", "seq": "3", "base_outer_step": "4"}
    run.raw("w2", codec.delta_name("w2", 3), codec.encode(payload.tensors, "fp32", replay))
    assert m.round() is False and "replay" in m.rejected[-1]["reason"]
    assert m.finished == {"w1"}, m.rejected


def test_the_run_ends_when_all_nodes_finished_with_nothing_pending(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bug this fixes: w2's final delta arrives stale and is rejected; the master used to wait
    for w2 until its idle timeout. Now w2 counts as finished and the run ends at once."""
    run = Run(tmp_path, "distributed.rounds.min_deltas=2", "distributed.rounds.max_staleness=0")
    m = master(run)
    run.delta("w1", 0, base=0)
    run.delta("w2", 0, base=0)
    last = run.delta("w1", 1, base=1, final="1")
    stale = run.delta("w2", 1, base=0, final="1")  # built on outer step 0; the run will be at 1
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        reason = run_to_end(m, end=2, idle_s=120.0)
    assert reason == "all 2 nodes finished", reason
    assert m.outer_step == 2 and last in m.applied and [r["id"] for r in m.rejected] == [stale]
    assert m.finished == {"w1", "w2"} and m.pending_count == 0 and run.bus.list_deltas(None) == []
    summary = m.summary()
    assert summary["end_reason"] == reason and summary["final"]["chosen"] == "last"
    metrics = json.loads(m.metrics_path.read_text())
    assert metrics["end_reason"] == reason and metrics["pending"] == 0
    head = run.bus.read_head()
    assert head is not None and head["final"]["reason"] == reason and head["outer_step"] == 2
    lines = [r.getMessage() for r in caplog.records if "run complete" in r.getMessage()]
    assert len(lines) == 1 and "all 2 nodes finished" in lines[0] and "outer step 2" in lines[0], lines


def test_a_node_that_stops_sending_has_left_and_the_run_ends_naming_it(tmp_path: Path) -> None:
    """Listed w1, w2, w3: w1 sends its two deltas, w2 one and then nothing, w3 never starts. The
    liveness window (max_wait, 1 s here) passes; the run ends naming both, long before idle_s."""
    run = Run(tmp_path, "distributed.master.collaborators=[w1,w2,w3]", "distributed.rounds.max_wait=1.0")
    m = master(run)
    run.delta("w1", 0)
    run.delta("w2", 0)
    run.delta("w1", 1, base=1, final="1")
    reason = run_to_end(m, end=2, idle_s=300.0)
    assert reason.startswith("1 of 3 nodes finished; 2 left: w2 (last heard "), reason
    assert reason.endswith("s ago), w3 (never heard from)"), reason
    assert m.outer_step == 2 and m.pending_count == 0 and m.finished == {"w1"}
    assert json.loads(m.metrics_path.read_text())["end_reason"] == reason


def test_the_final_global_is_the_best_recent_one_when_the_last_is_worse(tmp_path: Path) -> None:
    # Losses: the initial global, after outer step 1, after outer step 2 (worse than step 1).
    evaluate = Scripted([5.0, 3.0, 4.0])
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.defences.loss_probe=false")
    m = master(run, evaluate)
    run.delta("w1", 0)
    assert m.round() is True
    run.delta("w1", 1, base=1, final="1")
    assert m.round() is True and m.val_losses == [(0, 5.0), (1, 3.0), (2, 4.0)]
    assert m.best is not None and m.best.outer_step == 1
    reason = run_to_end(m, end=2)
    assert reason == "all 1 nodes finished"
    step1 = evaluate.seen[1]  # the weights of outer step 1's global
    assert m.final == {
        "outer_step": 3,
        "from_outer_step": 1,
        "val_loss": 3.0,
        "last_val_loss": 4.0,
        "chosen": "best",
        "reason": reason,
    }
    head = run.bus.read_head()
    assert head is not None and head["outer_step"] == 3 and head["final"] == m.final
    published = codec.decode(run.bus.read_global(head), run.specs, kind="global")
    assert published.int("outer_step") == 3
    for name, tensor in step1.items():
        assert torch.equal(published.tensors[name], tensor), name
    assert m.summary()["global_val_loss"][-1] == {"outer_step": 3, "val_loss": 3.0}

    # A worker still running (it has installed outer step 2) takes it as a normal newer global.
    worker = Coordinator(run.cfg, run.bus, "w1", run.manifest)
    worker.book.outer_step = 2
    worker.poller.poll_once()
    incoming = worker.poller.take()
    assert incoming is not None and incoming[0] == 3
    for name, tensor in step1.items():
        assert torch.equal(incoming[1][name], tensor), name


def test_the_last_global_stays_final_when_it_is_the_best(tmp_path: Path) -> None:
    evaluate = Scripted([5.0, 3.0, 2.5])
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.defences.loss_probe=false")
    m = master(run, evaluate)
    run.delta("w1", 0)
    run.delta("w1", 1, base=1, final="1")
    reason = run_to_end(m, end=2)
    assert m.outer_step == 2 and m.final is not None
    assert (m.final["chosen"], m.final["outer_step"], m.final["val_loss"]) == ("last", 2, 2.5)
    head = run.bus.read_head()
    assert head is not None and head["outer_step"] == 2 and head["final"]["reason"] == reason


def test_a_diverged_global_is_refused_never_published_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A step whose global has a NaN validation loss is refused (logged): the previous global stays,
    nothing is published for it, and the next round steps from the previous global."""
    evaluate = Scripted([5.0, 3.0, float("nan"), 2.5])
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.defences.loss_probe=false")
    m = master(run, evaluate)
    run.delta("w1", 0)
    assert m.round() is True and m.outer_step == 1
    before = {n: t.clone() for n, t in m.outer.weights.items()}
    run.delta("w1", 1, base=1)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is False
    head = run.bus.read_head()
    assert m.outer_step == 1 and head is not None and head["outer_step"] == 1
    assert all(torch.equal(before[n], t) for n, t in m.outer.weights.items())
    assert any("refused outer step 2" in r.getMessage() and "nan" in r.getMessage() for r in caplog.records)
    assert "w1/w1--00000001.safetensors" in m.applied  # consumed (weighing 0), not applied again
    run.delta("w1", 2, base=1, final="1")
    assert run_to_end(m, end=2) == "all 1 nodes finished"
    assert m.outer_step == 2 and [loss for _, loss in m.val_losses] == [5.0, 3.0, 2.5]
    assert m.final is not None and m.final["chosen"] == "last" and m.final["val_loss"] == 2.5


def test_an_exploding_global_is_refused(tmp_path: Path) -> None:
    evaluate = Scripted([5.0, 3.0, 4.6])  # 4.6 > 1.5 × 3.0
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.defences.loss_probe=false")
    m = master(run, evaluate)
    run.delta("w1", 0)
    run.delta("w1", 1, base=1)
    assert m.round() is True and m.round() is False and m.outer_step == 1


def test_the_kept_global_is_the_best_of_the_whole_run(tmp_path: Path) -> None:
    """However long ago: a hostile majority late in a run cannot push the best global out of a window."""
    run = Run(tmp_path)
    m = master(run)
    m.end.remember(m.outer_step, 1.0, m.outer.weights)  # outer step 0: the best so far
    for step in range(1, 40):
        m.ledger.outer_step = step
        m.end.remember(step, 2.0 + step, m.outer.weights)
    assert m.best is not None and m.best.outer_step == 0 and m.best.val_loss == 1.0
    assert m.end.better(39, 41.0) is m.best


@pytest.mark.slow
def test_a_listed_node_that_never_starts_does_not_hold_the_run_end(tmp_path: Path) -> None:
    """Real processes: a master that does not train, w1 and w2, and `ghost` listed but never started.
    The run ends when w1 and w2 have finished and its last outer step is out (ghost, never heard from,
    holds nothing; no max_wait), saying so in the JSON summary, metrics.json, head.json and the last log line."""
    from test_diloco_multiprocess import TEXT, Procs, write_config

    procs = Procs(tmp_path)
    try:
        cfg = write_config(
            tmp_path,
            TEXT if TEXT.exists() else None,
            max_steps=10,
            collaborators=["w1", "w2", "ghost"],
            min_deltas=2,  # rounds do not wait for ghost: only the run's end has to decide about it
            # Neither never_heard_wait nor late_join_wait set, and a long max_wait: the run ends once
            # its last outer step is out (ghost was never heard from), not max_wait later.
            max_wait=600.0,
            late_join_wait=None,  # the shipped default (the harness pins 0)
        )
        bus = f"file://{tmp_path / 'bus'}"
        m = procs.start("master", "master", cfg, "--repo", bus, "--no-train", "--json")
        workers = [
            (n, procs.start(n, "worker", cfg, "--repo", bus, "--node-id", n, "--json")) for n in ("w1", "w2")
        ]
        results = [procs.result(n, p) for n, p in workers]
        rm = procs.result("master", m)
        # ghost starts after all: the run is over (head.json names its final global). Without the
        # stop it trained its 10 steps and waited a global_wait (max_wait: 600 s) for a global.
        late = procs.result(
            "ghost", procs.start("ghost", "worker", cfg, "--repo", bus, "--node-id", "ghost", "--json")
        )
    finally:
        procs.kill_all()
    uploaded = {f"{r['node']}/{name}" for r in results for name in r["uploaded"]}
    assert sorted(rm["applied"]) == sorted(uploaded) and rm["rejected"] == []
    assert rm["finished"] == ["w1", "w2"]
    reason = rm["end_reason"]
    assert reason.startswith("2 of 3 nodes finished; 1 left: ghost (never heard from)"), reason
    final = rm["final"]
    assert final["chosen"] in ("best", "last") and final["val_loss"] is not None, final
    losses = {e["outer_step"]: e["val_loss"] for e in rm["global_val_loss"]}
    assert final["val_loss"] == losses[final["from_outer_step"]] <= final["last_val_loss"], (final, losses)
    metrics = json.loads((tmp_path / "runs" / "dl" / "diloco-master" / "metrics.json").read_text())
    assert metrics["end_reason"] == reason and metrics["final"] == final
    head = json.loads((tmp_path / "bus" / "head.json").read_text())
    assert head["final"] == final and head["outer_step"] == final["outer_step"]
    last = [line for line in procs.log("master").splitlines() if "DiLoCo master" in line][-1]
    assert "run complete" in last and "ghost (never heard from)" in last, last
    assert late["uploaded"] == [] and late["ended_early"], late
    assert "the DiLoCo run is over: its master published the final global" in procs.log("ghost")
    print(f"\nrun end: {reason}; final {final}")


def test_past_the_end_a_silent_node_that_holds_its_id_has_not_left(tmp_path: Path) -> None:
    """A worker killed and started again takes its lease back at once but sends nothing until its
    start-up and H steps are done — under load longer than END_FACTOR × its window, and the run used to
    end then with its last deltas unprocessed (test_diloco_node_restart's flake). Past the end, a silent
    node whose lease on its id is live has not left, up to max_wait; without a lease, or past max_wait, it
    has. Before the end the lease is not read (no request spent)."""
    from speedtronic.diloco.master.end import LEASE_LOOK_S

    run = Run(tmp_path, "distributed.master.collaborators=[w1,w2]", "distributed.rounds.max_wait=30.0")
    m = master(run)
    reads: list[str] = []
    read = m.end.id_leases.read
    m.end.id_leases.read = lambda node: reads.append(node) or read(node)

    def left(silent_s: float) -> dict[str, float | None]:
        m.rounds.heard["w2"] = m.clock() - silent_s
        m.rounds.intervals["w2"] = [0.5, 0.5, 0.5]  # live window 1.5 s: the end's is 4.5 s
        m.end.id_leases.seen.clear()  # read again (at most every LEASE_LOOK_S otherwise)
        return m._liveness().left(m.clock())

    claim = run.bus.claim("w2", "w2@restarted", 60.0)
    assert "w2" in left(10.0) and reads == []  # the end is not out: no lease read
    m.end.ends_at(0)  # outer step 0 of 0: the run's end is out
    assert "w2" not in left(10.0) and reads == ["w2"]  # it holds its id: restarting, not gone
    m.rounds.heard["w2"] = m.clock() - 10.0
    assert "w2" not in m._liveness().left(m.clock()) and reads == ["w2"]  # cached for LEASE_LOOK_S
    assert LEASE_LOOK_S > 1
    assert "w2" in left(31.0)  # silent past max_wait: gone, lease or not
    run.bus.release(claim)
    assert "w2" in left(10.0)  # no lease: gone after END_FACTOR × its window, as before
    assert "w1" not in left(10.0)  # never heard from: its own rule (the late joiners' window)
