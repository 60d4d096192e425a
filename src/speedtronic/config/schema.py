"""The run configuration: one pydantic model per YAML section, and the rules that tie sections together.

One YAML file describes one run. Every section has defaults, so a five-line file is a valid run;
every model forbids unknown keys so a typo fails loudly (loading.py adds the did-you-mean hint).
`load_config` and `dump_config` live here, by the `Config` they make and take; the YAML pipeline they
run is config/loading.py, which never imports this module.
A config is what the user wrote and is immutable: an unset (None) field means "derive it", and the
derived values (schedule length, warm-up, context, accumulation, vocabulary, data seed, …) live in
the run plan (`speedtronic.plan`), computed once from the config and the facts of the run. Validators
here only check combinations of the user's own values; they never write a value back.

This module must not import torch: `speedtronic validate` and `--help` stay fast.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from speedtronic.config.data_sources import DataSource, check_sources
from speedtronic.config.distributed import DistributedConfig as DistributedConfig  # re-exported
from speedtronic.config.loading import load_root
from speedtronic.config.models import BaseModelConfig, resolve_model_section, validate_model_field
from speedtronic.config.models import ModelConfig as ModelConfig  # re-exported: the generic section
from speedtronic.config.optimizers import MuonPlusMode as MuonPlusMode  # re-exported
from speedtronic.config.optimizers import OptimizerConfig, validate_optimizer_field
from speedtronic.config.section import Section
from speedtronic.secrets import REDACTED

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
# A run name becomes runs/<name>: one path component, never `..` or a separator.
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# Seeds feed torch, numpy-style generators and per-node offsets (data.seed + crc32(node)): 32 bits keep
# every derived seed far inside the 64-bit integers those take (2**70 used to crash `train`).
MAX_SEED = 2**32 - 1


# Fields that were removed, by section: the step count lives in one place, run.max_steps. A config
# (or a checkpoint's stored config) that sets one gets an error naming the field to use; a stored
# `null` (what older versions dumped for "unset") is dropped silently.
REMOVED_FIELDS: dict[str, dict[str, str]] = {
    "data": {
        "max_steps": "data.max_steps was removed: the step count is set in one place, run.max_steps "
        "(use --max-steps N to stop this process early)",
    },
    "scheduler": {
        "max_steps": "scheduler.max_steps was removed: the schedule always spans run.max_steps, so "
        "set run.max_steps (and --max-steps N to stop early without changing the schedule)",
    },
}


def _drop_removed(section: str, values: Any) -> Any:
    removed = REMOVED_FIELDS.get(section, {})
    if not isinstance(values, dict) or not removed.keys() & values.keys():
        return values
    for key, message in removed.items():
        if values.get(key) is not None:
            raise ValueError(message)
    return {key: value for key, value in values.items() if key not in removed}


class RunConfig(Section):
    name: str = Field(
        "speedtronic",
        min_length=1,
        max_length=128,
        pattern=RUN_NAME_PATTERN,
        description="Run name; the default output directory is runs/<name>. Letters, digits, '.', '_' "
        "and '-', starting with a letter or digit (a name is a directory, never a path).",
    )
    seed: int = Field(
        1337,
        ge=0,
        le=MAX_SEED,
        description="Seeds Python, torch and (unless data.seed is set) the data order; 0 to 2**32-1.",
    )
    device: str = Field(
        "auto", description="auto | cpu | cuda | cuda:N | mps. auto picks CUDA, then MPS, then CPU."
    )
    max_steps: int = Field(1000, gt=0, description="Optimizer steps to train for.")
    output_dir: str | None = Field(
        None, description="Where checkpoints and metrics go (default runs/<name>)."
    )
    log_every: int = Field(10, gt=0, description="Log a line every N steps.")
    eval_every: int = Field(
        200, ge=0, description="Evaluate on the validation split every N steps (0: only at the end)."
    )
    eval_tasks: list[str] = Field(
        default_factory=list,
        description="Task files, suites or shipped task names (as `speedtronic eval --task` takes) "
        "scored at every evaluation; accuracies and their CORE aggregate go to metrics.jsonl.",
    )
    deterministic: bool = Field(
        False,
        description="Bitwise-reproducible runs and resumes on one machine: fp32 (Muon too), eager, "
        "torch.use_deterministic_algorithms and one compute thread; slower.",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE_PATTERN.match(value):
            raise ValueError(f"must be auto, cpu, cuda, cuda:N or mps, not {value!r}")
        return value


class DataConfig(Section):
    text_path: str | None = Field(
        None, description="A UTF-8 text file (default: the embedded tinyshakespeare)."
    )
    dataset: str | None = Field(None, description="A directory written by `speedtronic data prepare`.")
    synthetic: bool = Field(False, description="Reproducible synthetic tokens (smoke runs).")
    sources: list[DataSource] | None = Field(
        None,
        description="A weighted mixture: [{path | dataset, weight, name}] (config/data_sources.py); "
        "instead of text_path, dataset or synthetic.",
    )
    num_tokens: int = Field(1_000_000, gt=0, description="Length of the synthetic token stream.")
    vocab_size: int | None = Field(
        None, gt=0, description="Synthetic vocabulary size (default model.vocab_size or 256)."
    )
    tokenizer: str | None = Field(
        None, description="byte (default) or a path to a Hugging Face tokenizer.json."
    )
    block_size: int = Field(256, gt=0, description="Tokens per training sequence.")
    micro_batch_size: int = Field(16, gt=0, description="Sequences per forward/backward pass.")
    target_batch_size: int | None = Field(
        None,
        gt=0,
        description="Sequences per optimizer step over all ranks; a multiple of micro_batch_size × ranks "
        "(default: micro_batch_size × ranks).",
    )
    num_workers: int = Field(
        0, ge=0, description="DataLoader worker processes (0: load in the training process)."
    )
    prefetch_factor: int | None = Field(
        None, gt=0, description="Batches prefetched per worker (needs num_workers > 0)."
    )
    pin_memory: bool = Field(True, description="Pin host batches (used on CUDA only).")
    shuffle: bool = Field(
        True, description="Visit windows in a seeded random order, different cuts each epoch."
    )
    drop_last: bool = Field(True, description="Drop a last incomplete batch instead of training on it.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Data order seed (default run.seed).")
    val_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Held-out share of a text file for validation."
    )
    val_batches: int = Field(20, ge=0, description="Validation batches per evaluation.")

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, values: Any) -> Any:
        return _drop_removed("data", values)

    @model_validator(mode="after")
    def _batches(self) -> DataConfig:
        sources = [name for name in ("text_path", "dataset") if getattr(self, name)]
        if self.sources is not None:
            single = [*sources, *(["synthetic"] if self.synthetic else [])]
            if single:
                raise ValueError(
                    f"data.sources and data.{single[0]} are both set: pick one (a mixture lists every "
                    f"source under data.sources; remove data.{single[0]}, or data.sources to train on it alone)"
                )
            check_sources(self.sources)
        if self.synthetic and sources:
            raise ValueError(
                f"data.synthetic is true and data.{sources[0]} is set: pick one data source (remove "
                f"data.synthetic to train on data.{sources[0]}, or remove data.{sources[0]} for synthetic tokens)"
            )
        if len(sources) == 2:
            raise ValueError(
                "data.text_path and data.dataset are both set: pick one data source (a prepared "
                "data.dataset, or a data.text_path to tokenise at start)"
            )
        if self.target_batch_size is not None and self.target_batch_size % self.micro_batch_size:
            raise ValueError(
                f"data.target_batch_size ({self.target_batch_size}) must be a multiple of "
                f"data.micro_batch_size ({self.micro_batch_size})"
            )
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("data.prefetch_factor needs data.num_workers > 0")
        return self


class SchedulerConfig(Section):
    name: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="After linear warm-up: cosine or linear decay to min_lr_ratio, or constant."
    )
    warmup_steps: int | None = Field(None, ge=0, description="Default: 5% of run.max_steps, at most 1000.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, values: Any) -> Any:
        return _drop_removed("scheduler", values)


class PrecisionConfig(Section):
    mode: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Autocast mode; auto picks bf16 where the device runs it natively, else fp16/fp32.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Storage dtype of the parameters.")


class CheckpointConfig(Section):
    enabled: bool = Field(True, description="Save checkpoints (false: none, and no automatic resume).")
    directory: str | None = Field(None, description="Default: <output_dir>/checkpoints.")
    every_steps: int = Field(500, gt=0, description="Save every N steps (and always at the end).")
    keep_last: int = Field(3, ge=0, description="Checkpoints kept (0: all).")
    resume: bool | None = Field(
        None, description="true: must resume; false: start fresh; null: resume when a checkpoint exists."
    )


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    file: str | None = Field(None, description="Also write log lines to this file.")
    every_steps: int | None = Field(None, gt=0, description="Default run.log_every.")
    json_file: str | None = Field(
        None, description="Metrics JSONL for the jsonl hook (default <output_dir>/metrics.jsonl)."
    )
    hooks: list[str] = Field(default_factory=lambda: ["jsonl"], description="Training hooks by name.")


class ShapeValidationConfig(Section):
    """Startup advice on tensor-core-friendly shapes (engine/preflight/shapes.py; `speedtronic shapes`)."""

    enabled: bool = Field(True, description="Check shapes at start (false: never).")
    alignment: int | None = Field(
        None, gt=0, description="Required multiple (default: from device and precision)."
    )
    check_batch: bool = Field(True, description="Rows per matmul: micro_batch_size × block_size.")
    check_sequence: bool = Field(True, description="data.block_size.")
    check_model: bool = Field(True, description="Every GEMM dimension of the built model's modules.")
    check_vocab: bool = Field(
        True, description="model.vocab_size (suggestions pad up, never below the tokenizer's)."
    )
    warn_on_cpu: bool = Field(False, description="Also check on CPU/MPS (quiet there by default).")


class CompileConfig(Section):
    enabled: bool | Literal["auto"] = Field(
        "auto",
        description="Wrap the model in torch.compile (falls back to eager if it fails). auto: on CUDA and "
        "on CPUs with native bf16, for runs of at least auto_min_steps; off for fp32 on CPU, where it "
        "was measured to gain too little for its start-up cost (engine/compile_plan.py).",
    )
    auto_min_steps: int = Field(
        100, ge=0, description="With enabled: auto, shorter runs stay eager (compiling takes 30-90 s)."
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (default: torch's)."
    )
    fullgraph: bool = Field(False, description="torch.compile fullgraph: fail on graph breaks.")
    dynamic: bool | None = Field(None, description="torch.compile dynamic shapes (null: torch decides).")


class Config(Section):
    """A whole run. Build it with `speedtronic.config.load_config`, not directly from user input."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: SerializeAsAny[BaseModelConfig] = Field(
        default_factory=lambda: resolve_model_section({}),
        description="The model's section: its fields are those of the config class registered for "
        "model.name (the built-in transformer's by default); a bare name is short for {name: NAME}.",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: SerializeAsAny[OptimizerConfig] = Field(
        default_factory=OptimizerConfig,
        description="The optimizer's section: its fields are those of the config class registered for "
        "optimizer.name (OptimizerConfig's by default); a bare name is short for {name: NAME}.",
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    shape_validation: ShapeValidationConfig = Field(default_factory=ShapeValidationConfig)
    gradient_checkpointing: bool = Field(False, description="Same as model.gradient_checkpointing.")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="true/false or a mapping.")
    ooo_backprop: bool = Field(
        False,
        description="Run independent branches on several CUDA streams so their backward overlaps "
        "(engine/streams.py; off by default: no GPU speed-up measured yet; a no-op on CPU/MPS).",
    )
    ooo_streams: int = Field(2, gt=0, description="CUDA streams for ooo_backprop, the caller's own included.")

    @field_validator("model", mode="wrap")
    @classmethod
    def _model_section(cls, value: Any, handler: Any, info: ValidationInfo) -> BaseModelConfig:
        return validate_model_field(value, info)

    @field_validator("optimizer", mode="wrap")
    @classmethod
    def _optimizer_section(cls, value: Any, handler: Any, info: ValidationInfo) -> OptimizerConfig:
        return validate_optimizer_field(value, info)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_flag(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) or value == "auto" else value

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        # Only the user's own values are compared; what is unset is derived later, in the run plan.
        model, data, scheduler = self.model, self.data, self.scheduler
        if model.max_seq_len is not None and data.block_size > model.max_seq_len:
            raise ValueError(
                f"data.block_size ({data.block_size}) exceeds model.max_seq_len ({model.max_seq_len}); "
                "lower data.block_size or raise model.max_seq_len"
            )
        if data.synthetic and model.vocab_size is not None and model.vocab_size < (data.vocab_size or 0):
            raise ValueError(
                f"model.vocab_size ({model.vocab_size}) is smaller than data.vocab_size ({data.vocab_size})"
            )
        schedule = self.run.max_steps
        if scheduler.warmup_steps is not None and scheduler.warmup_steps > schedule:
            raise ValueError(
                f"scheduler.warmup_steps ({scheduler.warmup_steps}) exceeds run.max_steps ({schedule}); "
                "lower the warm-up or lengthen the run"
            )
        return self

    # Paths derived from the run name; kept as methods so a dump stays as the user wrote it.
    def output_dir(self) -> str:
        return self.run.output_dir or f"runs/{self.run.name}"

    def checkpoint_dir(self) -> str:
        return self.checkpoint.directory or f"{self.output_dir()}/checkpoints"

    def metrics_file(self) -> str:
        return self.logging.json_file or f"{self.output_dir()}/metrics.jsonl"

    def max_steps(self) -> int:
        """Steps this run trains for: run.max_steps (the one place the step count is set)."""
        return self.run.max_steps

    # Loading and saving, through the one loader (config/loading.py) and dumper (below).
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = (), *, registries: Any = None) -> Config:
        """`load_config(path, overrides)`: a YAML file (or a shipped config's name) with `--set` overrides."""
        return load_config(path, overrides, registries=registries)

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """The config as plain JSON-able data (`dump_config`); the token is asterisks unless redact=False."""
        return dump_config(self, redact=redact)

    def save(self, path: str | Path) -> Path:
        """Write the config as YAML that `from_yaml` loads back to an equal config. Secrets are always
        redacted (a saved file is shared and committed): a token comes back from HF_TOKEN or the
        login, as when the config was first loaded. The write is atomic."""
        from speedtronic.atomic_files import atomic_write_bytes

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, config_to_yaml(self, redact=True).encode("utf-8"))
        return target


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Iterable[str] = (),
    *,
    registries: Any = None,
) -> Config:
    """Load and validate a run config from a YAML path (or a shipped config's name) or a mapping,
    applying `--set` overrides (config/loading.py says in what order).

    `registries` (speedtronic.registry.Registries) gives the model config classes; None: the built-ins,
    then the installed plugins (asked only for a model name that is not built in)."""
    return load_root(Config, source, overrides, registries=registries)


def dump_config(config: Config, *, redact: bool = True) -> dict[str, Any]:
    """The config as plain JSON-able data; the token is replaced by asterisks unless redact=False."""
    data = config.model_dump(mode="json")
    token = config.distributed.bus.token
    data["distributed"]["bus"]["token"] = (
        None if token is None else (REDACTED if redact else token.get_secret_value())
    )
    return data


def config_to_yaml(config: Config, *, redact: bool = True) -> str:
    """`dump_config` as YAML, sections in their schema order."""
    import yaml

    return yaml.safe_dump(dump_config(config, redact=redact), sort_keys=False)


SECTIONS: dict[str, type[Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Config.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, Section)
}
# The model section's fields are the default model's (the built-in transformer's; docs, completion).
SECTIONS["model"] = type(resolve_model_section({}))
