"""Rules that only count what can count (diloco/master: rounds.py, checks.py, end.py, core.py), with the
master's real round and outer loop on a real directory bus and real safetensors deltas: a quarantined
node's delta and one the loss probe weighs 0 never fill a round's `min_deltas`; an open run and a run
with a listed node never heard from end once their last outer step is out (no late joiners' window, no
max_wait); a hostile majority cannot keep the run stepping past its end, never gets a non-finite global
published, and the run ends on the best global of the whole run."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.master import Master
from test_diloco_master import Run
from test_diloco_rounds import Clock
from test_diloco_run_end import Scripted, master


def send(run: Run, node: str, seq: int, delta: dict[str, torch.Tensor], base: int, **meta: str) -> str:
    header = {"kind": "delta", "node": node, "seq": str(seq), "base_outer_step": str(base), "tokens": "64"}
    name = codec.delta_name(node, seq)
    run.bus.put_delta(node, name, codec.encode(delta, "fp32", {**header, **meta}))
    return f"{node}/{name}"


def probed_master(
    run: Run, tmp_path: Path, seed: int, clock: Clock | None = None
) -> tuple[Master, dict[str, torch.Tensor]]:
    """A started master whose validation loss is the squared distance to a random target near the
    start, and a delta that moves a tenth of the way towards it (Δ = θ − θ_local)."""
    start = codec.snapshot(run.model)
    g = torch.Generator().manual_seed(seed)
    target = {n: t + torch.randn(t.shape, generator=g) * 1e-2 for n, t in start.items()}

    def evaluate(weights: dict[str, torch.Tensor]) -> float:
        return float(sum(((weights[n] - target[n]) ** 2).sum() for n in weights))

    m = Master(
        run.cfg,
        run.bus,
        run.manifest,
        start,
        state_dir=tmp_path / "s",
        momentum=0.0,
        evaluate=evaluate,
        **({"clock": clock} if clock is not None else {}),
    )
    m.start_state()
    return m, {n: (start[n] - target[n]) * 0.1 for n in start}


def test_a_quarantined_nodes_delta_does_not_fill_min_deltas(tmp_path: Path) -> None:
    """min_deltas 3 with three honest nodes and a reversing one: once it is quarantined, its delta plus
    two honest ones no longer close the round; the third honest one does."""
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=3",
        "distributed.defences.quarantine_below=0.0",
        "distributed.defences.aggregation=mean",
    )
    m = run.master()
    g = torch.Generator().manual_seed(3)
    direction = {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in run.specs.items()}

    def delta(sign: float) -> dict[str, torch.Tensor]:
        return {n: sign * t + torch.randn(t.shape, generator=g) * 3e-4 for n, t in direction.items()}

    seq = 0
    while m.peers.active("evil"):
        assert seq < 6, m.peers.scores
        for node, sign in (("w0", 1.0), ("w1", 1.0), ("w2", 1.0), ("evil", -1.0)):
            send(run, node, seq, delta(sign), m.outer_step)
        assert m.round() is True
        seq += 1
    step = m.outer_step
    evil = send(run, "evil", seq, delta(-1.0), step)
    send(run, "w0", seq, delta(1.0), step)
    send(run, "w1", seq, delta(1.0), step)
    assert m.round() is False and m.outer_step == step and evil not in m.applied
    assert m.waiting["have"] == ["w0", "w1"] and m.waiting["cannot_weigh"] == ["evil"], m.waiting
    assert m.rounds.report["cannot_weigh"] == ["evil"]
    send(run, "w2", seq, delta(1.0), step)
    assert m.round() is True and m.outer_step == step + 1 and evil in m.applied  # received, weighing 0


def test_a_delta_the_probe_weighs_zero_does_not_fill_min_deltas(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """min_deltas 3: two honest deltas and a harmful one wait for a third honest one (listed: the round
    expects it); each delta is evaluated alone once, however often the round is asked."""
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=3",
        "distributed.defences.loss_probe=true",
        "distributed.defences.aggregation=mean",
        "distributed.master.collaborators=[w0,w1,w2,evil]",
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

    def delta(sign: float) -> dict[str, torch.Tensor]:
        return {n: sign * t + torch.randn(t.shape, generator=g) * 1e-4 for n, t in towards.items()}

    for node, sign in (("w0", 1.0), ("w1", 1.0), ("evil", -1.0)):
        send(run, node, 0, delta(sign), 0)
    calls.clear()
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        assert m.round() is False and m.round() is False
    assert m.outer_step == 0 and m.applied == [] and len(calls) == 3  # one probe per delta, once
    assert any("waits on: evil would weigh 0" in r.getMessage() for r in caplog.records)
    send(run, "w2", 0, delta(1.0), 0)
    assert m.round() is True and m.outer_step == 1 and len(m.applied) == 4
    assert len(calls) == 3 + 1 + 1  # w2's probe, then the new global's loss
    assert m.peers.scores["evil"]["probe_failures"] == 1
    assert all("probe_failures" not in m.peers.scores[n] for n in ("w0", "w1", "w2"))


def test_an_open_run_ends_once_its_last_outer_step_is_out(tmp_path: Path) -> None:
    """No collaborators listed, late_join_wait unset (launch.py passes None): the master does not wait
    for late joiners once outer step 2 of 2 is out and the one node it heard from has finished."""
    run = Run(tmp_path, "distributed.rounds.max_wait=600")
    m = master(run)
    run.delta("w1", 0)
    run.delta("w1", 1, base=1, final="1")
    m.start()
    try:
        reason = m.wait(2, idle_s=600.0, linger_s=run.cfg.distributed.rounds.late_join_wait)
    finally:
        m.stop()
    assert reason == "all 1 nodes finished" and m.outer_step == 2


def test_a_listed_node_never_heard_from_does_not_hold_the_end(tmp_path: Path) -> None:
    """ghost is listed and never sends: with max_wait 600 and never_heard_wait unset, the run ends once
    its last outer step is out, naming ghost."""
    run = Run(
        tmp_path,
        "distributed.master.collaborators=[w1,ghost]",
        "distributed.rounds.min_deltas=1",
        "distributed.rounds.max_wait=600",
    )
    m = master(run)
    run.delta("w1", 0)
    run.delta("w1", 1, base=1, final="1")
    m.start()
    try:
        reason = m.wait(2, idle_s=600.0, linger_s=run.cfg.distributed.rounds.late_join_wait)
    finally:
        m.stop()
    assert reason == "1 of 2 nodes finished; 1 left: ghost (never heard from)", reason


def test_a_hostile_majority_ends_at_the_end_without_a_non_finite_global_on_the_best_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Five listed nodes, three hostile. The honest pair takes the run to a 3.0 global; the hostile
    trio's next global has a NaN loss (refused: never published), the one after is worse but kept and
    reaches the end (3). Past it each node counts up to its share, 4 deltas (3 for the run's outer
    steps, 1 for a restart's redone sync): the honest finals with the trio's third deltas make outer
    step 4, the trio's fourth outer step 5; their fifth is refused as after the end, whatever base it
    claims, and the run ends naming them, on the 3.0 global (published as the final pick)."""
    evaluate = Scripted([5.0, 4.0, 3.0, float("nan"), 4.2, 3.6, 3.7])
    run = Run(
        tmp_path,
        "distributed.master.collaborators=[w0,w1,h0,h1,h2]",
        "distributed.rounds.min_deltas=2",
        "distributed.rounds.max_wait=30",
        "distributed.defences.loss_probe=false",
    )
    m = master(run, evaluate)
    m.end.ends_at(3)  # as `wait` will be asked (launch.py); the rounds below run before it
    for seq in (0, 1):
        run.delta("w0", seq, base=seq)
        run.delta("w1", seq, base=seq)
        assert m.round() is True

    def away(k: int) -> dict[str, torch.Tensor]:  # honest-sized norms, a payload of its own each
        return {n: torch.full(s.shape, 1e-3 * (1 + 0.05 * k)) for n, s in run.specs.items()}

    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for seq in (0, 1):
            for i, node in enumerate(("h0", "h1", "h2")):
                send(run, node, seq, away(3 * seq + i), 2)
            m.round()
        assert m.outer_step == 3  # the NaN global refused, the worse one kept
        run.delta("w0", 2, base=2, final="1")
        run.delta("w1", 2, base=2, final="1")
        for i, node in enumerate(("h0", "h1", "h2")):
            send(run, node, 2, away(6 + i), 3)  # the third and fourth: within their share
            send(run, node, 3, away(9 + i), 4)
            send(run, node, 4, away(12 + i), 2)  # the fifth, whatever base it claims: refused
        m.start()
        try:
            reason = m.wait(3, idle_s=60.0, linger_s=None)
        finally:
            m.stop()
    assert reason == "2 of 5 nodes finished; 3 refused past the end: h0, h1, h2", reason
    assert any("refused outer step 3" in r.getMessage() and "nan" in r.getMessage() for r in caplog.records)
    losses = [loss for _, loss in m.val_losses]
    assert all(math.isfinite(v) for v in losses) and losses == [5.0, 4.0, 3.0, 4.2, 3.6, 3.7, 3.0], losses
    assert {r["check"] for r in m.rejected} == {"after_end"} and len(m.rejected) == 3
    final = m.final
    assert final is not None and (final["chosen"], final["from_outer_step"], final["val_loss"]) == (
        "best",
        2,
        3.0,
    )
    head = run.bus.read_head()
    assert head is not None and head["outer_step"] == final["outer_step"] == 6  # end, 2 more, the pick
    published = codec.decode(
        run.bus.read_global(head), m.specs, kind="global", max_bytes=m.limits.max_bytes * 2
    ).tensors
    assert all(torch.isfinite(t).all() for t in published.values())


