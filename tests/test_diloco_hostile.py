"""Hostile peers inside the run: a listed collaborator that sends well-formed deltas with lying claims
or norms chosen to steer or silence the round. Real master rounds on a real directory bus with real
safetensors deltas (test_diloco_master.Run); the checks themselves are in diloco/master/checks.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import DeltaRef
from speedtronic.diloco.documents import Manifest
from speedtronic.diloco.master.peers import Peers
from speedtronic.diloco.spec import MAX_NODE_RANKS, RunSpec
from test_diloco_master import Run


def tensors_of(run: Run, delta_id: str) -> dict[str, torch.Tensor]:
    data = (run.bus.root / "deltas" / delta_id).read_bytes()
    return codec.decode(data, run.specs, kind="delta").tensors


def test_the_manifest_holds_the_token_plan_and_old_manifests_still_bound_claims(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.sync.inner_steps=4")
    per_step = 16 * 16 * MAX_NODE_RANKS  # micro_batch_size × block_size × ranks (no target batch)
    assert run.manifest["run"]["tokens_per_step"] == per_step
    assert run.manifest["run"]["max_delta_tokens"] == 4 * per_step
    old = {**run.manifest, "run": {k: v for k, v in run.manifest["run"].items() if "tokens" not in k}}
    # derived from the manifest's inner_steps
    assert RunSpec.of_run(Manifest.parse(old), run.cfg).max_delta_tokens == 4 * per_step
    fixed = Run(tmp_path / "fixed", "distributed.sync.inner_steps=4", "data.target_batch_size=32")
    assert fixed.manifest["run"]["max_delta_tokens"] == 4 * 32 * 16
    # The outer step as it runs: the defaults resolved (not null), or the configured values.
    assert (run.manifest["run"]["outer_lr"], run.manifest["run"]["outer_momentum"]) == (0.7, 0.8)
    set_ = Run(tmp_path / "set", "distributed.sync.outer_lr=0.5", "distributed.sync.outer_momentum=0.6")
    assert (set_.manifest["run"]["outer_lr"], set_.manifest["run"]["outer_momentum"]) == (0.5, 0.6)


def test_token_inflation_is_clipped_to_the_plan_and_logged_with_node_and_claim(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Under mean, where the weights decide the most (clipped_mean, the default, also clips norms).
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=2",
        "distributed.sync.inner_steps=4",
        "distributed.defences.aggregation=mean",
    )
    plan = run.manifest["run"]["max_delta_tokens"]
    m = run.master()
    start = {n: t.clone() for n, t in m.outer.weights.items()}
    honest = run.delta("w1", 0, tokens=str(plan))
    evil = run.delta("evil", 0, tokens=str(10**30))
    d1, d2 = tensors_of(run, honest), tensors_of(run, evil)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is True
    assert sorted(m.applied) == sorted([honest, evil])
    # Both count as one round's plan: the mean is the plain average, not the attacker's delta.
    for n, w in m.outer.weights.items():
        assert torch.allclose(w, start[n] - (d1[n] + d2[n]) / 2, atol=1e-7)
    (line,) = [r.getMessage() for r in caplog.records if "claims" in r.getMessage()]
    assert "evil" in line and str(10**30) in line and f"counted as {plan}" in line


def test_sequence_numbers_and_steps_past_what_the_run_allows_are_rejected(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    run.delta("w1", codec.SEQ_WINDOW + 1)  # no honest worker numbers this far past the master's mark
    run.delta("w2", 0, local_step="-5")
    assert m.round() is False
    reasons = {r["id"]: r["reason"] for r in m.rejected}
    assert "more than 10000 past" in reasons[f"w1/{codec.delta_name('w1', codec.SEQ_WINDOW + 1)}"]
    assert "local_step -5 is negative" in reasons["w2/w2--00000000.safetensors"]
    assert m.hwm == {} and m.outer_step == 0
    ok = run.delta("w1", 3)  # within the window (earlier ones may have been dropped): accepted
    assert m.round() is True and m.applied == [ok]


def test_tiny_deltas_first_do_not_lock_honest_peers_out_even_after_a_restart(
    tmp_path: Path,
) -> None:
    """The lock-out of issue 24: three well-formed 1e-6-scale deltas from one node put the median of the
    norm history near zero, and every honest delta afterwards was rejected as a norm outlier."""
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    for seq in range(3):
        tiny = run.delta("tiny", seq, scale=1e-6, base=m.outer_step)
        assert m.round() is True and m.applied[-1] == tiny
    for seq in range(2):
        honest = run.delta("w1", seq, base=m.outer_step)  # 1000× the tiny ones: an ordinary honest delta
        assert m.round() is True, m.rejected
        assert m.applied[-1] == honest
    assert m.rejected == []
    again = run.master()  # the history is saved: a restart must not bring a lock-out back
    b = again.outer_step
    more = [run.delta("tiny", 3, scale=1e-6, base=b), run.delta("w1", 2, base=b), run.delta("w2", 0, base=b)]
    again.min_deltas = 3
    assert again.round() is True and sorted(again.applied[-3:]) == sorted(more) and again.rejected == []


def test_one_node_cannot_fill_the_history_with_large_norms_to_let_its_poison_in(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    for seq in range(6):  # honest rounds from three nodes
        run.delta(f"w{seq % 3}", seq // 3, base=m.outer_step)
        assert m.round() is True
    for seq in range(8):  # the attacker sends ever larger deltas alone, each a round of its own
        run.delta("evil", seq, scale=1e-3 * 3**seq, base=m.outer_step)
        m.round()
    reasons = {r["id"]: r["reason"] for r in m.rejected if r["id"].startswith("evil/")}
    # The attacker is one vote among four: its history never raises the reference, so everything past
    # 10× the honest norm (3³ = 27× and up) is refused however long it keeps trying.
    assert sorted(reasons) == [f"evil/{codec.delta_name('evil', s)}" for s in range(3, 8)]
    assert all("norm" in reason for reason in reasons.values())
    b = m.outer_step
    good = [run.delta("w0", 2, base=b), run.delta("w1", 2, base=b), run.delta("w2", 2, base=b)]
    m.rounds.min_deltas = 3
    assert m.round() is True and sorted(m.applied[-3:]) == sorted(good)


def test_the_master_publishes_why_it_rejects_a_node_and_resets_on_an_applied_delta(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    m.report.feedback_every_s = 0.0  # republish the head on every poll that rejects (default: once a minute)
    run.delta("w1", 0, scale=1.0)  # 1000× an honest delta: over the global weights' norm bound
    run.delta("w1", 1, scale=1.0, base=0)
    assert m.round() is False and m.round() is False and m.outer_step == 0
    head = run.bus.read_head()
    assert head["outer_step"] == 0 and head["rejected"] == {"w1": 2}
    entry = head["rejections"]["w1"]
    assert entry["consecutive"] == 2
    assert [name for name, _ in entry["recent"]] == ["w1--00000000.safetensors", "w1--00000001.safetensors"]
    assert all("global weights' norm" in reason for _, reason in entry["recent"])
    run.delta("w1", 2)
    assert m.round() is True
    assert run.bus.read_head()["rejections"]["w1"]["consecutive"] == 0
    assert run.master().report.feedback["w1"]["consecutive"] == 0  # persisted in the state


def test_a_worker_whose_deltas_are_all_rejected_logs_why_and_stops_with_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from speedtronic import Trainer
    from speedtronic.diloco.worker import Coordinator
    from speedtronic.errors import SpeedtronicError
    from test_diloco_coordinator import setup_run

    extra = [
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.worker.async_global_poll=false",
        "distributed.worker.max_rounds_ahead=1",
        "distributed.worker.max_consecutive_rejections=2",
    ]
    cfg, bus, manifest, m = setup_run(tmp_path, *extra, "distributed.rounds.min_deltas=1")
    m.limits.max_bytes = 200  # a master whose size limit refuses every delta this worker can send
    m.report.feedback_every_s = 0.0
    planted = codec.delta_name("w1", 50)  # someone else's garbage under w1's name: not w1's own
    (bus.root / "deltas" / "w1").mkdir(parents=True)
    (bus.root / "deltas" / "w1" / planted).write_bytes(b"garbage")
    m.start()
    try:
        coordinator = Coordinator(cfg, bus, "w1", manifest)
        with (
            caplog.at_level(logging.WARNING, logger="speedtronic.diloco"),
            pytest.raises(SpeedtronicError, match="the master rejected its last 2 deltas"),
        ):
            Trainer(cfg, sync=coordinator, progress=False).train(max_steps=40)
    finally:
        m.stop()
    logged = [r.getMessage() for r in caplog.records if "the master rejected w1--" in r.getMessage()]
    assert len(logged) == 2 and all("size limit" in line for line in logged), logged
    assert not any(planted in line for line in logged)  # the planted file never counts as the node's
    assert len(coordinator.uploaded) < 20  # it stopped early instead of training on for nothing


def test_robust_aggregations_on_known_values() -> None:
    from speedtronic.diloco.outer import aggregate, weighted_mean

    def deltas(*values: float) -> list[tuple[dict[str, torch.Tensor], float]]:
        return [({"a": torch.tensor([v, -v])}, 1.0) for v in values]

    weighted = [({"a": torch.tensor([1.0, 2.0])}, 3.0), ({"a": torch.tensor([5.0, 6.0])}, 1.0)]
    assert torch.equal(aggregate(weighted, "mean")["a"], weighted_mean(weighted)["a"])
    assert aggregate(deltas(1, 2, 100), "median")["a"].tolist() == [2.0, -2.0]
    assert aggregate(deltas(1, 2, 4, 100), "median")["a"].tolist() == [3.0, -3.0]
    # 5 deltas: the largest and smallest of each coordinate dropped (⌊5/5⌋ = 1).
    assert aggregate(deltas(-50, 1, 2, 3, 100), "trimmed_mean")["a"].tolist() == [2.0, -2.0]
    # clipped_mean: the ×100 delta is scaled to the median norm (2) before the mean of 1, 2 and 2.
    assert aggregate(deltas(1, 2, 100), "clipped_mean")["a"] == pytest.approx(torch.tensor([5 / 3, -5 / 3]))
    # With two deltas there is nothing to cut: the plain mean (token claims ignored).
    assert aggregate(weighted, "median")["a"].tolist() == [3.0, 4.0]


@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed_mean", "clipped_mean"])
def test_a_reversed_delta_at_a_plausible_norm_cannot_steer_a_robust_round(
    tmp_path: Path, aggregation: str
) -> None:
    """Four honest nodes agree on a direction; one hostile node sends its reverse ×5 (within the norm
    check); all claim the plan's tokens. The mean is pulled backwards; the robust aggregations still
    move the model the honest way."""
    run = Run(tmp_path, "distributed.rounds.min_deltas=5", f"distributed.defences.aggregation={aggregation}")
    plan = str(run.manifest["run"]["max_delta_tokens"])
    m = run.master()
    start = {n: t.clone() for n, t in m.outer.weights.items()}
    g = torch.Generator().manual_seed(7)
    direction = {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in run.specs.items()}
    for i in range(4):
        noisy = {n: t + torch.randn(t.shape, generator=g) * 2e-4 for n, t in direction.items()}
        header = {"kind": "delta", "node": f"w{i}", "seq": "0", "base_outer_step": "0", "tokens": plan}
        run.bus.put_delta(f"w{i}", codec.delta_name(f"w{i}", 0), codec.encode(noisy, "fp32", header))
    evil = {n: -5 * t for n, t in direction.items()}
    header = {"kind": "delta", "node": "evil", "seq": "0", "base_outer_step": "0", "tokens": plan}
    run.bus.put_delta("evil", codec.delta_name("evil", 0), codec.encode(evil, "fp32", header))
    assert m.round() is True and len(m.applied) == 5  # nothing for the norm check to refuse
    moved = torch.cat([(start[n] - m.outer.weights[n]).flatten() for n in start])
    honest = torch.cat([t.flatten() for t in direction.values()])
    cosine = float(torch.nn.functional.cosine_similarity(moved, honest, dim=0))
    if aggregation == "mean":
        assert cosine < -0.5, cosine  # steered: the reason the robust settings exist
    else:
        assert cosine > 0.9, cosine


def test_a_reversing_peer_is_scored_quarantined_shown_in_hub_status_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from speedtronic.diloco.launch import run_status

    run = Run(
        tmp_path,
        # 3: a quarantined node's delta does not count toward min_deltas (the three honest ones do)
        "distributed.rounds.min_deltas=3",
        "distributed.defences.quarantine_below=0.0",
        "distributed.defences.aggregation=mean",
    )
    m = run.master()
    g = torch.Generator().manual_seed(3)
    direction = {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in run.specs.items()}

    def send(node: str, seq: int, sign: float) -> dict[str, torch.Tensor]:
        delta = {n: sign * t + torch.randn(t.shape, generator=g) * 3e-4 for n, t in direction.items()}
        header = {"kind": "delta", "node": node, "seq": str(seq), "base_outer_step": str(m.outer_step)}
        run.bus.put_delta(
            node, codec.delta_name(node, seq), codec.encode(delta, "fp32", {**header, "tokens": "64"})
        )
        return delta

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for seq in range(4):
            before = {n: t.clone() for n, t in m.outer.weights.items()}
            honest = [send(f"w{i}", seq, 1.0) for i in range(3)]
            send("evil", seq, -1.0)  # the reverse of the honest direction, at the honest norm
            assert m.round() is True and len(m.applied) == 4 * (seq + 1)  # received, every time
        # From the third scored round on the attacker is quarantined: the last step is the honest mean.
        for n, t in m.outer.weights.items():
            assert torch.allclose(t, before[n] - sum(h[n] for h in honest) / 3, atol=1e-6)
        assert m.peers.scores["evil"]["quarantined"] and m.peers.scores["evil"]["agreement"] < -0.5
        assert all(
            not m.peers.scores[f"w{i}"]["quarantined"] and m.peers.scores[f"w{i}"]["agreement"] > 0.3
            for i in range(3)
        )
        status = {c["node"]: c for c in run_status(f"file://{run.bus.root}", None)["collaborators"]}
        assert status["evil"]["quarantined"] is True and status["evil"]["score"]["agreement"] < -0.5
        assert status["w0"]["quarantined"] is False and m.metrics()["nodes"]["evil"]["score"]["quarantined"]
        assert run.master().peers.scores["evil"]["quarantined"]  # persisted in the state
        for seq in range(4, 12):  # the peer turns honest: its agreement recovers and so does its weight
            before = {n: t.clone() for n, t in m.outer.weights.items()}
            honest = [send(f"w{i}", seq, 1.0) for i in range(3)]
            send("evil", seq, 1.0)
            assert m.round() is True
            if not m.peers.scores["evil"]["quarantined"]:
                break
        # The round that lets it out still weighs its delta 0: the loss probe skips a quarantined node's
        # delta, so nothing judged it (a hostile delta weighed past the run's end so: the attack suite).
        for n, t in m.outer.weights.items():
            assert torch.allclose(t, before[n] - sum(h[n] for h in honest) / 3, atol=1e-6)
        before = {n: t.clone() for n, t in m.outer.weights.items()}
        sent = [send(f"w{i}", seq + 1, 1.0) for i in range(3)] + [send("evil", seq + 1, 1.0)]
        assert m.round() is True  # the next round it weighs again
        for n, t in m.outer.weights.items():
            assert torch.allclose(t, before[n] - sum(h[n] for h in sent) / 4, atol=1e-6)
    assert not m.peers.scores["evil"]["quarantined"], m.peers.scores["evil"]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("quarantined node evil" in line for line in lines) == 1
    assert sum("node evil leaves quarantine" in line for line in lines) == 1
    assert not any("quarantined node w" in line for line in lines)


def test_the_loss_probe_weighs_a_harmful_delta_zero_and_keeps_honest_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The master's validation loss here is the distance to a target model (a real function of the
    weights, cheap enough for a test): honest deltas step towards it, the hostile one away."""
    from speedtronic.diloco.master import Master

    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=2",  # the delta the probe weighs 0 does not count toward it
        "distributed.defences.loss_probe=true",
        "distributed.defences.aggregation=mean",
    )
    start = codec.snapshot(run.model)
    g = torch.Generator().manual_seed(5)
    target = {n: t + torch.randn(t.shape, generator=g) * 1e-2 for n, t in start.items()}
    calls: list[int] = []

    def evaluate(weights: dict[str, torch.Tensor]) -> float:
        calls.append(1)
        return float(sum(((weights[n] - target[n]) ** 2).sum() for n in weights))

    m = Master(
        run.cfg, run.bus, run.manifest, start, state_dir=tmp_path / "s", momentum=0.0, evaluate=evaluate
    )
    m.start_state()
    towards = {n: (start[n] - target[n]) * 0.1 for n in start}  # Δ = θ − θ_local: a step to the target
    sent = {}
    for node, sign in (("w0", 1.0), ("w1", 1.0), ("evil", -1.0)):
        header = {"kind": "delta", "node": node, "seq": "0", "base_outer_step": "0", "tokens": "64"}
        delta = {n: sign * t + torch.randn(t.shape, generator=g) * 1e-4 for n, t in towards.items()}
        run.bus.put_delta(node, codec.delta_name(node, 0), codec.encode(delta, "fp32", header))
        sent[node] = delta
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is True
    assert len(m.applied) == 3 and m.hwm == {"w0": 0, "w1": 0, "evil": 0}  # all received
    assert len(calls) == 3 + 1  # one probe per delta, then the new global's loss
    for n, w in m.outer.weights.items():  # only the honest deltas moved the model (lr 1, no momentum)
        assert torch.allclose(w, start[n] - (sent["w0"][n] + sent["w1"][n]) / 2, atol=1e-6)
    assert m.val_losses[-1][1] < m.val_losses[0][1]
    assert m.peers.scores["evil"]["probe_failures"] == 1 and m.peers.scores["evil"]["probe"] > 0
    assert m.peers.scores["w0"]["probe"] < 0 and "probe_failures" not in m.peers.scores["w0"]
    (line,) = [r.getMessage() for r in caplog.records if "loss probe" in r.getMessage()]
    assert "evil" in line and "weighs 0" in line


