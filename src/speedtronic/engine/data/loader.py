"""The training batch loader with exact resume, and deterministic validation batches.

Every batch is ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` cut from a window
``w`` of ``T + 1`` tokens as ``input_ids = w[:-1]``, ``labels = w[1:]``: labels are already
shifted, the model never shifts again.

Random-access sources (everything except a streamed text file): batch ``i`` of rank ``r`` is a
pure function of ``(seed, global batch g = i * world_size + r)``. The source is cut into
``n`` non-overlapping windows; epoch ``e = g // batches_per_epoch`` visits them in order
(``shuffle=False``) or in a permutation seeded from ``(seed, e)`` with a random shift of the window
grid so epochs see different cuts (``shuffle=True``). Because batches depend on nothing else, the
loader is a map-style dataset indexed by batch number behind a standard ``DataLoader`` (so
``num_workers`` > 0 gives identical batches; with no workers and no pinning it is indexed directly,
the same batches without the DataLoader's per-batch toll) and its resume state is just ``batches_served``.

Streamed text files (:class:`~speedtronic.engine.data.stream.TextStream`) are read sequentially;
each batch carries the stream position after it and that position is the state (see stream.py).
At most one worker is used there, since a sequential stream cannot be split between workers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from speedtronic.errors import CheckpointError, ConfigError, DataError

from .sources import TokenSource, mix_seed
from .stream import StreamPos, TextStream

__all__ = ["Batch", "TrainLoader", "WindowPlan", "iterate_batches", "make_val_batches", "to_batch"]

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
_STATE_VERSION = 1
MAX_POSITION = 2**53  # batches, epochs and offsets beyond any real run (and exact in a float)


def to_batch(windows: torch.Tensor) -> Batch:
    # clone(): the slices are strided views; contiguous tensors pin and transfer faster.
    return {"input_ids": windows[:, :-1].clone(), "labels": windows[:, 1:].clone()}


class WindowPlan:
    """Which window offsets make up global batch ``g``: a pure function of the constructor args."""

    def __init__(
        self,
        num_tokens: int,
        block_size: int,
        micro_batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int,
    ) -> None:
        self.num_tokens, self.block_size, self.micro_batch_size = num_tokens, block_size, micro_batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        base = (num_tokens - 1) // block_size
        if base < 1:
            raise DataError(
                f"the training data has {num_tokens:,} tokens but one window needs block_size + 1 = "
                f"{block_size + 1:,}; lower block_size or use more data"
            )
        # Shuffled epochs shift the window grid by up to block_size - 1 tokens, which costs one window.
        self.jitter = shuffle and base >= 2
        self.num_windows = base - 1 if self.jitter else base
        full, rest = divmod(self.num_windows, micro_batch_size)
        self.batches_per_epoch = full if drop_last else full + (rest > 0)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the training data has {self.num_windows:,} windows of {block_size + 1:,} tokens, fewer than "
                f"micro_batch_size={micro_batch_size}, and drop_last is set; lower micro_batch_size or "
                "block_size, use more data, or set drop_last: false"
            )
        self._cached: tuple[int, int, torch.Tensor | None] | None = None

    def _epoch_order(self, epoch: int) -> tuple[int, torch.Tensor | None]:
        """``(shift, permutation or None for in-order)`` of an epoch, cached for the current epoch."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(mix_seed(self.seed, "epoch", epoch))
                shift = int(torch.randint(0, self.block_size, (1,), generator=g)) if self.jitter else 0
                self._cached = (epoch, shift, torch.randperm(self.num_windows, generator=g))
            else:
                self._cached = (epoch, 0, None)
        return self._cached[1], self._cached[2]

    def starts(self, g: int) -> list[int]:
        """Token offsets of the windows of global batch ``g`` (any ``g >= 0``; epochs wrap)."""
        if g < 0:
            raise ValueError(f"batch index must be >= 0, got {g}")
        epoch, k = divmod(g, self.batches_per_epoch)
        shift, order = self._epoch_order(epoch)
        lo = k * self.micro_batch_size
        hi = min(lo + self.micro_batch_size, self.num_windows)
        idx = range(lo, hi) if order is None else order[lo:hi].tolist()
        return [shift + j * self.block_size for j in idx]


class _IndexedBatches(Dataset):
    """Map-style dataset: item ``i`` is this rank's ``i``-th batch."""

    def __init__(self, source: TokenSource, plan: WindowPlan, rank: int, world_size: int) -> None:
        self.source, self.plan, self.rank, self.world_size = source, plan, rank, world_size

    def __getitem__(self, i: int) -> Batch:
        starts = self.plan.starts(i * self.world_size + self.rank)
        return to_batch(self.source.windows(starts, self.plan.block_size + 1))