def test_only_nodes_that_cannot_weigh_left_is_said_loudly_and_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """w1 is the only node and its step is refused (NaN loss): a WARNING names it, and metrics.json and
    head.json's status carry `untrusted_only`; its next good step clears both."""
    evaluate = Scripted([5.0, float("nan"), 4.0])
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", "distributed.defences.loss_probe=false")
    m = master(run, evaluate)
    run.delta("w1", 0)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is False
    assert any("only nodes that cannot weigh are left: w1" in r.getMessage() for r in caplog.records)
    m.write_metrics(force=True)
    head = run.bus.read_head()
    assert head is not None and head["status"]["untrusted_only"] == ["w1"]
    assert json.loads(m.metrics_path.read_text())["untrusted_only"] == ["w1"]
    from speedtronic.cli.hub_cmd import _print_status
    from speedtronic.diloco.launch import run_status

    out = run_status(f"file://{tmp_path / 'bus'}", None)
    assert out["untrusted_only"] == ["w1"]  # `hub status --json`
    _print_status(str(tmp_path / "bus"), out, None)
    assert "WARNING: only nodes that cannot weigh are left: w1" in capsys.readouterr().out
    run.delta("w1", 1)
    assert m.round() is True and m.status()["untrusted_only"] is None


def test_a_probe_that_fails_most_deltas_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every delta of a round worse alone than none (what honest nodes on synthetic data, each with its
    own motif set, look like to the master's held-out batches): one WARNING says why and what to do."""
    run = Run(tmp_path, "distributed.master.collaborators=[w0,w1]", "distributed.defences.loss_probe=true")
    m, towards = probed_master(run, tmp_path, seed=6)
    g = torch.Generator().manual_seed(7)
    for seq in (0, 1):
        for node in ("w0", "w1"):  # both away from the master's target
            away = {n: -t + torch.randn(t.shape, generator=g) * 1e-4 for n, t in towards.items()}
            send(run, node, seq, away, m.outer_step)
        with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
            assert m.round() is True
    lines = [
        r.getMessage() for r in caplog.records if "the master's validation data is unlike" in r.getMessage()
    ]
    assert len(lines) == 1 and "synthetic data" in lines[0] and "loss_probe=false" in lines[0], lines


@pytest.mark.parametrize("last", [False, True])
def test_a_nodes_last_delta_that_cannot_weigh_counts_it_off_min_deltas(tmp_path: Path, last: bool) -> None:
    """min_deltas 2, one honest delta and one the probe weighs 0, a third listed node to come: the
    round waits for a delta that weighs, not once the misjudged delta was its node's last (the
    attack suite's honest node, misjudged, then finished: the round waited max_wait, 300 s)."""
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=2",
        "distributed.defences.loss_probe=true",
        "distributed.defences.aggregation=mean",
        "distributed.master.collaborators=[w0,w1,w2]",
    )
    m, towards = probed_master(run, tmp_path, seed=5)
    send(run, "w0", 0, towards, 0)
    send(run, "w1", 0, {n: -t for n, t in towards.items()}, 0, **({"final": "1"} if last else {}))
    if last:
        assert m.round() is True and m.outer_step == 1 and "w1" in m.finished
    else:
        assert m.round() is False and m.waiting["cannot_weigh"] == ["w1"], m.waiting


