"""When a worker stops for its rejected deltas (`distributed.worker.max_consecutive_rejections`): the
streak since its last applied delta, where a backlog rejected as stale on one old global counts once."""

from __future__ import annotations

from speedtronic.diloco import codec
from speedtronic.diloco.worker.feedback import rejection_streak


def name(seq: int) -> str:
    return codec.delta_name("w1", seq)


def stale(base: int, at: int) -> str:
    return f"stale: built on outer step {base}, the run is at {at}"


def test_a_backlog_rejected_as_stale_on_one_global_counts_once() -> None:
    # After a master failover: 12 deltas the worker made while it trained through, all on global 446.
    backlog = {name(40 + i): stale(446, 451) for i in range(12)}
    assert rejection_streak(backlog, hwm=39) == [name(40)]
    # What it sends on the next global, if that is rejected too, counts again.
    later = {**backlog, name(52): stale(451, 457), name(53): "norm_outlier: 40x the median norm"}
    assert rejection_streak(later, hwm=39) == [name(40), name(52), name(53)]
    assert rejection_streak(later, hwm=52) == [name(53)]  # applied up to 52: the streak starts after


def test_a_worker_stale_on_every_new_global_still_stops() -> None:
    # Too slow for the run: each delta on a newer global, each rejected as stale: every one counts.
    slow = {name(i): stale(10 * i, 10 * i + 6) for i in range(1, 6)}
    assert rejection_streak(slow, hwm=0) == [name(i) for i in range(1, 6)]
    # Rejections for what a delta contains count one by one, whatever it was built on.
    bad = {name(i): "finite: a non-finite value in tok_emb.weight" for i in range(1, 6)}
    assert len(rejection_streak(bad, hwm=0)) == 5


def test_a_restarted_worker_counts_only_what_it_sent_itself() -> None:
    # Its previous life's 5 rejections are in the head; the restart is the fix the error asked for.
    before = {name(i): "finite: a non-finite value in tok_emb.weight" for i in range(1, 6)}
    assert len(rejection_streak(before, hwm=0)) == 5
    assert rejection_streak(before, hwm=0, sent_here=set()) == []
    after = {**before, name(6): "norm_outlier: 40x the median norm"}
    assert rejection_streak(after, hwm=0, sent_here={name(6)}) == [name(6)]
