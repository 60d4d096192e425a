"""Sharded data parallel on PyTorch's own engine: FSDP2 (`torch.distributed.fsdp.fully_shard`).

With `distributed.strategy: fsdp` every rank stores 1/N of each parameter, its gradient and its
optimizer state (DTensors sharded along dim 0); a block's full parameters exist only while the
block runs (gathered before its forward and again before its backward, freed after each unless
`distributed.fsdp.reshard_after_forward` is false), and gradients are reduce-scattered.

- Units: each module `fsdp_units(model)` names is sharded on its own (one all-gather per block),
  then the root takes what is left (embeddings, final norm, head). A model says which modules to
  wrap with a method `fsdp_units() -> list[nn.Module]`; otherwise its top-level block list is used
  (the largest `nn.ModuleList` among its children), which fits the built-in transformer and most
  plugin models.
- Mixed precision: under bf16 with fp32 master weights the plan asks for bf16 gathered parameters
  and fp32 gradient reduction (`plan.fsdp_param_dtype`, `plan.fsdp_reduce_dtype`).
- Accumulation: gradients are reduce-scattered only on the last micro-batch of a step
  (`set_requires_gradient_sync`), like DDP's `no_sync`.
- Activation checkpointing composes: the model checkpoints its (sharded) blocks itself.
- Muon gathers each sharded matrix for Newton–Schulz (optim/muon.py); AdamW is elementwise and runs
  on the shards as they are.
- Checkpoints are sharded too (engine/checkpoint/layout.py: Distributed Checkpoint, written by every
  rank, read back on any number of ranks).

Everything here takes plain (unsharded) modules in a single process as well, so callers need not
branch: `local` of a plain tensor is the tensor, `state_bytes` counts what the process holds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from speedtronic.errors import ConfigError
from speedtronic.plan import RunPlan

logger = logging.getLogger("speedtronic.fsdp")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one: `model.fsdp_units()` where the model defines it, else the
    largest nn.ModuleList among its direct children (its blocks), else none (the root alone)."""
    method = getattr(model, "fsdp_units", None)
    if callable(method):
        units = list(method())
        if not all(isinstance(u, nn.Module) for u in units):
            raise ConfigError(f"{type(model).__name__}.fsdp_units() must return a list of nn.Module")
        return units
    lists = [child for child in model.children() if isinstance(child, nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def apply_fsdp(model: nn.Module, plan: RunPlan, device: torch.device) -> nn.Module:
    """Shard `model` in place over all ranks of the default process group (per unit, then the root)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise ConfigError("distributed.strategy fsdp shards over ranks; start the run with --nproc N")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=_dtype(plan.fsdp_param_dtype), reduce_dtype=_dtype(plan.fsdp_reduce_dtype)
        ),
        "offload_policy": CPUOffloadPolicy() if plan.fsdp_cpu_offload else OffloadPolicy(),
    }
    units = fsdp_units(model)
    for unit in units:
        fully_shard(unit, reshard_after_forward=plan.fsdp_reshard_after_forward, **options)
    # The root's parameters are needed first in backward (the head), so keeping them is free.
    fully_shard(model, reshard_after_forward=False, **options)
    logger.info(
        "fsdp: %d units + root sharded over %d ranks (params %s, reduce %s%s)",
        len(units),
        dist.get_world_size(),
        plan.fsdp_param_dtype or "as stored",
        plan.fsdp_reduce_dtype or "as stored",
        ", CPU offload" if plan.fsdp_cpu_offload else "",
    )
    return model


def is_sharded(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank stores (a DTensor's local shard; a plain tensor itself)."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor (gathered from every rank when sharded: a collective)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def _bytes(tensors: Any) -> int:
    total = 0
    seen: set[int] = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        shard = local(t)
        total += shard.numel() * shard.element_size()
    return total


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, grads: int | None = None
) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (sharded: its shards).

    `grads` is the gradient bytes measured at the optimizer step (they are freed right after it);
    without it, gradients are counted as one per trainable parameter, as they are at the step."""
    params = list(model.parameters())
    param_bytes = _bytes(params)
    grad_bytes = grads if grads is not None else _bytes(p for p in params if p.requires_grad)
    opt_bytes = 0
    if optimizer is not None:
        opt_bytes = _bytes(v for state in optimizer.state.values() for v in state.values())
    return {
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer": opt_bytes,
        "total": param_bytes + grad_bytes + opt_bytes,
    }


def grad_bytes(params: list[torch.Tensor]) -> int:
    return _bytes(p.grad for p in params if p.grad is not None)