def four_known(tmp_path: Path) -> tuple[Run, Master, Clock, Callable[[float], dict[str, torch.Tensor]]]:
    """min_deltas 2, a probing master on a test clock, and a first round from w1, w2, h1 and h2 (every
    node heard from); `scaled(k)`: k × a delta that moves toward the probe's target."""
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=2",
        "distributed.defences.loss_probe=true",
        "distributed.defences.aggregation=mean",
    )
    clock = Clock()
    m, towards = probed_master(run, tmp_path, seed=5, clock=clock)

    def scaled(k: float) -> dict[str, torch.Tensor]:
        return {n: k * t for n, t in towards.items()}

    for i, node in enumerate(("w1", "w2", "h1", "h2")):
        send(run, node, 0, scaled(0.2 + 0.01 * i), 0)
    assert m.round() is True and m.outer_step == 1
    clock.t += 5
    return run, m, clock, scaled


def test_a_complete_round_counts_only_what_it_will_weigh_zero(tmp_path: Path) -> None:
    """min_deltas 2, four known nodes, each with its delta in the round: two attackers and one honest
    delta the probe misjudges (a stale one) fail the probe, which leaves one delta that weighs. No
    other can come from a known node (a round takes one delta per node, and each waits for this round's
    global), so the round waits only the learnt grace for a node not started yet, then closes; it waited
    out max_wait (300 s in the attack suite under load). A node still expected keeps the round waiting
    (the next test)."""
    run, m, clock, scaled = four_known(tmp_path)
    sent = {
        "w1": send(run, "w1", 1, scaled(-0.1), 1),  # misjudged: alone it raises the loss, a little
        "w2": send(run, "w2", 1, scaled(0.5), 1),
        "h1": send(run, "h1", 1, scaled(-2.0), 1),
        "h2": send(run, "h2", 1, scaled(-1.5), 1),
    }
    # It waits as long as a node not started yet takes to come (the learnt grace), not max_wait.
    assert m.round() is False and m.waiting["closes_by"] == "grace", m.waiting
    clock.t += m.rounds.grace_for(None, m.report.poll_delay_s)[0] + 0.01
    assert m.round() is True and m.outer_step == 2, m.waiting
    assert set(sent.values()) <= set(m.applied) and m.rounds.last["closed_by"] == "grace", m.rounds.last
    zeroed = {n for n, score in m.peers.scores.items() if score.get("probe_failures")}
    assert zeroed == {"h1", "h2", "w1"}, m.peers.scores  # one passes: every one that fails weighs 0


