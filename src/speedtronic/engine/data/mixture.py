"""A weighted mixture of token sources (``data.sources``), with exact resume on any number of ranks.

Sequences, not batches, are mixed: global sequence ``q`` (sequence ``b`` of global batch ``g`` is
``q = g * micro_batch_size + b``, and rank ``r``'s ``i``-th batch is ``g = i * world_size + r``, as
in loader.py) comes from the source a *schedule* assigns it. The schedule cuts the sequence axis into
blocks of :data:`BLOCK` sequences; every block holds each source's share of them (largest remainder,
so a source's share is exact to 1/BLOCK) in an order shuffled from ``(seed, block)``. Which source
sequence ``q`` comes from, and how many sequences that source gave before it, are therefore a pure
function of ``(seed, weights, q)``; the ``k``-th sequence of a source is window ``k`` of its own
:class:`~speedtronic.engine.data.loader.WindowPlan` (one window per step, its own seeded epochs: a
small source repeats sooner than a big one, as upsampling does).

The resume state holds the global position (``batches_served`` × ``world_size``, rescaled to another
number of ranks as the single-source loader does) and each source's position (sequences taken from
it, and its epoch). Resuming with the same sources and weights continues the schedule exactly;
with other weights, or sources added or removed, the schedule starts again at the saved position
and every source continues from its own saved position (a new source from its start).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from speedtronic.config.data_sources import MIX_BLOCK
from speedtronic.errors import CheckpointError, ConfigError, DataError

from .loader import MAX_POSITION, Batch, WindowPlan, iterate_batches, to_batch
from .sources import TokenSource, mix_seed

__all__ = ["BLOCK", "MixSchedule", "MixtureLoader", "WeightedSource"]

log = logging.getLogger(__name__)

#: Sequences per schedule block: every block holds each source's share of them exactly.
BLOCK = MIX_BLOCK
_STATE_VERSION = 1


@dataclass(frozen=True)
class WeightedSource:
    """One training source of a mixture: its name, its (unnormalised) weight and its tokens."""

    name: str
    weight: float
    tokens: TokenSource


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder (ties to the earlier source)."""
    norm = sum(weights)
    exact = [w * total / norm for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda j: (-(exact[j] - counts[j]), j))
    for j in order[: total - sum(counts)]:
        counts[j] += 1
    return counts


