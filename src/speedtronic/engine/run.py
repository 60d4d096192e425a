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
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from speedtronic import run_lock
from speedtronic.config import Config
from speedtronic.engine.build import GivenParts, build_data_for, place_model
from speedtronic.engine.built_run import Run
from speedtronic.engine.checkpoint import parts as checkpoint_parts
from speedtronic.engine.checkpoint.layout import RunCheckpoint, find_resume
from speedtronic.engine.checkpoint.stateful import TrainCounters, checkpointed_parts, resumable
from speedtronic.engine.data_facts import data_facts
from speedtronic.engine.device import device_facts, make_deterministic, open_world
from speedtronic.engine.events import build_events
from speedtronic.engine.optimizer import build_optimizer
from speedtronic.engine.parallel.distributed import World
from speedtronic.engine.precision import precision_for_run
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

    given = GivenParts(model, optimizer, scheduler, train_data, val_data, hooks, sync, progress)
    try:
        run = _assemble(config, resolve_registries(registries), world, resume, lock_run_dir, given)
    except BaseException:
        for key in held:
            run_lock.release(key)
        raise
    for key in held:
        weakref.finalize(run, run_lock.release, key)
    return run


def _assemble(
    config: Config,
    registries: Registries,
    world: World,
    resume: RunCheckpoint | bool | None,
    lock_run_dir: Callable[[], None],
    given: GivenParts,
) -> Run:
    """build_run's body on an open world, in the order that fixes each part's random numbers."""
    resume = (find_resume(config) if resume is True else resume) or None
    dist, device = world.dist, world.device
    facts = data_facts(config) if given.train_data is None else DataFacts(synthetic_vocab_size(config))
    start_step = resume.step if resume is not None else 0
    plan = plan_run(
        config, world_size=dist.world_size, data=facts, device=device_facts(device), start_step=start_step
    )
    lock_run_dir()  # the config passed the plan's checks: from here on this process writes the run
    precision = precision_for_run(plan, device)
    if plan.deterministic:
        make_deterministic(device)
    for warning in plan.warnings:
        logger.warning(warning)
    bundle = build_data_for(config, plan, dist, device.type) if given.train_data is None else None
    placed = place_model(
        config, plan, registries, world, precision.param_dtype, given, pretrained=resume is None
    )
    optimizer = given.optimizer
    optimizer = optimizer if optimizer is not None else build_optimizer(config, placed.raw, registries)
    scheduler = given.scheduler if given.scheduler is not None else build_scheduler(optimizer, plan)
    scaler = precision.grad_scaler()
    counters = TrainCounters()
    data = resumable(bundle.train if bundle is not None else given.train_data, counters)
    parts = checkpointed_parts(placed.raw, optimizer, scheduler, scaler, data, counters, placed.sync)
    run = Run(
        config=config,
        registries=registries,
        plan=plan,
        precision=precision,
        dist=dist,
        device=device,
        raw_model=placed.raw,
        model=placed.wrapped,
        ddp=placed.ddp,
        fsdp=plan.strategy == "fsdp" and dist.enabled,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        counters=counters,
        data=data,
        val_source=given.val_data,
        data_bundle=bundle,
        events=build_events(config, registries, dist.is_main, given.hooks),
        sync=placed.sync,
        parts=parts,
        pass_labels=placed.pass_labels,
        user_optimizer=given.optimizer is not None,
        progress=given.progress and dist.is_main,
    )
    if resume is None:
        return run
    return replace(run, resume=resume, resume_changes=checkpoint_parts.restore(run, resume))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
