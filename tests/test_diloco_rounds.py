"""Who a round waits for and until when (diloco/master/rounds.py): the pure deadline rule, then real
master rounds on a real directory bus (and the loopback Hub for the collaborator list) with real
safetensors deltas and a clock the test moves, so nothing depends on wall-clock luck."""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.manifest import add_collaborator
from speedtronic.diloco.master import Master
from speedtronic.diloco.master.rounds import deadline, live_window, predicted_grace, quorum_count
from test_diloco_master import Run


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def master(run: Run, clock: Clock, state: str = "state", momentum: float = 0.0) -> Master:
    m = Master(
        run.cfg,
        run.bus,
        run.manifest,
        codec.snapshot(run.model),
        state_dir=run.tmp_path / state,
        momentum=momentum,
        clock=clock,
    )
    m.start_state()
    return m


def listed(run: Run, *nodes: str) -> None:
    """The manifest lists exactly `nodes` (what `hub add-collaborator` writes, and its undoing)."""
    manifest = {**run.bus.read_manifest(), "collaborators": {}}
    for node in nodes:
        manifest = add_collaborator(manifest, node, node, None)
    run.bus.write_manifest(manifest)
    run.manifest = manifest


POLL = ["distributed.node.poll_interval=1", "distributed.rounds.max_wait=600"]
NO_SLOW = "distributed.rounds.slow_factor=null"


# -- the rule, as pure functions --------------------------------------------------------------------
def test_the_grace_is_learnt_from_offsets_and_clamped() -> None:
    kw = {"k": 3.0, "poll": 1.0, "max_wait": 600.0, "initial": 120.0}
    assert predicted_grace([], [], **kw) == (120.0, "initial")  # no history yet
    assert predicted_grace([], [0.0, 0.2, 0.1], **kw) == (2.0, "pooled")  # tight: the 2-poll floor
    grace, source = predicted_grace([20.0, 21.0, 19.0, 20.0], [0.0] * 12, **kw)
    # median 20, MAD 0.5 (floored at 5% of the median: 1.0), + one poll
    assert source == "own" and grace == pytest.approx(20.0 + 3 * 1.0 + 1.0)
    assert predicted_grace([900.0] * 3, [], **kw) == (600.0, "own")  # never past max_wait
    assert predicted_grace([], [], **{**kw, "initial": 5000.0})[0] == 600.0


def test_the_deadline_rule_all_quorum_max_wait() -> None:
    assert deadline(100.0, 3, 3, quorum=0.5, grace=20.0, max_wait=600.0) == (100.0, "all")
    assert deadline(100.0, 2, 3, quorum=0.5, grace=20.0, max_wait=600.0) == (120.0, "grace")
    assert deadline(100.0, 1, 3, quorum=0.5, grace=20.0, max_wait=600.0) == (700.0, "max_wait")
    assert deadline(100.0, 1, 4, quorum=0.25, grace=900.0, max_wait=600.0) == (700.0, "grace")
    assert [quorum_count(0.5, n) for n in (0, 1, 2, 3, 4)] == [1, 1, 1, 2, 2]
    assert live_window([], poll=1.0, max_wait=600.0) == 600.0  # one delta: no pace known yet
    assert live_window([10.0, 12.0, 11.0], poll=1.0, max_wait=600.0) == 33.0
    assert live_window([0.1], poll=1.0, max_wait=600.0) == 3.0  # at least 3 polls


# -- real rounds ------------------------------------------------------------------------------------
def test_a_listed_node_that_never_sends_does_not_hold_rounds_beyond_the_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(
        tmp_path, *POLL, "distributed.master.collaborators=[w1,w2,w3]", "distributed.rounds.initial_grace=30"
    )
    clock = Clock()
    m = master(run, clock)
    run.delta("w1", 0)
    run.delta("w2", 0)
    assert m.round() is False  # the first round: w3 may be starting too
    assert m.waiting["waiting_on"] == ["w3"] and m.waiting["closes_by"] == "grace"
    # No history yet: the grace is learnt from this round's arrivals (w1 and w2 at once: 2 polls),
    # never the 30 s initial grace, which only bounds it.
    report = m.metrics()["round"]
    assert report["quorum_nodes"] == 2 and report["grace_s"] == 2.0 and report["grace_from"] == "this round"
    assert "a quorum of 0.5" in m.rounds.describe() and "pinned by the config" in m.rounds.describe()
    clock.t += 1
    assert m.round() is False
    clock.t += 1.5
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        assert m.round() is True  # at the grace, not at the initial grace (30 s) nor max_wait (600 s)
    assert m.outer_step == 1 and m.rounds.last["without"] == ["w3"]
    # w3's join grace (one grace from the first arrival) ran out with the round's grace.
    assert any("(not_live) without w3" in r.getMessage() for r in caplog.records)
    # Never heard from and past its join grace: no later round waits for it at all.
    for seq in (1, 2):
        clock.t += 10
        run.delta("w1", seq)
        run.delta("w2", seq)
        assert m.round() is True
    assert m.outer_step == 3 and m.rounds.report["not_waited_for"] == ["w3"]
    head = run.bus.read_head()
    assert head["round"]["members"] == ["w1", "w2", "w3"] and head["round"]["live"] == ["w1", "w2"]