def test_a_round_with_an_expected_node_missing_still_waits_for_a_delta_that_weighs(tmp_path: Path) -> None:
    run, m, clock, scaled = four_known(tmp_path)
    # w2 has nothing in this round yet: everything the probe finds worse counts out — both attackers
    # and w1's misjudged delta (3 of 3 worse: "the probe is misjudging, at most half weigh 0" let h2
    # fill the quorum and weigh) — and the round waits for w2
    send(run, "w1", 1, scaled(-0.1), 1)
    send(run, "h1", 1, scaled(-2.0), 1)
    send(run, "h2", 1, scaled(-1.5), 1)
    assert m.round() is False and m.waiting["cannot_weigh"] == ["h1", "h2", "w1"], m.waiting
    send(run, "w2", 1, scaled(0.5), 1)
    assert m.round() is False  # now only w2 weighs: the grace for a node not started yet
    clock.t += m.rounds.grace_for(None, m.report.poll_delay_s)[0] + 0.01
    assert m.round() is True and m.outer_step == 2
    zeroed = {n for n, score in m.peers.scores.items() if score.get("probe_failures")}
    assert zeroed == {"h1", "h2", "w1"}, m.peers.scores  # w2 passes: no attacker weighs


def test_with_fewer_known_nodes_than_min_deltas_a_round_still_waits_for_more_to_start(
    tmp_path: Path,
) -> None:
    """An open run, min_deltas 3: an honest delta and a harmful one are all the master knows. It waits
    for a third node to start; with three in and one that cannot weigh, initial_grace for a fourth."""
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=3",
        "distributed.defences.loss_probe=true",
        "distributed.defences.aggregation=mean",
    )
    clock = Clock()
    m, towards = probed_master(run, tmp_path, seed=5, clock=clock)
    send(run, "w0", 0, towards, 0)
    send(run, "evil", 0, {n: -t for n, t in towards.items()}, 0)
    assert m.round() is False and m.waiting["need"] == 3, m.waiting
    # a third node: every known node is in and one cannot weigh; a fourth may still be starting, so
    # the round waits initial_grace for it (the start-up min_deltas is for), then closes
    clock.t += 1
    send(run, "w1", 0, {n: 0.5 * t for n, t in towards.items()}, 0)
    assert m.round() is False and m.waiting["closes_by"] == "grace", m.waiting
    clock.t += run.cfg.distributed.rounds.initial_grace - 2
    assert m.round() is False
    clock.t += 2
    assert m.round() is True and m.outer_step == 1 and m.rounds.last["closed_by"] == "grace", m.rounds.last


