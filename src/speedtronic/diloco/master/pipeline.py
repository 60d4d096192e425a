"""Receiving deltas, as a pipeline: decode → checks → weigh → aggregate → outer step → record → commit
→ publish. The master's round (core.py) runs the stages in that order; each is a function or a small
class here, with its own unit tests (tests/test_diloco_delta_pipeline.py).

- `screen`: the LISTING checks on a file's name and sequence number (checks.py), before it is read;
- `read`: a delta's bytes (held back by an earlier round, or from the bus);
- `Pipeline.receive`: the DELTA checks, decoding step by step; `Pipeline.judge_round`: the ROUND checks;
  a check's verdict rejects (`Rejection`, with the check's name), weighs 0, or bounds the tokens;
- `weigh`: the live (Δ, weight, fragment) items of the round: tokens × staleness weight, without the
  deltas weighed 0, a short delta stretched to a round's tokens (`stretches`); `freshness`: each fragment's step scale, its freshest live delta's staleness weight;
- aggregate and outer step: master/fragments.py (`FragmentState.step`), one per fragment;
- `record`: every accepted delta (weighed 0 or not) in the ledger, the feedback and the round history;
- commit: the state file (state.py) — from there on the deltas count as applied; publish: core.py.

Nothing here keeps state of its own beyond the checks' (checks.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speedtronic.diloco import node_eval
from speedtronic.diloco.bus.base import Bus, DeltaRef
from speedtronic.diloco.master.checks import (
    Context,
    Delta,
    DeltaCheck,
    LossProbeCheck,
    NormOutlierCheck,
    RoundCheck,
    delta_checks,
    judges_sender,
    listing_checks,
    round_checks,
)
from speedtronic.diloco.master.norms import NormHistory
from speedtronic.diloco.outer import staleness_weight
from speedtronic.errors import SpeedtronicError

if TYPE_CHECKING:
    from speedtronic.diloco.master.fragments import FragmentState
    from speedtronic.diloco.master.ledger import Ledger
    from speedtronic.diloco.master.report import Report
    from speedtronic.diloco.master.rounds import Rounds

logger = logging.getLogger("speedtronic.diloco")
PREFETCH_THREADS = 8  # deltas a round downloads at once


@dataclass(frozen=True)
class Rejection:
    """A check refused a delta: which one, why, and whether it judged the content (not the sender)."""

    delta: Delta
    check: str
    reason: str
    content: bool


Reject = Callable[[Rejection], None]


class Pipeline:
    """The ordered checks of one master: built-in, then plugins' (`register_delta_checks`)."""

    def __init__(self, extra: list[DeltaCheck] | None = None) -> None:
        self.listing: list[DeltaCheck] = listing_checks()
        self.delta: list[DeltaCheck] = delta_checks(extra)
        self.round: list[RoundCheck] = round_checks()

    @property
    def norms(self) -> NormHistory:
        """The norm history (owned by the norm outlier check; persisted in the state file)."""
        return self._outliers.history

    @property
    def _outliers(self) -> NormOutlierCheck:
        return next(c for c in self.round if isinstance(c, NormOutlierCheck))

    def kept(self, deltas: list[Delta], context: Context) -> None:
        """The outer step these deltas made was kept: the ones that weighed join the norm history."""
        self._outliers.remember(deltas, context)

    def cannot_weigh(self, deltas: list[Delta], context: Context, complete: bool = False) -> set[str]:
        """The nodes of `deltas` that would weigh 0 in a round of them: a twin's copy, quarantined, or
        caught by the loss probe (its evaluations are kept for the round itself; `complete`: no other
        delta can join the round, checks.py)."""
        out = {d.node for d in deltas if d.zeroed or not context.peers.active(d.node)}  # zeroed: a twin
        for check in self.round:
            if isinstance(check, LossProbeCheck):
                zero = check.would_zero(deltas, context, complete)
                out |= {d.node for d in deltas if d.id in zero}
        return out

    def names(self) -> list[str]:
        return [c.name for c in (*self.listing, *self.delta, *self.round)]

    def screen(self, delta: Delta, context: Context, check: str) -> Rejection | None:
        """One LISTING check by name (the name check comes before the processed-before test, the
        sequence check after it)."""
        for c in self.listing:
            if c.name == check:
                verdict = c.check(delta, context)
                if verdict.kind == "reject":
                    return Rejection(delta, c.name, verdict.reason, False)
        return None

    def receive(self, delta: Delta, context: Context, reject: Reject) -> bool:
        """The DELTA checks in order; False (after `reject`) at the first that rejects. A check that
        does not judge the sender judges the content: the file passed every sender check before it."""
        for check in self.delta:
            verdict = check.check(delta, context)
            if verdict.kind == "reject":
                reject(Rejection(delta, check.name, verdict.reason, not judges_sender(check)))
                return False
            if verdict.kind == "weigh_zero":
                delta.zero(check.name)
            elif verdict.tokens is not None:
                delta.count(verdict.tokens)
        delta.weigh(_staleness_weight(delta, context))
        context.passed(delta)
        return True

    def judge_round(self, deltas: list[Delta], context: Context, reject: Reject) -> list[Delta]:
        """The ROUND checks over the round's deltas; the ones that are left. Every check prepares, even
        for a round with nothing left."""
        for check in self.round:
            check.prepare(deltas, context)
            kept = []
            for delta in deltas:
                verdict = check.check(delta, context)
                if verdict.kind == "reject":
                    reject(Rejection(delta, check.name, verdict.reason, True))
                    continue
                if verdict.kind == "weigh_zero":
                    delta.zero(check.name)
                elif verdict.tokens is not None and verdict.tokens != delta.tokens:
                    delta.cap(verdict.tokens)
                kept.append(delta)
            deltas = kept
        return deltas