def rounds_with(run: Run, m: Master, clock: Clock, c_offset: float, n: int, seq0: int = 0) -> None:
    """n rounds where a and b send at once and c `c_offset` seconds later; each round waits for c."""
    for seq in range(seq0, seq0 + n):
        clock.t += 5
        run.delta("a", seq)
        run.delta("b", seq)
        assert m.round() is False, m.waiting
        clock.t += c_offset
        run.delta("c", seq)
        assert m.round() is True
        assert m.rounds.last["closed_by"] == "all"


def test_the_grace_is_short_when_arrivals_are_tight_and_longer_for_a_slow_live_node(
    tmp_path: Path,
) -> None:
    runs = {}
    for name, offset in (("tight", 0.5), ("slow", 20.0)):
        # slow_factor null: every live node is waited for, however slow (the default leaves c out:
        # test_a_much_slower_node_is_not_waited_for_and_its_deltas_still_count)
        run = Run(tmp_path / name, *POLL, "distributed.master.collaborators=[a,b,c]", NO_SLOW)
        clock = Clock()
        m = master(run, clock)
        rounds_with(run, m, clock, offset, 4)
        # Now c is late: where does the round stop waiting for it?
        clock.t += 5
        run.delta("a", 4)
        run.delta("b", 4)
        assert m.round() is False
        runs[name] = (run, m, clock, m.waiting["grace_s"])
    tight, slow = runs["tight"][3], runs["slow"][3]
    assert tight == 2.0  # the floor: two polls
    assert 20.0 < slow < 30.0  # c's typical 20 s, with a margin, never the 120 s initial guess
    run, m, clock, _ = runs["tight"]
    clock.t += 2.1
    assert m.round() is True and m.rounds.last["without"] == ["c"]
    run, m, clock, _ = runs["slow"]
    clock.t += 19
    assert m.round() is False and m.waiting["waiting_on"] == ["c"]  # still within c's usual delay
    clock.t += 1.5
    run.delta("c", 4)
    assert m.round() is True and m.rounds.last["closed_by"] == "all"
    # The history is part of the master's state: a restarted master keeps what it learnt.
    offsets = m.rounds.offsets
    assert offsets["c"][-1] == pytest.approx(20.5) and len(offsets["a"]) == 5
    again = master(run, clock, "state")
    assert again.rounds.offsets == offsets and again.rounds.intervals == m.rounds.intervals
    m.write_metrics(force=True)
    shown = json.loads(m.metrics_path.read_text())["round"]
    assert shown["last"]["closed_by"] == "all" and shown["live"] == ["a", "b", "c"]
    assert shown["rule"] == "quorum+grace" and shown["grace_from"] in ("own", "pooled")


def slow_swarm(run: Run, m: Master, clock: Clock, rounds: int) -> list[float]:
    """a and b send a delta every 5 s, c every 20 s (built three outer steps back); each round is
    polled every second until it closes. Returns how long each round stayed open."""
    waited, seq = [], {"a": 0, "b": 0, "c": 0}
    for r in range(rounds):
        clock.t += 5
        nodes = ["a", "b", "c"] if r % 4 == 0 else ["a", "b"]
        for node in nodes:
            run.delta(node, seq[node], base=max(0, m.outer_step - (3 if node == "c" else 0)))
            seq[node] += 1
        opened = clock.t
        while not m.round():
            clock.t += 1
        waited.append(clock.t - opened)
    return waited


