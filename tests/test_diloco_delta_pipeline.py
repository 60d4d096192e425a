"""Receiving a delta as a pipeline (diloco/master/pipeline.py, checks.py): each stage on its own, each
built-in rule as a named check, and a plugin's check registered through the real plugin host
(`register_delta_checks`) rejecting by a rule of its own — its name in the rejection log line, the
status document (metrics.json, head.json) and `hub status --json`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from speedtronic import hookimpl
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import DeltaRef
from speedtronic.diloco.master import checks, pipeline
from speedtronic.diloco.master.checks import Delta, Verdict
from speedtronic.plugins import get_plugin_host
from test_diloco_master import Run


def ref(node: str, seq: int = 0) -> DeltaRef:
    return DeltaRef(node=node, name=codec.delta_name(node, seq), size=None, where="")


def delta_bytes(run: Run, node: str, seq: int = 0, scale: float = 1e-3, **meta: str) -> bytes:
    g = torch.Generator().manual_seed(seq + 7)
    tensors = {n: torch.randn(s.shape, generator=g) * scale for n, s in run.specs.items()}
    header = {"kind": "delta", "node": node, "seq": str(seq), "local_step": "4", "base_outer_step": "0"}
    return codec.encode(tensors, "fp32", {**header, "tokens": "64", **meta})


def verdicts(run: Run, data: bytes, node: str = "w1", seq: int = 0) -> list[tuple[str, Verdict]]:
    """Every DELTA check's verdict on these bytes, in order, up to the first rejection."""
    m = run.master()
    context, delta = m.context(), Delta(ref(node, seq), seq, data)
    out = []
    for check in m.pipeline.delta:
        verdict = check.check(delta, context)
        out.append((check.name, verdict))
        if verdict.kind == "reject":
            break
    return out


# -- the stages -------------------------------------------------------------------------------------------
def test_the_built_in_checks_have_names_in_order(tmp_path: Path) -> None:
    names = Run(tmp_path).master(state="s").pipeline.names()
    assert names == [
        "name",
        "sequence",
        "size",
        "format",
        "checksum",
        "layout",
        "finite",
        "sender",
        "replay",
        "copy",
        "local_step",
        "staleness",
        "after_end",
        "norm_bound",
        "tokens",
        "twin",
        "norm_outlier",
        "token_cap",
        "loss_probe",
        "quarantine",
    ]
    assert len(set(names)) == len(names)


def test_a_good_delta_passes_every_check(tmp_path: Path) -> None:
    run = Run(tmp_path)
    out = verdicts(run, delta_bytes(run, "w1"))
    assert [v.kind for _, v in out] == ["accept"] * len(out) and out[-1][0] == "twin"
    assert dict(out)["tokens"].tokens == 64


