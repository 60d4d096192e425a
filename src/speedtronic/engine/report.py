"""What a training run tells its user: the start-up summary lines and the final `TrainResult`.

`train --json` prints the result's `as_dict()`; the `train_start` event carries the summary lines
(the console shows them above the progress display).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from speedtronic.engine.device import describe_device
from speedtronic.engine.metrics import Throughput, peak_memory_bytes
from speedtronic.engine.optimizer import optimizer_routes
from speedtronic.engine.parallel import fsdp

if TYPE_CHECKING:
    from speedtronic.engine.built_run import Run
    from speedtronic.engine.compiled_step import CompiledStep
    from speedtronic.plan import RunPlan


class TrainerState(Protocol):
    """What the report reads of a Trainer (engine/trainer.py, which calls it): the run and its plan, the
    compiled step, and the loop's counters and last values."""

    run: Run
    plan: RunPlan
    compiled_step: CompiledStep
    grad_bytes: int | None
    last_loss: float | None
    last_val: tuple[float, float] | None
    best_val_loss: float | None
    resumed_from: str | None
    last_checkpoint: str | None
    time_split: dict[str, float]

    @property
    def step(self) -> int: ...

    @property
    def tokens_seen(self) -> int: ...


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
    # Nothing was trained this time: resumed at the stop step (all of run.max_steps, or --max-steps).
    complete: bool = False
    # data.sources: {name: {weight (normalised), tokens trained from it}}; None for one source.
    data_sources: dict[str, dict[str, float | int]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_result(trainer: TrainerState, elapsed: float, meter: Throughput, interrupted: bool) -> TrainResult:
    """The result of `trainer.train()` so far."""
    run, plan, step = trainer.run, trainer.plan, trainer.compiled_step
    held = fsdp.state_bytes(run.raw_model, run.optimizer, trainer.grad_bytes)
    config = run.config
    return TrainResult(
        steps=trainer.step,
        tokens=trainer.tokens_seen,
        final_loss=trainer.last_loss,
        val_loss=trainer.last_val[0] if trainer.last_val else None,
        val_ppl=trainer.last_val[1] if trainer.last_val else None,
        elapsed_s=elapsed,
        tokens_per_s=meter.tokens_per_s,
        checkpoint=trainer.last_checkpoint,
        resumed_from=trainer.resumed_from,
        interrupted=interrupted,
        device=str(run.device),
        precision=run.precision.mode,
        parameters=sum(p.numel() for p in run.raw_model.parameters()),
        optimizer=type(run.optimizer).__name__ if run.user_optimizer else config.optimizer.name,
        compiled=step.compiled,
        optimizer_routes=optimizer_routes(run.optimizer),
        compile_s=step.compile_s,
        compile_reason=step.reason(plan.compile_reason),
        plan=plan.as_dict(),
        best_val_loss=trainer.best_val_loss,
        time_split={"compile": step.compile_s or 0.0, "train": meter.total_time, **trainer.time_split},
        metrics_path=config.metrics_file() if "jsonl" in config.logging.hooks else None,
        strategy=plan.strategy if run.dist.enabled else "single",
        rank0_state_bytes=held["total"],
        state_bytes=held,
        peak_memory_bytes=peak_memory_bytes(run.device),
        peak_memory_kind="cuda allocated" if run.device.type == "cuda" else "process RSS",
        data_sources=_data_sources(run),
    )


def _data_sources(run: Run) -> dict[str, dict[str, float | int]] | None:
    """A data.sources mixture's weights and tokens trained per source (engine/data/mixture.py)."""
    bundle = run.data_bundle
    by_source = getattr(bundle.train, "tokens_by_source", None) if bundle is not None else None
    return by_source() if by_source is not None else None


def summary_lines(trainer: TrainerState) -> list[str]:
    """The start-up summary: device and precision, model, data, batch and optimizer, steps."""
    run, plan = trainer.run, trainer.plan
    config = run.config
    data = run.data_bundle.describe() if run.data_bundle is not None else "user-supplied data"
    compile_state = trainer.compiled_step.describe(plan.compile, plan.compile_reason)
    routes = optimizer_routes(run.optimizer)
    return [
        f"device {describe_device(run.device)} · precision {run.precision.describe()}",
        f"model {config.model.name}: {sum(p.numel() for p in run.raw_model.parameters()):,} parameters"
        f" · vocab {plan.vocab_size:,} · {compile_state}",
        f"data {data}",
        f"batch {plan.micro_batch_size}×{plan.block_size} tokens × {plan.accum_steps} accumulation"
        + (f" × {plan.world_size} ranks ({plan.strategy.upper()})" if run.dist.enabled else "")
        + f" · optimizer {config.optimizer.name} lr {config.optimizer.lr:g}"
        f" · schedule {plan.schedule} over {plan.schedule_steps} steps (warmup {plan.warmup_steps})",
        *(
            [f"optimizer routes: muon {routes['muon']:,} parameters · adamw {routes['adamw']:,} parameters"]
            if routes
            else []
        ),
        *(["deterministic: fp32, eager, deterministic algorithms, 1 thread"] if plan.deterministic else []),
        f"{plan.describe_steps()} · checkpoints {run.checkpoint_dir}"
        + (f" (resumed at step {plan.start_step})" if trainer.resumed_from else ""),
    ]