def test_under_clipped_mean_a_claim_within_the_plan_counts_no_more_than_the_rounds_median(
    tmp_path: Path,
) -> None:
    """The plan leaves room for a node of MAX_NODE_RANKS ranks, so a one-rank peer claiming the whole
    plan would weigh 8× an honest one-rank peer (bench/attacks.py "tokens": reversed deltas claiming
    it took over the run). clipped_mean clips claims to the round's median, as it clips norms."""
    run = Run(tmp_path, "distributed.rounds.min_deltas=3", "distributed.sync.inner_steps=4")
    plan = run.manifest["run"]["max_delta_tokens"]
    honest_claim = plan // 8  # one rank: micro_batch × block × inner_steps
    m = run.master()
    start = {n: t.clone() for n, t in m.outer.weights.items()}
    ids = [run.delta(f"w{i}", 0, tokens=str(honest_claim)) for i in (1, 2)]
    evil = run.delta("evil", 0, tokens=str(plan))  # within the plan: not clipped by the bound
    deltas = [tensors_of(run, i) for i in [*ids, evil]]
    assert m.round() is True and sorted(m.applied) == sorted([*ids, evil])
    norms = [codec.norm(d) for d in deltas]
    cap = sorted(norms)[1]
    clipped = [
        {n: t * min(1.0, cap / norm) for n, t in d.items()} for d, norm in zip(deltas, norms, strict=True)
    ]
    step = {n: sum(d[n] for d in clipped) / 3 for n in start}  # equal weights, not 1:1:8
    lr = m.outer.lr
    for n, w in m.outer.weights.items():
        torch.testing.assert_close(w, start[n] - lr * step[n], atol=1e-6, rtol=1e-5)