def test_a_much_slower_node_is_not_waited_for_and_its_deltas_still_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a and b take 5 s per delta, c 20 s. Once c has a pace of its own (three deltas), rounds no
    longer wait out a grace for it: they close as soon as a and b are in, and c's deltas are applied
    in the round open when they come. With slow_factor null, rounds keep waiting for c whenever it
    is due by its learnt grace."""
    outcome = {}
    for name, sets in (("default", []), ("null", [NO_SLOW])):
        run = Run(tmp_path / name, *POLL, "distributed.master.collaborators=[a,b,c]", *sets)
        clock = Clock()
        m = master(run, clock)
        with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
            outcome[name] = (slow_swarm(run, m, clock, 16), m)
    waited, m = outcome["default"]
    assert waited[-4:] == [0.0, 0.0, 0.0, 0.0], waited  # c's pace is known: a and b close each round
    assert m.rounds.report["slow"] == ["c"] and "c" not in m.rounds.report["expected"], m.rounds.report
    assert "c is much slower than the fastest node" in caplog.text
    applied_c = [i for i in m.applied if i.startswith("c/")]
    assert len(applied_c) == 4 and not [i for i in m.rejected if str(i).startswith("c/")], m.rejected
    null_waited, null_m = outcome["null"]
    assert sum(null_waited[-4:]) > 0, (null_waited, waited)  # waited for c
    assert null_m.rounds.report["slow"] == []


def test_a_node_that_missed_a_round_teaches_the_grace_its_delay(tmp_path: Path) -> None:
    run = Run(tmp_path, *POLL, "distributed.master.collaborators=[a,b,c]")
    clock = Clock()
    m = master(run, clock)
    rounds_with(run, m, clock, 0.5, 3)
    assert m.rounds.offsets["c"] == [0.5, 0.5, 0.5]
    clock.t += 5
    run.delta("a", 3)
    run.delta("b", 3)
    assert m.round() is False
    grace = m.waiting["grace_s"]
    clock.t += grace + 0.1
    assert m.round() is True and m.rounds.last["without"] == ["c"]
    clock.t += 10
    run.delta("c", 3)  # 10 s after the round it missed closed
    assert m.round() is False  # it opens the next round, which waits for a quorum
    # Its offset counts from the opening of the round it missed, not from the round it opened.
    assert m.rounds.offsets["c"] == [0.5, 0.5, 0.5, pytest.approx(grace + 10.1)]
    clock.t += 5
    run.delta("a", 4)
    run.delta("b", 4)
    assert m.round() is True and m.rounds.last["closed_by"] == "all"
    assert len(m.rounds.offsets["c"]) == 4 and m.rounds.offsets["a"][-1] == 5.0  # not counted twice


def test_a_collaborator_added_while_running_counts_from_the_next_round_and_a_removed_one_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(tmp_path, *POLL, "distributed.master.membership_refresh_s=0")
    listed(run, "w1", "w2")
    clock = Clock()
    m = master(run, clock)
    early = run.delta("w3", 0)  # not listed yet: ignored
    run.delta("w1", 0)
    run.delta("w2", 0)
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        assert m.round() is True
        assert early not in m.applied and m.allowed == {"w1", "w2"}
        listed(run, "w1", "w2", "w3")  # `hub add-collaborator` while the master runs
        clock.t += 10
        run.delta("w1", 1)
        run.delta("w2", 1)
        assert m.round() is True  # w3 has a delta waiting: the next round takes it
        assert early in m.applied and m.allowed == {"w1", "w2", "w3"}
        listed(run, "w1", "w3")  # w2 removed
        clock.t += 10
        gone = run.delta("w2", 2)
        run.delta("w1", 2)
        run.delta("w3", 1)
        assert m.round() is True  # every remaining member has a delta: no wait for w2
        assert gone not in m.applied and m.outer_step == 3 and m.allowed == {"w1", "w3"}
        assert m.rounds.report["members"] == ["w1", "w3"]
        listed(run)  # a manifest that suddenly lists nobody never opens the run to everyone
        manifest = run.bus.read_manifest()
        run.bus.write_manifest({**manifest, "collaborators": {"../evil": {}, "w1": {}}})
        clock.t += 10
        m.round()
        assert m.allowed == {"w1"}  # the bad name is dropped, never trusted
        listed(run)
        m.round()
        m.round()
        assert m.allowed == {"w1"}
    said = [r.getMessage() for r in caplog.records]
    assert sum("collaborator w3 added" in s for s in said) == 1
    assert sum("collaborator w2 removed" in s for s in said) == 1
    assert any("ignoring delta w2--00000002.safetensors from unlisted node w2" in s for s in said)
    assert sum("lists no collaborators now" in s for s in said) == 1


def test_an_unlisted_nodes_file_re_reads_the_manifest_before_it_is_due(tmp_path: Path) -> None:
    """membership_refresh_s 600, and a file of a node the master does not list: a sign that the owner
    listed it since. The manifest is re-read at the next poll (at most every HINT_MIN_S), once per node."""
    run = Run(
        tmp_path, *POLL, "distributed.rounds.min_deltas=1", "distributed.master.membership_refresh_s=600"
    )
    listed(run, "w1")
    clock = Clock()
    m = master(run, clock)
    early = run.delta("w3", 0)
    assert m.round() is False and m.allowed == {"w1"}  # ignored: not listed (as far as it knows)
    listed(run, "w1", "w3")
    clock.t += 3
    assert m.round() is True and m.applied == [early] and m.allowed == {"w1", "w3"}
    stranger = run.delta("x9", 0)
    reads = []
    read_manifest = run.bus.read_manifest
    run.bus.read_manifest = lambda: reads.append(1) or read_manifest()  # type: ignore[method-assign]
    for _ in range(3):
        clock.t += 3
        m.round()
    assert len(reads) == 1 and stranger not in m.applied, reads  # one re-read for x9's sign, not one a poll


def test_an_added_collaborator_is_waited_for_in_the_next_round(tmp_path: Path) -> None:
    run = Run(
        tmp_path, *POLL, "distributed.master.membership_refresh_s=0", "distributed.rounds.initial_grace=60"
    )
    listed(run, "w1", "w2")
    clock = Clock()
    m = master(run, clock)
    run.delta("w1", 0)
    run.delta("w2", 0)
    assert m.round() is True
    listed(run, "w1", "w2", "w3")
    clock.t += 10
    run.delta("w1", 1)
    run.delta("w2", 1)
    assert m.round() is False and m.waiting["waiting_on"] == ["w3"]  # its join grace
    clock.t += 5
    run.delta("w3", 0)
    assert m.round() is True and "w3/w3--00000000.safetensors" in m.applied and m.outer_step == 2


def test_a_stragglers_delta_counts_in_a_later_round_with_its_staleness_weight(tmp_path: Path) -> None:
    run = Run(
        tmp_path,
        *POLL,
        "distributed.master.collaborators=[a,b]",
        "distributed.rounds.initial_grace=10",
        "distributed.defences.aggregation=mean",
    )
    clock = Clock()
    m = master(run, clock)
    a0 = run.delta("a", 0)
    assert m.round() is False
    clock.t += 10
    assert m.round() is True and m.applied == [a0]  # closed at the grace without b
    before = {n: t.clone() for n, t in m.outer.weights.items()}
    clock.t += 3
    a1 = run.delta("a", 1, base=1)
    b0 = run.delta("b", 0, base=0)  # the straggler, built on outer step 0
    da, db = (
        codec.decode((run.bus.root / "deltas" / i).read_bytes(), run.specs, kind="delta").tensors
        for i in (a1, b0)
    )
    assert m.round() is True and m.applied == [a0, a1, b0] and m.outer_step == 2
    # 64 tokens each; b's count 1/(1+1) for its one outer step of staleness (lr 1, no momentum).
    for n, w in m.outer.weights.items():
        assert torch.allclose(w, before[n] - (64 * da[n] + 32 * db[n]) / 96, atol=1e-6)


def test_a_round_of_only_stale_deltas_steps_at_its_freshest_deltas_weight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst after an outage: a, b and c built on outer step 0; the round closes at its grace with a
    alone (outer step 1), then b and c land together, both one step behind. Their round steps half the
    outer lr (1/(1+1)): step 1 already carried that span's progress (a's). Stepping it in full, each
    split of the quorum stepped the same global again (bench/chaos.py: 3 full steps in 2 s, the loss up
    0.05–0.09). A round with one fresh delta still steps in full (the straggler test above)."""
    run = Run(
        tmp_path,
        *POLL,
        "distributed.master.collaborators=[a,b,c]",
        "distributed.rounds.initial_grace=10",
        "distributed.rounds.quorum=0.3",
        "distributed.defences.aggregation=mean",
    )
    clock = Clock()
    m = master(run, clock)
    a0 = run.delta("a", 0)
    assert m.round() is False
    clock.t += 10
    assert m.round() is True and m.applied == [a0] and m.outer_step == 1
    before = {n: t.clone() for n, t in m.outer.weights.items()}
    b0, c0 = run.delta("b", 0, base=0), run.delta("c", 0, base=0)
    db, dc = (
        codec.decode((run.bus.root / "deltas" / i).read_bytes(), run.specs, kind="delta").tensors
        for i in (b0, c0)
    )
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        assert m.round() is False  # the quorum is in; its grace for a
        clock.t += 10
        assert m.round() is True and m.applied == [a0, b0, c0] and m.outer_step == 2
    for n, w in m.outer.weights.items():  # lr 1, no momentum; equal tokens: the mean of b and c, halved
        assert torch.allclose(w, before[n] - 0.5 * (db[n] + dc[n]) / 2, atol=1e-6)
    assert any("built on a global 1 step(s) old" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("refresh_s", [0, 600])
def test_the_hub_bus_lists_a_collaborator_added_since_its_manifest_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refresh_s: int
) -> None:
    """refresh_s 600: the manifest is not due for ten minutes, but the run's repos list a new delta repo
    that no listed node owns: the master re-reads the manifest at its next poll (a Hub soak's joiner
    waited up to membership_refresh_s, its deltas went stale and were rejected)."""
    pytest.importorskip("huggingface_hub")
    from hub_server import HubServer
    from test_diloco_hub_bus import ALICE, OWNER, make_bus

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    server = HubServer()
    server.state.add_user("owner", OWNER)
    server.state.add_user("alice", ALICE)
    try:
        run = Run(
            tmp_path,
            "distributed.rounds.min_deltas=1",
            f"distributed.master.membership_refresh_s={refresh_s}",
        )
        clock = Clock()
        owner = make_bus(server, OWNER)
        owner.api.create_repo("owner/run", private=False)
        first = add_collaborator(run.manifest, "bob", "bob", None)
        owner.write_manifest(first)
        assert list(owner.collaborators()) == ["bob"]  # read once, then cached
        m = Master(
            run.cfg,
            owner,
            first,
            codec.snapshot(run.model),
            state_dir=tmp_path / "s",
            momentum=0.0,
            clock=clock,
        )
        m.start_state()
        assert m.round() is False and m.allowed == {"bob"}
        reads = []
        read_manifest = owner.read_manifest
        monkeypatch.setattr(owner, "read_manifest", lambda: reads.append(1) or read_manifest())
        # Someone else (`hub add-collaborator` on another machine) lists alice.
        make_bus(server, OWNER).write_manifest(add_collaborator(first, "alice", "alice", None))
        alice = make_bus(server, ALICE)
        alice.check_worker_access("alice")
        run.delta("alice", 0)
        data = (run.bus.root / "deltas" / "alice" / "alice--00000000.safetensors").read_bytes()
        alice.put_delta("alice", "alice--00000000.safetensors", data)
        clock.t += 3
        if refresh_s:  # this poll lists alice's repo: a sign; the next one re-reads the manifest
            assert m.round() is False and m.allowed == {"bob"} and not reads
            clock.t += 3
        # The master's refresh re-reads the manifest, and the bus then lists alice's own delta repo.
        assert m.round() is True and m.applied == ["alice/alice--00000000.safetensors"]
        assert m.allowed == {"alice", "bob"}
        if refresh_s:  # one re-read for the sign, none again for the same repo
            clock.t += 3
            m.round()
            assert len(reads) == 1, reads
    finally:
        server.stop()


