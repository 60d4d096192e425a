"""The outer optimizer of DiLoCo and the rules of a round: averaging, staleness, momentum.

The master keeps the global weights and the outer momentum in fp32 on the CPU (never in the wire
codec: compression is for the network only). One outer step, with Δ̄ the token-weighted mean of the
round's pseudo-gradients (Δ = θ_global_at_sync − θ_local, so Δ points *against* the direction the
workers moved, like a gradient):

    m ← μ·m + Δ̄          θ ← θ − η·(Δ̄ + μ·m)        (Nesterov SGD, as in the DiLoCo paper)

With η = 1 and μ = 0 this is plain model averaging.

Folded deltas. A worker whose delta the master has not answered (a bus outage, a failover) folds its
next ones into one: a delta then stands for r sync points' work. The outer step applies it whole (η·Δ̄:
the workers did that work), but fed into the momentum whole it counts r rounds' displacement as one
round's, and the momentum then carries it on for ~1/(1−μ) rounds more: after a 20-s bus outage in a
30-minute soak (r ≈ 11) the global's loss rose 2.03 → 2.79 over 12 rounds (bench/results/chaos/
s3-30min-every30-globalwait4-momentum-2026-12-06.json). The momentum is fed instead what r rounds of Δ̄/r
each would have left in it, m ← μ·m + c(r)·Δ̄ with c(r) = (1 − μ^r) / (r·(1 − μ)) (`momentum_feed`:
1 at r = 1, so an unfolded round is exactly the rule above; 0.42 at r = 11, μ = 0.8), c averaged over
the round's deltas by their weight. r comes from the delta's sequence number past its node's last
applied one: a node that claims more can only lower c, by its weight in the round.

A step that overshoots. The momentum carries the last rounds' direction on, and after a round that
moved the global far (the folded deltas of a failover) that can take the global past the valley: in
the 30-minute Hub and directory soaks the round after the first takeover's folded one raised the loss
3.24 → 3.59 for one round. The master evaluates every new global before it publishes it; where the
loss rose over RISE (3%), it takes the same round once more without the momentum (`plain`: θ ← θ − η·Δ̄,
and the momentum restarts from the round, m ← c(r)·Δ̄) and keeps whichever of the two globals has the
lower loss (diloco/master/core.py). The plain step records μ = 0 as its momentum, so a standby's
recovery of the momentum from the published globals (master/momentum.py) reads it right.

Short runs. Momentum 0.9 (the DiLoCo paper's) averages over ~10 rounds; switched on at full strength
from the first round it overshoots in a run of a dozen rounds (bench/diloco.py: worse than a single
worker). Growing it linearly over the first rounds (`warmup`, default
`distributed.sync.outer_momentum_warmup` = 10) fixes that. The default momentum is 0.8, not 0.9: pooled
over four seeds of bench/diloco.py (--corpus all, 25 rounds; bench/pool.py), the worst of three corpora
closes 73% of the single-worker → synchronous-DP gap with a 4×128 model and 74% with a 2×64 one at 0.8
(0.9: 48% / 64%, where the larger model's one-worker control overshoots worst); on a corpus held out of
that choice 81% at 25 rounds and 75% at 12 (0.9: 61% / 74%). 0.7 closes a little more (74% / 83%), but
against two colluders of four (tests/test_diloco_attack_suite.py) the loss probe then misses their second
round too and the run ends 18% behind the clean one, against 10% at 0.8 and 0.9. Optionally the first
syncs come early and then ever less often (`sync_steps` with ramp), because workers drift apart fastest
at the start of a run.
This module has no I/O and never touches the network.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

DEFAULT_LR = 0.7
DEFAULT_MOMENTUM = 0.8
RECENT_UPDATES = 8  # steps a folded round's update is compared with (update_ratio)
RISE = 1.03  # a new global whose val loss is over this × the last one's is retried without momentum


@dataclass(frozen=True)
class Saved:
    """The outer optimizer's whole state at one moment (copies), to go back to (`OuterOptimizer.put_back`)."""

    weights: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    steps: int
    last_mu: float
    update_norms: tuple[float, ...]