@pytest.mark.parametrize(
    ("mangle", "check", "reason"),
    [
        (lambda b: b + b"x" * 300_000, "size", "over the size limit"),
        (lambda b: b[:5], "format", "truncated"),
        (lambda b: b[: len(b) // 2], "format", "not a valid safetensors file"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 0x55]) + b[-2:], "checksum", "checksum mismatch"),
    ],
)
def test_decoding_is_a_chain_of_named_checks(tmp_path: Path, mangle, check: str, reason: str) -> None:
    run = Run(tmp_path, "distributed.defences.max_delta_mb=0.2")
    name, verdict = verdicts(run, mangle(delta_bytes(run, "w1")))[-1]
    assert (name, verdict.kind) == (check, "reject") and reason in verdict.reason, verdict


def test_layout_finite_sender_and_local_step_checks(tmp_path: Path) -> None:
    run = Run(tmp_path)
    wrong = {n: torch.zeros(3) for n in run.specs}
    assert verdicts(run, codec.encode(wrong, "fp32", {"kind": "delta", "node": "w1"}))[-1][0] == "layout"
    inf = {n: torch.zeros(s.shape) for n, s in run.specs.items()}
    next(iter(inf.values())).view(-1)[0] = float("inf")
    name, verdict = verdicts(run, codec.encode(inf, "fp32", {"kind": "delta", "node": "w1"}))[-1]
    assert name == "finite" and "non-finite" in verdict.reason
    assert verdicts(run, delta_bytes(run, "w2"))[-1][0] == "sender"  # filed under w1, names w2
    name, verdict = verdicts(run, delta_bytes(run, "w1", local_step="-1"))[-1]
    assert name == "local_step" and verdict.reason == "local_step -1 is negative"


def test_staleness_norm_bound_and_token_checks(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.max_staleness=0")
    m = run.master()
    m.ledger.outer_step = 1
    name, verdict = verdicts(run, delta_bytes(run, "w1"))[-1]
    run2 = Run(tmp_path / "b")
    name2, verdict2 = verdicts(run2, delta_bytes(run2, "w1", scale=1e3))[-1]
    assert (name2, verdict2.kind) == ("norm_bound", "reject") and "global weights' norm" in verdict2.reason
    huge = dict(verdicts(run2, delta_bytes(run2, "w1", tokens="999999999")))["tokens"]
    assert huge.kind == "accept" and huge.tokens is not None and huge.tokens < 999999999
    # A check reads the run from its context: a master one outer step on makes the same delta stale.
    context = m.context()
    stale = checks.StalenessCheck().check(Delta(ref("w1"), 0, delta_bytes(run, "w1")), context)
    assert stale.kind == "reject" and stale.reason == "stale: built on outer step 0, the run is at 1"
    assert (name, verdict.kind) == ("twin", "accept")  # the other master, at outer step 0: fresh


def test_a_garbled_round_number_is_stale_not_minus_one(tmp_path: Path) -> None:
    """`fragment_round: abc` once read as -1 and passed; now it is refused by name (a missing one still
    reads as -1, as deltas of older workers may lack it)."""
    run = Run(tmp_path, "distributed.sync.fragments=2")
    plan = run.master().fragments.plan

    def fragment_delta(**meta: str) -> bytes:
        header = {"kind": "delta", "node": "w1", "seq": "0", "local_step": "4", "base_outer_step": "0"}
        header.update(fragment="0", tokens="64", **meta)
        specs = plan.select(header, run.specs)
        return codec.encode({n: torch.full(s.shape, 1e-4) for n, s in specs.items()}, "fp32", header)

    name, verdict = verdicts(run, fragment_delta(fragment_round="abc"))[-1]
    assert (name, verdict.kind) == ("staleness", "reject")
    assert verdict.reason == "fragment_round 'abc' is not a round number"
    name, verdict = verdicts(run, fragment_delta(fragment_round="0", base_outer_step="1e3"))[-1]
    assert (name, verdict.reason) == ("staleness", "base_outer_step '1e3' is not a round number")
    kinds = [v.kind for _, v in verdicts(run, fragment_delta(fragment_round="0"))]
    assert kinds == ["accept"] * len(kinds)


def test_replay_copy_and_twin_use_the_ledger_and_the_round(tmp_path: Path) -> None:
    run = Run(tmp_path)
    m = run.master()
    data = delta_bytes(run, "w1")
    context = m.context()
    first = Delta(ref("w1"), 0, data)
    assert m.pipeline.receive(first, context, lambda r: pytest.fail(r.reason))
    assert context.seen == {first.meta["checksum"]: "w1/w1--00000000.safetensors"}
    copy = Delta(DeltaRef("w2", codec.delta_name("w2", 0), None, ""), 0, data)
    copy.__dict__["parsed"] = (dict(first.meta, node="w2"), first.parsed[1])
    context.first_seen.update({first.id: 1.0, copy.id: 2.0})
    assert checks.CopyCheck().check(copy, context).reason.startswith("replay: a copy of w1/")
    context.first_seen[copy.id] = 1.0  # seen in the same poll: which is the copy is unknown
    assert checks.CopyCheck().check(copy, context).kind == "accept"
    assert checks.TwinCheck().check(copy, context).kind == "weigh_zero"
    m.ledger.apply(first.ref, 0, first.meta["checksum"], 64, first.meta, None)
    assert checks.ReplayCheck().check(first, m.context()).reason == f"replay: the same payload as {first.id}"


def test_listing_checks_judge_the_name_and_the_sequence(tmp_path: Path) -> None:
    m = Run(tmp_path).master()
    context = m.context()
    bad = DeltaRef("w1", "w2--00000000.safetensors", None, "")
    assert m.pipeline.screen(Delta(bad, -1), context, "name").reason == (
        "named for node 'w2' but published by 'w1'"
    )
    far = Delta(ref("w1", 10**6), 10**6)
    rejection = m.pipeline.screen(far, context, "sequence")
    assert (
        rejection is not None
        and rejection.check == "sequence"
        and "past the node's last applied" in rejection.reason
    )
    assert m.pipeline.screen(Delta(ref("w1", 3), 3), context, "sequence") is None


def test_round_checks_reject_cap_and_weigh_zero(tmp_path: Path) -> None:
    run = Run(
        tmp_path, "distributed.defences.aggregation=clipped_mean", "distributed.defences.quarantine_below=0.5"
    )
    m = run.master()
    context = m.context()
    context.round_tokens = 64  # a one-rank round here: the cap's floor
    tensors = {n: torch.full(s.shape, 1e-4) for n, s in run.specs.items()}
    deltas = [Delta.of(ref(f"w{i}"), 0, tensors, {"checksum": str(i)}) for i in range(3)]
    for d, tokens in zip(deltas, (64, 64, 6400), strict=True):
        d.tokens, d.mass = tokens, float(tokens)
        context.norms[d.id] = (d.node, 1.0)
    m.peers.scores["w0"] = {"agreement": -1.0, "rounds": 9, "quarantined": True}
    rejected: list[pipeline.Rejection] = []
    kept = m.pipeline.judge_round(deltas, context, rejected.append)
    assert rejected == [] and kept == deltas
    assert deltas[2].tokens == 64 and deltas[2].mass == 64.0  # clipped to the round's median claim
    assert deltas[0].zeroed == ["quarantine"] and deltas[1].zeroed == []
    assert [w for _, w, _ in pipeline.weigh(kept, 1)] == [64.0, 64.0]  # without the quarantined one


def test_the_claim_cap_counts_a_folded_delta_for_the_rounds_it_spans(tmp_path: Path) -> None:
    """w3 folded three sync points into one delta while the master did not answer (sequence numbers
    0–2 past its mark, three of its usual intervals on the master's clock): its claim of three rounds
    counts whole, where the round's median of one round counted it as one (a soak's folded work lost
    its weight). The cap still holds per round: w4 claims ten rounds in one delta of one round, and
    w3's claim past its three rounds is cut to them."""
    run = Run(tmp_path, "distributed.defences.aggregation=clipped_mean")
    m = run.master()
    context = m.context()
    context.round_tokens = 64  # a one-rank round here: the cap's floor
    tensors = {n: torch.full(s.shape, 1e-4) for n, s in run.specs.items()}
    claims = {"w0": (0, 64), "w1": (0, 64), "w2": (0, 64), "w3": (2, 192), "w4": (0, 640)}
    deltas = [Delta.of(ref(n, seq), seq, tensors, {"checksum": n}) for n, (seq, _) in claims.items()]
    for d in deltas:
        d.tokens, d.mass = claims[d.node][1], float(claims[d.node][1])
        context.norms[d.id] = (d.node, 1.0)
    context.spans[deltas[3].id] = 3
    kept = m.pipeline.judge_round(deltas, context, lambda r: pytest.fail(str(r)))
    assert [d.tokens for d in kept] == [64, 64, 64, 192, 64], [(d.node, d.tokens) for d in kept]
    assert kept[3].mass == 192.0 and kept[4].mass == 64.0
    deltas[3].tokens, deltas[3].mass = 640, 640.0  # more than its three rounds
    kept = m.pipeline.judge_round(deltas, context, lambda r: pytest.fail(str(r)))
    assert kept[3].tokens == 192, [(d.node, d.tokens) for d in kept]


def test_a_short_delta_is_stretched_to_a_round_and_weighs_its_tokens(tmp_path: Path) -> None:
    """Two nodes at H and two syncing every H/4 (bench/uneven.py `fast2slow2h`): the short deltas are
    stretched ×4 (a one-rank round, from the run's config, over their claim) and weigh their own
    tokens, so the mean is the deltas' sum over the rounds' worth of tokens they cover. Nothing is
    stretched in a round without a full delta, nor a folded delta, nor in a round of full ones (the
    same tensors, not copies)."""
    run = Run(tmp_path, "distributed.defences.aggregation=clipped_mean")
    m = run.master()
    config = run.cfg
    one_rank = config.distributed.sync.inner_steps * config.data.micro_batch_size * config.data.block_size
    assert m.context().round_tokens == one_rank  # the run's own: no peer's claim moves it
    context = m.context()
    context.round_tokens = 64
    full = {n: torch.full(s.shape, 4e-4) for n, s in run.specs.items()}
    short = {n: t / 4 for n, t in full.items()}
    claims = {"f0": (full, 64), "f1": (full, 64), "s0": (short, 16), "s1": (short, 16)}
    deltas = [Delta.of(ref(n), 0, t, {"checksum": n}) for n, (t, _) in claims.items()]
    for d in deltas:
        d.tokens = claims[d.node][1]
        d.mass = float(d.tokens)
    assert pipeline.stretches(deltas, context) == {deltas[2].id: 4.0, deltas[3].id: 4.0}
    kept = m.pipeline.judge_round(deltas, context, lambda r: pytest.fail(str(r)))
    assert [d.mass for d in kept] == [64.0, 64.0, 16.0, 16.0]  # the claim cap stays at a round: 64, not 16
    live = pipeline.weigh(deltas, 1, context)
    assert [w for _, w, _ in live] == [64.0, 64.0, 16.0, 16.0]
    name = next(iter(full))
    assert all(torch.equal(t[name], full[name]) for t, _, _ in live)  # each a round's worth now
    assert pipeline.weigh(deltas, 1)[2][0] is short  # without the round's context: as sent
    deltas[0].zero("loss_probe")
    deltas[1].zero("loss_probe")  # no full delta weighs: nothing to put the short ones beside
    assert pipeline.stretches(deltas, context) == {}
    equal = [Delta.of(ref(f"w{i}"), 0, full, {}) for i in range(3)]
    for d in equal:
        d.tokens, d.mass = 64, 64.0
    assert all(t is full for t, _, _ in pipeline.weigh(equal, 1, context))
    folded = Delta.of(ref("w3", 2), 2, short, {})  # 3 sync points past its mark, seen over 3 intervals
    folded.tokens, folded.mass = 16, 16.0
    context.spans[folded.id] = 3
    assert pipeline.stretches([*equal, folded], context) == {}
    context.round_tokens = 0  # unknown: nothing stretched
    assert pipeline.stretches(deltas[2:] + equal, context) == {}


def test_a_norm_outlier_is_rejected_and_only_deltas_that_weighed_enter_the_history(tmp_path: Path) -> None:
    """The reference comes from deltas that weighed in a kept outer step: an attack the checks caught
    (or a step the master refused) never drags the bounds along."""
    m = Run(tmp_path).master()
    context = m.context()
    small = {n: torch.zeros(1) for n in ("a",)}
    deltas = [Delta.of(ref(f"w{i}"), 0, small, {}) for i in range(3)]
    for d, size in zip(deltas, (1e-3, 1.1e-3, 5.0), strict=True):
        context.norms[d.id] = (d.node, size)
    rejected: list[pipeline.Rejection] = []
    kept = m.pipeline.judge_round(deltas, context, rejected.append)
    assert [r.check for r in rejected] == ["norm_outlier"] and rejected[0].content
    assert [d.node for d in kept] == ["w0", "w1"]
    assert m.norm_history == []  # nothing until the step they make is kept
    kept[1].zero("loss_probe")
    m.pipeline.kept(kept, context)
    assert [node for node, _ in m.norm_history] == ["w0"]


def test_read_counts_bus_bytes_once_and_serves_held_back_bytes(tmp_path: Path) -> None:
    run = Run(tmp_path)
    m = run.master()
    run.delta("w1", 0)
    (listed,) = run.bus.list_deltas(None)
    data = pipeline.read(listed, m.fragments, run.bus, m.limits.max_bytes, m.ledger)
    assert m.ledger.bytes_in == len(data) and m.ledger.per_node["w1"]["bytes"] == len(data)
    # A round that holds a delta back keeps its bytes: the next round does not read (or count) them again.
    m.fragments._held[f"{listed.id}@{listed.etag}"] = b"held"
    assert pipeline.read(listed, m.fragments, run.bus, m.limits.max_bytes, m.ledger) == b"held"
    assert m.ledger.bytes_in == len(data)


def test_record_moves_the_ledger_feedback_and_rounds(tmp_path: Path) -> None:
    m = Run(tmp_path).master()
    tensors = {"a": torch.zeros(1)}
    d = Delta.of(ref("w1", 4), 4, tensors, {"checksum": "c", "final": "1"})
    d.tokens = 64
    m.report.note_rejection("w1", "w1--00000003.safetensors", "bad")
    pipeline.record([d], m.ledger, m.report, m.rounds)
    assert m.hwm == {"w1": 4} and m.applied == [d.id] and m.finished == {"w1"}
    assert m.ledger.nodes["w1"]["tokens"] == 64 and m.report.feedback["w1"]["consecutive"] == 0
    assert m.rounds.last is not None and m.rounds.last["without"] == []


# -- a plugin's defence ----------------------------------------------------------------------------------
class NoLateLocalSteps:
    """A rule of the plugin's own: a delta whose local step is past 100 is refused."""

    name = "no-late-local-steps"

    def check(self, delta: Delta, context: checks.Context) -> Verdict:
        if int(delta.meta.get("local_step", "0")) > 100:
            return Verdict.reject(f"local step {delta.meta['local_step']} is past this run's 100")
        return Verdict.accept()


class DefencePlugin:
    @hookimpl
    def register_delta_checks(self, register) -> None:
        register("no-late-local-steps", NoLateLocalSteps)


def test_a_plugin_check_rejects_by_its_own_rule_and_is_named_everywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from speedtronic.cli.app import build_app

    host = get_plugin_host()
    host.register(DefencePlugin(), "defence-plugin")
    try:
        assert host.describe()[-1]["registers"] == {"delta checks": ["no-late-local-steps"]}
        run = Run(tmp_path, "distributed.rounds.min_deltas=2")
        m = run.master()
        assert m.pipeline.names()[-5:] == [
            "no-late-local-steps",
            "norm_outlier",
            "token_cap",
            "loss_probe",
            "quarantine",
        ]
        good = run.delta("w1", 0)
        late = run.delta("w2", 0, local_step="500")
        with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
            assert m.round() is True  # the round of two: w2's refused, w1's applied
        lines = [r.getMessage() for r in caplog.records]
        assert any(
            "rejected delta w2--00000000.safetensors from w2 by no-late-local-steps: local step 500" in line
            for line in lines
        ), lines
        assert m.rejected == [
            {"id": late, "reason": "local step 500 is past this run's 100", "check": "no-late-local-steps"}
        ]
        m.write_metrics(force=True)
        metrics = json.loads(m.metrics_path.read_text())
        assert metrics["rejected_recent"][-1]["check"] == "no-late-local-steps"
        assert metrics["rejected_by_check"] == {"no-late-local-steps": 1}
        head = run.bus.read_head()
        assert head["status"]["rejected_recent"][-1]["check"] == "no-late-local-steps"
        result = CliRunner().invoke(build_app(), ["hub", "status", f"file://{run.bus.root}", "--json"])
        assert result.exit_code == 0, result.output
        shown = json.loads(result.output)
        assert shown["rejected_recent"][-1]["check"] == "no-late-local-steps", shown["rejected_recent"]
        assert m.applied == [good] and m.outer_step == 1
    finally:
        host.unregister("defence-plugin")
    assert "no-late-local-steps" not in Run(tmp_path / "after").master().pipeline.names()