def every_node_each_round(tmp_path: Path, nodes: str, rounds: int) -> tuple[Run, Clock, Master]:
    """A master on a test clock after `rounds` rounds with a delta from each of `nodes`, 5 s apart."""
    run = Run(tmp_path, *POLL, NO_SLOW)
    clock = Clock()
    m = master(run, clock)
    for seq in range(rounds):
        clock.t += 5
        for node in nodes:
            run.delta(node, seq, base=m.outer_step)
        assert m.round() is True and m.rounds.last["closed_by"] == "all"
    return run, clock, m


def test_a_delta_folded_while_the_master_could_not_answer_counts_for_the_intervals_it_took(
    tmp_path: Path,
) -> None:
    """A bus outage: no round passes, the workers train on and fold 8 sync points into one delta each.
    Its claim is bounded by the intervals it took on the master's clock (8 of the node's usual 5 s),
    not by its staleness (0 here: it counted as one round).
    Without that much time behind it, a claim that skips sequence numbers still counts for one round."""
    run, clock, m = every_node_each_round(tmp_path, "abc", 4)  # nodes' marks 3, intervals 5 s
    bound = m.limits.max_tokens

    def counted(seq: int, after: float) -> dict[str, int]:
        before = {n: m.ledger.nodes[n]["tokens"] for n in "abc"}
        clock.t += after
        for node in "abc":
            run.delta(node, seq, base=m.outer_step, tokens=str(8 * bound))  # 8 sequence numbers in one
        assert m.round() is True
        return {n: m.ledger.nodes[n]["tokens"] - before[n] for n in "abc"}

    assert counted(11, after=5) == dict.fromkeys("abc", bound)  # numbers skipped, no time behind them
    assert counted(19, after=40) == dict.fromkeys("abc", 8 * bound)  # the outage: 8 usual intervals


