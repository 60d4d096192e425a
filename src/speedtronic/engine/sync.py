"""The seam through which a synchronisation scheme (DiLoCo today) plugs into the training loop.

The trainer knows nothing of buses, masters or deltas: it hands a `Sync` the model, the step and the
token count after every optimizer step, and the sync answers whether it installed new weights. The
trainer alone reacts to an install: under DDP it broadcasts rank 0's weights to every rank, and with
`distributed.sync.reset_inner_optimizer` it clears the optimizer state. A sync's own state rides in the
checkpoint as its `sync` part, so a resumed node continues where it stopped.

A sync may also end the run early, at a step of its choosing (DiLoCo: the run's end in the manifest
was reached): `after_step` raises `StopTraining` once it has finished with that step. The trainer
then ends exactly as at the plan's last step (final log line, evaluation, checkpoint; the result is
not "interrupted"); under DDP every rank stops at the same step.

A sync may also be `Prefetching`: when the model is compiled before its first step (a single process
with a sync, engine/trainer.py), `prefetch(model)` is called first, so that what `attach` waits for
(DiLoCo: the head and the global model) comes over the network while the model compiles.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn


class StopTraining(Exception):
    """Raised by `Sync.after_step` to end training after the current step, as a normal end.
    `installed` says whether the sync replaced the weights in that same call."""

    def __init__(self, reason: str, *, installed: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.installed = installed


@runtime_checkable
class Sync(Protocol):
    def attach(self, model: nn.Module, *, step: int, tokens: int, final_step: int) -> None:
        """Called when `Trainer.train()` starts, before its first step (after a resume): check the model
        against the run, and install the shared starting weights if this node has none yet.
        `final_step` is the last step this call will train. A second `train()` call (training on
        after an earlier stop) attaches again with its own final step, so it must be idempotent."""

    def after_step(self, model: nn.Module, *, step: int, tokens: int) -> bool:
        """Called after every optimizer step with the step just taken and the tokens seen so far;
        returns True when it replaced the model's weights; raises StopTraining to end the run here."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Called once when training ends (normally, interrupted or failing): flush and stop."""


@runtime_checkable
class Prefetching(Protocol):
    def prefetch(self, model: nn.Module) -> None:
        """Called before `attach` when the model is about to be compiled ahead of the first step: check
        what can be checked now, then start fetching on a thread what `attach` will need, which waits
        for it (and raises what the fetch raised)."""
