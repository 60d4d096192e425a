"""The training loop: accumulation, clipping, schedule, precision, evaluation, checkpoints and events.

    from speedtronic import Trainer, load_config
    result = Trainer(load_config("configs/smoke.yaml")).train()

Every derived value comes from the run plan (speedtronic.plan), computed once from the user's config,
the number of ranks, the data's vocabulary and the device. Each part is optional and used as given:
`Trainer(config, model=…, optimizer=…, scheduler=…, train_data=…, val_data=…, hooks=…, sync=…)`;
what is not given is built from the config through the registries the trainer is handed. A
checkpoint is `{name: part.state_dict()}` over the run's stateful parts (engine/run_checkpoint.py),
so resume is exact — a resumed run is bitwise identical to an uninterrupted one on CPU in fp32 — also
with a user's own optimizer and scheduler.

The loop is architecture-neutral (any nn.Module, see batches.py for the return conventions). It reads
the loss from the device only on logging steps, so the GPU never waits on the host in between.
A compiled step that fails (the first compilation or a later recompilation) is retried eagerly with
the same batches and RNG state, and the run goes on eagerly: nothing is lost. SIGINT/SIGTERM finish
the current step, save a checkpoint and end the run as "interrupted".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config, dump_config
from speedtronic.engine import checkpoint as ckpt_files
from speedtronic.engine import fsdp, hyperparameters, shapes, sharded_state, streams
from speedtronic.engine.batches import accepts_labels, forward_loss, move_batch, split_batch
from speedtronic.engine.build import (
    build_optimizer,
    data_facts,
    instantiate_model,
    optimizer_routes,
    resolve_registries,
)
from speedtronic.engine.compile_plan import compile_model
from speedtronic.engine.device import (
    describe_device,
    device_facts,
    make_deterministic,
    peak_flops,
    resolve_device,
)
from speedtronic.engine.distributed import close_distributed, init_distributed, wrap_ddp
from speedtronic.engine.events import EventBus, build_hooks
from speedtronic.engine.metrics import Throughput, flops_per_token, memory_stats, peak_memory_bytes
from speedtronic.engine.precision import precision_for_run
from speedtronic.engine.restore import load_weights
from speedtronic.engine.run_checkpoint import (
    RunCheckpoint,
    read_checkpoint,
    tied_names,
    write_checkpoint,
    write_sharded_checkpoint,
)
from speedtronic.engine.run_state import IterablePosition, RngState, Stateful, TrainCounters
from speedtronic.engine.schedule import build_scheduler
from speedtronic.engine.signals import GracefulStop
from speedtronic.engine.step_fn import ensure_train_mode
from speedtronic.engine.sync import StopTraining, Sync
from speedtronic.errors import CheckpointError, ConfigError, SpeedtronicError
from speedtronic.plan import DataFacts, RunPlan, plan_run, replan, synthetic_vocab_size
from speedtronic.registry import Registries

logger = logging.getLogger("speedtronic.train")


@dataclass
class TrainResult:
    steps: int
    tokens: int
    final_loss: float | None
    val_loss: float | None
    val_ppl: float | None
    elapsed_s: float
    tokens_per_s: float
    checkpoint: str | None
    resumed_from: str | None
    interrupted: bool
    device: str
    precision: str
    parameters: int
    optimizer: str
    compiled: bool
    optimizer_routes: dict[str, int] | None = None
    compile_s: float | None = None
    compile_reason: str | None = None
    plan: dict[str, Any] | None = None
    best_val_loss: float | None = None
    # Where the wall-clock time went: compile (the first compiled step), train, eval, checkpoint (s).
    time_split: dict[str, float] | None = None
    metrics_path: str | None = None
    strategy: str = "single"
    rank0_state_bytes: int | None = None  # parameters + gradients + optimizer state held by rank 0
    state_bytes: dict[str, int] | None = None  # the same, by kind
    peak_memory_bytes: int | None = None  # rank 0's peak: the device's allocator (CUDA) or the process RSS
    peak_memory_kind: str | None = None  # "cuda allocated" or "process RSS"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(kind: str) -> Any:
    """Adds the wall-clock time of each call of the method to `self.time_split[kind]`."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def timed(self: Trainer, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.time_split[kind] += time.perf_counter() - started

        return timed

    return wrap