def test_after_a_takeover_a_node_already_quiet_is_not_waited_for_and_a_live_one_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Four nodes, then d goes quiet (a worker that left): its last delta was applied a minute before
    # the others'. A master that takes over waits for a, b and c (live when the last round was applied)
    # and not for d, whose liveness window would otherwise hold its first rounds (the chaos soak).
    run, clock, m = every_node_each_round(tmp_path, "abcd", 4)
    a_minute_ago = datetime.fromtimestamp(time.time() - 60, timezone.utc).isoformat(timespec="seconds")
    m.ledger.nodes["d"]["at"] = a_minute_ago
    m.save_state()
    clock.t += 10
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        again = master(run, clock, "state")  # the standby: what the last master saved
    assert again.rounds.quiet == {"d"}, again.rounds.heard
    assert "not waiting for d: quiet when the last round was applied" in caplog.text
    clock.t += 5
    run.delta("a", 4, base=again.outer_step)
    run.delta("b", 4, base=again.outer_step)
    assert again.round() is False and again.waiting["waiting_on"] == ["c"], again.waiting  # c, not d
    clock.t += 0.5
    run.delta("c", 4, base=again.outer_step)
    assert again.round() is True and again.rounds.last["closed_by"] == "all", again.rounds.last
    # d comes back: live again with its delta, and waited for from then on
    clock.t += 5
    for node in "abd":
        run.delta(node, 5 if node != "d" else 4, base=again.outer_step)
    assert again.round() is False and again.waiting["waiting_on"] == ["c"]
    assert "d" not in again.rounds.quiet


def test_a_standby_stops_waiting_for_a_node_that_left_once_the_others_show_their_pace(
    tmp_path: Path,
) -> None:
    """A standby takes over with no history: every node in the ledger counts as just heard from. d
    left just before (it sends nothing more). Once a, b and c have intervals of their own, d's
    liveness comes from theirs (3 × 5 s), not max_wait (600 s here): the rounds stop waiting for it.
    Before, each round waited its grace for d for max_wait, and a round whose deltas the probe all
    found worse waited for d until max_wait (a 30-minute soak: 60 s without an outer step)."""
    run, clock, _ = every_node_each_round(tmp_path, "abcd", 2)
    standby = master(run, clock, "standby")  # its own, empty state directory: it adopts the bus's head
    assert standby.rounds.intervals == {} and set(standby.rounds.heard) == set("abcd")
    closed = []
    for seq in range(2, 8):
        clock.t += 5
        for node in "abc":
            run.delta(node, seq, base=standby.outer_step)
        while not standby.round():
            clock.t += 1
        closed.append(standby.rounds.last["closed_by"])
    # The first rounds wait for d (no intervals yet: max_wait); from 3 × 5 s after the takeover on, not.
    assert closed[-3:] == ["all", "all", "all"], closed


def test_a_takeover_reads_the_ledgers_times_as_untrusted(tmp_path: Path) -> None:
    """Ledger times come from a head on the bus: a malformed one counts the node as live (waited
    for, as before), and one in the future cannot make every other node look quiet."""
    run, clock, m = every_node_each_round(tmp_path, "abc", 3)
    m.ledger.nodes["a"]["at"] = "3025-01-01T00:00:00+00:00"  # a thousand years ahead
    m.ledger.nodes["b"]["at"] = "not a time"
    m.save_state()
    again = master(run, clock, "state")
    assert again.rounds.quiet == set() and set(again.rounds.heard) == {"a", "b", "c"}, again.rounds.heard