class MixSchedule:
    """Which source global sequence ``q`` (counted from the schedule's origin) comes from."""

    def __init__(self, weights: Sequence[float], seed: int, names: Sequence[str], block: int = BLOCK) -> None:
        self.seed, self.block = seed, block
        self.counts = apportion(weights, block)
        empty = [names[j] for j, c in enumerate(self.counts) if c == 0]
        if empty:
            raise ConfigError(
                f"data.sources: the weight of {empty[0]!r} is below 1/{block} of the total, so it would "
                "never be sampled; raise it or remove the source"
            )
        self._layout = torch.repeat_interleave(torch.arange(len(self.counts)), torch.tensor(self.counts))
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _block(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source of each position, index of that position among its source's in the block)``."""
        hit = self._cache.get(b)
        if hit is None:
            g = torch.Generator().manual_seed(mix_seed(self.seed, "mix", b))
            src = self._layout[torch.randperm(self.block, generator=g)]
            onehot = torch.nn.functional.one_hot(src, len(self.counts))
            within = (onehot.cumsum(0) - onehot).gather(1, src[:, None])[:, 0]
            if len(self._cache) >= 2:  # batches only ever straddle two blocks
                self._cache.pop(min(self._cache))
            hit = self._cache[b] = (src, within)
        return hit

    def locate(self, q: int) -> tuple[int, int]:
        """``(source, sequences that source gave before q)`` for sequence ``q`` of the schedule."""
        b, r = divmod(q, self.block)
        src, within = self._block(b)
        j = int(src[r])
        return j, b * self.counts[j] + int(within[r])

    def taken(self, q: int) -> list[int]:
        """Sequences each source gave in the schedule's first ``q`` sequences."""
        b, r = divmod(q, self.block)
        head = (
            torch.bincount(self._block(b)[0][:r], minlength=len(self.counts)).tolist()
            if r
            else [0] * len(self.counts)
        )
        return [b * c + h for c, h in zip(self.counts, head, strict=True)]


class _MixedBatches(Dataset):
    """Map-style dataset: item ``i`` is this rank's ``i``-th batch of the mixture."""

    def __init__(self, loader: MixtureLoader) -> None:
        self.sources = [s.tokens for s in loader.sources]
        self.plans, self.schedule = loader.plans, loader.schedule
        self.origin, self.offsets = loader.origin, list(loader.offsets)
        self.rank, self.world_size = loader.rank, loader.world_size
        self.micro, self.length = loader.micro_batch_size, loader.block_size + 1

    def __getitem__(self, i: int) -> Batch:
        first = (i * self.world_size + self.rank) * self.micro
        rows = []
        for q in range(first, first + self.micro):
            j, k = self.schedule.locate(q - self.origin)
            start = self.plans[j].starts(self.offsets[j] + k)[0]
            rows.append(self.sources[j].windows([start], self.length))
        return to_batch(torch.cat(rows))


class MixtureLoader:
    """Endless, resumable batches of a weighted mixture (see the module doc); the TrainLoader API."""

    def __init__(
        self,
        sources: Sequence[WeightedSource],
        *,
        block_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.sources = list(sources)
        self.block_size, self.micro_batch_size = block_size, micro_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.rank, self.world_size = rank, world_size
        names = [s.name for s in self.sources]
        self.plans = [_window_plan(s, block_size, shuffle, seed) for s in self.sources]
        self.schedule = MixSchedule([s.weight for s in self.sources], seed, names)
        self.origin = 0  # the global sequence the schedule starts at (moved by a resume with new weights)
        self.offsets = [0] * len(self.sources)  # each source's position at the origin
        self._served = 0
        self._it: Iterator[Batch] | None = None

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            self._it = iterate_batches(
                _MixedBatches(self), self._served, self.num_workers, self.pin_memory, self.prefetch_factor
            )
        item = next(self._it)
        self._served += 1
        return item

    def close(self) -> None:
        """Stop worker processes (they restart on the next ``next()``)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    # -- position ------------------------------------------------------------------------------

    @property
    def batches_served(self) -> int:
        return self._served

    def global_sequences(self) -> int:
        """Sequences served over all ranks (every rank serves as many batches)."""
        return self._served * self.world_size * self.micro_batch_size

    def positions(self) -> dict[str, int]:
        """Sequences taken from each source so far, over all ranks, by name."""
        taken = self.schedule.taken(self.global_sequences() - self.origin)
        return {s.name: o + t for s, o, t in zip(self.sources, self.offsets, taken, strict=True)}

    def tokens_by_source(self) -> dict[str, dict[str, float | int]]:
        """``{name: {weight, tokens}}``: each source's normalised weight and tokens trained from it."""
        total = sum(s.weight for s in self.sources)
        return {
            s.name: {"weight": s.weight / total, "tokens": n * self.block_size}
            for s, n in zip(self.sources, self.positions().values(), strict=True)
        }

    def _settings(self) -> dict[str, int]:
        return {
            "seed": int(self.seed),
            "block_size": self.block_size,
            "micro_batch_size": self.micro_batch_size,
            "shuffle": int(self.shuffle),
        }

    def state_dict(self) -> dict[str, Any]:
        """The global position, the schedule's origin and every source's position (JSON-serialisable)."""
        positions = self.positions()
        sources = {
            s.name: {
                "weight": float(s.weight),
                "num_tokens": len(s.tokens),
                "position": positions[s.name],
                "epoch": positions[s.name] // p.batches_per_epoch,
                "origin": o,
            }
            for s, p, o in zip(self.sources, self.plans, self.offsets, strict=True)
        }
        return {
            "version": _STATE_VERSION,
            "kind": "mixture",
            "world_size": self.world_size,
            "batches_served": self._served,
            "origin": self.origin,
            "sources": sources,
            **self._settings(),
        }

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state`` (see the module doc); a state of other data is a ConfigError."""
        if state.get("kind") != "mixture" or int(state.get("version", 0)) > _STATE_VERSION:
            raise ConfigError(
                f"the saved data position (kind {state.get('kind')!r}) is not a data.sources mixture's: the data "
                "changed since the checkpoint; resume with the original data settings or start a new run"
            )
        diff = {k: (state.get(k), v) for k, v in self._settings().items() if state.get(k) != v}
        if diff and strict:
            detail = ", ".join(f"{k}: saved {a!r} now {b!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"the saved data position does not match the configured data ({detail}); resume with the "
                "original data settings or start a new run"
            )
        try:
            total = _position(state["batches_served"]) * _position(state["world_size"])
            origin = _position(state["origin"])
            saved = {str(k): dict(v) for k, v in dict(state["sources"]).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed data mixture state: {exc}") from None
        if total % self.world_size:
            raise ConfigError(
                f"the checkpoint's data position ({total} micro-batches over {state['world_size']} ranks) does "
                f"not divide between {self.world_size} ranks; resume with a number of ranks that divides it"
            )
        if origin > total * self.micro_batch_size:
            raise CheckpointError(
                f"the checkpoint's data mixture origin ({origin}) is past its position; the checkpoint is "
                "corrupt: resume from another one or start a new run"
            )
        self.close()
        self._served = total // self.world_size
        self._restore_sources(saved, origin)

    def _restore_sources(self, saved: dict[str, dict[str, Any]], origin: int) -> None:
        for s in self.sources:
            entry = saved.get(s.name)
            if entry is not None and int(entry.get("num_tokens", -1)) != len(s.tokens):
                raise ConfigError(
                    f"data.sources {s.name!r} has {len(s.tokens):,} training tokens but {entry.get('num_tokens')} "
                    "when the checkpoint was saved: the source changed; resume with the original data or start a new run"
                )
        same = set(saved) == {s.name for s in self.sources} and all(
            float(saved[s.name].get("weight", -1)) == float(s.weight) for s in self.sources
        )
        if same:  # the schedule continues exactly
            self.origin = origin
            self.offsets = [_position(saved[s.name]["origin"]) for s in self.sources]
            return
        # Other weights or sources: the schedule restarts here, each source from its own position.
        self.origin = self.global_sequences()
        self.offsets = [_position(saved.get(s.name, {}).get("position", 0)) for s in self.sources]
        log.info(
            "data.sources changed since the checkpoint: the mixture continues with the new weights, each source "
            "from its saved position (%s)",
            ", ".join(f"{s.name} {o:,}" for s, o in zip(self.sources, self.offsets, strict=True)),
        )


def _window_plan(source: WeightedSource, block_size: int, shuffle: bool, seed: int) -> WindowPlan:
    """The source's own window order: one window per step, epochs seeded from (seed, its name)."""
    try:
        return WindowPlan(
            len(source.tokens),
            block_size,
            1,
            shuffle=shuffle,
            drop_last=True,
            seed=mix_seed(seed, "source", source.name),
        )
    except DataError as exc:
        raise DataError(f"data.sources {source.name!r}: {exc}") from None


def _position(value: Any) -> int:
    """A position read from a checkpoint (maybe hostile): a plain count in range, or CheckpointError."""
    number = int(value)
    if isinstance(value, bool) or not 0 <= number < MAX_POSITION:
        raise CheckpointError(
            f"the checkpoint's data mixture position {value!r} is out of range (0 to {MAX_POSITION - 1}); the "
            "checkpoint is corrupt: resume from another one or start a new run"
        )
    return number
