"""The parallel wrap of a run's model: DDP, or FSDP sharding, or nothing in a single process.

    model, ddp, sync = wrap_model(raw_model, plan, world, config, sync=sync, optimizer=optimizer)

- fsdp (`distributed.strategy: fsdp` on several ranks): every rank starts from rank 0's weights (the
  pretrained ones included: model building applied them), then shards them in place (engine/parallel/fsdp.py);
  the optimizer is built afterwards, over the shards. A DiLoCo sync works on whole weights, so rank 0
  hands it an unsharded mirror (engine/parallel/fsdp_sync.py) and every rank gets the gathering wrapper.
- ddp (several ranks otherwise): DistributedDataParallel around the model (gradients averaged on the
  last micro-batch of a step); the loop calls the wrap, the optimizer holds the model's parameters.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from speedtronic.config import Config
from speedtronic.engine.parallel.distributed import World
from speedtronic.engine.sync import Sync
from speedtronic.errors import ConfigError
from speedtronic.plan import RunPlan


def wrap_model(
    model: nn.Module,
    plan: RunPlan,
    world: World,
    config: Config,
    *,
    sync: Sync | None = None,
    optimizer: Any = None,
) -> tuple[nn.Module, Any, Sync | None]:
    """(what the loop calls, the DDP wrap or None, the sync the run uses) for `model` on `world`."""
    dist, device = world.dist, world.device
    if not dist.enabled:
        return model, None, sync
    if plan.strategy != "fsdp":
        ddp = wrap_ddp(model, device)
        return ddp, ddp, sync
    from speedtronic.engine.parallel.fsdp import apply_fsdp

    if optimizer is not None:
        raise ConfigError(
            "distributed.strategy fsdp: an optimizer given to the Trainer was built over the unsharded "
            "parameters; pass the model alone (the optimizer is built after sharding)"
        )
    if config.ooo_backprop:
        raise ConfigError("ooo_backprop does not compose with distributed.strategy fsdp; turn one off")
    dist.broadcast_module(model)
    if dist.any(sync is not None, device):
        from speedtronic.engine.parallel.fsdp_sync import GatheredSync, make_mirror

        mirror = make_mirror(model) if dist.is_main else None
        sync = GatheredSync(sync, mirror, device)  # type: ignore[assignment]
    apply_fsdp(model, plan, device)
    return model, None, sync


def wrap_ddp(model: nn.Module, device: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)