def test_quarantine_never_covers_a_majority_and_probed_deltas_do_not_vote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two colluders of four (the shipped quarantine_below 0, no probe: the master has no data): the
    agreement vote is symmetric, so quarantine may take one node at most, and the run keeps moving
    (it used to be able to quarantine all four and freeze). With a probe verdict the colluders it
    caught are left out of "the others": then the honest peers agree and the colluders do not."""
    # min_deltas 2: deltas the probe weighs 0 do not count toward it (the two honest ones do).
    run = Run(tmp_path, "distributed.rounds.min_deltas=2", "distributed.defences.aggregation=mean")
    assert (
        run.cfg.distributed.defences.quarantine_below == 0.0
        and run.cfg.distributed.defences.loss_probe == "auto"
    )
    m = run.master()
    g = torch.Generator().manual_seed(4)
    direction = {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in run.specs.items()}

    def delta(sign: float) -> dict[str, torch.Tensor]:
        return {n: sign * t + torch.randn(t.shape, generator=g) * 3e-4 for n, t in direction.items()}

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for seq in range(5):
            for node, sign in (("w0", 1.0), ("w1", 1.0), ("c0", -1.0), ("c1", -1.0)):
                header = {"kind": "delta", "node": node, "seq": str(seq), "base_outer_step": str(seq)}
                payload = codec.encode(delta(sign), "fp32", {**header, "tokens": "64"})
                run.bus.put_delta(node, codec.delta_name(node, seq), payload)
            before = m.outer_step
            assert m.round() is True
            assert m.outer_step == before + 1  # never everyone quarantined: the model still moves
    held = [n for n, e in m.peers.scores.items() if e["quarantined"]]
    assert len(held) <= 1, m.peers.scores
    assert any("a strict minority at most" in r.getMessage() for r in caplog.records), m.peers.scores
    # The same four deltas scored with the probe's verdict on the colluders: they no longer vote.
    fresh = run.master("fresh")
    deltas = {"w0": delta(1.0), "w1": delta(1.0), "c0": delta(-1.0), "c1": delta(-1.0)}
    fresh.peers.update(deltas, {"c0", "c1"})
    assert fresh.peers.scores["w0"]["agreement"] > 0.5 and fresh.peers.scores["w1"]["agreement"] > 0.5, (
        fresh.peers.scores
    )
    assert fresh.peers.scores["c0"]["agreement"] < -0.5 and fresh.peers.scores["c1"]["agreement"] < -0.5, (
        fresh.peers.scores
    )


def test_the_loss_probe_weighs_at_most_half_of_a_rounds_deltas_zero(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Four deltas that all raise the loss (stale ones on a global that overshot, bench/wan.py): the two
    most harmful weigh 0, the other two still count and are named, and the model still moves."""
    from speedtronic.diloco.master.checks import Delta, LossProbeCheck

    run = Run(tmp_path, "distributed.rounds.min_deltas=4", "distributed.defences.loss_probe=true")
    m = run.master()
    start = {n: t.clone() for n, t in m.outer.weights.items()}
    m.evaluate = lambda weights: float(sum(((weights[n] - start[n]) ** 2).sum() for n in weights))
    g = torch.Generator().manual_seed(6)
    accepted = []
    for i, scale in enumerate((1.0, 4.0, 2.0, 3.0)):  # every delta moves away from the optimum, `start`
        tensors = {n: torch.randn(t.shape, generator=g) * 1e-3 * scale for n, t in start.items()}
        ref = DeltaRef(node=f"w{i}", name="d", size=None, where="")
        accepted.append(Delta.of(ref, 0, tensors, {}))
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        probe, context = LossProbeCheck(), m.context()
        probe.prepare(accepted, context)
        worse = {d.id for d in accepted if probe.check(d, context).kind == "weigh_zero"}
    assert worse == {"w1/d", "w3/d"}, worse  # the two largest steps away
    lines = [r.getMessage() for r in caplog.records]
    assert any("found 4 of 4 deltas" in line and "w2/d, w0/d" in line for line in lines), lines
    assert m.peers.scores["w0"]["probe"] > 0 and "probe_failures" not in m.peers.scores["w0"]


