"""The memory plan: estimated bytes per rank of a run under ddp and fsdp, before it starts.

    from speedtronic.engine.preflight.memory_plan import memory_plan
    plan = memory_plan(config, nproc=8)        # `speedtronic shapes CONFIG --memory --nproc 8`

The model is built on the meta device (no weights allocated) and counted as it really is, so plugin
models are measured too; the run plan gives the dtypes (parameters, FSDP's gathered compute dtype
and reduction dtype). Per rank:

- parameters, gradients: everything under ddp; 1/N under fsdp (each rank holds its shards), plus
  under fsdp the transiently gathered parameters: the root's (kept between forward and backward) and
  two blocks' (the one running and the one prefetched) in the compute dtype;
- optimizer state: what the optimizer's registration declares (`state_elements=`: AdamW two
  moments per parameter, the Muon hybrid one momentum matrix per Muon-routed parameter and two
  moments for the rest, read from the model); an optimizer that declares nothing is counted as two
  states per parameter; divided by N under fsdp;
- activations of one micro-batch: the same under both (each rank runs its own micro-batches), as
  the model's config estimates them (`activation_bytes`; the transformer's: s·b·h·(34 + 5·a·s/h)
  bytes per block at 16 bits, Korthikanti et al., 2022, without fused attention, scaled for 32-bit,
  or the block inputs alone plus one block's activations with gradient checkpointing; a model that
  gives no estimate counts none); plus the logits and their fp32 loss copy.

These are estimates (the allocator's fragmentation, communication buffers and framework overhead
come on top); `train --json` reports what rank 0 really held (`rank0_state_bytes`) and its peak.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speedtronic.config import Config
from speedtronic.registry import Registries, resolve_registries

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def memory_plan(
    config: Config, nproc: int = 1, registries: Registries | None = None, device: str | None = None
) -> dict[str, Any]:
    """Estimated bytes per rank of `config` on `nproc` ranks, for each strategy (see the module doc)."""
    from speedtronic.engine.data_facts import data_facts
    from speedtronic.engine.parallel.fsdp import fsdp_units
    from speedtronic.engine.preflight.shapes import build_meta_model
    from speedtronic.plan import DeviceFacts, plan_run

    facts = data_facts(config)
    name = device or config.run.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        facts_here = DeviceFacts(name, native_bf16=True)  # planning for a GPU not present: a bf16 one
    else:
        from speedtronic.engine.device import device_facts, resolve_device

        facts_here = device_facts(resolve_device(name))
    model = build_meta_model(config, facts.vocab_size, registries)
    plans = {
        strategy: plan_run(
            config.model_copy(
                update={"distributed": config.distributed.model_copy(update={"strategy": strategy})}
            ),
            world_size=nproc,
            data=facts,
            device=facts_here,
        )
        for strategy in ("ddp", "fsdp")
    }
    parameters = _numel(model)
    units = fsdp_units(model)
    unit_params = max((_numel(u) for u in units), default=0)
    root_params = parameters - sum(_numel(u) for u in units)
    state = _optimizer_state_elements(config, model, registries)

    out: dict[str, Any] = {"nproc": nproc, "parameters": parameters, "strategies": {}}
    for strategy, plan in plans.items():
        p_bytes = _BYTES[plan.param_dtype]
        act = _activation_bytes(config, plan)
        shards = nproc if strategy == "fsdp" else 1
        params = parameters * p_bytes / shards
        grads = parameters * (_BYTES[plan.fsdp_reduce_dtype or plan.param_dtype]) / shards
        gathered = 0.0
        if strategy == "fsdp" and nproc > 1:
            compute = _BYTES[plan.fsdp_param_dtype or plan.param_dtype]
            gathered = (root_params + 2 * unit_params) * compute
        optimizer = state * 4 / shards  # optimizer state is kept in float32
        total = params + grads + optimizer + gathered + act
        out["strategies"][strategy] = {
            k: int(v)
            for k, v in {
                "params": params,
                "grads": grads,
                "optimizer": optimizer,
                "gathered": gathered,
                "activations": act,
                "total": total,
            }.items()
        }
        out["strategies"][strategy]["state"] = int(params + grads + optimizer)
    out["micro_batch"] = [config.data.micro_batch_size, config.data.block_size]
    out["precision"] = plans["ddp"].precision
    return out


def _optimizer_state_elements(config: Config, model: nn.Module, registries: Registries | None) -> int:
    """Elements of optimizer state the optimizer keeps for `model`, as its registration declares."""
    declared = resolve_registries(registries).optimizers.entry(config.optimizer.name).declared
    state = declared.get("state_elements", 2)
    if callable(state):
        return int(state(model))
    return int(state * _numel(model))


def _activation_bytes(config: Config, plan: Any) -> float:
    """Activations of one micro-batch through the model (see the module doc)."""
    s, b = plan.block_size, plan.micro_batch_size
    elem = 2 if plan.precision in ("bf16", "fp16") else 4
    blocks = config.model.activation_bytes(s, b, elem, plan.gradient_checkpointing) or 0.0
    logits = s * b * plan.vocab_size * (elem + 4 + 4)  # logits, their fp32 copy, its gradient
    return blocks + logits


def describe_rows(plan: dict[str, Any]) -> list[tuple[str, ...]]:
    """Table rows (strategy, params, grads, optimizer, gathered, activations, total) in MiB."""
    rows = []
    for strategy, figures in plan["strategies"].items():
        rows.append(
            (
                strategy,
                *(
                    f"{figures[k] / 2**20:,.1f}"
                    for k in ("params", "grads", "optimizer", "gathered", "activations", "total")
                ),
            )
        )
    return rows