class _CountFrom(Sampler[int]):
    """Batch numbers ``start, start + 1, ...`` forever (training is step-driven, epochs wrap)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start)


class _StreamBatches(IterableDataset):
    """Batches from a sequential stream, each paired with the stream position after it."""

    def __init__(
        self, stream: TextStream, block_size: int, micro_batch_size: int, drop_last: bool, pos: StreamPos
    ):
        self.stream, self.block_size, self.micro_batch_size = stream, block_size, micro_batch_size
        self.drop_last, self.pos = drop_last, pos

    def __iter__(self) -> Iterator[tuple[Batch, tuple[int, int, int]]]:
        pos = self.pos
        while True:
            from_start = pos.offset == self.stream.start and pos.skip == 0
            produced = False
            batch: list[list[int]] = []
            for window, nxt in self.stream.windows(self.block_size + 1, self.block_size, pos):
                batch.append(window)
                if len(batch) == self.micro_batch_size:
                    yield to_batch(torch.tensor(batch, dtype=torch.int64)), tuple(nxt)
                    batch, produced = [], True
            pos = self.stream.first_pos(pos.epoch + 1)
            if batch and not self.drop_last:
                yield to_batch(torch.tensor(batch, dtype=torch.int64)), tuple(pos)
                produced = True
            if from_start and not produced:
                raise DataError(
                    f"{self.stream.path}: bytes {self.stream.start:,}-{self.stream.end:,} hold fewer than "
                    f"micro_batch_size={self.micro_batch_size} windows of block_size + 1 = {self.block_size + 1} "
                    "tokens; use more data, lower block_size/micro_batch_size or set drop_last: false"
                )


def iterate_batches(
    dataset: Dataset, start: int | None, num_workers: int, pin_memory: bool, prefetch_factor: int | None
) -> Iterator[Any]:
    """Batches of a map-style ``dataset`` indexed by batch number from ``start`` on (None: an iterable
    dataset), through a DataLoader when workers or pinning ask for one."""
    extra: dict[str, Any] = {}
    if num_workers > 0 and prefetch_factor is not None:
        extra["prefetch_factor"] = prefetch_factor
    if start is not None:
        if num_workers == 0 and not pin_memory:
            # In this process and unpinned, a DataLoader would only add a toll to every batch (its
            # profiler ranges and conversion, about as much again as cutting the batch itself).
            return map(dataset.__getitem__, _CountFrom(start))
        extra["sampler"] = _CountFrom(start)
    # A private generator: otherwise DataLoader draws its worker base seed from the global torch
    # RNG each time an iterator is made, which would shift dropout masks after a resume.
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(0),
        **extra,
    )
    return iter(loader)


class TrainLoader:
    """Endless iterator of training batches whose position can be saved and restored exactly.

    ``state_dict()`` is a small dict of ints and strings; after ``load_state_dict(state)`` the next
    batch is exactly the one an uninterrupted run would have produced next. Batches prefetched
    by workers but not yet returned are discarded on load, never counted as served.
    """

    def __init__(
        self,
        source: TokenSource | TextStream,
        *,
        block_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if block_size < 1 or micro_batch_size < 1:
            raise ValueError(
                f"block_size and micro_batch_size must be >= 1, got {block_size}, {micro_batch_size}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if num_workers < 0 or (prefetch_factor is not None and prefetch_factor < 1):
            raise ValueError(
                f"need num_workers >= 0 and prefetch_factor >= 1, got {num_workers}, {prefetch_factor}"
            )
        self.block_size, self.micro_batch_size = block_size, micro_batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.prefetch_factor, self.pin_memory = prefetch_factor, pin_memory
        self.rank, self.world_size = rank, world_size
        self.streaming = isinstance(source, TextStream)
        self.num_workers = num_workers
        self._plan: WindowPlan | None = None
        if isinstance(source, TextStream):
            self.stream = source.shard(rank, world_size)
            self._pos = self.stream.first_pos()
            if shuffle:
                log.info("%s is streamed: batches are read in file order (shuffle ignored)", source.name)
            # A sequential stream cannot be split between workers; one worker still overlaps tokenising.
            self.num_workers = min(num_workers, 1)
        else:
            self.source = source
            self._plan = WindowPlan(
                len(source), block_size, micro_batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed
            )
        self._served = 0
        self._it: Iterator[Any] | None = None

    # -- iteration -----------------------------------------------------------------------------

    def _make_iter(self) -> Iterator[Any]:
        if self._plan is not None:
            dataset: Dataset = _IndexedBatches(self.source, self._plan, self.rank, self.world_size)
            return iterate_batches(
                dataset, self._served, self.num_workers, self.pin_memory, self.prefetch_factor
            )
        dataset = _StreamBatches(
            self.stream, self.block_size, self.micro_batch_size, self.drop_last, self._pos
        )
        return iterate_batches(dataset, None, self.num_workers, self.pin_memory, self.prefetch_factor)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            self._it = self._make_iter()
        item = next(self._it)
        if self._plan is None:
            item, pos = item
            self._pos = StreamPos(*(int(x) for x in pos))
        self._served += 1
        return item

    def close(self) -> None:
        """Stop worker processes (they restart on the next ``next()``)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- position ------------------------------------------------------------------------------

    @property
    def batches_served(self) -> int:
        return self._served

    @property
    def batches_per_epoch(self) -> int | None:
        """Batches in one pass over the data, summed over all ranks; None for a streamed file."""
        return None if self._plan is None else self._plan.batches_per_epoch

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (0-based)."""
        if self._plan is None:
            return self._pos.epoch
        return (self._served * self.world_size + self.rank) // self._plan.batches_per_epoch

    def _config_state(self) -> dict[str, int | str]:
        cfg: dict[str, int | str] = {
            "version": _STATE_VERSION,
            "kind": "stream" if self._plan is None else "windows",
            "seed": int(self.seed),
            "block_size": self.block_size,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "drop_last": int(self.drop_last),
        }
        if self._plan is None:
            cfg.update(rank=self.rank, range_start=self.stream.start, range_end=self.stream.end)
        else:
            cfg.update(shuffle=int(self.shuffle), num_tokens=self._plan.num_tokens)
        return cfg

    def state_dict(self) -> dict[str, int | str]:
        """JSON-serialisable position: ``batches_served`` (+ the stream position when streaming)."""
        state = self._config_state()
        state["batches_served"] = self._served
        if self._plan is None:
            state.update(epoch=self._pos.epoch, offset=self._pos.offset, skip=self._pos.skip)
        return state

    def _rescale_world(self, state: dict[str, Any], mine: dict[str, int | str]) -> dict[str, Any]:
        """A position saved with another number of ranks, in this world's per-rank count.

        Every rank serves the same number of batches, so ``batches_served × world_size`` is the
        global position; it carries over when it divides by the new world size.
        """
        saved_world = state.get("world_size")
        if (
            mine["kind"] != "windows"
            or saved_world in (None, mine["world_size"])
            or "batches_served" not in state
        ):
            return state
        total = int(state["batches_served"]) * int(saved_world)
        if total % self.world_size:
            raise ConfigError(
                f"the checkpoint's data position ({total} micro-batches over {saved_world} ranks) does not "
                f"divide between {self.world_size} ranks; resume with a number of ranks that divides it"
            )
        return {**state, "world_size": self.world_size, "batches_served": total // self.world_size}

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state``. ``strict`` (default) refuses a state saved with other data/settings.

        A mismatch means the data configuration changed between runs, a user error, so it raises
        :class:`ConfigError`. With ``strict=False`` it is only logged and the batch counter (or the
        stream position) is taken as is; batches then no longer match the original run.
        """
        mine = self._config_state()
        if state.get("kind") != mine["kind"] or int(state.get("version", 0)) > _STATE_VERSION:
            raise ConfigError(
                f"the saved data position (kind {state.get('kind')!r}, v{state.get('version')}) cannot be used "
                f"with the configured {mine['kind']!r} data (v{_STATE_VERSION}): the data source changed since "
                "the checkpoint; resume with the original data settings or start a new run"
            )
        state = self._rescale_world(state, mine)
        diff = {k: (state.get(k), v) for k, v in mine.items() if k != "version" and state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} now {b!r}" for k, (a, b) in diff.items())
            if strict:
                raise ConfigError(
                    f"the saved data position does not match the configured data ({detail}); resume with "
                    "the original data settings or start a new run"
                )
            log.warning("resuming data loader with changed settings (%s); batches will differ", detail)
        try:
            served = int(state["batches_served"])
            pos = (
                StreamPos(int(state["epoch"]), int(state["offset"]), int(state["skip"]))
                if self._plan is None
                else None
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed data loader state {state!r}: {exc}") from None
        # A checkpoint may be hostile or corrupt: a position must be a plain count in range before
        # anything indexes with it (2**63 would overflow int64 tensors deep inside the sampler).
        fields = {"batches_served": served}
        if pos is not None:
            fields.update(epoch=pos.epoch, offset=pos.offset, skip=pos.skip)
        for name, value in fields.items():
            if not 0 <= value < MAX_POSITION:
                raise CheckpointError(
                    f"the checkpoint's data position {name}={value} is out of range (0 to {MAX_POSITION - 1}); "
                    "the checkpoint is corrupt: resume from another one or start a new run"
                )
        self.close()
        self._served = served
        if pos is not None:
            self._pos = pos


def make_val_batches(
    source: TokenSource | TextStream | None, *, block_size: int, micro_batch_size: int, max_batches: int
) -> list[Batch]:
    """The first ``max_batches`` batches of consecutive non-overlapping windows (same on every rank).

    The last batch may be smaller than ``micro_batch_size``; a split shorter than one window gives [].
    """
    if source is None or max_batches <= 0:
        return []
    want = max_batches * micro_batch_size
    if isinstance(source, TextStream):
        pairs = itertools.islice(source.windows(block_size + 1, block_size, source.first_pos()), want)
        rows = torch.tensor([w for w, _ in pairs], dtype=torch.int64).reshape(-1, block_size + 1)
    else:
        n = min(want, max(0, (len(source) - 1) // block_size))
        rows = source.windows([j * block_size for j in range(n)], block_size + 1)
    return [to_batch(rows[i : i + micro_batch_size]) for i in range(0, rows.shape[0], micro_batch_size)]