def _staleness_weight(delta: Delta, context: Context) -> float:
    weight = staleness_weight(context.staleness(delta), context.settings.rounds.max_staleness)
    assert weight is not None  # the staleness check rejected it otherwise
    return weight


def read(
    ref: DeltaRef,
    fragments: FragmentState,
    bus: Bus,
    max_bytes: int,
    ledger: Ledger,
    kept: dict[str, bytes] | None = None,
) -> bytes:
    """A delta's bytes: from what a previous poll read and kept (a round that waited on, `kept`) or a
    previous round held back, or from the bus."""
    if kept is not None and f"{ref.id}@{ref.etag}" in kept:
        return kept[f"{ref.id}@{ref.etag}"]
    held = fragments.held(ref)
    if held is not None:
        return held
    data = bus.get_delta(ref, max_bytes)
    ledger.read_bytes(ref.node, len(data))
    fragments.note_read(ref, data)
    return data


def prefetch(
    refs: list[DeltaRef],
    fragments: FragmentState,
    bus: Bus,
    max_bytes: int,
    ledger: Ledger,
    kept: dict[str, bytes],
) -> None:
    """Download the deltas a round is about to `read` side by side, into `kept` (counted as `read`
    counts them, in this thread). One after another they cost the round their sum: on the Hub two
    requests each, four deltas 0.23 s of a 1.5-s round (bench/wan.py, a timeline with ms stamps). A
    download that fails is left to `read`, which tries again and says why."""
    wanted = [r for r in refs if f"{r.id}@{r.etag}" not in kept and fragments.held(r) is None]
    if len(wanted) < 2:
        return
    with ThreadPoolExecutor(max_workers=min(PREFETCH_THREADS, len(wanted))) as pool:
        futures = [(ref, pool.submit(bus.get_delta, ref, max_bytes)) for ref in wanted]
    for ref, future in futures:
        try:
            data = future.result()
        except (SpeedtronicError, OSError):
            continue
        ledger.read_bytes(ref.node, len(data))
        fragments.note_read(ref, data)
        kept[f"{ref.id}@{ref.etag}"] = data


def weigh(
    deltas: list[Delta], count: int, context: Context | None = None
) -> list[tuple[dict[str, torch.Tensor], float, int]]:
    """The live (Δ, weight, fragment) items: every delta not weighed 0 by a check; with `context` (a
    plain run), a short delta stretched to a round's tokens (`stretches`)."""
    stretch = stretches(deltas, context) if context is not None and count <= 1 else {}
    return [
        (_stretched(d.tensors, stretch.get(d.id, 1.0)), d.mass, d.fragment(count))
        for d in deltas
        if not d.zeroed
    ]