class Trainer:
    """One training run. Every keyword part is optional; what is given is used as is."""

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        train_data: Iterable[Any] | None = None,
        val_data: Iterable[Any] | None = None,
        hooks: dict[str, Any] | None = None,
        sync: Sync | None = None,
        registries: Registries | None = None,
        progress: bool = True,
    ) -> None:
        if optimizer is not None and model is None:
            raise ConfigError("Trainer: an optimizer was given without its model; pass model= as well")
        self.config = config
        self.registries = resolve_registries(registries)
        self.sync = sync
        self.sync_ended: str | None = None  # why the sync ended the run early (StopTraining), if it did
        _seed_everything(config.run.seed)
        device = resolve_device(config.run.device)
        self.dist = init_distributed(device)
        self.device = self.dist.device(device)
        if config.distributed.enabled and sync is None and self.dist.is_main:
            raise ConfigError(
                "distributed.enabled is true, but plain training does not join a DiLoCo run: start this "
                "node with `speedtronic master CONFIG` or `speedtronic worker CONFIG --repo REPO`, or set "
                "distributed.enabled: false to train alone"
            )
        self.checkpoint_dir = Path(config.checkpoint_dir())
        resume = self._checkpoint_to_resume()

        facts = data_facts(config) if train_data is None else DataFacts(synthetic_vocab_size(config))
        self.plan: RunPlan = plan_run(
            config,
            world_size=self.dist.world_size,
            data=facts,
            device=device_facts(self.device),
            start_step=resume.step if resume is not None else 0,
        )
        self.precision = precision_for_run(self.plan, self.device)
        if self.plan.deterministic:
            make_deterministic(self.device)
        for warning in self.plan.warnings:
            logger.warning(warning)

        self.data_bundle: Any = None
        if train_data is None:
            train_data = self._build_data()
        self._val_source = val_data
        self._val_cache: list[Any] | None = None

        built = model is None
        model = instantiate_model(self.plan.model_config(config.model), self.registries) if built else model
        self.raw_model: nn.Module = model.to(self.device, dtype=self.precision.param_dtype)
        if self.dist.is_main and built:
            shapes.warn_at_startup(
                config, self.raw_model, self.device, self.precision, facts.vocab_size, self.registries
            )
        streams.maybe_enable(self.raw_model, config, self.device, self.plan.gradient_checkpointing)
        self.pass_labels = accepts_labels(self.raw_model)
        # fsdp: shard the model before the optimizer is built over its (now sharded) parameters.
        self.fsdp = self.plan.strategy == "fsdp" and self.dist.enabled
        if self.fsdp:
            self._shard_model(optimizer, resume)
        self._user_optimizer = optimizer is not None
        self.optimizer = (
            optimizer if optimizer is not None else build_optimizer(config, self.raw_model, self.registries)
        )
        self.scheduler = scheduler if scheduler is not None else build_scheduler(self.optimizer, self.plan)
        self.scaler = self.precision.grad_scaler()
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self._grad_bytes: int | None = None  # gradient bytes on this rank at the optimizer step
        self._ddp: Any = (
            wrap_ddp(self.raw_model, self.device) if self.dist.enabled and not self.fsdp else None
        )
        self._eager_model: nn.Module = self._ddp or self.raw_model
        self.model: nn.Module = self._eager_model

        self.counters = TrainCounters()
        self.data: Stateful = (
            train_data if hasattr(train_data, "state_dict") else IterablePosition(train_data, self.counters)
        )
        self.parts: dict[str, Stateful] = {
            "model": self.raw_model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            **({"grad_scaler": self.scaler} if self.scaler is not None else {}),
            "data": self.data,
            "rng": RngState(),
            "counters": self.counters,
            **({"sync": sync} if sync is not None else {}),
        }
        self.last_loss: float | None = None
        self.last_val: tuple[float, float] | None = None
        self.best_val_loss: float | None = None
        self.time_split = {"eval": 0.0, "checkpoint": 0.0}
        self.resumed_from: str | None = None
        self.resume_changes: list[str] = []  # optimizer settings the config changed on resume
        self.last_checkpoint: str | None = None
        self.compiled = False
        self.compile_s: float | None = None
        self.compile_failure: str | None = None
        self._data_iter: Any = None
        self._step_batches: list[Any] | None = None  # this step's batches, kept while compiled
        self._replay: deque[Any] = deque()
        # The first step (in this process) whose loss was not finite, 0 if none: kept on the device so
        # that no step waits on the host for it; read before every save (never a NaN checkpoint).
        self._first_bad_step = torch.zeros((), dtype=torch.long, device=self.device)

        # Hooks, progress and files belong to rank 0; the other ranks train silently.
        self.events = EventBus(
            build_hooks(config.logging.hooks, config, self.registries) if self.dist.is_main else {}
        )
        for name, hook in (hooks or {}).items() if self.dist.is_main else ():
            self.events.add(name, hook)
        self._progress = progress and self.dist.is_main
        if resume is not None:
            self.load_checkpoint(resume)
        if config.model.init_from and self.resumed_from is None and not self.fsdp:
            from speedtronic.interop.hf_import import init_from_pretrained  # continued pretraining

            init_from_pretrained(self.raw_model, config.model.init_from)

    # -- convenience views of the counters ------------------------------------------------------
    @property
    def step(self) -> int:
        return self.counters.step

    @property
    def tokens_seen(self) -> int:
        return self.counters.tokens_seen

    @property
    def accum(self) -> int:
        return self.plan.accum_steps

    # -- set-up ---------------------------------------------------------------------------------
    def _shard_model(self, optimizer: Any, resume: RunCheckpoint | None) -> None:
        """FSDP: every rank starts from rank 0's weights (or the pretrained ones), then shards them."""
        from speedtronic.engine.fsdp import apply_fsdp

        if optimizer is not None:
            raise ConfigError(
                "distributed.strategy fsdp: an optimizer given to the Trainer was built over the unsharded "
                "parameters; pass the model alone (the optimizer is built after sharding)"
            )
        if self.config.ooo_backprop:
            raise ConfigError("ooo_backprop does not compose with distributed.strategy fsdp; turn one off")
        if self.config.model.init_from and resume is None:
            from speedtronic.interop.hf_import import init_from_pretrained

            init_from_pretrained(self.raw_model, self.config.model.init_from)
        self.dist.broadcast_module(self.raw_model)
        # A sync (DiLoCo) works on whole weights: rank 0 hands it an unsharded mirror (engine/fsdp_sync.py).
        if self.dist.any(self.sync is not None, self.device):
            from speedtronic.engine.fsdp_sync import GatheredSync, make_mirror

            mirror = make_mirror(self.raw_model) if self.dist.is_main else None
            self.sync = GatheredSync(self.sync, mirror, self.device)  # on every rank
        apply_fsdp(self.raw_model, self.plan, self.device)

    def _checkpoint_to_resume(self) -> RunCheckpoint | None:
        setting = self.config.checkpoint.resume
        directory = self.checkpoint_dir
        latest = ckpt_files.latest_checkpoint(directory) if directory.exists() else None
        if latest is None:
            if setting is True:
                raise ConfigError(
                    f"checkpoint.resume: no checkpoint in {directory} to resume from; "
                    "run without --resume to start fresh"
                )
            return None
        if not self.config.checkpoint.enabled and setting is not True:
            return None  # this run writes no checkpoints, so it can neither overwrite nor auto-resume
        if setting is False:
            raise ConfigError(
                f"checkpoint.directory {directory} already holds {latest.name}; starting fresh would "
                "overwrite it. Resume with --resume, or pick another --set checkpoint.directory=… (or run.name)"
            )
        return read_checkpoint(latest, consolidate=False)  # shards are loaded in this run's own layout

    def _build_data(self) -> Any:
        from speedtronic.engine.data import build_data

        data = self.config.data
        resolved = data.model_copy(
            update={
                "seed": self.plan.data_seed,
                "vocab_size": self.plan.data_vocab_size if data.synthetic else data.vocab_size,
            }
        )
        self.data_bundle = build_data(
            resolved, device_type=self.device.type, rank=self.dist.rank, world_size=self.dist.world_size
        )
        if self.data_bundle.vocab_size != self.plan.data_vocab_size:
            raise SpeedtronicError(  # the plan read the data's facts; the data must agree with them
                f"the data's vocabulary ({self.data_bundle.vocab_size}) differs from the plan's "
                f"({self.plan.data_vocab_size}); the tokenizer or dataset changed while starting"
            )
        return self.data_bundle.train

    # -- state ----------------------------------------------------------------------------------
    def checkpoint(self) -> RunCheckpoint:
        """This run's state now: the user config, the plan and every part's state_dict(). Under fsdp
        the model and optimizer are not in it (see `save`: they are written as shards), and the RNG
        part carries every rank's streams."""
        sharded = ("model", "optimizer") if self.plan.strategy == "fsdp" else ()
        parts = {name: part.state_dict() for name, part in self.parts.items() if name not in sharded}
        if sharded and self.dist.enabled:
            ranks: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(ranks, parts["rng"])
            parts["rng"] = {**parts["rng"], "ranks": ranks}
        return RunCheckpoint(
            step=self.step,
            config=dump_config(self.config),
            plan=self.plan.as_dict(),
            parts=parts,
            metrics={"loss": self.last_loss, "val_loss": self.last_val[0] if self.last_val else None},
        )

    def load_checkpoint(self, checkpoint: RunCheckpoint) -> None:
        """Restore every part from `checkpoint` (the model strictly; a part the run does not have, such
        as a grad scaler under another precision, is skipped)."""
        source = checkpoint.path or "checkpoint"
        fresh = hyperparameters.settings(self.optimizer, self.scheduler)  # the config's, before loading
        done: tuple[str, ...] = ()
        if checkpoint.sharded is not None:
            sharded_state.load_sharded(self.raw_model, self.optimizer, checkpoint, self.dist.enabled)
            done = ("model", "optimizer")
        elif self.fsdp:
            sharded_state.load_whole_into_shards(self.raw_model, self.optimizer, checkpoint)
            done = ("model", "optimizer")
        for name, part in self.parts.items():
            if name in done:
                continue
            state = checkpoint.part(name)
            if name == "rng" and isinstance(state, dict) and state.get("ranks"):
                ranks = state["ranks"]  # this rank's own streams where the saving run had this rank
                state = ranks[self.dist.rank] if self.dist.rank < len(ranks) else ranks[0]
            if state is None:
                if name in ("model", "optimizer", "scheduler", "rng", "counters"):
                    raise CheckpointError(f"{source} has no {name} state; resume from another step_*.pt")
                continue
            if name == "model":
                load_weights(part, state, source)  # type: ignore[arg-type]
                continue
            try:
                part.load_state_dict(state)
            except (ValueError, KeyError, TypeError, RuntimeError) as error:
                raise CheckpointError(
                    f"{source}: the {name} state does not fit this run ({type(error).__name__}: {error}); "
                    f"use the {name} it was trained with, or another checkpoint.directory"
                ) from None
        self.resume_changes = hyperparameters.reapply(self.optimizer, self.scheduler, fresh)
        self._data_iter = None
        self.last_loss = checkpoint.metrics.get("loss")
        self.resumed_from = str(source)
        logger.info("resumed from %s at step %d (%s tokens seen)", source, self.step, f"{self.tokens_seen:,}")

    # -- data -----------------------------------------------------------------------------------
    def _next_batch(self) -> Any:
        if self._replay:  # the batches of a compiled step that failed, given again to the eager retry
            batch = self._replay.popleft()
        else:
            if self._data_iter is None:
                self._data_iter = iter(self.data)  # type: ignore[call-overload]
            try:
                batch = next(self._data_iter)
            except StopIteration:  # a finite user iterable: start its next epoch
                self._data_iter = (
                    self.data.restart() if isinstance(self.data, IterablePosition) else iter(self.data)  # type: ignore[call-overload]
                )
                try:
                    batch = next(self._data_iter)
                except StopIteration:
                    raise SpeedtronicError("the training data yielded no batches") from None
        self.counters.batches_consumed += 1
        if self._step_batches is not None:
            self._step_batches.append(batch)
        return batch

    def val_batches(self) -> list[Any]:
        if self._val_cache is None:
            if self._val_source is not None:
                self._val_cache = list(self._val_source)
            elif self.data_bundle is not None:
                self._val_cache = list(self.data_bundle.val_batches())
            else:
                self._val_cache = []
        return self._val_cache

    # -- the loop -------------------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One optimizer step over the plan's accumulation: (mean loss, grad norm, tokens)."""
        ensure_train_mode(self.model)  # model.train(), without walking every module each step
        accum = self.plan.accum_steps
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        tokens = 0
        non_blocking = self.device.type == "cuda"
        for micro in range(accum):
            batch = move_batch(self._next_batch(), self.device, non_blocking)
            tokens += split_batch(batch)[0]["input_ids"].numel()
            # DDP averages (FSDP reduce-scatters) gradients only on the last micro-batch of the step.
            skip_sync = self._ddp is not None and micro < accum - 1
            if self.fsdp:
                self.raw_model.set_requires_gradient_sync(micro == accum - 1)  # type: ignore[operator]
            with self._ddp.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[union-attr]
                with self.precision.autocast():
                    loss = forward_loss(self.model, batch, self.pass_labels)
                loss_sum += loss.detach().float()
                scaled = loss / accum  # so the summed gradients are those of the mean loss
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.config.optimizer.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip) if clip else None
        if grad_norm is not None and self.fsdp:
            grad_norm = fsdp.full(grad_norm)  # the norm over every rank's shards
        if self._grad_bytes is None:
            self._grad_bytes = fsdp.grad_bytes(self.params)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.counters.step += 1
        self._note_finite(loss_sum)
        tokens *= self.dist.world_size  # every rank ran as many tokens
        self.counters.tokens_seen += tokens
        return loss_sum / accum, grad_norm, tokens

    @_timed("eval")
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float] | None:
        """Mean validation loss and perplexity, or None when there is no validation data."""
        batches = self.val_batches()
        if not batches:
            return None
        # Through the eager module, also when training is compiled: a compiled forward under no_grad
        # and eval() is another graph to compile (tens of seconds on a CPU), which the few eval batches
        # never earn back (engine/compile_plan.py); nor can it fail the run mid-eval.
        model = self._eager_model
        model.eval()
        total = torch.zeros((), device=self.device)
        mine = batches[self.dist.rank :: self.dist.world_size]  # each rank scores its share
        for batch in mine:
            with self.precision.autocast():
                total += forward_loss(model, move_batch(batch, self.device), self.pass_labels).float()
        if self.fsdp:  # every rank must run as many forwards (each gathers parameters collectively)
            for _ in range(-(-len(batches) // self.dist.world_size) - len(mine)):
                with self.precision.autocast():
                    forward_loss(model, move_batch(batches[0], self.device), self.pass_labels)
        model.train()
        val_loss = (self.dist.all_sum(total) / len(batches)).item()
        self.last_val = (val_loss, math.exp(min(val_loss, 50.0)))
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)
        self.events.emit("eval", {"step": self.step, "val_loss": val_loss, "val_ppl": self.last_val[1]})
        return self.last_val

    def _note_finite(self, loss: torch.Tensor) -> None:
        """Remember this step if its loss is the first non-finite one (on the device: no host sync)."""
        first = self._first_bad_step
        self._first_bad_step = torch.where((first == 0) & ~torch.isfinite(loss), self.step, first)

    def check_finite(self) -> None:
        """Refuse to go on (exit 1) when a loss since the start of this process, or a parameter now, is
        not finite: one host sync, before each save, so `latest` stays on the last finite checkpoint."""
        first_bad = int(self._first_bad_step.item())
        finite_params = not self.params or bool(
            torch.stack([fsdp.local(p).detach().isfinite().all() for p in self.params]).all().item()
        )
        if not self.dist.any(first_bad > 0 or not finite_params, self.device):
            return
        what = f"the loss became non-finite at step {first_bad}" if first_bad else "parameters are non-finite"
        raise SpeedtronicError(
            f"{what} (found before saving step {self.step}); nothing was saved, the last checkpoint is "
            "untouched. Lower optimizer.lr, enable optimizer.grad_clip, or use precision.mode fp32"
        )

    @_timed("checkpoint")
    def save(self) -> Path | None:
        self.check_finite()
        if self.plan.strategy == "fsdp":  # every rank writes its shards (also alone: same layout)
            path = write_sharded_checkpoint(
                self.checkpoint_dir,
                self.checkpoint(),
                sharded_state.shards(self.raw_model, self.optimizer),
                self.config.checkpoint.keep_last,
                aliases=tied_names(self.raw_model),
            )
            if path is None:
                return None
        elif not self.dist.is_main:
            return None
        else:
            path = write_checkpoint(self.checkpoint_dir, self.checkpoint(), self.config.checkpoint.keep_last)
        self.last_checkpoint = str(path)
        self.events.emit("checkpoint", {"step": self.step, "path": str(path)})
        return path

    def train(self, max_steps: int | None = None) -> TrainResult:
        """Train to the plan's stop step; `max_steps=N` stops after step N of the run instead (it may
        not go past the run's end: run.max_steps)."""
        if max_steps is not None:
            self.plan = replan(self.plan, self.config, stop_step=max_steps)
        plan, stop = self.plan, self.plan.stop_step
        self._start()
        peak = peak_flops(self.device)
        fpt = flops_per_token(self.raw_model, plan.block_size)
        meter = Throughput()
        started = time.perf_counter()
        interrupted = False
        self.events.emit(
            "train_start",
            {
                "step": self.step,
                "max_steps": stop,
                "summary": self.summary_lines(),
                "plan": plan.as_dict(),
                "compiling": self.compiled,  # the first step compiles: the progress bar says so
                "config": dump_config(self.config),  # redacted; `speedtronic runs` reads it back
            },
        )
        try:
            with GracefulStop() as stop_signal:
                meter.resume()
                saved_at = self.step if self.resumed_from else -1
                # The logged loss is the mean over the logging interval, summed on the device (no sync).
                interval_loss: torch.Tensor | None = None
                interval_steps = 0
                while self.step < stop:
                    loss, grad_norm, _ = self._step(meter)
                    self._after_step()
                    self.events.emit("step_end", {"step": self.step})  # no device value: no host sync
                    interval_loss = loss if interval_loss is None else interval_loss + loss
                    interval_steps += 1
                    last = self.step == stop or self.sync_ended is not None
                    stopping = self.dist.any(stop_signal.requested, self.device)  # all ranks stop together
                    if self.step % plan.log_every == 0 or last or stopping:
                        mean = interval_loss if interval_steps == 1 else interval_loss / interval_steps
                        self._log_step(mean, grad_norm, meter, fpt, peak)
                        interval_loss, interval_steps = None, 0
                    meter.pause()
                    if plan.eval_every and self.step % plan.eval_every == 0 and not last:
                        self.evaluate()
                    every = plan.checkpoint_every
                    if every and not last and (self.step % every == 0 or stopping):
                        self.save()
                        saved_at = self.step
                    meter.resume()
                    if self.sync_ended is not None and not stopping:
                        logger.info("the run ends at step %d: %s", self.step, self.sync_ended)
                        break
                    if stopping:
                        interrupted = True
                        logger.warning(
                            "stopping at step %d on %s (%s)",
                            self.step,
                            stop_signal.signal_name or "a signal on another rank",
                            "checkpoint saved" if every else "checkpoints are disabled: nothing saved",
                        )
                        break
                meter.pause()
                if not interrupted:
                    self.evaluate()  # the final val loss, also stored in the final checkpoint
                    if plan.checkpoint_every and saved_at != self.step and self.step > 0:
                        self.save()
                # Every rank is done with its collectives (the last save's gathers included) before
                # any rank tears the process group down: gloo aborts a process whose peer left early.
                self.dist.barrier()
        finally:
            if self.sync is not None:
                self.sync.close()
            result = self._result(time.perf_counter() - started, meter, interrupted)
            self.events.emit("train_end", result.as_dict())
            self.events.close()
            if self.dist.enabled:
                close_distributed()
        return result

    def _start(self) -> None:
        """What happens once the step range is final: the sync joins, ranks agree on the weights, the
        model is compiled (or not, as the plan says), and the progress display learns its total."""
        # Under DDP rank 0 alone has a sync and the others take its weights; under fsdp every rank has
        # one (engine/fsdp_sync.py), which gathers and scatters the weights collectively.
        if self.sync is not None:
            self.sync.attach(
                self.raw_model, step=self.step, tokens=self.tokens_seen, final_step=self.plan.stop_step
            )
        if self.dist.enabled and not self.fsdp:  # fsdp: the ranks agreed before sharding
            self.dist.broadcast_module(self.raw_model)
        if self.plan.compile and not self.compiled:
            compiled = compile_model(self._eager_model, self.config.compile)
            if compiled is not None:
                self.model, self.compiled = compiled, True
            else:
                self.compile_failure = "torch.compile failed: trained eagerly"
        if self._progress:
            from speedtronic.engine.progress import ProgressReporter

            self.events.add("progress", ProgressReporter(self.plan.stop_step))
            self._progress = False

    def _after_step(self) -> None:
        """Let the sync (DiLoCo) act after a step. Under DDP only rank 0 has one: when it installs new
        global weights, rank 0 broadcasts them so every rank trains the same model; the optimizer's
        state is cleared on every rank when the plan says so."""
        installed = ended = False
        if self.sync is not None:
            try:
                installed = bool(
                    self.sync.after_step(self.raw_model, step=self.step, tokens=self.tokens_seen)
                )
            except StopTraining as stop:
                installed, ended, self.sync_ended = stop.installed, True, stop.reason
        if self.dist.enabled:
            installed = self.dist.any(installed, self.device)
            if self.dist.any(ended, self.device) and self.sync_ended is None:
                self.sync_ended = "the sync on rank 0 ended the run"
            if installed and not self.fsdp:  # fsdp: the sync scattered them itself
                self.dist.broadcast_module(self.raw_model)
        if installed and self.plan.reset_optimizer_on_sync:
            self.optimizer.state.clear()

    def _step(self, meter: Throughput) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One step; compiled steps are guarded so that a failing compilation falls back to eager."""
        if not self.compiled:
            result = self.train_step()
            meter.add(result[2])
            return result
        first = self.compile_s is None
        if first:  # timed on its own: compilation is reported as compile_s, not in the throughput
            meter.pause()
            started = time.perf_counter()
        result = self._guarded_compiled_step()
        if first:
            result[0].item()  # wait for the device, so the compile time is complete
            if self.compiled:
                self.compile_s = time.perf_counter() - started
                logger.info("torch.compile: first step took %.1f s (compilation included)", self.compile_s)
            meter.resume()
        else:
            meter.add(result[2])
        return result

    def _guarded_compiled_step(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        before = (self.counters.state_dict(), torch.get_rng_state())
        self._step_batches = []
        try:
            return self.train_step()
        except Exception as error:  # a compilation (or recompilation) failed inside the step
            step = before[0]["step"] + 1
            logger.warning(
                "torch.compile failed at step %d (%s: %s); continuing eagerly from that step",
                step,
                type(error).__name__,
                (str(error).splitlines() or [""])[0][:200],
            )
            self.model, self.compiled = self._eager_model, False
            self.compile_failure = f"torch.compile failed at step {step}: trained eagerly from there"
            # The optimizer has not stepped (it runs after every forward/backward): undo the step's
            # gradients, counters and RNG draws, and give the eager retry the very same batches.
            self.optimizer.zero_grad(set_to_none=True)
            self.counters.load_state_dict(before[0])
            torch.set_rng_state(before[1])
            self._replay.extend(self._step_batches)
            self._step_batches = None
            return self.train_step()
        finally:
            self._step_batches = None

    def _log_step(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        meter: Throughput,
        fpt: float,
        peak: float | None,
    ) -> None:
        loss_value = self.dist.all_mean(loss).item()  # the only host-device sync, on logging steps only
        if not math.isfinite(loss_value):
            raise SpeedtronicError(
                f"loss is {loss_value} at step {self.step}; lower optimizer.lr, enable optimizer.grad_clip, "
                "or use precision.mode fp32 (the last checkpoint is untouched)"
            )
        self.last_loss = loss_value
        tps, step_time = meter.take_window()
        payload: dict[str, Any] = {
            "step": self.step,
            "loss": loss_value,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm.item() if grad_norm is not None else None,
            "tokens_per_s": tps,
            "step_time_s": step_time,
            "tokens_seen": self.tokens_seen,
            "mfu": tps * fpt / peak if peak else None,
            **memory_stats(self.device),
        }
        self.events.emit("step", payload)

    def _compile_reason(self) -> str:
        return self.compile_failure or self.plan.compile_reason

    def _result(self, elapsed: float, meter: Throughput, interrupted: bool) -> TrainResult:
        held = fsdp.state_bytes(self.raw_model, self.optimizer, self._grad_bytes)
        return TrainResult(
            steps=self.step,
            tokens=self.tokens_seen,
            final_loss=self.last_loss,
            val_loss=self.last_val[0] if self.last_val else None,
            val_ppl=self.last_val[1] if self.last_val else None,
            elapsed_s=elapsed,
            tokens_per_s=meter.tokens_per_s,
            checkpoint=self.last_checkpoint,
            resumed_from=self.resumed_from,
            interrupted=interrupted,
            device=str(self.device),
            precision=self.precision.mode,
            parameters=sum(p.numel() for p in self.raw_model.parameters()),
            optimizer=type(self.optimizer).__name__ if self._user_optimizer else self.config.optimizer.name,
            compiled=self.compiled,
            optimizer_routes=optimizer_routes(self.optimizer),
            compile_s=self.compile_s,
            compile_reason=self._compile_reason(),
            plan=self.plan.as_dict(),
            best_val_loss=self.best_val_loss,
            time_split={"compile": self.compile_s or 0.0, "train": meter.total_time, **self.time_split},
            metrics_path=self.config.metrics_file() if "jsonl" in self.config.logging.hooks else None,
            strategy=self.plan.strategy if self.dist.enabled else "single",
            rank0_state_bytes=held["total"],
            state_bytes=held,
            peak_memory_bytes=peak_memory_bytes(self.device),
            peak_memory_kind="cuda allocated" if self.device.type == "cuda" else "process RSS",
        )

    def summary_lines(self) -> list[str]:
        plan, config = self.plan, self.config
        data = self.data_bundle.describe() if self.data_bundle is not None else "user-supplied data"
        compile_state = (
            self.compile_failure or f"torch.compile {'on' if plan.compile else 'off'} ({plan.compile_reason})"
        )
        routes = optimizer_routes(self.optimizer)
        return [
            f"device {describe_device(self.device)} · precision {self.precision.describe()}",
            f"model {config.model.name}: {sum(p.numel() for p in self.raw_model.parameters()):,} parameters"
            f" · vocab {plan.vocab_size:,} · {compile_state}",
            f"data {data}",
            f"batch {plan.micro_batch_size}×{plan.block_size} tokens × {plan.accum_steps} accumulation"
            + (f" × {plan.world_size} ranks ({plan.strategy.upper()})" if self.dist.enabled else "")
            + f" · optimizer {config.optimizer.name} lr {config.optimizer.lr:g}"
            f" · schedule {plan.schedule} over {plan.schedule_steps} steps (warmup {plan.warmup_steps})",
            *(
                [
                    f"optimizer routes: muon {routes['muon']:,} parameters · adamw {routes['adamw']:,} parameters"
                ]
                if routes
                else []
            ),
            *(
                ["deterministic: fp32, eager, deterministic algorithms, 1 thread"]
                if plan.deterministic
                else []
            ),
            f"{plan.describe_steps()} · checkpoints {self.checkpoint_dir}"
            + (f" (resumed at step {plan.start_step})" if self.resumed_from else ""),
        ]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