@pytest.mark.parametrize("took_s", [40, 5])
def test_a_folded_delta_is_held_to_the_norm_allowance_of_the_rounds_it_spans(
    tmp_path: Path, took_s: float
) -> None:
    """c folds 8 sync points into one delta 16× the others' norm. After 8 of its usual intervals (a bus
    outage) that is 2× a round's norm: applied, and its per-round norm is what joins the history.
    With no time behind the skipped numbers it stands for one round: 16× the reference, past the 10×
    allowance, rejected (before, the 8-interval fold was rejected too: a joiner's 29-sync fold in a soak)."""
    run, clock, m = every_node_each_round(tmp_path, "abc", 4)  # marks 3, intervals 5 s
    clock.t += took_s
    for node in "ab":
        run.delta(node, 4, base=m.outer_step)
    folded = run.delta("c", 11, scale=16e-3, base=m.outer_step)
    assert m.round() is True
    rejected = {r["id"]: r["reason"] for r in m.rejected}
    if took_s == 40:
        assert folded in m.applied and not rejected, rejected
        per_round = [v for node, v in m.pipeline.norms.entries if node == "c"][-1]
        assert per_round < 3 * [v for node, v in m.pipeline.norms.entries if node == "a"][-1]
    else:
        assert folded not in m.applied and "norm outlier" in rejected[folded], rejected


def test_after_a_takeover_the_first_arrival_is_no_interval_of_the_node(tmp_path: Path) -> None:
    """A master that takes over counts the ledger's live nodes as heard at adoption. Its first poll finds
    deltas that were already waiting, 0.2 s later: taken as an interval, that gave each node a liveness
    window of 3 polls, and a node whose next delta took a little longer (folded over the sync points
    the master did not answer) dropped out of the round, which then closed as "all" without it — the
    swarm split into two groups that each took an outer step of their own (a 30-minute Hub soak: the
    loss 3.2 → 4.5 after the first takeover). The time from adoption to a delta is not an interval."""
    run, clock, _ = every_node_each_round(tmp_path, "abcd", 2)
    standby = master(run, clock, "standby")  # its own, empty state directory: it adopts the bus's head
    clock.t += 0.2
    for node in "abcd":
        run.delta(node, 2, base=standby.outer_step)  # waiting on the bus when it took over
    assert standby.round() is True and standby.rounds.last["closed_by"] == "all"
    assert standby.rounds.intervals == {}, standby.rounds.intervals
    clock.t += 5
    for node in "abc":
        run.delta(node, 3, base=standby.outer_step)
    assert standby.round() is False and standby.waiting["waiting_on"] == ["d"], standby.waiting
    clock.t += 1
    run.delta("d", 3, base=standby.outer_step)  # its delta took a second longer
    assert standby.round() is True and standby.rounds.last["closed_by"] == "all", standby.rounds.last
    assert standby.rounds.last["without"] == [], standby.rounds.last


def test_after_a_silence_of_the_whole_swarm_the_first_round_waits_for_the_nodes_live_before_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bus outage: no node's delta comes for 30 s (6 of their usual 5 s intervals; their liveness
    windows are 15 s). When the bus is back, a and b come first. The silence was the bus's, not the
    nodes': the round waits for c and d, live when it began, instead of closing as "all" with a and b
    (a 30-minute Hub soak: a round of 2 of 8 deltas folded over 11 sync points, then the two groups
    took alternate rounds), and waits as long as their bus retries may take, not its usual grace (the
    next soak: the round closed on a quorum of 4 of 7, 1.9 s after the bus came back). A node already gone before the silence (e) is still not waited for, and
    the deltas' intervals stay the real ones (the spans that bound their folded claims)."""
    run = Run(tmp_path, *POLL, NO_SLOW, "distributed.defences.quarantine_below=null")  # random deltas
    clock = Clock()
    m = master(run, clock)
    for seq in range(8):
        clock.t += 5
        for node in "abcd" if seq >= 4 else "abcde":  # e leaves after 4 rounds
            run.delta(node, seq, base=m.outer_step)
        while not m.round():
            clock.t += 1
    assert m.rounds.last["closed_by"] == "all" and "e" not in m.rounds.expected, m.rounds.last
    clock.t += 30  # then 30 s of nothing from anyone
    for node in "ab":
        run.delta(node, 8, base=m.outer_step)
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        assert m.round() is False, m.rounds.last
    assert m.waiting["waiting_on"] == ["c", "d"], m.waiting
    assert "no delta from any node for 30.0s" in caplog.text and "the bus, not the nodes" in caplog.text
    # c and d come back as their retries let them, 3 and 12 s later: past the usual grace (2 polls here:
    # a and b are a quorum) and d past its liveness window, within the grace after a silence (their
    # retries: at most the silence, plus one usual interval: 35 s)
    clock.t += 3
    run.delta("c", 8, base=m.outer_step)
    assert m.round() is False and m.waiting["waiting_on"] == ["d"], m.waiting
    assert m.rounds.report["grace_from"] == "silence", m.rounds.report
    clock.t += 8
    assert m.round() is False and m.waiting["waiting_on"] == ["d"], m.waiting
    clock.t += 1
    run.delta("d", 8, base=m.outer_step)
    assert m.round() is True and m.rounds.last["closed_by"] == "all", m.rounds.last
    assert [m.rounds.intervals[n][-1] for n in "abcd"] == [30.0, 30.0, 33.0, 42.0], m.rounds.intervals
    assert m.rounds.recovery == 0.0  # the next round's grace is its own again


