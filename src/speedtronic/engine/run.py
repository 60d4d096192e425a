"""One construction path: `build_run` turns a config into a `Run`, every part of a training run, built.

    from speedtronic import build_run, Trainer, load_config
    run = build_run(load_config("configs/smoke.yaml"))      # opens the world, finds the resume
    print(run.plan.describe_steps(), type(run.optimizer).__name__)
    Trainer(run).train()

Each part is optional and used as given (model=, optimizer=, scheduler=, train_data=, val_data=,
hooks=, sync=); what is not given is built from the config through the registries handed in (None:
the built-ins). The order is part of the contract, since it fixes which random numbers each part
draws: seed, plan, precision, data, model (with `model.init_from` applied while it is built, before
any sharding or wrapping), the parallel wrap (fsdp sharding or DDP: engine/parallel/wrap.py), optimizer,
scheduler, hooks; last, a resumed run's parts take the checkpoint's state (RNG included), so the
`Run` returned is ready to train.
"""

from __future__ import annotations

import logging
import random
import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from speedtronic import run_lock
from speedtronic.config import Config
from speedtronic.engine import streams
from speedtronic.engine.batches import accepts_labels
from speedtronic.engine.build import build_data_for, build_model_for
from speedtronic.engine.built_run import Run
from speedtronic.engine.checkpoint import parts as checkpoint_parts
from speedtronic.engine.checkpoint.layout import RunCheckpoint, find_resume
from speedtronic.engine.checkpoint.stateful import IterablePosition, RngState, Stateful, TrainCounters
from speedtronic.engine.data_facts import data_facts
from speedtronic.engine.device import device_facts, make_deterministic, open_world
from speedtronic.engine.events import EventBus, build_hooks
from speedtronic.engine.optimizer import build_optimizer
from speedtronic.engine.parallel.distributed import World
from speedtronic.engine.parallel.wrap import wrap_model
from speedtronic.engine.precision import precision_for_run
from speedtronic.engine.preflight import shapes
from speedtronic.engine.schedule import build_scheduler
from speedtronic.engine.sync import Sync
from speedtronic.errors import ConfigError
from speedtronic.plan import DataFacts, plan_run, synthetic_vocab_size
from speedtronic.registry import Registries, resolve_registries

logger = logging.getLogger("speedtronic.train")


def build_run(
    config: Config,
    registries: Registries | None = None,
    world: World | None = None,
    resume: RunCheckpoint | bool | None = True,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    train_data: Iterable[Any] | None = None,
    val_data: Iterable[Any] | None = None,
    hooks: dict[str, Any] | None = None,
    sync: Sync | None = None,
    progress: bool = True,
) -> Run:
    """Build the run `config` describes on `world` (None: `open_world(run.device)`), resuming from
    `resume` (True: the checkpoint `checkpoint.resume` selects; None or False: a fresh start)."""
    if optimizer is not None and model is None:
        raise ConfigError("Trainer: an optimizer was given without its model; pass model= as well")
    seed_everything(config.run.seed)
    world = world if world is not None else open_world(config.run.device)
    if config.distributed.enabled and sync is None and world.dist.is_main:
        raise ConfigError(
            "distributed.enabled is true, but plain training does not join a DiLoCo run: start this "
            "node with `speedtronic master CONFIG` or `speedtronic worker CONFIG --repo REPO`, or set "
            "distributed.enabled: false to train alone"
        )
    # One process per run directory (run_lock.py), taken once the plan has checked the config (a
    # refused config leaves no runs/<name>/ behind) and before anything is written; the lock lives as
    # long as the Run (under DDP the ranks are one run: the main rank holds it).
    held: list[str] = []

    def lock_run_dir() -> None:
        if world.dist.is_main and not held:
            held.append(run_lock.acquire(config.output_dir()))

    try:
        run = _assemble(
            config,
            registries,
            world,
            resume,
            lock_run_dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            train_data=train_data,
            val_data=val_data,
            hooks=hooks,
            sync=sync,
            progress=progress,
        )
    except BaseException:
        for key in held:
            run_lock.release(key)
        raise
    for key in held:
        weakref.finalize(run, run_lock.release, key)
    return run


def _assemble(
    config: Config,
    registries: Registries | None,
    world: World,
    resume: RunCheckpoint | bool | None,
    lock_run_dir: Any,
    *,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    train_data: Iterable[Any] | None,
    val_data: Iterable[Any] | None,
    hooks: dict[str, Any] | None,
    sync: Sync | None,
    progress: bool,
) -> Run:
    """build_run's body, once the world is open; it calls `lock_run_dir` once the plan has checked the
    config, before anything is written."""
    if resume is True:
        resume = find_resume(config)
    resume = resume or None
    registries = resolve_registries(registries)
    dist, device = world.dist, world.device

    facts = data_facts(config) if train_data is None else DataFacts(synthetic_vocab_size(config))
    plan = plan_run(
        config,
        world_size=dist.world_size,
        data=facts,
        device=device_facts(device),
        start_step=resume.step if resume is not None else 0,
    )
    lock_run_dir()  # the config passed the plan's checks: from here on this process writes the run
    precision = precision_for_run(plan, device)
    if plan.deterministic:
        make_deterministic(device)
    for warning in plan.warnings:
        logger.warning(warning)
    bundle = build_data_for(config, plan, dist, device.type) if train_data is None else None

    built = model is None
    raw = build_model_for(config, plan, registries, model=model, pretrained=resume is None)
    raw = raw.to(device, dtype=precision.param_dtype)
    if dist.is_main and built:
        shapes.warn_at_startup(config, raw, device, precision, facts.vocab_size, registries)
    streams.maybe_enable(raw, config, device, plan.gradient_checkpointing)
    pass_labels = accepts_labels(raw)  # read before sharding, which changes the model's class
    # fsdp shards the model here, before the optimizer is built over its (now sharded) parameters.
    wrapped, ddp, sync = wrap_model(raw, plan, world, config, sync=sync, optimizer=optimizer)
    user_optimizer = optimizer is not None
    optimizer = optimizer if optimizer is not None else build_optimizer(config, raw, registries)
    scheduler = scheduler if scheduler is not None else build_scheduler(optimizer, plan)
    scaler = precision.grad_scaler()

    counters = TrainCounters()
    train = bundle.train if bundle is not None else train_data
    data = train if hasattr(train, "state_dict") else IterablePosition(train, counters)
    parts: dict[str, Stateful] = {
        "model": raw,
        "optimizer": optimizer,
        "scheduler": scheduler,
        **({"grad_scaler": scaler} if scaler is not None else {}),
        "data": data,
        "rng": RngState(),
        "counters": counters,
        **({"sync": sync} if sync is not None else {}),
    }
    # Hooks, progress and files belong to rank 0; the other ranks train silently.
    events = EventBus(build_hooks(config.logging.hooks, config, registries) if dist.is_main else {})
    for name, hook in (hooks or {}).items() if dist.is_main else ():
        events.add(name, hook)
    run = Run(
        config=config,
        registries=registries,
        plan=plan,
        precision=precision,
        dist=dist,
        device=device,
        raw_model=raw,
        model=wrapped,
        ddp=ddp,
        fsdp=plan.strategy == "fsdp" and dist.enabled,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        counters=counters,
        data=data,
        val_source=val_data,
        data_bundle=bundle,
        events=events,
        sync=sync,
        parts=parts,
        pass_labels=pass_labels,
        user_optimizer=user_optimizer,
        progress=progress and dist.is_main,
    )
    if resume is None:
        return run
    return replace(run, resume=resume, resume_changes=checkpoint_parts.restore(run, resume))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