def test_past_the_runs_end_every_delta_the_probe_finds_worse_weighs_zero(tmp_path: Path) -> None:
    """Before the end a lone delta that raises the loss still counts (at most half of a round weigh 0:
    1 // 2 = 0); once the run's last outer step is out the work is optional and it weighs 0 (a hostile
    node's lone delta after the honest ones finished used to take an outer step of its own)."""
    from speedtronic.diloco.master.checks import Delta, LossProbeCheck

    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.defences.loss_probe=true")
    m = run.master()
    start = {n: t.clone() for n, t in m.outer.weights.items()}
    m.evaluate = lambda weights: float(sum(((weights[n] - start[n]) ** 2).sum() for n in weights))
    g = torch.Generator().manual_seed(7)
    tensors = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in start.items()}
    lone = [Delta.of(DeltaRef(node="h1", name="d", size=None, where=""), 0, tensors, {})]

    def weighs_zero(context: Any) -> tuple[bool, bool]:
        probe = LossProbeCheck()
        probe.prepare(lone, context)
        return probe.check(lone[0], context).kind == "weigh_zero", lone[0].id in probe.would_zero(
            lone, context
        )

    before_end = m.context()
    before_end.run_end = before_end.outer_step + 5
    assert weighs_zero(before_end) == (False, True)  # counts, but fills no quorum
    past_end = m.context()
    past_end.run_end = past_end.outer_step
    assert weighs_zero(past_end) == (True, True)