def test_a_round_that_waited_makes_no_silence_of_the_swarm(tmp_path: Path) -> None:
    """e leaves just before a bus outage: the round after the outage waits for it (live when the
    silence began) as long as the nodes' retries may take, and closes without it. The nodes waited
    for that round's global meanwhile: their next deltas come one interval after it closed, and that
    wait was the master's, not a silence of the swarm — e is not waited for again. (Counted from the
    last delta alone, it was: in a soak, a node that had left held three rounds in a row 5–10 s each,
    each wait making the silence that excused the next.)"""
    run = Run(tmp_path, *POLL, NO_SLOW, "distributed.defences.quarantine_below=null")
    clock = Clock()
    m = master(run, clock)

    def round_of(nodes: str, seq: int) -> None:
        for node in nodes:
            run.delta(node, seq, base=m.outer_step)
        while not m.round():
            clock.t += 1

    for seq in range(4):
        clock.t += 5
        round_of("abcde", seq)
    clock.t += 5
    round_of("abcd", 4)  # e left: it sends nothing more
    clock.t += 30  # the bus is down
    round_of("abcd", 5)  # waits for e up to the retries' grace, then closes without it
    assert m.rounds.last["without"] == ["e"] and m.rounds.last["waited_s"] >= 30, m.rounds.last
    clock.t += 5  # the nodes' next deltas, one interval after that round's global
    for node in "abcd":
        run.delta(node, 6, base=m.outer_step)
    assert m.round() is True and m.rounds.last["closed_by"] == "all", m.rounds.last
    assert m.rounds.last["without"] == [], m.rounds.last


def split_swarm(run: Run, m: Master, clock: Clock) -> float:
    """Eight nodes in step for five rounds (a delta every 5 s), then a round that closes on its grace
    with a–d only: e–h come 3.1 s after it opened, built on the global before it (a 429/500 storm's
    retries made them late), and open the next round with a quorum of their own. Returns when the
    round a–d were in opened (a–d train on its global and send again 5.5 s after it)."""
    for seq in range(5):
        clock.t += 5
        for node in "abcdefgh":
            run.delta(node, seq, base=m.outer_step)
        assert m.round() is True and m.rounds.last["closed_by"] == "all", m.rounds.last
    clock.t += 5
    opened, base = clock.t, m.outer_step
    for node in "abcd":
        run.delta(node, 5, base=base)
    while not m.round():
        clock.t += 1
    assert m.rounds.last["without"] == list("efgh"), m.rounds.last
    clock.t = opened + 3.1
    for node in "efgh":
        run.delta(node, 5, base=base)
    assert m.round() is False, m.rounds.last
    return opened


def test_stragglers_that_fill_a_quorum_do_not_close_the_round_before_the_last_rounds_nodes(
    tmp_path: Path,
) -> None:
    """The round e–h open has a quorum (4 of 8) at once, and its grace from their arrivals (2 polls)
    would close it at +5.1 s, 0.4 s before a–d's deltas, built on the last round's global: then e–h
    take this round and a–d the next one alone, and the swarm goes on in two groups half a round
    apart (a 30-minute S3 soak after a 429/500 storm). a–d are due one interval after their last
    deltas: the round waits for them, and all eight are in one round again."""
    run = Run(tmp_path, *POLL, NO_SLOW, "distributed.defences.quarantine_below=null")  # random deltas
    clock = Clock()
    m = master(run, clock)
    opened = split_swarm(run, m, clock)
    while clock.t < opened + 5.5:
        clock.t = min(clock.t + 1, opened + 5.5)
        assert m.round() is False, m.rounds.last  # e–h wait for a–d
    assert m.waiting["waiting_on"] == list("abcd") and m.rounds.report["grace_from"] == "last round"
    assert m.waiting["grace_s"] == pytest.approx(6.75 - 3.1), m.waiting  # a–d's interval bound
    for node in "abcd":
        run.delta(node, 6, base=m.outer_step)
    assert m.round() is True, m.waiting
    assert m.rounds.last["closed_by"] == "all" and m.rounds.last["without"] == [], m.rounds.last
    assert sorted(i.split("/")[0] for i in m.applied[-8:]) == list("abcdefgh"), m.applied


def test_the_last_rounds_nodes_are_waited_for_one_interval_at_most(tmp_path: Path) -> None:
    """a–d were killed after their last round: the round e–h opened waits for them until one
    interval bound after their last deltas (5 s + 3 × the 5% floor of it + a poll = 6.75 s after
    that round opened), not max_wait, and closes without them."""
    run = Run(tmp_path, *POLL, NO_SLOW, "distributed.defences.quarantine_below=null")
    clock = Clock()
    m = master(run, clock)
    opened = split_swarm(run, m, clock)
    while not m.round():
        clock.t += 0.25
    assert 6.75 <= clock.t - opened < 7.0, (clock.t - opened, m.rounds.last)  # the first poll after it
    assert m.rounds.last["without"] == list("abcd") and m.rounds.last["closed_by"] == "grace"


