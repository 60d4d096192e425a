"""A `Sync` (DiLoCo) on a node whose ranks shard the model with FSDP.

A sync works on whole weights: at a sync point it snapshots the model to compute the delta, and it
installs a global model into it. Under FSDP no rank holds whole weights, so rank 0 keeps a *mirror*,
an unsharded copy of the model on the CPU, and hands the mirror to the sync in place of the sharded
model:

- before a step at which the sync will read or write weights, every rank all-gathers each parameter
  (one at a time, so no rank holds more than one whole parameter besides its shards) and rank 0
  copies it into the mirror: the delta is computed from the full weights, exactly as on a DDP node;
- when the sync installed new weights, rank 0 broadcasts the mirror one parameter at a time and each
  rank keeps its own shard of it.

Which steps need weights the sync says itself (`needs_weights(step)`, asked on rank 0 and broadcast);
a sync without that method gets fresh weights at every step (correct, but a gather per step). Other
steps cost one scalar all-reduce. The mirror costs rank 0 one copy of the parameters in host memory,
next to the sync's own CPU copies (DiLoCo keeps the anchor and its book-keeping in fp32 there).
Only rank 0 has the wrapped sync; its state rides in the checkpoint as on a DDP node.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.engine.parallel import fsdp
from speedtronic.engine.sync import StopTraining, Sync


def make_mirror(model: nn.Module) -> nn.Module:
    """An unsharded CPU copy of `model` (taken before it is sharded), with the same names and dtypes.
    Each tensor is copied straight to the CPU: a model that just fits its GPU is never doubled there."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to("cpu", copy=True), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


class GatheredSync:
    """Runs on every rank of an FSDP node; `inner` (the real sync) and `mirror` exist on rank 0 only."""

    def __init__(self, inner: Sync | None, mirror: nn.Module | None, device: torch.device) -> None:
        self.inner = inner
        self.mirror = mirror
        self.device = device
        self.is_main = dist.get_rank() == 0
        if self.is_main and (inner is None or mirror is None):
            raise ValueError("GatheredSync: rank 0 needs the sync and the mirror")

    # -- collectives ------------------------------------------------------------------------------
    def _flag(self, value: bool) -> bool:
        """Rank 0's answer, on every rank."""
        tensor = torch.tensor([1.0 if value else 0.0], device=self.device)
        dist.broadcast(tensor, src=0)
        return bool(tensor.item())

    @torch.no_grad()
    def gather(self, model: nn.Module) -> None:
        """Every rank: the sharded weights into rank 0's mirror."""
        mirrored = dict(self.mirror.named_parameters()) if self.mirror is not None else {}
        for name, param in model.named_parameters():
            whole = fsdp.full(param.detach())  # a collective: every rank takes part
            if self.is_main:
                mirrored[name].copy_(whole.to("cpu"))

    @torch.no_grad()
    def scatter(self, model: nn.Module) -> None:
        """Every rank: rank 0's mirror into the shards (each rank keeps its own part)."""
        from torch.distributed.tensor import distribute_tensor

        mirrored = dict(self.mirror.named_parameters()) if self.mirror is not None else {}
        for name, param in model.named_parameters():
            if self.is_main:
                whole = mirrored[name].detach().to(self.device, param.dtype)
            else:
                whole = torch.empty(param.shape, dtype=param.dtype, device=self.device)
            dist.broadcast(whole, src=0)
            if fsdp.is_sharded(param):
                shard = distribute_tensor(whole, param.device_mesh, param.placements).to_local()
                fsdp.local(param).copy_(shard.to(fsdp.local(param).device))
            else:
                param.copy_(whole.to(param.device))

    # -- the Sync protocol ------------------------------------------------------------------------
    def attach(self, model: nn.Module, *, step: int, tokens: int, final_step: int) -> None:
        """Fresh weights for the sync to check and start from; whatever it installed reaches the shards."""
        self.gather(model)
        if self.inner is not None:
            self.inner.attach(self.mirror, step=step, tokens=tokens, final_step=final_step)  # type: ignore[arg-type]
        self.scatter(model)

    def after_step(self, model: nn.Module, *, step: int, tokens: int) -> bool:
        wants = getattr(self.inner, "needs_weights", None)
        needs = self._flag(bool(wants(step)) if callable(wants) else self.is_main)
        if needs:
            self.gather(model)
        installed, stop = False, None
        if self.inner is not None:
            try:
                installed = bool(self.inner.after_step(self.mirror, step=step, tokens=tokens))  # type: ignore[arg-type]
            except StopTraining as stopping:
                installed, stop = stopping.installed, stopping
        installed = self._flag(installed)
        if installed:
            if not needs:  # a sync that installs must have asked for weights first (its needs_weights)
                raise RuntimeError("the sync installed weights at a step it said needed none")
            self.scatter(model)
        if stop is not None:
            raise stop
        return installed

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
