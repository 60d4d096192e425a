"""The training loop: accumulation, clipping, schedule, precision, evaluation, checkpoints and events.

    from speedtronic import Trainer, load_config
    result = Trainer(load_config("configs/smoke.yaml")).train()

The Trainer is the loop over a `Run` (engine/run.py), which `build_run` builds — every part, from
the run plan (speedtronic.plan: every derived value, computed once from the user's config, the number
of ranks, the data's vocabulary and the device) to the restored state of a resumed run.
`Trainer(config, model=…, optimizer=…, scheduler=…, train_data=…, val_data=…, hooks=…, sync=…)`
builds the run itself; `Trainer(build_run(config, …))` takes one built already. A checkpoint is
`{name: part.state_dict()}` over the run's stateful parts (engine/checkpoint/parts.py), so resume is exact.

The loop is architecture-neutral (any nn.Module, see batches.py for the return conventions). It reads
the loss from the device only on logging steps, so the GPU never waits on the host in between. The
model it calls is its one compile wrapper's (engine/compiled_step.py: a compiled step that fails is
retried eagerly, nothing is lost). SIGINT/SIGTERM finish the current step, save a checkpoint and end
the run as "interrupted".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config, dump_config
from speedtronic.engine.batches import batch_tokens, forward_loss, move_batch
from speedtronic.engine.checkpoint import parts as checkpoint_parts
from speedtronic.engine.checkpoint.layout import RunCheckpoint
from speedtronic.engine.checkpoint.stateful import IterablePosition
from speedtronic.engine.compiled_step import CompiledStep
from speedtronic.engine.device import peak_flops
from speedtronic.engine.metrics import Throughput, flops_per_token, memory_stats, reset_memory_peak
from speedtronic.engine.parallel import fsdp
from speedtronic.engine.parallel.distributed import close_distributed
from speedtronic.engine.report import TrainResult, summary_lines, train_result
from speedtronic.engine.run import Run, build_run
from speedtronic.engine.signals import GracefulStop
from speedtronic.engine.step_fn import FiniteWatch, ensure_train_mode
from speedtronic.engine.sync import Prefetching, StopTraining, Sync
from speedtronic.errors import ConfigError, SpeedtronicError
from speedtronic.plan import RunPlan, replan
from speedtronic.registry import Registries

__all__ = ["TrainResult", "Trainer"]

logger = logging.getLogger("speedtronic.train")


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


def _of_run(name: str) -> Any:
    """A read-only view of one part of the trainer's run."""
    return property(lambda self: getattr(self.run, name), doc=f"The run's {name} (engine/run.py).")


