"""The master's defences, one named check each: what a delta must pass before it counts.

A check has a `name` and `check(delta, context) -> Verdict`: accept (optionally counting fewer
tokens), weigh 0 (received, recorded, but no weight in this round's mean) or reject with a reason.
The name is in the rejection log line ("rejected delta … by <name>: <reason>"), in the master's
`rejected` entries and so in the status document and `hub status` ("rejected_recent").

Checks run in stages (pipeline.py runs them, in the order of the lists below):
- LISTING: on a file's name and sequence number, before it is read;
- DELTA: on one delta, read and decoded step by step (each decode step is a check, so a corrupt file
  is rejected by `size`, `format`, `checksum`, `layout` or `finite`). Checks with `judges = "sender"`
  decide whether the file is what its sender claims; after them a rejection judges the content (a
  final delta rejected for its content still ends its node: end.py);
- ROUND: on the round's surviving deltas together; `prepare(deltas, context)` sees them all first
  (norm outliers against the history, the claim cap, the loss probe, agreement and quarantine).
Plugins add DELTA checks (`register_delta_checks`: hookspecs.py), which run after the built-in ones.
A new defence is one class here and one line in a list. Checks never write the master's state;
the round's scratch (`context.seen`, `context.norms`) and their own (the norm history, the probe's
once-said warning) is all they keep.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch

from speedtronic.diloco import codec, fragments
from speedtronic.diloco.bus.base import DeltaRef
from speedtronic.diloco.master.norms import NormHistory, clip_tokens, rounds_spanned
from speedtronic.diloco.outer import staleness_weight

if TYPE_CHECKING:
    from speedtronic.config.distributed import DistributedConfig
    from speedtronic.diloco.master.ledger import Ledger
    from speedtronic.diloco.master.peers import Peers

logger = logging.getLogger("speedtronic.diloco")
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """accept | weigh_zero | reject, with the reason (and for accept, the tokens it counts for)."""

    kind: str = "accept"
    reason: str = ""
    tokens: int | None = None

    @classmethod
    def accept(cls, tokens: int | None = None) -> Verdict:
        return cls("accept", "", tokens)

    @classmethod
    def weigh_zero(cls, reason: str) -> Verdict:
        return cls("weigh_zero", reason)

    @classmethod
    def reject(cls, reason: str) -> Verdict:
        return cls("reject", reason)


ACCEPT = Verdict()
ROUND_NUMBER = re.compile(r"^-?\d{1,12}$")  # a delta's base outer step or fragment round (-1: none)


@dataclass(eq=False)
class Delta:
    """One delta file on its way through the pipeline: its bytes, decoded on demand (each step once)."""

    ref: DeltaRef
    seq: int
    data: bytes = b""
    tokens: int = 0  # the tokens it counts for (its claim, bounded)
    mass: float = 0.0  # its weight in the mean: tokens × staleness weight
    freshness: float = 1.0  # its staleness weight, 1/(1+k): a round's step is its freshest delta's
    zeroed: list[str] = field(default_factory=list)  # checks that weighed it 0 this round

    @classmethod
    def of(cls, ref: DeltaRef, seq: int, tensors: Tensors, meta: dict[str, str]) -> Delta:
        """A delta already decoded (tests; a plugin's own checks)."""
        delta = cls(ref, seq)
        delta.__dict__["parsed"] = (meta, {})
        delta.__dict__["_tensors"] = tensors
        return delta

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def node(self) -> str:
        return self.ref.node

    @cached_property
    def parsed(self) -> tuple[dict[str, str], Tensors]:
        return codec.parse(self.data)

    @property
    def meta(self) -> dict[str, str]:
        return self.parsed[0]

    def unpack(self, context: Context) -> Tensors:
        if "_tensors" not in self.__dict__:
            self.__dict__["_tensors"] = codec.unpack(
                self.meta, self.parsed[1], context.specs, context.plan.select
            )
        return self.__dict__["_tensors"]

    @property
    def tensors(self) -> Tensors:
        return self.__dict__["_tensors"]

    def count(self, tokens: int) -> None:
        """The tokens it counts for (its claim, bounded by a check)."""
        self.tokens = tokens

    def weigh(self, staleness_weight: float) -> None:
        """Its weight in the mean: tokens × staleness weight."""
        self.freshness = staleness_weight
        self.mass = self.tokens * staleness_weight

    def cap(self, tokens: int) -> None:
        """Count it for fewer tokens (the round's claim cap): its weight shrinks in proportion."""
        self.mass = self.mass * tokens / self.tokens
        self.tokens = tokens  # what the node is credited with, in head.json too

    def zero(self, check: str) -> None:
        self.zeroed.append(check)

    def int(self, key: str, default: int = 0) -> int:
        """A metadata value as an integer (`default` when absent or not one), as codec.Decoded.int."""
        return codec.Decoded({}, self.meta, 0).int(key, default)

    @property
    def decoded(self) -> codec.Decoded:
        return codec.Decoded(self.tensors, self.meta, len(self.data))

    def fragment(self, count: int) -> int:
        return fragments.fragment_of(self.meta, count)


@dataclass
class Context:
    """What checks may read about the run and the round (read-only, but for the round's scratch)."""

    specs: dict[str, codec.ParamSpec]
    plan: fragments.Plan
    settings: DistributedConfig
    ledger: Ledger
    peers: Peers
    weights: Tensors  # the global model (read only)
    fragment_rounds: list[int]
    max_bytes: int
    max_tokens: int
    round_tokens: int = 0  # a one-rank node's round (spec.one_rank_round; 0: unknown, nothing stretched)
    lr: float = 1.0
    evaluate: Callable[[Tensors], float] | None = None
    first_seen: dict[str, float] = field(default_factory=dict)  # delta id -> when it was first seen
    # delta id -> how many of its node's usual intervals it took to come (rounds.py `_span`)
    spans: dict[str, int] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # payload checksum -> id accepted this round
    norms: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (node, norm): every
    # delta of the round that reached the norm rules (the ones that weigh become the history)
    run_end: int | None = None  # the run's last outer step (None: not known)
    round_nodes: int = 1  # how many nodes the open round expects (rounds.py): the probe's share
    late_open: bool = True  # the end is not reached yet, or late_join_wait after it is not over

    @property
    def outer_step(self) -> int:
        return self.ledger.outer_step

    def candidate(self, delta: Delta, size: float) -> None:
        """A delta of this round reached the norm rules: a candidate of the norm history."""
        self.norms[delta.id] = (delta.node, size)

    def passed(self, delta: Delta) -> None:
        """A delta passed every DELTA check: its payload is this round's (copies of it are judged by it)."""
        self.seen.setdefault(delta.meta["checksum"], delta.id)

    def hold(self, delta_id: str) -> None:
        """A delta held back for a later round (fragments): not this round's candidate."""
        self.norms.pop(delta_id, None)

    @cached_property
    def global_norm(self) -> float:
        return codec.norm(self.weights)

    def staleness(self, delta: Delta) -> int:
        """How many rounds of this delta's fragment were taken since the global it was built on."""
        if self.plan.count <= 1:
            return self.outer_step - delta.int("base_outer_step", -1)
        return self.fragment_rounds[delta.fragment(self.plan.count)] - delta.int("fragment_round", -1)

    def rounds_spanned(self, delta: Delta) -> int:
        """The rounds `delta` may stand for (norms.rounds_spanned): its claim's and its norm's multiple."""
        return rounds_spanned(
            delta.seq, self.ledger.mark(delta.node), self.staleness(delta), self.spans.get(delta.id, 1)
        )

    def scaled_norm(self, delta: Delta) -> float:
        """A fragment delta's norm on the whole model's scale (÷ its share of the global weights' norm),
        so the outlier checks compare like with like across fragments; P=1: the norm itself."""
        size = codec.norm(delta.tensors)
        if self.plan.count <= 1:
            return size
        part = codec.norm(self.plan.part(delta.fragment(self.plan.count), self.weights))
        return size * self.global_norm / part if part > 0 else size


@runtime_checkable
class DeltaCheck(Protocol):
    """A defence: a name (in the rejection log and the status) and a verdict on one delta."""

    name: str

    def check(self, delta: Delta, context: Context) -> Verdict: ...


def _rejects(step: Callable[[], object]) -> Verdict:
    """A codec step's Rejected as a verdict."""
    try:
        step()
    except codec.Rejected as error:
        return Verdict.reject(str(error))
    return ACCEPT


# -- LISTING: on the name, before the file is read -----------------------------------------------------
class NameCheck:
    name = "name"

    def check(self, delta: Delta, context: Context) -> Verdict:
        try:
            node, _ = codec.parse_delta_name(delta.ref.name)
        except codec.Rejected as error:
            return Verdict.reject(str(error))
        if node != delta.node:
            return Verdict.reject(f"named for node {node!r} but published by {delta.node!r}")
        return ACCEPT


class SequenceCheck:
    """A sequence number no honest worker would use (it numbers from the master's mark)."""

    name = "sequence"

    def check(self, delta: Delta, context: Context) -> Verdict:
        hwm = context.ledger.mark(delta.node)
        if delta.seq > hwm + codec.SEQ_WINDOW:
            return Verdict.reject(
                f"sequence number {delta.seq} is more than {codec.SEQ_WINDOW} past the node's last applied #{hwm}"
            )
        return ACCEPT


# -- DELTA: decoding, step by step (codec.decode's steps) -----------------------------------------------
class SizeCheck:
    name = "size"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        return _rejects(lambda: codec.check_size(delta.data, context.max_bytes))


class FormatCheck:
    """A safetensors file of kind "delta" in this format version."""

    name = "format"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        return _rejects(lambda: codec.check_header(delta.meta, "delta"))


class ChecksumCheck:
    name = "checksum"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        return _rejects(lambda: codec.check_checksum(delta.meta, delta.parsed[1]))


class LayoutCheck:
    """Keys, shapes and dtypes as the run's parameters (a fragment's, for Streaming DiLoCo)."""

    name = "layout"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        return _rejects(lambda: delta.unpack(context))


class FiniteCheck:
    name = "finite"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        return _rejects(lambda: codec.check_finite(delta.tensors))


class SenderCheck:
    """Its metadata names the node it is filed under."""

    name = "sender"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        if delta.meta.get("node") != delta.node:
            return Verdict.reject(f"metadata names node {delta.meta.get('node')!r}")
        return ACCEPT


class ReplayCheck:
    """The payload of a delta applied before, whatever the file is called."""

    name = "replay"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        first = context.ledger.replay_of(delta.meta["checksum"])
        if first is not None:
            return Verdict.reject(f"replay: the same payload as {first}")
        return ACCEPT


class CopyCheck:
    """Of two identical payloads in one round, the later one on the bus is the copy (a copier must read
    the original first). Seen in the same poll, which is the copy is unknown: `TwinCheck`."""

    name = "copy"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        twin = context.seen.get(delta.meta["checksum"])
        if twin is not None and context.first_seen.get(twin, 0.0) < context.first_seen.get(delta.id, 0.0):
            return Verdict.reject(f"replay: a copy of {twin}, which was on the bus first")
        return ACCEPT


class LocalStepCheck:
    name = "local_step"
    judges: ClassVar[str] = "sender"

    def check(self, delta: Delta, context: Context) -> Verdict:
        raw = delta.meta.get("local_step", "0")
        try:
            step = int(raw)
        except ValueError:
            return Verdict.reject(f"local_step {raw[:20]!r} is not an integer")
        if step < 0:
            return Verdict.reject(f"local_step {step} is negative")
        return ACCEPT


class StalenessCheck:
    """Built on a global more than `max_staleness` rounds (of its fragment) old."""

    name = "staleness"

    def check(self, delta: Delta, context: Context) -> Verdict:
        count = context.plan.count
        # The round a delta was built on must be a number: a garbled one would otherwise read as -1
        # (one round before the first) and pass. A missing one still reads as -1, as it always did.
        for key in ("base_outer_step", "fragment_round") if count > 1 else ("base_outer_step",):
            raw = str(delta.meta.get(key, "-1"))
            if not ROUND_NUMBER.match(raw):
                return Verdict.reject(f"{key} {raw[:20]!r} is not a round number")
        stale = context.staleness(delta)
        if staleness_weight(stale, context.settings.rounds.max_staleness) is not None:
            return ACCEPT
        base = delta.int("base_outer_step", -1)
        return Verdict.reject(
            f"stale: built on outer step {base}, the run is at {context.outer_step}"
            + (f" (fragment {delta.fragment(count)}: {stale} rounds behind)" if count > 1 else "")
        )


class AfterEndCheck:
    """Past the run's end (end.py), each node's work counts up to its share — one delta per outer step
    of the run, what an honest node sends over the whole run, plus `end // 4` (at least 1) for the
    syncs a restarted node redoes from its checkpoint — and no further: a node that has had its share
    received is refused. So a swarm whose honest nodes have finished cannot keep the run stepping for
    long, while a node's last deltas, a late joiner's whole run and a swarm whose rounds take one
    delta each (where the outer steps pass `end` early) still count in full. Before the end, or within
    `late_join_wait` after it, nothing is refused."""

    name = "after_end"

    def check(self, delta: Delta, context: Context) -> Verdict:
        end = context.run_end
        if end is None or context.late_open:
            return ACCEPT
        had = int(context.ledger.per_node.get(delta.node, {}).get("applied", 0))
        share = end + max(1, end // 4)
        if had < share:
            return ACCEPT
        return Verdict.reject(
            f"after the run's end (outer step {end}): {delta.node} has had {had} deltas received, its share "
            f"(one per outer step of the run, and {share - end} for syncs redone after a restart)"
        )


class NormBoundCheck:
    """No history needed: a pseudo-gradient larger than `outlier_factor` × the model is an attack.
    Every delta that gets here is a candidate of the norm history (`context.norms`), at its norm per
    round: a delta folded over k rounds (`norms.rounds_spanned`, the same k its token claim may cover)
    is k rounds of training, and the outlier check compared it whole with one round's norms (a joiner's
    29-sync fold, 16× the reference, was rejected at the 10× allowance; chaos soak, 2026-12-06)."""

    name = "norm_bound"

    def check(self, delta: Delta, context: Context) -> Verdict:
        size = context.scaled_norm(delta)
        context.candidate(delta, size / context.rounds_spanned(delta))
        factor = context.settings.defences.outlier_factor
        if size > factor * context.global_norm:
            return Verdict.reject(f"norm {size:.3g} is over {factor:g}× the global weights' norm")
        return ACCEPT


def _past_end(context: Context) -> bool:
    """Whether the run's last outer step is out (every round from here is past the end)."""
    return context.run_end is not None and context.outer_step >= context.run_end


class TokenBoundCheck:
    """Its token claim, clipped to the node's plan × the rounds it can span (norms.clip_tokens): the
    sequence numbers it covers, at most its staleness + 1 or the node's usual intervals it took to come."""

    name = "tokens"

    def __init__(self) -> None:
        self._said: set[str] = set()  # delta ids whose clipped claim was logged (a waiting round rereads)

    def check(self, delta: Delta, context: Context) -> Verdict:
        key = f"{delta.id}@{delta.ref.etag}"
        tokens = clip_tokens(
            delta.node,
            delta.int("tokens", 1),
            context.max_tokens,
            context.rounds_spanned(delta),
            delta.id,
            say=key not in self._said,
        )
        if tokens < delta.int("tokens", 1):
            if len(self._said) >= 4096:
                self._said.clear()  # bounded: only a waiting round's deltas need remembering
            self._said.add(key)
        return Verdict.accept(tokens)


class TwinCheck:
    """The same payload as another delta seen in the same poll: both are accepted and it counts once
    (the later one weighs 0), so copying a pending delta neither rejects the original nor adds weight."""

    name = "twin"

    def check(self, delta: Delta, context: Context) -> Verdict:
        twin = context.seen.get(delta.meta["checksum"])
        if twin is not None:
            return Verdict.weigh_zero(f"the same payload as {twin}, seen in the same poll")
        return ACCEPT


# -- ROUND: on the round's deltas together ----------------------------------------------------------------
class RoundCheck(DeltaCheck, Protocol):
    def prepare(self, deltas: list[Delta], context: Context) -> None: ...


class NormOutlierCheck:
    """A norm far off the recent nodes' norms (norms.py). Only deltas that weighed in an outer step the
    master kept enter the history after (`remember`, from core.py), so an attack the defences caught —
    or a majority whose steps were refused — cannot drag the bounds along. Owns the norm history
    (persisted)."""

    name = "norm_outlier"

    def __init__(self) -> None:
        self.history = NormHistory()
        self._bad: dict[str, str] = {}

    def prepare(self, deltas: list[Delta], context: Context) -> None:
        within = {d.id: context.norms[d.id] for d in deltas if d.id in context.norms}
        s = context.settings
        self._bad = self.history.outliers(
            within, s.defences.outlier_factor, context.global_norm, s.defences.norm_floor
        )

    def remember(self, deltas: list[Delta], context: Context) -> None:
        """The norms of the deltas that weighed in a kept outer step join the history."""
        self.history.remember(
            {d.id: context.norms[d.id] for d in deltas if not d.zeroed and d.id in context.norms}
        )

    def check(self, delta: Delta, context: Context) -> Verdict:
        reason = self._bad.get(delta.id)
        return ACCEPT if reason is None else Verdict.reject(reason)


class TokenCapCheck:
    """`aggregation: clipped_mean`: no claim per round above the round's (lower) median per round. The
    plan's bound leaves room for a node of MAX_NODE_RANKS ranks, so a one-rank attacker could otherwise
    claim 8× an honest peer's weight (bench/attacks.py, "tokens"). Equal claims: no change. A delta
    folded over k rounds (`norms.rounds_spanned`: the same k its plan bound and its norm allowance
    use) may claim k × that median: capped whole at one round's, a delta a worker folded while the
    master did not answer counted one round's tokens in a round of unfolded ones (a 30-minute S3 chaos
    soak: the applied deltas claimed 0.956 of the fault-free twin's tokens and counted 0.918). The cap is
    never below a one-rank node's round at the run's inner_steps (`Context.round_tokens`): what any node
    at H may honestly claim."""

    name = "token_cap"

    def __init__(self) -> None:
        self._per_round: float | None = None

    def prepare(self, deltas: list[Delta], context: Context) -> None:
        self._per_round = None
        if context.settings.defences.aggregation == "clipped_mean" and deltas:
            per_round = sorted(d.tokens / context.rounds_spanned(d) for d in deltas)
            # Never below a one-rank node's round (spec.one_rank_round): nodes syncing every H/4 of their
            # own steps (pipeline.stretches) made the median theirs and cut every full claim to a quarter.
            self._per_round = max(per_round[(len(deltas) - 1) // 2], float(context.round_tokens))

    def check(self, delta: Delta, context: Context) -> Verdict:
        if self._per_round is None:
            return ACCEPT
        cap = max(1, round(self._per_round * context.rounds_spanned(delta)))
        return Verdict.accept(cap) if delta.tokens > cap else ACCEPT


class LossProbeCheck:
    """The loss probe (`distributed.defences.loss_probe`): a delta that, applied alone at its share of
    the outer step (θ − η/k·Δ, k the nodes the round averages: `probe_step`), raises the master's
    validation loss above not applying it weighs 0 this round — at most half of the round's, the most
    harmful first. Each node's latest probe result and its failures are kept in its score (peers.py).
    Cost: one evaluation of the master's validation batches per delta per round (the loss of the
    current global is the one the master already computed after the last step); a delta's loss is kept
    while the global and the round's size stay, so asking before the round closes (`would_zero`: the
    round's quorum counts only deltas that weigh) costs no second evaluation."""

    name = "loss_probe"

    def __init__(self) -> None:
        self._warned = False
        self._explained = False
        self._few_warned = False
        self._worse: dict[str, str] = {}
        self._losses: dict[str, float] = {}  # "id@etag" -> its loss alone, on the global of `_step`
        self._step: int | None = None

    def check(self, delta: Delta, context: Context) -> Verdict:
        reason = self._worse.get(delta.id)
        return ACCEPT if reason is None else Verdict.weigh_zero(reason)

    def _score(self, context: Context) -> Callable[[Tensors], float] | None:
        setting = context.settings.defences.loss_probe
        if setting is False:
            return None
        if context.evaluate is None:
            if not self._warned:
                self._warned = True
                # auto: a master without data is a supported set-up (say so once); true: it was asked for.
                (logger.info if setting == "auto" else logger.warning)(
                    "DiLoCo master: the loss probe (distributed.defences.loss_probe=%s) is off: the master has no "
                    "validation data (give it data.text_path or a prepared dataset to score deltas)",
                    "auto" if setting == "auto" else "true",
                )
            return None
        self._warn_few_tokens(context.evaluate)
        # The loss alone: the probe has no use for the run.eval_tasks scores the full evaluation adds.
        return getattr(context.evaluate, "loss_only", context.evaluate)

    def _warn_few_tokens(self, evaluate: object) -> None:
        """Say once when the master's validation batches are too few tokens for the probe to judge a
        delta by: it weighs 0 any delta whose loss goes up at all, and on a few hundred tokens an honest
        delta's share of a step moves the loss up or down by noise."""
        batches = getattr(evaluate, "batches", None) or []
        tokens = sum(int(b["input_ids"].numel()) for b in batches if isinstance(b, dict) and "input_ids" in b)
        if self._few_warned or not 0 < tokens < PROBE_MIN_TOKENS:
            return
        self._few_warned = True
        logger.warning(
            "DiLoCo master: the loss probe scores each delta on the master's %d validation batches, %d tokens "
            "(data.val_batches): on so few, noise alone weighs honest deltas 0 — 10–12%% of them with 256 tokens, "
            "0–1%% with 2,560 (bench/probe_noise.py). Give the master at least %d validation tokens "
            "(data.val_batches × micro_batch_size × block_size)",
            len(batches),
            tokens,
            PROBE_MIN_TOKENS,
        )

    @torch.no_grad()
    def _probe(
        self, deltas: list[Delta], context: Context, score: Callable[[Tensors], float]
    ) -> tuple[float, dict[str, float]]:
        """(the current global's loss, {delta id: its loss alone}) for the deltas of active nodes."""
        if self._step != context.outer_step:
            self._step, self._losses = context.outer_step, {}
        if "base" not in self._losses:
            known = context.ledger.last_loss(context.outer_step)
            self._losses["base"] = known if known is not None else float(score(context.weights))
        weights, plan = context.weights, context.plan
        step = probe_step(context, len(deltas))
        out: dict[str, float] = {}
        for delta in deltas:
            if not context.peers.active(delta.node):
                continue  # quarantined: it weighs 0 anyway, so its evaluation would buy nothing
            key = f"{delta.id}@{delta.ref.etag}@{step:.9g}"
            if key not in self._losses:
                # A fragment's delta (Streaming DiLoCo) moves only its own tensors (or shares of them).
                p = delta.fragment(plan.count)
                current = plan.part(p, weights)
                trial = plan.merged(
                    p, weights, {n: current[n] - step * t.float() for n, t in delta.tensors.items()}
                )
                self._losses[key] = float(score(trial))  # loss only: the task results shown stay the global's
            out[delta.id] = self._losses[key]
        return self._losses["base"], out

    def would_zero(self, deltas: list[Delta], context: Context, complete: bool = False) -> set[str]:
        """The ids of the deltas that cannot count toward a round of `deltas`' quorum (nothing is
        noted). While a node the round expects is not in it yet, every one that alone raises the loss:
        the round waits for that node, whose delta may show the probe is not failing everything (the
        attack suite under load: two attackers and a stale honest delta, 3 of 3 worse; counting the
        "misjudged" half let an attacker fill the quorum and weigh). Once the round is `complete` (every
        node it expects is in it: a round takes one delta per node, so no other can come), those the
        round will weigh 0 (`_judge`), and a lone one, which the round's "at most half" lets through."""
        score = self._score(context) if deltas else None
        if score is None:
            return set()
        base, losses = self._probe(deltas, context, score)
        failed = _failed(losses, base, {d.id: d.node for d in deltas})
        if complete and len(losses) >= 2 and len(failed) == len(losses):
            failed = failed[: len(losses) // 2]
        return {delta_id for _, delta_id, _ in failed}

    def prepare(self, deltas: list[Delta], context: Context) -> None:
        self._worse = {}
        score = self._score(context) if deltas else None
        if score is None:
            return
        base, losses = self._probe(deltas, context, score)
        nodes = {d.id: d.node for d in deltas}
        for delta_id, loss in losses.items():
            context.peers.note_probe(nodes[delta_id], loss - base)
        self._judge(_failed(losses, base, nodes), len(losses), base, context)

    def _judge(
        self, failed: list[tuple[float, str, str]], probed: int, base: float, context: Context
    ) -> None:
        # Every delta that fails, unless all of the round's do: then at most half, the most harmful first
        # (NaN first), for the probe is misjudging rather than facing a majority of attackers (which no rule
        # here can stop): on a slow link, stale deltas applied alone to a global the last momentum step
        # overshot all raise the loss, and zeroing them all left the global standing still for rounds
        # (bench/wan.py). While one delta passes, the probe is not failing everything: capping at half
        # then let an attacker weigh (two attackers and one honest delta, attack suite under load).
        # Past the run's end the work is optional and the best global is kept: every delta the probe finds
        # worse weighs 0 (the cap let a lone hostile delta weigh in a round of its own once the honest nodes
        # had finished). Only the weighing changes: `would_zero` keeps the cap, so what a round past the end
        # waits for is as before (counting every worse delta out there left rounds waiting for deltas that
        # weigh and never came).
        cap = probed if _past_end(context) or len(failed) < probed else probed // 2
        for loss, delta_id, node in failed[:cap]:
            self._worse[delta_id] = f"alone it raises the validation loss from {base:.4f} to {loss:.4f}"
            context.peers.note_probe_failure(node)
            logger.warning(
                "DiLoCo master: loss probe: delta %s from %s alone raises the validation loss from %.4f to "
                "%.4f; it weighs 0 this round",
                delta_id,
                node,
                base,
                loss,
            )
        if len(failed) > cap:
            logger.warning(
                "DiLoCo master: the loss probe found %d of %d deltas raising the validation loss from %.4f; at "
                "most half weigh 0, so %d still count: %s",
                len(failed),
                probed,
                base,
                len(failed) - cap,
                ", ".join(d for _, d, _ in failed[cap:]),
            )
        if probed >= 2 and 2 * len(failed) >= probed and not self._explained:
            self._explained = True
            logger.warning(
                "DiLoCo master: the loss probe finds most deltas of a round (%d of %d) worse alone than none: "
                "when they come from honest nodes, the master's validation data is unlike what the nodes train "
                "on (synthetic data: each node draws its own motif set; or a different data mix), so the probe "
                "cannot judge them and weighs honest work 0. Give the master the nodes' dataset, or set "
                "distributed.defences.loss_probe=false and rely on the norm checks and quarantine (said once)",
                len(failed),
                probed,
            )


# Fewer validation tokens on the master and the probe warns (_warn_few_tokens): bench/probe_noise.py
# (8 honest workers, a 1-layer model on tinyshakespeare, 2026-12-06) weighed 10–12% of honest deltas 0 on
# 256 tokens, 0.2–4.5% on 1,024 and 0–1.1% on 2,560, where 64 held-out batches found none worse.
PROBE_MIN_TOKENS = 2048


def probe_step(context: Context, probed: int) -> float:
    """How far the probe moves the global along one delta: its share of the outer step, the outer lr ÷
    the deltas the round averages (the nodes it expects, or the deltas at hand where more). A whole
    outer lr moves the global 70% of the way to one node's local model, whose own noise (H steps on its
    own batches) then outweighs its progress once the average of the nodes beats any one of them: a
    clean 4-worker run (bench/wan.py, 64 rounds) had 54 of 252 honest deltas weighed 0, 3 of 4 in some
    rounds. At its share the probe asks what the round asks of a delta, whether its part of the step
    goes down on the master's validation batches; a reversed or random delta still goes up at any
    step (first order), and the norm clip bounds what a scaled one can do."""
    return context.lr / max(1, context.round_nodes, probed)


def _failed(losses: dict[str, float], base: float, nodes: dict[str, str]) -> list[tuple[float, str, str]]:
    """(loss, delta id, node) of the deltas that raise the loss alone, the most harmful first (NaN first)."""
    failed = [(loss, delta_id, nodes[delta_id]) for delta_id, loss in losses.items() if not loss <= base]
    failed.sort(key=lambda f: (f[0] == f[0], -f[0] if f[0] == f[0] else 0.0))
    return failed


class QuarantineCheck:
    """Nodes whose agreement with the others fell below `quarantine_below` (peers.py) weigh 0. The
    agreement is measured here first, per fragment, without the deltas the loss probe caught. A node
    quarantined when the round opened weighs 0 in it even if this round's agreement lets it out: the
    loss probe skipped its delta (quarantined deltas are not probed), so nothing else judged it."""

    name = "quarantine"

    def __init__(self) -> None:
        self._held: set[str] = set()  # the round's nodes quarantined before it was measured

    def prepare(self, deltas: list[Delta], context: Context) -> None:
        count = context.plan.count
        self._held = {d.node for d in deltas if not context.peers.active(d.node)}
        caught = {d.node for d in deltas if "loss_probe" in d.zeroed}
        for p in sorted({d.fragment(count) for d in deltas}):  # agreement among one fragment's deltas
            context.peers.update({d.node: d.tensors for d in deltas if d.fragment(count) == p}, caught)

    def check(self, delta: Delta, context: Context) -> Verdict:
        if not context.peers.active(delta.node):
            return Verdict.weigh_zero(f"node {delta.node} is quarantined")
        if delta.node in self._held:
            return Verdict.weigh_zero(f"node {delta.node} was quarantined when this round was measured")
        return ACCEPT


def listing_checks() -> list[DeltaCheck]:
    return [NameCheck(), SequenceCheck()]


def delta_checks(extra: list[DeltaCheck] | None = None) -> list[DeltaCheck]:
    """The built-in per-delta checks in order, then `extra` (plugins')."""
    built_in: list[DeltaCheck] = [
        SizeCheck(),
        FormatCheck(),
        ChecksumCheck(),
        LayoutCheck(),
        FiniteCheck(),
        SenderCheck(),
        ReplayCheck(),
        CopyCheck(),
        LocalStepCheck(),
        StalenessCheck(),
        AfterEndCheck(),
        NormBoundCheck(),
        TokenBoundCheck(),
        TwinCheck(),
    ]
    return [*built_in, *(extra or [])]


def round_checks() -> list[RoundCheck]:
    """The round's checks in order: the probe goes before quarantine, so that the deltas it caught do
    not vote in the agreement scores."""
    return [NormOutlierCheck(), TokenCapCheck(), LossProbeCheck(), QuarantineCheck()]


def judges_sender(check: DeltaCheck) -> bool:
    return getattr(check, "judges", "content") == "sender"


def plugin_checks() -> list[DeltaCheck]:
    """Checks plugins registered (`register_delta_checks`), in registration order: each entry's
    factory is called with no arguments and must return an object with `name` and `check`."""
    from speedtronic.plugins import delta_checks as registered

    out: list[DeltaCheck] = []
    for name, factory in registered().items():
        made = factory()
        if not isinstance(made, DeltaCheck):
            raise TypeError(f"delta check {name!r}: its factory returned {made!r}, not a check")
        out.append(made)
    return out
