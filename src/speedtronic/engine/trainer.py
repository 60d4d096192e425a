"""The training loop: accumulation, clipping, schedule, precision, evaluation, checkpoints and events.

    from speedtronic import load_config, train
    result = train(load_config("configs/smoke.yaml"))

The loop is architecture-neutral (any nn.Module from the registry, see batches.py for the return
conventions). It reads the loss from the device only on logging steps, so the GPU never waits on the
host in between. Resume is exact: model, optimizer, scheduler, grad scaler, RNG states and the data
position are all in the checkpoint, and a resumed run is bitwise identical to an uninterrupted one on
CPU. SIGINT/SIGTERM finish the current step, save a checkpoint and end the run as "interrupted".
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config, dump_config
from speedtronic.engine import checkpoint as ckpt
from speedtronic.engine import shapes, streams
from speedtronic.engine.batches import accepts_labels, forward_loss, move_batch, split_batch
from speedtronic.engine.build import build_model, build_optimizer, optimizer_routes
from speedtronic.engine.compile_plan import compile_model, plan_compile
from speedtronic.engine.device import describe_device, peak_flops, resolve_device
from speedtronic.engine.distributed import (
    close_distributed,
    init_distributed,
    per_rank_accumulation,
    wrap_ddp,
)
from speedtronic.engine.events import EventBus, build_hooks
from speedtronic.engine.metrics import Throughput, flops_per_token, memory_stats
from speedtronic.engine.precision import plan_precision
from speedtronic.engine.schedule import build_scheduler
from speedtronic.engine.signals import GracefulStop
from speedtronic.errors import CheckpointError, ConfigError, SpeedtronicError

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trainer:
    """One training run. Pass your own `model`, `train_data` (an iterable of batches) or `val_data`
    to override what the config would build; everything else comes from the config."""

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module | None = None,
        train_data: Iterable[Any] | None = None,
        val_data: Iterable[Any] | None = None,
        progress: bool = True,
        hooks: dict[str, Any] | None = None,
        coordinator: Any = None,
    ) -> None:
        self.config = config
        # Optional sync hook (DiLoCo): attach(trainer), after_step(trainer), state_dict(),
        # load_state_dict(state), close(). Its state rides in the checkpoint's "coordinator" slot.
        self.coordinator = coordinator
        _seed_everything(config.run.seed)
        self.dist = init_distributed(resolve_device(config.run.device))
        self.device = self.dist.device(resolve_device(config.run.device))
        # An unset target batch means one micro-batch per rank per step (the resolved config fills in
        # micro_batch_size, so ask whether the user set it).
        target = (
            config.data.target_batch_size if "target_batch_size" in config.data.model_fields_set else None
        )
        self.accum = per_rank_accumulation(target, config.data.micro_batch_size, self.dist.world_size)
        self.plan = plan_precision(config.precision.mode, config.precision.dtype, self.device)
        for warning in self.plan.warnings:
            logger.warning(warning)

        self.data_bundle: Any = None
        if train_data is None:
            from speedtronic.engine.data import build_data

            self.data_bundle = build_data(
                config.data,
                device_type=self.device.type,
                rank=self.dist.rank,
                world_size=self.dist.world_size,
            )
            train_data = self.data_bundle.train
            vocab_size = self.data_bundle.vocab_size
        else:
            vocab_size = config.model.vocab_size or config.data.vocab_size or 256
        self.train_data = train_data
        self._val_source = val_data
        self._val_cache: list[Any] | None = None

        self.raw_model = (model if model is not None else build_model(config, vocab_size)).to(
            self.device, dtype=self.plan.param_dtype
        )
        if self.dist.is_main:
            shapes.warn_at_startup(config, self.raw_model, self.device, self.plan, vocab_size)
        streams.maybe_enable(self.raw_model, config, self.device)
        self.model: nn.Module = self.raw_model
        self.pass_labels = accepts_labels(self.raw_model)
        self.optimizer = build_optimizer(config, self.raw_model)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler)
        self.scaler = self.plan.grad_scaler()
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self._ddp: Any = None
        if self.dist.enabled:
            self.model = self._ddp = wrap_ddp(self.raw_model, self.device)

        self.step = 0
        self.tokens_seen = 0
        self.batches_consumed = 0
        self.last_loss: float | None = None
        self.last_val: tuple[float, float] | None = None
        self.resumed_from: str | None = None
        self.checkpoint_dir = Path(config.checkpoint_dir())
        self.last_checkpoint: str | None = None
        self.compiled = False
        self.compile_s: float | None = None
        self._data_iter: Iterator[Any] | None = None
        self._skip_batches = 0
        self._compile_checked = False

        # Hooks, progress and files belong to rank 0; the other ranks train silently.
        self.events = EventBus(build_hooks(config.logging.hooks, config) if self.dist.is_main else {})
        for name, hook in (hooks or {}).items() if self.dist.is_main else ():
            self.events.add(name, hook)
        if progress and self.dist.is_main:
            from speedtronic.engine.progress import ProgressReporter

            self.events.add("progress", ProgressReporter(config.max_steps()))
        self._maybe_resume()
        if config.model.init_from and self.resumed_from is None:
            from speedtronic.interop.hf_import import init_from_pretrained  # continued pretraining

            init_from_pretrained(self.raw_model, config.model.init_from)
        if coordinator is not None:
            coordinator.attach(self)  # on rank 0 alone under DDP; the others take its weights
        if self.dist.enabled:
            self.dist.broadcast_module(self.raw_model)
        self._maybe_compile()

    # -- set-up ---------------------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        setting = self.config.checkpoint.resume
        latest = ckpt.latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir.exists() else None
        if latest is None:
            if setting is True:
                raise ConfigError(
                    f"checkpoint.resume: no checkpoint in {self.checkpoint_dir} to resume from; "
                    "run without --resume to start fresh"
                )
            return
        if not self.config.checkpoint.enabled and setting is not True:
            return  # this run writes no checkpoints, so it can neither overwrite nor auto-resume
        if setting is False:
            raise ConfigError(
                f"checkpoint.directory {self.checkpoint_dir} already holds {latest.name}; starting fresh would "
                "overwrite it. Resume with --resume, or pick another --set checkpoint.directory=… (or run.name)"
            )
        self.load_state(ckpt.load_checkpoint(latest, map_location="cpu"), source=latest)

    def _maybe_compile(self) -> None:
        # Decided after resuming: auto weighs the steps still to run against the cost of compiling.
        self.compile_plan = plan_compile(
            self.config, self.device, self.plan, steps_left=self.config.max_steps() - self.step
        )
        if not self.compile_plan.enabled:
            return
        compiled = compile_model(self.model, self.config.compile)
        if compiled is not None:
            self.model, self.compiled = compiled, True

    # -- state ----------------------------------------------------------------------------------
    def state_payload(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly (see engine/checkpoint.py for the layout)."""
        data_state = (
            self.train_data.state_dict()
            if hasattr(self.train_data, "state_dict")
            else {"batches_consumed": self.batches_consumed}
        )
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_name": self.config.optimizer.name,
            "scheduler": self.scheduler.state_dict(),
            "scheduler_name": self.config.scheduler.name,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "batches_consumed": self.batches_consumed,
            "rng": {
                "python": ckpt.pack_python_rng(random.getstate()),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            "data_state": data_state,
            "config": dump_config(self.config),
            "precision": self.plan.mode,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "coordinator": self.coordinator.state_dict() if self.coordinator is not None else None,
            "metrics": {"loss": self.last_loss, "val_loss": self.last_val[0] if self.last_val else None},
        }

    def load_state(self, payload: dict[str, Any], source: Path | str = "checkpoint") -> None:
        try:
            self.raw_model.load_state_dict(payload["model"])
        except RuntimeError as error:
            first = str(error).splitlines()[1:2] or [str(error)]
            raise CheckpointError(
                f"{source} does not match the configured model ({first[0].strip()}); use the config it was "
                "trained with, or another checkpoint.directory"
            ) from None
        try:
            self.optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError) as error:
            raise CheckpointError(
                f"{source}: optimizer state does not fit optimizer {self.config.optimizer.name!r} ({error})"
            ) from None
        self.scheduler.load_state_dict(payload["scheduler"])
        if self.scaler is not None and payload.get("grad_scaler"):
            self.scaler.load_state_dict(payload["grad_scaler"])
        self.step = int(payload["step"])
        self.tokens_seen = int(payload.get("tokens_seen", 0))
        self.batches_consumed = int(payload.get("batches_consumed", 0))
        metrics = payload.get("metrics") or {}
        self.last_loss = metrics.get("loss")
        rng = payload["rng"]
        random.setstate(ckpt.unpack_python_rng(rng["python"]))
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if self.coordinator is not None and payload.get("coordinator") is not None:
            self.coordinator.load_state_dict(payload["coordinator"])
        data_state = payload.get("data_state") or {}
        if hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(data_state)
        else:
            self._skip_batches = self.batches_consumed  # plain iterables: fast-forward on first use
        self.resumed_from = str(source)
        logger.info("resumed from %s at step %d (%s tokens seen)", source, self.step, f"{self.tokens_seen:,}")

    # -- data -----------------------------------------------------------------------------------
    def _next_batch(self) -> Any:
        if self._data_iter is None:
            self._data_iter = iter(self.train_data)
            for _ in range(self._skip_batches):
                next(self._data_iter)
            self._skip_batches = 0
        try:
            batch = next(self._data_iter)
        except StopIteration:  # a finite user iterable: start its next epoch
            self._data_iter = iter(self.train_data)
            try:
                batch = next(self._data_iter)
            except StopIteration:
                raise SpeedtronicError("the training data yielded no batches") from None
        self.batches_consumed += 1
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
        """One optimizer step over `grad_accum_steps` micro-batches: (mean loss, grad norm, tokens)."""
        self.model.train()
        accum = self.accum
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        tokens = 0
        non_blocking = self.device.type == "cuda"
        for micro in range(accum):
            batch = move_batch(self._next_batch(), self.device, non_blocking)
            tokens += split_batch(batch)[0]["input_ids"].numel()
            # DDP averages gradients over ranks only on the last micro-batch of the step.
            skip_sync = self._ddp is not None and micro < accum - 1
            with self._ddp.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[union-attr]
                with self.plan.autocast():
                    loss = forward_loss(self.model, batch, self.pass_labels)
                loss_sum += loss.detach().float()
                scaled = loss / accum  # so the summed gradients are those of the mean loss
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.config.optimizer.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip) if clip else None
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        tokens *= self.dist.world_size  # every rank ran as many tokens
        self.tokens_seen += tokens
        return loss_sum / accum, grad_norm, tokens

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float] | None:
        """Mean validation loss and perplexity, or None when there is no validation data."""
        batches = self.val_batches()
        if not batches:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.device)
        mine = batches[self.dist.rank :: self.dist.world_size]  # each rank scores its share
        for batch in mine:
            with self.plan.autocast():
                total += forward_loss(self.model, move_batch(batch, self.device), self.pass_labels).float()
        self.model.train()
        val_loss = (self.dist.all_sum(total) / len(batches)).item()
        self.last_val = (val_loss, math.exp(min(val_loss, 50.0)))
        self.events.emit("eval", {"step": self.step, "val_loss": val_loss, "val_ppl": self.last_val[1]})
        return self.last_val

    def save(self) -> Path | None:
        if not self.dist.is_main:
            return None
        path = ckpt.save_checkpoint(
            self.checkpoint_dir, self.step, self.state_payload(), keep_last=self.config.checkpoint.keep_last
        )
        self.last_checkpoint = str(path)
        self.events.emit("checkpoint", {"step": self.step, "path": str(path)})
        return path

    def train(self, max_steps: int | None = None) -> TrainResult:
        config = self.config
        total = max_steps or config.max_steps()
        log_every = config.logging.every_steps or config.run.log_every
        save_every = config.checkpoint.every_steps if config.checkpoint.enabled else 0
        eval_every = config.run.eval_every
        peak = peak_flops(self.device)
        fpt = flops_per_token(self.raw_model, config.data.block_size)
        meter = Throughput()
        started = time.perf_counter()
        interrupted = False
        self.events.emit(
            "train_start", {"step": self.step, "max_steps": total, "summary": self.summary_lines()}
        )
        try:
            with GracefulStop() as stop:
                meter.resume()
                saved_at = self.step if self.resumed_from else -1
                while self.step < total:
                    if self.compiled and not self._compile_checked:
                        loss, grad_norm, tokens = self._timed_compile_step(meter)
                    else:
                        loss, grad_norm, tokens = self._compiled_step()
                        meter.add(tokens)
                    self._sync_coordinator()
                    last = self.step == total
                    stopping = self.dist.any(stop.requested, self.device)  # all ranks stop together
                    if self.step % log_every == 0 or last or stopping:
                        self._log_step(loss, grad_norm, meter, fpt, peak)
                    meter.pause()
                    if eval_every and self.step % eval_every == 0 and not last:
                        self.evaluate()
                    if save_every and not last and (self.step % save_every == 0 or stopping):
                        self.save()
                        saved_at = self.step
                    meter.resume()
                    if stopping:
                        interrupted = True
                        logger.warning(
                            "stopping at step %d on %s (%s)",
                            self.step,
                            stop.signal_name or "a signal on another rank",
                            "checkpoint saved" if save_every else "checkpoints are disabled: nothing saved",
                        )
                        break
                meter.pause()
                if not interrupted:
                    self.evaluate()  # the final val loss, also stored in the final checkpoint
                    if config.checkpoint.enabled and saved_at != self.step and self.step > 0:
                        self.save()
        finally:
            if self.coordinator is not None:
                self.coordinator.close()
            result = self._result(time.perf_counter() - started, meter, interrupted)
            self.events.emit("train_end", result.as_dict())
            self.events.close()
            if self.dist.enabled:
                close_distributed()
        return result

    def _sync_coordinator(self) -> None:
        """Let the sync coordinator (DiLoCo) act after a step. Under DDP only rank 0 has one: when it
        installs new global weights, rank 0 broadcasts them so every rank trains the same model."""
        installed = False
        if self.coordinator is not None:
            before = getattr(self.coordinator, "installs", 0)
            self.coordinator.after_step(self)
            installed = getattr(self.coordinator, "installs", 0) != before
        if self.dist.enabled and self.dist.any(installed, self.device):
            self.dist.broadcast_module(self.raw_model)
            if self.config.distributed.reset_inner_optimizer:
                self.optimizer.state.clear()

    def _timed_compile_step(self, meter: Throughput) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The first compiled step, timed on its own: compilation is reported as `compile_s`, and kept
        out of the throughput, which then measures the steady state."""
        meter.pause()
        started = time.perf_counter()
        loss, grad_norm, tokens = self._compiled_step()
        loss.item()  # wait for the device, so the compile time is complete
        if self.compiled:
            self.compile_s = time.perf_counter() - started
            logger.info("torch.compile: first step took %.1f s (compilation included)", self.compile_s)
        meter.resume()
        return loss, grad_norm, tokens

    def _compiled_step(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        if not self.compiled or self._compile_checked:
            return self.train_step()
        self._compile_checked = True
        state = self._pre_step_state()
        try:
            return self.train_step()
        except Exception as error:  # compilation happens on the first call: fall back, retry the step
            logger.warning(
                "torch.compile failed on the first step (%s: %s); training eagerly",
                type(error).__name__,
                str(error).splitlines()[0][:200],
            )
            self.model, self.compiled = self.raw_model, False
            self._restore_pre_step_state(state)
            return self.train_step()

    def _pre_step_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens_seen,
            "batches": self.batches_consumed,
            "data": self.train_data.state_dict() if hasattr(self.train_data, "state_dict") else None,
            "rng": torch.get_rng_state(),
        }

    def _restore_pre_step_state(self, state: dict[str, Any]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.step, self.tokens_seen, self.batches_consumed = state["step"], state["tokens"], state["batches"]
        torch.set_rng_state(state["rng"])
        if state["data"] is not None:
            self.train_data.load_state_dict(state["data"])
            self._data_iter = None

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

    def _result(self, elapsed: float, meter: Throughput, interrupted: bool) -> TrainResult:
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
            precision=self.plan.mode,
            parameters=sum(p.numel() for p in self.raw_model.parameters()),
            optimizer=self.config.optimizer.name,
            compiled=self.compiled,
            optimizer_routes=optimizer_routes(self.optimizer),
            compile_s=self.compile_s,
            compile_reason=self.compile_plan.reason
            if self.compiled or not self.compile_plan.enabled
            else "torch.compile failed: trained eagerly",
        )

    def _compile_summary(self) -> str:
        if self.compile_plan.enabled and not self.compiled:
            return "torch.compile failed: eager"
        return self.compile_plan.describe()

    def summary_lines(self) -> list[str]:
        config = self.config
        data = self.data_bundle.describe() if self.data_bundle is not None else "user-supplied data"
        return [
            f"device {describe_device(self.device)} · precision {self.plan.describe()}",
            f"model {config.model.name}: {sum(p.numel() for p in self.raw_model.parameters()):,} parameters"
            + f" · {self._compile_summary()}",
            f"data {data}",
            f"batch {config.data.micro_batch_size}×{config.data.block_size} tokens × "
            f"{self.accum} accumulation"
            + (f" × {self.dist.world_size} ranks (DDP)" if self.dist.enabled else "")
            + f" · optimizer {config.optimizer.name} lr {config.optimizer.lr:g}"
            f" · schedule {config.scheduler.name} (warmup {config.scheduler.warmup_steps})",
            *self._route_line(),
            f"checkpoints {self.checkpoint_dir}"
            + (f" (resumed at step {self.step})" if self.resumed_from else ""),
        ]

    def _route_line(self) -> list[str]:
        routes = optimizer_routes(self.optimizer)
        if routes is None:
            return []
        return [
            f"optimizer routes: muon {routes['muon']:,} parameters · adamw {routes['adamw']:,} parameters"
        ]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def train(config: Config, **kwargs: Any) -> TrainResult:
    """Build a Trainer from `config` and run it to `config.max_steps()`."""
    return Trainer(config, **kwargs).train()