def stretches(deltas: list[Delta], context: Context) -> dict[str, float]:
    """{delta id: T / t} for the live deltas of one round (not folded) that claim fewer tokens t than a
    one-rank node's round T (`context.round_tokens`, from the run's config: no peer can move it), in a
    round that also holds a delta of at least T a round: a worker that syncs every H/4 of its own steps
    (a slow node kept in phase) beside nodes at H. Its Δ is stretched to a round's (× T/t) and still
    weighs its t tokens, so the mean is the deltas' sum over the rounds' worth of tokens they cover: a
    short delta adds its own displacement instead of diluting the others'. Unstretched, two nodes at
    H/4 beside two at H (bench/uneven.py `fast2slow2h`) set the clipped mean's median norm to a 5-step
    delta's and cut the 20-step ones to it: val loss 2.651 against 2.419 without them. A short claim
    buys no pull: the norm clip caps the stretched Δ and the weight is its tokens (under `mean`, which
    has no clip, it pulls as a full claim would, which any node may make). Rounds of equal or
    full claims are untouched, bit for bit. A node of r ranks at H/4 claims r/4 of T and is stretched
    only 4/r: T counts one rank's batch."""
    full = context.round_tokens
    live = [d for d in deltas if not d.zeroed and d.tokens > 0]
    if full <= 0 or not any(d.tokens >= full * context.rounds_spanned(d) for d in live):
        return {}
    return {d.id: full / d.tokens for d in live if d.tokens < full and context.rounds_spanned(d) == 1}


def _stretched(tensors: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return tensors if factor == 1.0 else {n: t.float() * factor for n, t in tensors.items()}


def freshness(deltas: list[Delta], count: int) -> dict[int, float]:
    """Each fragment's step scale: the staleness weight of its freshest live delta (1/(1+k), k the rounds
    its fragment took since that delta's global). A round with one delta built on the current global
    steps in full, as before; a round whose deltas are all k rounds behind steps 1/(1+k): the k steps
    since their global already carried the same span's progress from other nodes. A burst of rounds
    after a storm, an outage or a failover (nodes that had built on the same global, split by the
    quorum) took 3 full steps in 2 s on S3 and raised the validation loss 0.05–0.09 (bench/chaos.py)."""
    out: dict[int, float] = {}
    for d in deltas:
        if not d.zeroed:
            p = d.fragment(count)
            out[p] = max(out.get(p, 0.0), d.freshness)
    return out


def folds(deltas: list[Delta], ledger: Ledger) -> list[tuple[int, float]]:
    """(sync points folded, weight) of each live delta: its sequence number past its node's last applied
    one (a worker numbers every sync point, and folds those the master did not answer into the newest),
    for the momentum's share of the step (outer.momentum_feed). Read before `record` moves the marks."""
    return [(max(1, d.seq - ledger.mark(d.node)), d.mass) for d in deltas if not d.zeroed]


def record(deltas: list[Delta], ledger: Ledger, report: Report, rounds: Rounds) -> None:
    """Every delta the round accepted counts as processed (weighed 0 or not): the ledger, the nodes'
    feedback, and the round's arrival history."""
    for d in deltas:
        eval_ = node_eval.read(d.meta)  # the node's own latest evaluation, untrusted and validated
        ledger.apply(d.ref, d.seq, d.meta["checksum"], d.tokens, d.meta, eval_)
        report.note_applied(d.node)
    rounds.closed({d.node: d.id for d in deltas}, ledger.outer_step, ledger.finished)


def log_step(outer_step: int, deltas: list[Delta], live: int, loss: float | None) -> None:
    zeroed = len(deltas) - live
    logger.info(
        "DiLoCo master: outer step %d from %s%s%s",
        outer_step,
        ", ".join(sorted(d.id for d in deltas)),
        f" ({zeroed} quarantined, probed worse or duplicates, weighing 0)" if zeroed else "",
        f" · global val loss {loss:.4f}" if loss is not None else "",
    )