def test_the_probe_moves_a_delta_by_its_share_of_the_outer_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Four honest deltas, each a step to its node's local model: the target plus noise of twice the
    distance (H steps on its own batches). Moved the whole outer lr alone, each raises the loss — the
    probe weighed them 0 before (at most half, by its cap); at its share of the step (the lr ÷ the 5
    nodes) each one lowers it, so none weighs 0, while a reversed one still raises it."""
    nodes = ["w0", "w1", "w2", "w3", "evil"]
    run = Run(
        tmp_path,
        "distributed.defences.loss_probe=true",
        "distributed.defences.aggregation=mean",
        "distributed.defences.quarantine_below=null",
        f"distributed.master.collaborators=[{','.join(nodes)}]",
    )
    m, towards = probed_master(run, tmp_path, seed=7)
    g = torch.Generator().manual_seed(8)
    start = codec.snapshot(run.model)
    evaluate = m.evaluate
    assert evaluate is not None
    base = evaluate(start)
    for node in nodes[:4]:
        local = {n: -t / 0.1 + 2 * (t / 0.1).norm() * _unit(t.shape, g) for n, t in towards.items()}
        delta = {n: -local[n] for n in towards}  # Δ = θ − θ_local, θ_local = θ + local
        whole = evaluate({n: start[n] - m.outer.lr * delta[n] for n in start})
        assert whole > base, (node, whole, base)  # what the probe measured before: worse alone
        send(run, node, 0, delta, 0)
    send(run, "evil", 0, {n: -t / 0.1 for n, t in towards.items()}, 0)  # the reversed full step
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is True
    caught = [r.getMessage() for r in caplog.records if "loss probe: delta" in r.getMessage()]
    assert len(caught) == 1 and "from evil" in caught[0], caught
    assert all("probe_failures" not in m.peers.scores[n] for n in nodes[:4]), m.peers.scores


def _unit(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=g)
    return x / x.norm()


def test_the_probe_says_once_when_the_masters_validation_tokens_are_too_few(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The probe weighs 0 any delta whose loss goes up at all: on 256 validation tokens (the chaos
    soak's 2 batches of 4×32) noise alone did that to 11–14% of honest deltas. A master with so few
    tokens says so once, naming data.val_batches; one with enough says nothing."""
    from types import SimpleNamespace

    from speedtronic.diloco.master.checks import PROBE_MIN_TOKENS, LossProbeCheck
    from speedtronic.diloco.node_eval import Evaluator

    def context(batches: int) -> SimpleNamespace:
        ids = torch.zeros(4, 32, dtype=torch.long)
        data = [{"input_ids": ids, "labels": ids} for _ in range(batches)]
        evaluate = Evaluator(torch.nn.Linear(1, 1), data, None)
        return SimpleNamespace(
            settings=SimpleNamespace(defences=SimpleNamespace(loss_probe=True)), evaluate=evaluate
        )

    few, enough = context(2), context(PROBE_MIN_TOKENS // 128)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        check = LossProbeCheck()
        assert check._score(few) is not None and check._score(few) is not None
        LossProbeCheck()._score(enough)
    lines = [r.getMessage() for r in caplog.records if "loss probe scores each delta" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "2 validation batches, 256 tokens" in lines[0] and "data.val_batches" in lines[0], lines