def test_a_node_that_gave_up_its_id_is_not_waited_for_until_it_sends_again(tmp_path: Path) -> None:
    """a, b and c hold the leases on their ids and send every 5 s. c stops cleanly (it releases its
    lease, as a worker's SIGINT/SIGTERM does): once it is overdue (its 5-s interval + a poll), the
    round reads its lease, finds none and closes without it, before the 2-s grace; the next round does
    not wait for it at all. c's comeback (lease, delta) is waited for again. A node killed with its
    lease still held (b, later) is waited for by the grace as before."""
    run = Run(tmp_path, *POLL, NO_SLOW, "distributed.defences.quarantine_below=null")
    claims = {node: run.bus.claim(node, f"holder-{node}", 60.0) for node in "abc"}
    clock = Clock()
    m = master(run, clock)
    for seq in range(4):
        clock.t += 5
        for node in "abc":
            run.delta(node, seq, base=m.outer_step)
        assert m.round() is True and m.rounds.last["closed_by"] == "all"

    def next_round(seq: int, senders: str) -> float:
        clock.t += 5
        opened = clock.t
        for node in senders:
            run.delta(node, seq, base=m.outer_step)
        while not m.round():
            clock.t += 0.25
        return clock.t - opened

    run.bus.release(claims["c"])
    assert next_round(4, "ab") == 1.25  # c overdue after 5 + 1 s since its last delta: no lease
    assert m.rounds.last["without"] == ["c"] and m.rounds.report["departed"] == ["c"]
    assert next_round(5, "ab") == 0.0  # gone until it sends again
    claims["c"] = run.bus.claim("c", "holder-c2", 60.0)
    assert next_round(6, "abc") == 0.0 and m.rounds.last["closed_by"] == "all"
    assert next_round(7, "ac") == 2.0  # b holds its lease (killed, say): the 2-s grace, as before
    assert m.rounds.last["without"] == ["b"] and m.rounds.last["closed_by"] == "grace"


def test_departures_trust_only_an_absent_lease_of_a_node_seen_holding_one() -> None:
    """Departures (master/departures.py) with a lease table the test writes: a node never seen holding
    its lease is never taken for gone; a bus error reads as "still there"; an expired lease is gone; a
    node gone stays gone until a newer arrival, without another read."""
    from speedtronic.diloco.bus.base import BusError
    from speedtronic.diloco.master.departures import Departures

    clock, leases, reads = Clock(), {"a": 30.0, "b": 30.0}, []

    def read(node: str) -> float | None:
        reads.append(node)
        if leases.get(node) == -1:
            raise BusError("the bus is down")
        return leases.get(node)

    d = Departures(read, clock)
    d.met({"a", "b", "c"})  # at most two a poll: c is met at the next one
    assert d.holders == {"a", "b"}
    d.met({"c"})
    assert d.holders == {"a", "b"} and reads == ["a", "b", "c"]  # c holds none: never "gone"
    leases.update(a=None, b=-1, c=None)
    assert d.gone({"a": 990.0, "b": 990.0, "c": 990.0}) == {"a"}  # b: the bus cannot say
    reads.clear()
    assert d.gone({"a": 990.0}) == {"a"} and reads == []  # gone until it sends again
    leases.update(a=0.0)  # back, then its lease lapsed (a freeze)
    assert d.gone({"a": 995.0}) == {"a"} and reads == ["a"]
    leases.update(a=12.0)
    assert d.gone({"a": 999.0}) == set()
    reads.clear()
    clock.t += 1
    assert d.gone({"a": 999.0}) == set() and reads == []  # held: read again only after LOOK_S
    clock.t += 2
    assert d.gone({"a": 999.0}) == set() and reads == ["a"]


def test_from_the_third_round_the_first_deltas_of_new_nodes_wait_for_the_last_rounds_nodes(
    tmp_path: Path,
) -> None:
    """a and b send every 5 s for three rounds (two intervals each). Then two slow nodes' first deltas
    (built on global 0, 4x slower) come 3 s before a and b's next: they fill the quorum, and the
    grace learnt from the arrivals (2 polls) would close round 4 on them alone, a and b's deltas
    taking round 5 one step stale (bench/uneven.py: the run never caught up). a and b are due one
    interval after their last deltas: the round waits for them and takes all four."""
    run = Run(tmp_path, *POLL, "distributed.defences.quarantine_below=null")
    clock = Clock()
    m = master(run, clock)
    for seq in range(3):
        clock.t += 5
        for node in "ab":
            run.delta(node, seq, base=m.outer_step)
        assert m.round() is True and m.rounds.last["closed_by"] == "all", m.rounds.last
    clock.t += 2
    opened = clock.t
    for node in "st":
        run.delta(node, 0, base=0)
    while clock.t < opened + 3:
        assert m.round() is False, m.rounds.last  # s and t wait for a and b
        clock.t += 0.5
    assert m.rounds.report["grace_from"] == "last round", m.rounds.report
    for node in "ab":
        run.delta(node, 3, base=m.outer_step)
    assert m.round() is True, m.waiting
    assert m.rounds.last["closed_by"] == "all" and m.rounds.last["without"] == [], m.rounds.last
    assert sorted(i.split("/")[0] for i in m.applied[-4:]) == list("abst"), m.applied
