"""The small stateful parts of a run that are not torch objects: counters, RNG streams, and the
position in a plain iterable. Each has `state_dict()` / `load_state_dict()` like a model or an
optimizer, so a checkpoint is just `{name: part.state_dict()}` over the run's parts."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from speedtronic.engine.checkpoint.files import pack_python_rng, unpack_python_rng


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass
class TrainCounters:
    """Where the run stands: optimizer steps taken, tokens trained on, micro-batches drawn."""

    step: int = 0
    tokens_seen: int = 0
    batches_consumed: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.batches_consumed = int(state.get("batches_consumed", 0))


class RngState:
    """Python's and torch's (CPU and CUDA) random streams, as weights-only loading accepts them."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "python": pack_python_rng(random.getstate()),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(unpack_python_rng(state["python"]))
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class IterablePosition:
    """The position in a plain iterable of batches (a user's list or generator factory), which has no
    state of its own: resuming skips the batches already consumed, once, on first use. A finite
    iterable starts its next epoch when it runs out."""

    def __init__(self, source: Iterable[Any], counters: TrainCounters) -> None:
        self.source = source
        self.counters = counters
        self._iterator: Iterator[Any] | None = None
        self._skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches_consumed": self.counters.batches_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skip = int(state.get("batches_consumed", 0))
        self._iterator = None

    def __iter__(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self.source)
            for _ in range(self._skip):
                next(self._iterator)
            self._skip = 0
        return self._iterator

    def restart(self) -> Iterator[Any]:
        self._iterator = iter(self.source)
        return self._iterator


def resumable(train: Iterable[Any], counters: TrainCounters) -> Stateful:
    """The training batches as a part a checkpoint can hold: as they are when they have `state_dict`
    (the data bundle's loader), else their position in the plain iterable, counted in `counters`."""
    return train if hasattr(train, "state_dict") else IterablePosition(train, counters)  # type: ignore[return-value]


def checkpointed_parts(
    model: Stateful,
    optimizer: Stateful,
    scheduler: Stateful,
    scaler: Stateful | None,
    data: Stateful,
    counters: TrainCounters,
    sync: Stateful | None,
) -> dict[str, Stateful]:
    """What a checkpoint of a run holds, by name, in the order it is written (engine/checkpoint/layout.py
    names the format); a fresh RNG state part captures every generator when saved."""
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        **({"grad_scaler": scaler} if scaler is not None else {}),
        "data": data,
        "rng": RngState(),
        "counters": counters,
        **({"sync": sync} if sync is not None else {}),
    }