def planned_outer(lr: float | None, momentum: float | None, rounds: int) -> tuple[float, float]:
    """Outer (lr, momentum): the configured values, or Nesterov lr 0.7 / momentum 0.8, for any number
    of planned rounds — with the momentum warm-up (`OuterOptimizer(warmup=…)`), which a short run
    needs. The worst of three corpora in bench/diloco.py, pooled over four seeds at two model sizes,
    chose it (module docstring); lr 0.7 without momentum, plain averaging (lr 1) and lr 0.5 close far
    less there. `rounds` is kept for callers; it no longer changes the rule."""
    del rounds
    return (
        lr if lr is not None else DEFAULT_LR,
        momentum if momentum is not None else DEFAULT_MOMENTUM,
    )


def momentum_at(momentum: float, warmup: int, round_index: int) -> float:
    """The outer momentum of round `round_index` (0-based): grows linearly to `momentum` over the first
    `warmup` rounds (none with warmup 0)."""
    if warmup <= 0:
        return momentum
    return momentum * min(1.0, (round_index + 1) / warmup)


def momentum_feed(mu: float, spans: Iterable[tuple[int, float]]) -> float:
    """c: the share of a round's Δ̄ the momentum takes, from each live delta's (sync points it folds,
    weight): the weighted mean of (1 − μ^r) / (r·(1 − μ)), exactly 1 where no delta is folded."""
    items = [(max(1, r), w) for r, w in spans if w > 0]
    total = sum(w for _, w in items)
    if not 0.0 < mu < 1.0 or total <= 0 or all(r == 1 for r, _ in items):
        return 1.0
    return sum(w * (1.0 - mu**r) / (r * (1.0 - mu)) for r, w in items) / total


def sync_steps(total: int, inner_steps: int, ramp: bool) -> list[int]:
    """The inner steps after which a worker syncs: every `inner_steps`, or with `ramp` first after
    1, 2, 4, … steps (gaps doubling up to `inner_steps`), so the start of a run — where workers
    drift apart fastest — is nearly synchronous, at the cost of about log2(inner_steps) extra syncs."""
    points: list[int] = []
    step, gap = 0, 1 if ramp else inner_steps
    while step + gap <= total:
        step += gap
        points.append(step)
        gap = min(gap * 2, inner_steps)
    return points


def is_sync_step(step: int, inner_steps: int, ramp: bool) -> bool:
    """Whether inner step `step` (1-based) ends a round, consistent with `sync_steps`."""
    if not ramp:
        return step % inner_steps == 0
    point, gap = 0, 1
    while point < step:
        point += gap
        gap = min(gap * 2, inner_steps)
    return point == step