def test_a_rejected_delta_answers_the_overlap_wait(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With overlap_steps (the shipped 1) a worker waits at its due step for the global that answers its
    delta; the high-water mark moves only when one is applied, so a rejected delta is answered by the
    master's word that it was rejected (head.json "rejections"), never by waiting out max_wait."""
    from speedtronic import Trainer
    from speedtronic.diloco.worker import Coordinator
    from test_diloco_coordinator import setup_run

    extra = [
        "checkpoint.enabled=false",
        "distributed.sync.inner_steps=4",
        "distributed.sync.overlap_steps=1",
        "distributed.rounds.max_wait=20",
        "distributed.rounds.min_deltas=1",
        "distributed.worker.max_consecutive_rejections=100",
    ]
    cfg, bus, manifest, m = setup_run(tmp_path, *extra)
    m.limits.max_bytes = 200  # every delta this worker can send is over the master's size limit
    m.report.feedback_every_s = 0.0
    m.start()
    try:
        coordinator = Coordinator(cfg, bus, "w1", manifest)
        with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
            Trainer(cfg, sync=coordinator, progress=False).train(max_steps=12)
    finally:
        m.stop()
    lines = [r.getMessage() for r in caplog.records]
    rejected = [line for line in lines if "the master rejected w1--" in line]
    assert len(rejected) >= 2, lines
    assert not [line for line in lines if "no global answered" in line], lines  # never waited it out


def test_an_honest_node_that_meets_two_colluders_first_is_not_quarantined_for_it() -> None:
    """The attack suite's CI flake: the attackers start first, so the first round holds two colluders
    and one honest node; the probe cannot tell them apart yet (the initial plateau) and the honest node
    disagrees with "the others". Its first round must not outweigh the next ones (the score is a
    bias-corrected average: the first rounds weigh alike); the colluders are still quarantined by the
    third round."""
    g = torch.Generator().manual_seed(0)
    progress = torch.randn(256, generator=g)

    def honest() -> dict[str, torch.Tensor]:
        return {"w": progress + 1.6 * torch.randn(256, generator=g)}  # cos with the progress ~0.5

    def hostile() -> dict[str, torch.Tensor]:
        return {"w": -progress + 0.3 * torch.randn(256, generator=g)}  # colluders: nearly one direction

    peers = Peers(quarantine_below=0.0)
    peers.update({"h1": hostile(), "h2": hostile(), "w1": honest()})  # nobody probed worse yet
    assert peers.scores["w1"]["agreement"] < -0.3 < 0.3 < peers.scores["h1"]["agreement"], peers.scores
    for _ in range(2):  # the others join; the probe names one attacker a round (at most half weigh 0)
        peers.update({"h1": hostile(), "h2": hostile(), **{f"w{i}": honest() for i in (1, 2, 3)}}, {"h1"})
    assert not any(peers.scores[f"w{i}"]["quarantined"] for i in (1, 2, 3)), peers.scores
    assert peers.scores["h1"]["quarantined"] and peers.scores["h2"]["quarantined"], peers.scores


def test_the_agreement_score_is_a_bias_corrected_moving_average() -> None:
    peers = Peers(quarantine_below=None)
    same, opposite = {"w": torch.ones(4)}, {"w": -torch.ones(4)}
    cosines = []
    for round_ in range(6):  # b agrees with a in rounds 0 and 1 only
        peers.update({"a": same, "b": same if round_ < 2 else opposite})
        cosines.append(1.0 if round_ < 2 else -1.0)
        beta = 0.7
        weights = [beta ** (round_ - k) for k in range(round_ + 1)]
        expected = sum(w * c for w, c in zip(weights, cosines, strict=True)) / sum(weights)
        assert peers.scores["b"]["agreement"] == pytest.approx(expected, abs=2e-4), (round_, peers.scores)
