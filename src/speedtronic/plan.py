"""The run plan: every value a run derives from its config, computed once by one pure function.

The user's `Config` is what they wrote; an unset (`None`) field means "derive it". `plan_run` turns
(config, world size, data facts, device facts, where the run starts and stops) into a frozen
`RunPlan`, and every consumer — the trainer, the progress bar, the compile decision, checkpoints,
`validate`, `sample`, `export` — reads the plan instead of re-deriving a value. Because the config is
never written back, `speedtronic validate`'s printed config, fed back verbatim, gives the same plan on
any number of ranks and under any `--set`.

The rules that live here and nowhere else:
- steps: the run is `run.max_steps` long (the one place the step count is set); `--max-steps N` stops
  this process after step N of it and may not go past its end;
- schedule: spans `run.max_steps`, the warm-up 5% of it (at most 1000) unless `scheduler.warmup_steps`;
- batch: the global batch (`data.target_batch_size`, default one micro-batch per rank) is a multiple
  of micro-batch × ranks; each rank accumulates global ÷ (micro × ranks) micro-batches;
- vocabulary: the data's vocabulary (tokenizer, prepared dataset or synthetic) is the floor; the
  model's is `model.vocab_size`, default the data's;
- precision (`precision.mode: auto`) and torch.compile (`compile.enabled: auto`) from the device;
- strategy: `distributed.strategy` (ddp or fsdp); fsdp gathers parameters in bf16 and reduces
  gradients in fp32 when the run is bf16 with fp32 master weights.

This module must not import torch: `validate` and `--help` stay fast, and the plan stays a pure
function of its inputs (the engine probes the device and hands the facts in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from speedtronic.config import Config
from speedtronic.config.models import BaseModelConfig
from speedtronic.errors import ConfigError

# A plan stored in a checkpoint carries this version; `RunPlan.from_dict` ignores unknown keys.
PLAN_VERSION = 1


@dataclass(frozen=True)
class DeviceFacts:
    """What the plan needs to know about the device: its kind and whether it runs bf16 natively."""

    name: str  # "cpu", "cuda:0", "mps"
    native_bf16: bool = False  # CUDA with bf16, or a CPU with AMX / AVX512-BF16
    memory_bytes: int | None = None  # RAM of the host (CPU) or of the GPU; None: not checked

    @property
    def type(self) -> str:
        return self.name.split(":")[0]


@dataclass(frozen=True)
class DataFacts:
    """What the plan needs to know about the data, read without loading it."""

    vocab_size: int  # the tokenizer's, the prepared dataset's or the synthetic stream's
    tokenizer: str | None = None  # the spec that rebuilds the tokenizer (None: the byte tokenizer)


@dataclass(frozen=True)
class RunPlan:
    """Everything derived about one run (one process of it), JSON-able and immutable."""

    # Steps: the run is `total_steps` long; this process trains steps start_step+1 … stop_step.
    total_steps: int
    start_step: int
    stop_step: int
    # The learning-rate schedule.
    schedule: str
    schedule_steps: int
    warmup_steps: int
    min_lr_ratio: float
    # Batches.
    world_size: int
    micro_batch_size: int
    block_size: int
    global_batch_size: int  # sequences per optimizer step over all ranks
    accum_steps: int  # micro-batches per optimizer step on one rank
    data_seed: int
    # Model and data.
    vocab_size: int  # the model's vocabulary
    data_vocab_size: int  # the data's (≤ vocab_size)
    tokenizer: str | None
    max_seq_len: int
    gradient_checkpointing: bool
    # Device, precision, compilation.
    device: str
    native_bf16: bool  # the device runs bf16 natively (CUDA with bf16, a CPU with AMX/AVX512-BF16)
    precision: str  # what runs: fp32 | bf16 | fp16
    param_dtype: str  # float32 | bfloat16
    autocast: str | None  # bf16 | fp16 | None
    grad_scaler: bool
    precision_reason: str
    compile: bool
    compile_reason: str
    # Intervals (0: never).
    log_every: int
    eval_every: int
    checkpoint_every: int
    # Synchronisation with other nodes (DiLoCo): reset the inner optimizer at each sync.
    reset_optimizer_on_sync: bool
    # How the ranks of this node share the model: "ddp" (replicated) or "fsdp" (sharded, FSDP2), and
    # for fsdp the dtype the sharded parameters are gathered in (the master copy stays float32), the
    # gradient reduction dtype, resharding after forward, and CPU offload.
    strategy: str = "ddp"
    fsdp_param_dtype: str | None = None
    fsdp_reduce_dtype: str | None = None
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    warnings: tuple[str, ...] = field(default=())
    # run.deterministic: fp32, eager, deterministic algorithms, one thread (engine/device.py)
    deterministic: bool = False
    version: int = PLAN_VERSION

    @property
    def steps_to_run(self) -> int:
        return max(0, self.stop_step - self.start_step)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.block_size

    def model_config(self, model: BaseModelConfig) -> BaseModelConfig:
        """The model section with the derived values filled in: what a model factory receives."""
        return model.model_copy(
            update={
                "vocab_size": self.vocab_size,
                "max_seq_len": self.max_seq_len,
                "gradient_checkpointing": self.gradient_checkpointing,
            }
        )

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["warnings"] = list(self.warnings)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunPlan:
        """A plan read back from a checkpoint (keys this version does not know are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["warnings"] = tuple(values.get("warnings") or ())
        try:
            return cls(**values)
        except TypeError as error:
            raise ConfigError(f"the stored run plan is incomplete ({error})") from None

    def describe_steps(self) -> str:
        if self.start_step >= self.total_steps:
            return f"complete at step {self.start_step} of {self.total_steps} (nothing to train)"
        if self.stop_step < self.total_steps:
            return f"steps {self.start_step + 1}…{self.stop_step} of {self.total_steps} (--max-steps)"
        return f"steps {self.start_step + 1}…{self.stop_step}"


# ------------------------------------------------------------------------------------------- rules


def _vocab_at_least(field_name: str, wanted: int | None, floor: int, floor_name: str) -> int:
    """`wanted` (a config field) where set — never below `floor`, the vocabulary it must cover."""
    if wanted is None:
        return floor
    if wanted < floor:
        raise ConfigError(
            f"{field_name} ({wanted}) is smaller than the {floor_name} vocabulary ({floor:,}); "
            f"raise it or leave it unset to use the {floor_name} size"
        )
    return wanted


def model_vocab_size(config: Config, data_vocab: int) -> int:
    """The model's vocabulary: `model.vocab_size`, at least the data's; default the data's."""
    return _vocab_at_least("model.vocab_size", config.model.vocab_size, data_vocab, "data's")


def synthetic_vocab_size(config: Config) -> int:
    """The vocabulary of `data.synthetic` tokens: data.vocab_size, else model.vocab_size, else 256."""
    return config.data.vocab_size or config.model.vocab_size or 256


def data_vocab_size(config: Config, tokenizer_vocab: int, what: str = "tokenizer's") -> int:
    """The data's vocabulary for real data: the tokenizer's, raised by `data.vocab_size` if set."""
    return _vocab_at_least("data.vocab_size", config.data.vocab_size, tokenizer_vocab, what)


def global_batch(config: Config, world_size: int) -> tuple[int, int]:
    """(sequences per optimizer step over all ranks, micro-batches per step on one rank)."""
    micro = config.data.micro_batch_size
    total = config.data.target_batch_size or micro * world_size
    if total % (micro * world_size):
        raise ConfigError(
            f"data.target_batch_size ({total}) must be a multiple of data.micro_batch_size × ranks "
            f"({micro} × {world_size}); change one of them or the number of processes"
        )
    return total, total // (micro * world_size)


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    param_dtype: str
    autocast: str | None
    grad_scaler: bool
    reason: str
    warnings: tuple[str, ...]


def choose_precision(mode: str, dtype: str, device: DeviceFacts) -> PrecisionChoice:
    """`precision.mode`/`precision.dtype` on this device (auto: bf16 only where it is native)."""
    warnings: list[str] = []
    kind = device.type
    bf16_ok = device.native_bf16 and kind in ("cuda", "cpu")
    bf16_possible = bf16_ok or kind in ("cpu", "mps")  # runs, if slowly, without native support
    if mode == "auto":
        if bf16_ok:
            chosen, reason = "bf16", "auto: device has native bf16"
        elif kind == "cuda":
            chosen, reason = "fp16", "auto: this GPU lacks bf16"
        else:
            chosen, reason = "fp32", f"auto: no native bf16 on {kind}"
    else:
        chosen, reason = mode, "requested"
        if mode == "bf16" and not bf16_possible:
            warnings.append(f"precision.mode bf16 is not supported on {device.name}; falling back to fp32")
            chosen, reason = "fp32", "bf16 unsupported here"
        elif mode == "fp16" and kind == "cpu":
            warnings.append("precision.mode fp16 autocast is not useful on CPU; falling back to fp32")
            chosen, reason = "fp32", "fp16 unsupported on cpu"
    param_dtype = "float32"
    if dtype == "bfloat16":
        if chosen == "fp16":
            warnings.append(
                "precision.dtype bfloat16 with fp16 autocast is not supported; keeping fp32 parameters"
            )
        else:
            param_dtype = "bfloat16"
    autocast = chosen if chosen in ("bf16", "fp16") else None
    if param_dtype == "bfloat16" and chosen == "bf16":
        autocast = None  # parameters already bf16: autocast adds only casts
    return PrecisionChoice(
        chosen, param_dtype, autocast, chosen == "fp16" and kind == "cuda", reason, tuple(warnings)
    )


def deterministic_precision(config: Config, chosen: PrecisionChoice) -> PrecisionChoice:
    """run.deterministic runs fp32: bf16 and fp16 kernels are not exact run to run on every device."""
    warnings = list(chosen.warnings)
    if config.precision.mode not in ("auto", "fp32") or config.precision.dtype != "float32":
        warnings.append(
            f"run.deterministic runs fp32: precision.mode {config.precision.mode} / precision.dtype "
            f"{config.precision.dtype} is ignored"
        )
    return PrecisionChoice("fp32", "float32", None, False, "run.deterministic: fp32", tuple(warnings))


def choose_compile(config: Config, device: DeviceFacts, precision: str, steps_left: int) -> tuple[bool, str]:
    """`compile.enabled` (true, false or auto) for this device, precision and the steps left to run.

    auto compiles where compilation was measured to pay for itself (engine/compile_plan.py has the
    figures): on CUDA, and on a CPU with native bf16 under bf16; never for fewer than
    `compile.auto_min_steps` steps left, nor with `ooo_backprop`, whose stream hooks compile traces away.
    """
    setting = config.compile.enabled
    if config.run.deterministic:
        return False, "run.deterministic: eager"
    if setting is True or setting is False:
        return setting, "requested"
    floor = config.compile.auto_min_steps
    if config.ooo_backprop:
        return False, "auto: ooo_backprop is on, and compile would bypass its stream hooks"
    if steps_left < floor:
        return False, f"auto: {steps_left} steps to run is under compile.auto_min_steps={floor}"
    if device.type == "cuda":
        return True, "auto: CUDA"
    if device.type == "cpu" and precision == "bf16" and device.native_bf16:
        return True, "auto: CPU with native bf16"
    if device.type == "cpu":
        return False, f"auto: {precision} on CPU gains too little to pay for compiling"
    return False, f"auto: not on {device.type}"


def choose_fsdp(config: Config, precision: PrecisionChoice) -> tuple[str | None, str | None]:
    """(gathered parameter dtype, gradient reduction dtype) of FSDP's mixed-precision policy.

    Under bf16 (chosen where the device has native bf16, or requested) the sharded float32 master
    parameters are gathered in bf16 for compute, and gradients are reduced in float32; otherwise
    FSDP computes in the parameters' own dtype (None: no policy)."""
    if config.distributed.strategy != "fsdp":
        return None, None
    if precision.precision == "bf16" and precision.param_dtype == "float32":
        return "bfloat16", "float32"
    return None, None


# The data fields a rough memory estimate depends on, each with the value that shrinks it; the model's
# own fields come from its config (`memory_fields`, reset to their defaults).
_DATA_SIZE_FIELDS = {"model.vocab_size": 256, "data.micro_batch_size": 8, "data.block_size": 256}


def estimate_memory(model: BaseModelConfig, vocab: int, micro_batch_size: int, block_size: int) -> int | None:
    """A lower bound on the bytes training `model` needs (its config's `estimate_memory`; None when
    the model gives none). A lower bound, so refusing on it is never wrong; it only has to tell a
    mistake (a d_model of 2^40) from a run, not predict the peak."""
    return model.estimate_memory(vocab, micro_batch_size * block_size)


def check_memory(config: Config, vocab: int, device: DeviceFacts) -> None:
    """Refuse (exit 2), before anything is allocated, a model that could not fit the device's memory by
    its config's rough estimate, naming the field that makes it so large."""
    model, data = config.model, config.data
    if not device.memory_bytes:
        return
    need = estimate_memory(model, vocab, data.micro_batch_size, data.block_size)
    if need is None or need <= device.memory_bytes:
        return
    values: dict[str, Any] = {
        "model.vocab_size": vocab,
        "data.micro_batch_size": data.micro_batch_size,
        "data.block_size": data.block_size,
    }
    trials: dict[str, int | None] = {}
    for name in model.memory_fields:
        values[f"model.{name}"] = getattr(model, name)
        default = type(model).model_fields[name].get_default(call_default_factory=True)
        trials[f"model.{name}"] = estimate_memory(
            model.model_copy(update={name: default}), vocab, data.micro_batch_size, data.block_size
        )
    for name, small in _DATA_SIZE_FIELDS.items():
        sizes = {**values, name: small}
        trials[name] = estimate_memory(
            model, sizes["model.vocab_size"], sizes["data.micro_batch_size"], sizes["data.block_size"]
        )
    # The culprit: the field whose default value shrinks the estimate the most.
    field_name = min(trials, key=lambda name: trials[name] if trials[name] is not None else need)
    raise ConfigError(
        f"{field_name}: {values[field_name]:,} makes this run need at least {_gib(need)} (weights, "
        f"gradients and activations, at their smallest), more than the {_gib(device.memory_bytes)} of "
        f"{device.name}; lower {field_name}"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_stop(config: Config, stop_step: int) -> None:
    """`--max-steps N` stops within the run; past its end the schedule has nothing left to give."""
    total = config.max_steps()
    if stop_step > total:
        raise ConfigError(
            f"--max-steps {stop_step} is past the end of the run: run.max_steps is {total}. "
            f"Lengthen the run with --set run.max_steps={stop_step} (the schedule follows it), or stop earlier"
        )


# -------------------------------------------------------------------------------------------- plan


def plan_run(
    config: Config,
    *,
    world_size: int = 1,
    data: DataFacts,
    device: DeviceFacts,
    start_step: int = 0,
    stop_step: int | None = None,
) -> RunPlan:
    """The plan of a run of `config` on `world_size` ranks of `device` over `data`, resuming after
    `start_step` and stopping after `stop_step` (default: the end of the run). Raises ConfigError
    (exit 2) naming the field when the combination cannot run."""
    total = config.max_steps()
    if stop_step is not None:
        check_stop(config, stop_step)
    stop = total if stop_step is None else stop_step
    scheduler = config.scheduler
    schedule_steps = total
    warmup, warmup_warnings = choose_warmup(scheduler.warmup_steps, schedule_steps)
    global_size, accum = global_batch(config, world_size)
    vocab = model_vocab_size(config, data.vocab_size)
    if device.memory_bytes:
        check_memory(config, vocab, device)
    precision = choose_precision(config.precision.mode, config.precision.dtype, device)
    if config.run.deterministic:
        precision = deterministic_precision(config, precision)
    compiled, compile_reason = choose_compile(config, device, precision.precision, max(0, stop - start_step))
    dist = config.distributed
    fsdp = choose_fsdp(config, precision)
    return RunPlan(
        total_steps=total,
        start_step=start_step,
        stop_step=stop,
        schedule=scheduler.name,
        schedule_steps=schedule_steps,
        warmup_steps=warmup,
        min_lr_ratio=scheduler.min_lr_ratio,
        world_size=world_size,
        micro_batch_size=config.data.micro_batch_size,
        block_size=config.data.block_size,
        global_batch_size=global_size,
        accum_steps=accum,
        data_seed=config.data.seed if config.data.seed is not None else config.run.seed,
        vocab_size=vocab,
        data_vocab_size=data.vocab_size,
        tokenizer=data.tokenizer,
        max_seq_len=config.model.max_seq_len or config.data.block_size,
        gradient_checkpointing=config.model.gradient_checkpointing or config.gradient_checkpointing,
        device=device.name,
        native_bf16=device.native_bf16,
        precision=precision.precision,
        param_dtype=precision.param_dtype,
        autocast=precision.autocast,
        grad_scaler=precision.grad_scaler,
        precision_reason=precision.reason,
        compile=compiled,
        compile_reason=compile_reason,
        log_every=config.logging.every_steps or config.run.log_every,
        eval_every=config.run.eval_every,
        checkpoint_every=config.checkpoint.every_steps if config.checkpoint.enabled else 0,
        strategy=dist.strategy,
        fsdp_param_dtype=fsdp[0],
        fsdp_reduce_dtype=fsdp[1],
        fsdp_reshard_after_forward=dist.fsdp.reshard_after_forward,
        fsdp_cpu_offload=dist.fsdp.cpu_offload and dist.strategy == "fsdp",
        reset_optimizer_on_sync=dist.sync.reset_inner_optimizer,
        warnings=(*precision.warnings, *warmup_warnings),
        deterministic=config.run.deterministic,
    )


def choose_warmup(warmup_steps: int | None, schedule_steps: int) -> tuple[int, tuple[str, ...]]:
    """The warm-up: `scheduler.warmup_steps`, default 5% of the run (at most 1000). A warm-up that is
    not shorter than the run (a shipped config's 50 steps under `--set run.max_steps=50`) would leave
    the LR rising to its last step and never decaying: it is clamped to the default, with a warning.
    Shorter warm-ups are kept exactly, so every existing run's schedule is unchanged; one over half the run
    is said (`--set run.max_steps=60` leaves 10 steps of decay)."""
    default = min(1000, schedule_steps // 20)
    if warmup_steps is None:
        return default, ()
    if warmup_steps == 0 or 2 * warmup_steps <= schedule_steps:
        return warmup_steps, ()
    if warmup_steps < schedule_steps:  # kept (the schedule is what was asked for), but said
        return warmup_steps, (
            f"scheduler.warmup_steps {warmup_steps} is {100 * warmup_steps // schedule_steps}% of "
            f"run.max_steps {schedule_steps}: the LR decays over the last {schedule_steps - warmup_steps} "
            "steps only; set scheduler.warmup_steps lower (e.g. 5% of the run) for a full decay",
        )
    return default, (
        f"scheduler.warmup_steps {warmup_steps} is not shorter than run.max_steps {schedule_steps}, so the "
        f"LR would never decay: warming up over {default} steps (5% of the run) instead; set "
        "scheduler.warmup_steps below run.max_steps to choose another",
    )


def replan(
    plan: RunPlan, config: Config, *, start_step: int | None = None, stop_step: int | None = None
) -> RunPlan:
    """The same run's plan with another start (a resume) or stop (`--max-steps`): the step range and
    the compile decision, which weighs the steps left to run, are derived again."""
    start = plan.start_step if start_step is None else start_step
    if stop_step is not None:
        check_stop(config, stop_step)
    stop = plan.stop_step if stop_step is None else stop_step
    device = DeviceFacts(plan.device, native_bf16=plan.native_bf16)
    compiled, reason = choose_compile(config, device, plan.precision, max(0, stop - start))
    return dataclasses.replace(
        plan, start_step=start, stop_step=stop, compile=compiled, compile_reason=reason
    )