class OuterOptimizer:
    """Nesterov-momentum SGD over a dict of fp32 CPU tensors (the global model)."""

    def __init__(self, weights: dict[str, torch.Tensor], lr: float, momentum: float, warmup: int = 0) -> None:
        self.weights = {n: t.detach().to("cpu", torch.float32, copy=True) for n, t in weights.items()}
        self.momentum_buffers = {n: torch.zeros_like(t) for n, t in self.weights.items()}
        self.lr = lr
        self.momentum = momentum
        self.warmup = warmup
        self.steps = 0  # outer steps taken (the warm-up's clock, unless step() is told the round)
        self.last_mu = 0.0  # the momentum of the latest step (master/momentum.py reads it back)
        # Norms of the latest steps' updates (θ_before − θ_after): the master's log compares a folded
        # round's step with the steps before it (`update_ratio`).
        self.update_norms: deque[float] = deque(maxlen=RECENT_UPDATES + 1)

    @torch.no_grad()
    def step(
        self,
        delta: dict[str, torch.Tensor],
        round_index: int | None = None,
        view: Callable[[torch.Tensor], torch.Tensor] | None = None,
        spans: Iterable[tuple[int, float]] = (),
        plain: bool = False,
    ) -> None:
        """One outer step; `round_index` (0-based, default: steps taken) places it in the warm-up. Only
        the tensors `delta` names move (a Streaming DiLoCo fragment); the others and their momentum stay.
        `view` maps a weight (and its momentum) to the share `delta` covers (an "elements" fragment's
        strided view, diloco/fragments.py); None: whole tensors. `spans`: (sync points folded, weight) of
        the round's live deltas, for the momentum's share (`momentum_feed`); none: every delta one.
        `plain`: the step without the momentum (θ − η·Δ̄), which restarts from this round (m = c·Δ̄)."""
        mu = momentum_at(self.momentum, self.warmup, self.steps if round_index is None else round_index)
        feed = momentum_feed(mu, spans)
        self.steps += 1
        self.last_mu = 0.0 if plain else mu
        squares = 0.0
        for name, w in self.weights.items():
            if name not in delta:
                continue
            d = delta[name].float()
            if view is not None:
                w = view(w)
            if mu:
                m = self.momentum_buffers[name] if view is None else view(self.momentum_buffers[name])
                if plain:
                    m.copy_(d).mul_(feed)
                elif feed == 1.0:  # the plain rule, bit for bit
                    m.mul_(mu).add_(d)
                else:
                    m.mul_(mu).add_(d, alpha=feed)
                if not plain:
                    d = d.add(m, alpha=mu)
            w.sub_(d, alpha=self.lr)
            squares += float(d.square().sum())
        self.update_norms.append(self.lr * math.sqrt(squares))

    def update_ratio(self) -> float | None:
        """The latest step's update norm over the median of the RECENT_UPDATES steps before it (None
        until there are some, or when they did not move the weights)."""
        if len(self.update_norms) < 2:
            return None
        *before, last = self.update_norms
        median = statistics.median(before)
        return last / median if median > 0 else None

    def save(self) -> Saved:
        """A copy of the whole state, to go back to with `put_back` (a step refused or retried)."""
        return Saved(
            {n: t.clone() for n, t in self.weights.items()},
            {n: t.clone() for n, t in self.momentum_buffers.items()},
            self.steps,
            self.last_mu,
            tuple(self.update_norms),
        )

    @torch.no_grad()
    def put_back(self, saved: Saved) -> None:
        """Back to `saved`, in place (the weights' tensors stay the same objects)."""
        for name, tensor in saved.weights.items():
            self.weights[name].copy_(tensor)
        for name, tensor in saved.buffers.items():
            self.momentum_buffers[name].copy_(tensor)
        self.steps, self.last_mu = saved.steps, saved.last_mu
        self.update_norms.clear()
        self.update_norms.extend(saved.update_norms)

    def reset_momentum(self) -> None:
        for m in self.momentum_buffers.values():
            m.zero_()

    def load(self, name: str, weight: torch.Tensor, momentum: torch.Tensor) -> None:
        """One tensor's weights and momentum as saved (the master's state file)."""
        self.weights[name] = weight.float()
        self.momentum_buffers[name] = momentum.float()

    def adopt(self, weights: dict[str, torch.Tensor]) -> None:
        """New weights from elsewhere (a global adopted from the bus): the old direction is dropped."""
        self.weights = weights
        self.reset_momentum()

    def resume(self, buffers: dict[str, torch.Tensor], steps: int, last_mu: float) -> None:
        """Momentum and round count recovered for adopted weights (master/momentum.py): the direction
        and the warm-up go on where the previous master left them."""
        for name, tensor in buffers.items():
            self.momentum_buffers[name] = tensor.float()
        self.steps, self.last_mu = steps, last_mu

    @torch.no_grad()
    def restore(self, weights: dict[str, torch.Tensor]) -> None:
        """Go back to earlier weights (the final pick), in place; momentum reset."""
        for name, tensor in weights.items():
            self.weights[name].copy_(tensor)
        self.reset_momentum()  # the weights jumped back: the old direction no longer applies