class Trainer:
    """The loop over one run. Give it a built `Run`, or a config and any parts (built as build_run does)."""

    def __init__(
        self,
        config: Config | Run,
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
        parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, train_data=train_data)
        parts.update(val_data=val_data, hooks=hooks, sync=sync)
        if isinstance(config, Run):
            given = [name for name, value in parts.items() if value is not None]
            if given or registries is not None:
                raise ConfigError(
                    f"Trainer(run): {', '.join(given) or 'registries'} given beside a built run; "
                    "pass them to build_run instead"
                )
            run = config
        else:
            run = build_run(config, registries, progress=progress, **parts)
        self.run = run
        self.plan: RunPlan = run.plan  # train(max_steps=N) replans the stop step
        self.params = run.params
        self.compiled_step = CompiledStep(run.model, run.config.compile, run.counters, run.optimizer)
        self.sync_ended: str | None = None  # why the sync ended the run early (StopTraining), if it did
        self.last_loss: float | None = run.resume.metrics.get("loss") if run.resume is not None else None
        self.last_val: tuple[float, float] | None = None
        self.best_val_loss: float | None = None
        self.resumed_from = str(run.resume.path or "checkpoint") if run.resume is not None else None
        self.last_checkpoint: str | None = None
        self.time_split = {"eval": 0.0, "checkpoint": 0.0}
        self.grad_bytes: int | None = None  # gradient bytes on this rank at the optimizer step
        self._progress = run.progress and progress  # Trainer(run, progress=False) turns it off too
        self._data_iter: Any = None
        self._val_cache: list[Any] | None = None
        # The first step (in this process) whose loss was not finite: kept on the device so that no
        # step waits on the host for it; read before every save (never a NaN checkpoint).
        self._finite = FiniteWatch(run.device)
        from speedtronic.engine.eval.during_training import TaskEval

        self.task_eval = TaskEval.for_run(run.config, run.plan)  # run.eval_tasks, or None

    # -- views of the run -----------------------------------------------------------------------
    config = _of_run("config")
    registries = _of_run("registries")
    precision = _of_run("precision")
    dist = _of_run("dist")
    device = _of_run("device")
    raw_model = _of_run("raw_model")
    optimizer = _of_run("optimizer")
    scheduler = _of_run("scheduler")
    scaler = _of_run("scaler")
    counters = _of_run("counters")
    data = _of_run("data")
    data_bundle = _of_run("data_bundle")
    events = _of_run("events")
    sync = _of_run("sync")
    parts = _of_run("parts")
    fsdp = _of_run("fsdp")
    pass_labels = _of_run("pass_labels")
    checkpoint_dir = _of_run("checkpoint_dir")
    resume_changes = _of_run("resume_changes")

    @property
    def model(self) -> nn.Module:
        """What the loop calls: the compiled model, or the eager one (the DDP wrap or the model)."""
        return self.compiled_step.model

    compiled = property(lambda self: self.compiled_step.compiled, doc="Whether the model is compiled.")
    compile_s = property(lambda self: self.compiled_step.compile_s, doc="The first compiled step's time.")

    @property
    def step(self) -> int:
        return self.run.counters.step

    @property
    def tokens_seen(self) -> int:
        return self.run.counters.tokens_seen

    @property
    def accum(self) -> int:
        return self.plan.accum_steps

    # -- state ----------------------------------------------------------------------------------
    def checkpoint(self) -> RunCheckpoint:
        """This run's state now: the user config, the plan and every part's state_dict()."""
        metrics = {"loss": self.last_loss, "val_loss": self.last_val[0] if self.last_val else None}
        return checkpoint_parts.capture(self.run, self.plan, metrics)

    # -- data -----------------------------------------------------------------------------------
    def _next_batch(self) -> Any:
        # A compiled step that failed gets its batches again for the eager retry (compiled_step.py).
        batch = self.compiled_step.take_batch(self._fetch_batch)
        self.counters.batches_consumed += 1
        return batch

    def _fetch_batch(self) -> Any:
        data = self.data
        if self._data_iter is None:
            self._data_iter = iter(data)
        try:
            return next(self._data_iter)
        except StopIteration:  # a finite user iterable: start its next epoch
            self._data_iter = data.restart() if isinstance(data, IterablePosition) else iter(data)
            try:
                return next(self._data_iter)
            except StopIteration:
                raise SpeedtronicError("the training data yielded no batches") from None

    def val_batches(self) -> list[Any]:
        if self._val_cache is None:
            if self.run.val_source is not None:
                self._val_cache = list(self.run.val_source)
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
        if accum == 1:  # the same numbers as the sum below, without its kernels (eager overhead)
            loss_sum, tokens = self._micro_step(0, 1)
            if loss_sum.is_cuda:  # a compiled model's loss may sit in a CUDA graph's buffer, which the
                loss_sum = loss_sum.clone()  # next step overwrites; it is kept longer than that
        else:
            loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
            tokens = 0
            for micro in range(accum):
                loss, micro_tokens = self._micro_step(micro, accum)
                loss_sum += loss
                tokens += micro_tokens
        grad_norm = self._optimizer_step()
        self.counters.step += 1
        self._finite.note(self.step, loss_sum)
        tokens *= self.dist.world_size  # every rank ran as many tokens
        self.counters.tokens_seen += tokens
        return (loss_sum if accum == 1 else loss_sum / accum), grad_norm, tokens

    def _micro_step(self, micro: int, accum: int) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch: (its loss, detached, in fp32; its tokens)."""
        device, ddp = self.device, self.run.ddp
        batch = move_batch(self._next_batch(), device, device.type == "cuda")
        tokens = batch_tokens(batch)
        # DDP averages (FSDP reduce-scatters) gradients only on the last micro-batch of the step.
        skip_sync = ddp is not None and micro < accum - 1
        if self.fsdp:
            self.raw_model.set_requires_gradient_sync(micro == accum - 1)  # type: ignore[operator]
        with ddp.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[union-attr]
            loss = self._forward(batch)
            # So that the summed gradients are those of the mean loss (x / 1 is x: skipped).
            scaled = loss if accum == 1 else loss / accum
            scaler = self.scaler
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        return loss.detach().float(), tokens

    def _optimizer_step(self) -> torch.Tensor | None:
        """Unscale, clip, step the optimizer and the schedule; the gradient norm (None: no clipping)."""
        scaler, optimizer = self.scaler, self.optimizer
        if scaler is not None:
            scaler.unscale_(optimizer)
        clip = self.config.optimizer.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip) if clip else None
        if grad_norm is not None and self.fsdp:
            grad_norm = fsdp.full(grad_norm)  # the norm over every rank's shards
        if self.grad_bytes is None:
            self.grad_bytes = fsdp.grad_bytes(self.params)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    @_timed("eval")
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float] | None:
        """Mean validation loss and perplexity, or None when there is no validation data."""
        batches = self.val_batches()
        tasks = self._score_tasks()
        if not batches:
            if tasks:
                self.events.emit("eval", {"step": self.step, **tasks})
            return None
        # Through the eager module, also when training is compiled: a compiled forward under no_grad
        # and eval() is another graph to compile (tens of seconds on a CPU), which the few eval batches
        # never earn back (engine/compile_plan.py); nor can it fail the run mid-eval.
        model = self.compiled_step.eager
        model.eval()
        by_source = self._source_val_batches()
        if by_source:  # data.sources: each source's loss, and their mean weighted as the mixture is
            losses = {name: self._mean_val_loss(model, b) for name, b in by_source.items() if b}
            weights = {name: self.data_bundle.weights[name] for name in losses}
            val_loss = sum(weights[name] * loss for name, loss in losses.items()) / sum(weights.values())
            tasks = {**{f"val_loss/{name}": loss for name, loss in losses.items()}, **tasks}
        else:
            val_loss = self._mean_val_loss(model, batches)
        model.train()
        self.last_val = (val_loss, math.exp(min(val_loss, 50.0)))
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)
        self.events.emit(
            "eval", {"step": self.step, "val_loss": val_loss, "val_ppl": self.last_val[1], **tasks}
        )
        return self.last_val

    def _mean_val_loss(self, model: nn.Module, batches: list[Any]) -> float:
        """The mean loss of `batches` over every rank (each rank scores its share)."""
        total = torch.zeros((), device=self.device)
        mine = batches[self.dist.rank :: self.dist.world_size]  # each rank scores its share
        for batch in mine:
            with self.precision.autocast():
                total += forward_loss(model, move_batch(batch, self.device), self.pass_labels).float()
        if self.fsdp:  # every rank must run as many forwards (each gathers parameters collectively)
            for _ in range(-(-len(batches) // self.dist.world_size) - len(mine)):
                with self.precision.autocast():
                    forward_loss(model, move_batch(batches[0], self.device), self.pass_labels)
        return (self.dist.all_sum(total) / len(batches)).item()

    def _source_val_batches(self) -> dict[str, list[Any]]:
        """A data.sources mixture's validation batches by source ({} for one source or the user's data)."""
        if self.run.val_source is not None or self.data_bundle is None:
            return {}
        return self.data_bundle.source_val_batches()

    def _score_tasks(self) -> dict[str, Any]:
        """run.eval_tasks' accuracies and CORE aggregate (engine/eval/during_training.py), {} without tasks."""
        if self.task_eval is None:
            return {}
        with self.precision.autocast():
            return self.task_eval.score(self.compiled_step.eager)

    def check_finite(self) -> None:
        """Refuse to go on (exit 1) when a loss since the start of this process, or a parameter now, is
        not finite: one host sync, before each save, so `latest` stays on the last finite checkpoint."""
        first_bad = int(self._finite.first_bad().item())
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
        if not checkpoint_parts.writes(self.run, self.plan):
            return None
        path = checkpoint_parts.write(self.run, self.plan, self.checkpoint())
        if path is None:
            return None
        self.last_checkpoint = str(path)
        self.events.emit("checkpoint", {"step": self.step, "path": str(path)})
        return path

    def train(self, max_steps: int | None = None) -> TrainResult:
        """Train to the plan's stop step; `max_steps=N` stops after step N of the run instead (it may
        not go past the run's end: run.max_steps)."""
        if max_steps is not None:
            self.plan = replan(self.plan, self.config, stop_step=max_steps)
        plan, stop = self.plan, self.plan.stop_step
        if self.resumed_from and self.sync is None and self.step >= stop:
            return self._already_complete()
        self._start()
        reset_memory_peak(self.device)
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
                # the first step compiles (not compiled ahead): the progress bar says so
                "compiling": self.compiled and self.compile_s is None,
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
                    loss, grad_norm, _ = self.compiled_step.run(self.train_step, meter)
                    self._after_step()
                    self.events.emit("step_end", {"step": self.step})  # no device value: no host sync
                    interval_loss = loss if interval_loss is None else interval_loss + loss
                    interval_steps += 1
                    last = self.step == stop or self.sync_ended is not None
                    stopping = self.dist.any(stop_signal.requested, self.device)  # all ranks stop together
                    # The first step of this process is logged too: a run piped to a file shows a line at
                    # step 1 instead of nothing until step log_every.
                    first = self.step == plan.start_step + 1
                    if self.step % plan.log_every == 0 or first or last or stopping:
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
            result = train_result(self, time.perf_counter() - started, meter, interrupted)
            self.events.emit("train_end", result.as_dict())
            self.events.close()
            if self.dist.enabled:
                close_distributed()
        return result

    def _already_complete(self) -> TrainResult:
        """A run resumed at its stop step (all of run.max_steps, or the --max-steps stop): nothing to
        train, evaluate or save (an evaluation would only repeat the stored one). Says so, and how to
        train further."""
        plan = self.plan
        if self.step < plan.total_steps:  # resumed at the --max-steps stop itself
            logger.info(
                "nothing to train: %s is at step %d, the --max-steps stop; pass a larger --max-steps (at "
                "most run.max_steps=%d), or none to train to the end of the run",
                self.resumed_from,
                self.step,
                plan.total_steps,
            )
        else:
            logger.info(
                "the run is complete: %s is at step %d of run.max_steps=%d; nothing to train. Extend it with "
                "--set run.max_steps=N (N > %d; the schedule is stretched to N), or give this config another "
                "run.name to start a new run",
                self.resumed_from,
                self.step,
                plan.total_steps,
                plan.total_steps,
            )
        result = dataclasses.replace(
            train_result(self, 0.0, Throughput(), False), checkpoint=self.resumed_from, complete=True
        )
        self.events.close()
        if self.dist.enabled:
            close_distributed()
        return result

    def _start(self) -> None:
        """What happens once the step range is final: the sync joins, ranks agree on the weights, the
        model is compiled (or not, as the plan says), and the progress display learns its total."""
        # Under DDP rank 0 alone has a sync and the others take its weights; under fsdp every rank has
        # one (engine/parallel/fsdp_sync.py), which gathers and scatters the weights collectively.
        self._compile_ahead()
        if self.sync is not None:
            self.sync.attach(
                self.raw_model, step=self.step, tokens=self.tokens_seen, final_step=self.plan.stop_step
            )
        if self.dist.enabled and not self.fsdp:  # fsdp: the ranks agreed before sharding
            self.dist.broadcast_module(self.raw_model)
        self.compiled_step.start(self.plan.compile)
        if self._progress:
            from speedtronic.engine.progress import ProgressReporter

            self.events.add("progress", ProgressReporter(self.plan.stop_step))
            self._progress = False

    def _compile_ahead(self) -> None:
        """A single process with a sync (a DiLoCo worker) compiles before `attach`, not in its first
        step: the global model downloads meanwhile (`Prefetching`), and a joiner's first delta is not
        held up by its compilation (in the 30-minute chaos soak, 2.7-5 s of a 2-s round on a CPU;
        minutes on a GPU for a large model). The steps and losses are those of a first-step compile."""
        sync = self.sync
        if sync is None or not self.plan.compile or self.dist.enabled or self.compile_s is not None:
            return
        if isinstance(sync, Prefetching):
            sync.prefetch(self.raw_model)
        self.compiled_step.start(True)
        self.compiled_step.warm(self._warm_pass, self._fetch_batch, self.device)

    def _forward(self, batch: Any) -> torch.Tensor:
        """The loss of a batch already on the device, through the model the loop calls, autocast."""
        with self.precision.autocast():
            return forward_loss(self.model, batch, self.pass_labels)

    def _warm_pass(self, batch: Any) -> torch.Tensor:
        """Forward and backward of `batch` as a step's micro-batch runs them (compiled_step.warm)."""
        ensure_train_mode(self.model)
        loss = self._forward(move_batch(batch, self.device, self.device.type == "cuda"))
        loss.backward()
        return loss.detach()

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
            **self._tokens_by_source(),
        }
        self.events.emit("step", payload)

    def _tokens_by_source(self) -> dict[str, int]:
        """A data.sources mixture's tokens trained from each source so far, as `tokens/<name>` ({} else)."""
        by_source = getattr(self.data, "tokens_by_source", None)
        if by_source is None or self.run.data_bundle is None:
            return {}
        return {f"tokens/{name}": int(entry["tokens"]) for name, entry in by_source().items()}

    def summary_lines(self) -> list[str]:
        return summary_lines(self)