def weighted_mean(items: Iterable[tuple[dict[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """Σ wᵢ·Δᵢ / Σ wᵢ over (Δ, w) pairs."""
    items = list(items)
    total = sum(w for _, w in items)
    if not items or total <= 0:
        raise ValueError("no deltas with positive weight")
    out = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in items[0][0].items()}
    for tensors, w in items:
        for n, t in tensors.items():
            out[n].add_(t.float(), alpha=w / total)
    return out


def scaled(delta: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """Δ̄ × `factor` (the same dict, untouched, at 1: a round of fresh deltas steps bit for bit as before)."""
    if factor == 1.0:
        return delta
    return {n: t.float() * factor for n, t in delta.items()}


def staleness_weight(staleness: int, max_staleness: int) -> float | None:
    """The stale-delta policy: a delta built on the current global counts fully; one built s outer
    steps ago counts 1/(1+s); beyond `max_staleness` it is rejected (None)."""
    if staleness < 0 or staleness > max_staleness:
        return None
    return 1.0 / (1.0 + staleness)


AGGREGATIONS = ("mean", "trimmed_mean", "median", "clipped_mean")


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.float() ** 2).sum() for t in tensors.values())))


@torch.no_grad()
def aggregate(
    items: Iterable[tuple[dict[str, torch.Tensor], float]], method: str = "mean"
) -> dict[str, torch.Tensor]:
    """One round's Δ̄ from (Δ, weight) pairs, by `distributed.defences.aggregation`:

    - mean: the weighted mean (weights: tokens × staleness), exactly `weighted_mean`;
    - clipped_mean: each Δ first scaled down to at most the median of the round's norms, then the
      weighted mean — a delta can still pull, but no harder than a typical one;
    - median: the coordinate-wise median (unweighted; the mean of the two middle values for an even
      count) — holds while fewer than half the deltas are hostile;
    - trimmed_mean: coordinate-wise, the ⌊n/5⌋ largest and smallest values (at least one of each
      once n ≥ 3) dropped, the rest averaged (unweighted).

    The robust ones ignore token weights on purpose: a weight is a claim, and the point is not to
    believe claims. With one or two deltas every method except clipped_mean is the mean of what
    there is (median and trimmed mean then have nothing to cut)."""
    items = list(items)
    if method == "mean" or (method in ("median", "trimmed_mean") and len(items) <= 2):
        if method != "mean":
            items = [(t, 1.0) for t, _ in items]
        return weighted_mean(items)
    if method == "clipped_mean":
        norms = [_norm(t) for t, _ in items]
        cap = sorted(norms)[(len(norms) - 1) // 2] if norms else 0.0
        clipped = []
        for (tensors, w), n in zip(items, norms, strict=True):
            scale = min(1.0, cap / n) if n > 0 else 1.0
            clipped.append(({k: v.float() * scale for k, v in tensors.items()}, w))
        return weighted_mean(clipped)
    if method not in AGGREGATIONS:
        raise ValueError(
            f"distributed.defences.aggregation {method!r} is not one of {', '.join(AGGREGATIONS)}"
        )
    n = len(items)
    cut = max(1, n // 5) if method == "trimmed_mean" else 0
    out: dict[str, torch.Tensor] = {}
    for name in items[0][0]:
        stacked, _ = torch.stack([t[name].float() for t, _ in items]).sort(dim=0)
        if method == "median":
            mid = n // 2
            out[name] = stacked[mid] if n % 2 else (stacked[mid - 1] + stacked[mid]) / 2
        else:
            out[name] = stacked[cut : n - cut].mean(dim=0)
    return out
