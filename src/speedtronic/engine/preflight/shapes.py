"""Shape validation: warn when a run's matmul dimensions are unfriendly to the device's tensor cores.

    from speedtronic.engine.preflight.shapes import check_config
    profile, warnings = check_config(config, device="cuda", precision="bf16")   # no GPU needed

`speedtronic shapes CONFIG` prints the result; the trainer runs the same check at startup and logs
each warning once. Warnings never stop a run.

What is checked (each switchable in the `shape_validation` section):

* batch     the rows of every matmul, micro_batch_size × block_size (the effective batch,
            micro × accumulation, is not a matmul dimension: only the micro-batch enters one);
* sequence  data.block_size, a GEMM dimension of the attention score and value matmuls;
* vocab     the embedding rows / lm-head columns (padding up is nearly free: nanoGPT's 50257 -> 50304
            made training ~25% faster);
* model     every GEMM dimension read from the *built* model's modules (nn.Linear in/out features,
            nn.Embedding width, recurrent input/hidden sizes, transformers' Conv1D, any `head_dim`
            attribute) — so plugin models are inspected as they really are, not guessed from the config.

The alignment table (auto; `shape_validation.alignment` replaces all of it with one number):

    device / compute precision          dims, rows, sequence   head dim   vocab
    CUDA bf16/fp16, before Hopper        8                      8          64
    CUDA bf16/fp16, Hopper or later      64                     8          128
    CUDA fp32 (TF32 tensor cores)        4                      4          64
    CPU / MPS (only with warn_on_cpu)    8                      8          8

8 elements (16 bytes) is what bf16/fp16 tensor-core kernels need to run without padding or a slower
fallback path; TF32 needs 4. Hopper's (H100/H200) wgmma tiles are 64 wide, so dims that are multiples
of 64 avoid partial tiles. Head dims only need 8 (flash-attention kernels pad to 64/128 themselves and
a head dim of 32 is a legitimate choice). The vocabulary is padded to 64/128 because its cost is a few
unused rows. On CPU the gain is small, so the check is quiet there unless `warn_on_cpu` is set or an
explicit alignment is given. No int8/fp8 precision exists yet; when one does it needs 16.

Each warning names the dotted config field that holds the value (`model (<module attribute>)` when no
field does: then there is nothing to suggest) and appears once however many modules share the value.
A warning's suggestion is only offered after the config with it applied has been re-validated and the
model rebuilt (on the meta device): it must pass every other rule (target batch a multiple of the micro
batch, d_model divisible by n_head, a vocabulary not below the tokenizer's, ...), remove its warning,
and preferably add no new one. If no candidate passes, `suggested` is None.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config
from speedtronic.engine.data_facts import data_facts
from speedtronic.errors import ConfigError, SpeedtronicError
from speedtronic.plan import global_batch
from speedtronic.registry import Registries

logger = logging.getLogger("speedtronic.shapes")

# Stable warning codes (they are part of the `shapes --json` contract).
SHAPE_BATCH = "SHAPE_BATCH"  # micro_batch_size × block_size rows per matmul
SHAPE_SEQUENCE = "SHAPE_SEQUENCE"  # data.block_size
SHAPE_VOCAB = "SHAPE_VOCAB"  # model.vocab_size
SHAPE_HIDDEN = "SHAPE_HIDDEN"  # model.d_model
SHAPE_FFN = "SHAPE_FFN"  # model.d_ff
SHAPE_HEAD_DIM = "SHAPE_HEAD_DIM"  # d_model / n_head (read from modules' head_dim)
SHAPE_DIM = "SHAPE_DIM"  # any other module dimension (e.g. a plugin's model.options.hidden_size)

# GPUs whose tensor cores use 64-wide tiles (Hopper, Blackwell), by name fragment when planning for a
# GPU that is not present; a present GPU is judged by its compute capability (>= 9).
_BIG_TILE_GPUS = ("H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200")
# GPUs without bf16 tensor cores (auto precision picks fp16 there).
_NO_BF16_GPUS = ("V100", "T4", "P100", "P40", "K80", "TITAN V", "RTX 20")
# Other GPUs `--gpu` accepts (16-wide tiles, bf16): a name matching none of these lists is refused
# rather than silently judged as a generic GPU (`--gpu H10` meant H100 or H20, not "some GPU").
_OTHER_GPUS = (
    "A100", "A800", "A10", "A30", "A40", "A6000", "A5000", "A4000", "L4", "L40", "L20",
    "RTX 30", "RTX 40", "RTX 50", "RTX A", "RTX 6000", "TITAN RTX", "GB10",
)  # fmt: skip

_MAX_CANDIDATES = 8


@dataclass(frozen=True)
class ShapeProfile:
    """The device and precision the shapes are judged for, and the alignments that follow."""

    device: str  # cuda | cpu | mps
    precision: str  # the matmul precision: fp32 | bf16 | fp16
    gpu: str | None
    alignment: int  # hidden/ffn/other dims, sequence, batch rows
    head_alignment: int
    vocab_alignment: int
    active: bool  # False: quiet (CPU/MPS without warn_on_cpu or an explicit alignment)
    source: str  # why these numbers, in words

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        gpu = f" ({self.gpu})" if self.gpu else ""
        if not self.active:
            return f"{self.device}{gpu} {self.precision}: quiet ({self.source})"
        return (
            f"{self.device}{gpu} {self.precision}: align dims to {self.alignment}, head dim to "
            f"{self.head_alignment}, vocab to {self.vocab_alignment} ({self.source})"
        )


@dataclass
class ShapeWarning:
    code: str
    field: str  # dotted config field
    value: int
    suggested: int | None
    alignment: int
    reason: str
    where: list[str] = field(default_factory=list)  # module attributes that carry the value

    def as_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "field": self.field,
            "value": self.value,
            "suggested": self.suggested,
            "alignment": self.alignment,
            "reason": self.reason,
        }

    @property
    def key(self) -> tuple[str, str]:
        return (self.code, self.field)


# -- profile ---------------------------------------------------------------------------------------
def alignment_for(
    device_type: str, precision: str, *, big_tiles: bool, explicit: int | None, warn_on_cpu: bool
) -> tuple[int, int, int, bool, str]:
    """(dims, head dim, vocab, active, source) for a profile: the table in the module docstring."""
    if explicit is not None:
        return explicit, explicit, explicit, True, "shape_validation.alignment"
    if device_type != "cuda":
        if not warn_on_cpu:
            return 8, 8, 8, False, f"no tensor cores on {device_type}; set shape_validation.warn_on_cpu"
        return 8, 8, 8, True, f"warn_on_cpu: SIMD-friendly multiples on {device_type}"
    if precision == "fp32":
        return 4, 4, 64, True, "TF32 tensor cores need multiples of 4"
    if big_tiles:
        return 64, 8, 128, True, f"{precision} on Hopper-class tensor cores (64-wide tiles)"
    return 8, 8, 64, True, f"{precision} tensor cores need multiples of 8"


def check_gpu_name(gpu: str) -> None:
    """Refuse a `--gpu` name that matches no known GPU (ConfigError, exit 2), with the nearest one."""
    import difflib

    known = (*_BIG_TILE_GPUS, *_NO_BF16_GPUS, *_OTHER_GPUS)
    upper = " ".join(gpu.upper().split())
    if upper and any(fragment in upper for fragment in known):
        return
    close = difflib.get_close_matches(upper, known, n=2, cutoff=0.5)
    meant = f"did you mean {' or '.join(close)}? " if close else ""
    raise ConfigError(
        f"--gpu {gpu!r} is no GPU whose tensor cores speedtronic knows; {meant}known: "
        f"{', '.join(sorted(known))} (a name containing one of them, e.g. 'NVIDIA H100 80GB HBM3', works too)"
    )


def resolve_profile(
    config: Config,
    *,
    device: str | None = None,
    precision: str | None = None,
    gpu: str | None = None,
) -> ShapeProfile:
    """The profile for `device`/`precision` (default: the config's). A CUDA profile needs no GPU: without
    one, `gpu` (a name such as "H100") stands in for it, and auto precision assumes bf16."""
    spec = device or config.run.device
    mode = precision or config.precision.mode
    sv = config.shape_validation
    if spec == "auto":
        from speedtronic.engine.device import resolve_device

        spec = str(resolve_device("auto"))
    kind = torch.device(spec).type
    big_tiles = False
    if kind == "cuda" and torch.cuda.is_available() and gpu is None:
        from speedtronic.engine.precision import plan_precision

        real = torch.device(spec)
        gpu = torch.cuda.get_device_name(real)
        big_tiles = torch.cuda.get_device_capability(real)[0] >= 9
        plan = plan_precision(mode, config.precision.dtype, real)
        compute = "bf16" if plan.param_dtype == torch.bfloat16 else plan.mode
    elif kind == "cuda":  # planning for a GPU that is not here
        if gpu is not None:
            check_gpu_name(gpu)
        upper = (gpu or "").upper()
        big_tiles = any(fragment in upper for fragment in _BIG_TILE_GPUS)
        no_bf16 = any(fragment in upper for fragment in _NO_BF16_GPUS)
        compute = mode if mode != "auto" else ("fp16" if no_bf16 else "bf16")
        if config.precision.dtype == "bfloat16" and compute in ("fp32", "bf16"):
            compute = "bf16"
    else:
        from speedtronic.engine.precision import plan_precision

        plan = plan_precision(mode, config.precision.dtype, torch.device(kind))
        compute = "bf16" if plan.param_dtype == torch.bfloat16 else plan.mode
    dims, head, vocab, active, source = alignment_for(
        kind, compute, big_tiles=big_tiles, explicit=sv.alignment, warn_on_cpu=sv.warn_on_cpu
    )
    return ShapeProfile(kind, compute, gpu, dims, head, vocab, active and sv.enabled, source)


def profile_for_run(config: Config, device: torch.device, plan: Any) -> ShapeProfile:
    """The profile of a run that is starting: its real device and precision plan."""
    sv = config.shape_validation
    compute = "bf16" if plan.param_dtype == torch.bfloat16 else plan.mode
    gpu, big_tiles = None, False
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        big_tiles = torch.cuda.get_device_capability(device)[0] >= 9
    dims, head, vocab, active, source = alignment_for(
        device.type, compute, big_tiles=big_tiles, explicit=sv.alignment, warn_on_cpu=sv.warn_on_cpu
    )
    return ShapeProfile(device.type, compute, gpu, dims, head, vocab, active and sv.enabled, source)


# -- reading the model -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Dim:
    value: int
    where: str  # e.g. "blocks.0.attn.q_proj.out_features"
    kind: str  # "gemm" | "vocab" | "head_dim"


def model_dims(model: nn.Module, vocab: int) -> list[Dim]:
    """Every matmul dimension the model's modules declare (see the module docstring).

    An embedding's row count is only a matmul dimension for the token embedding (whose matrix is, or
    mirrors, the lm head); a position embedding's rows are just a lookup table, so they are skipped.
    """
    dims: list[Dim] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Linear):
            dims += [
                Dim(module.in_features, f"{prefix}in_features", "gemm"),
                Dim(module.out_features, f"{prefix}out_features", "gemm"),
            ]
        elif isinstance(module, nn.Embedding):
            if module.num_embeddings == vocab:
                dims.append(Dim(module.num_embeddings, f"{prefix}num_embeddings", "vocab"))
            dims.append(Dim(module.embedding_dim, f"{prefix}embedding_dim", "gemm"))
        elif isinstance(module, nn.RNNBase):
            dims += [
                Dim(module.input_size, f"{prefix}input_size", "gemm"),
                Dim(module.hidden_size, f"{prefix}hidden_size", "gemm"),
            ]
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            # transformers' GPT-2 style linear layer: weight [in, out].
            n_in, n_out = module.weight.shape[:2]
            dims += [
                Dim(int(n_in), f"{prefix}weight[0]", "gemm"),
                Dim(int(n_out), f"{prefix}weight[1]", "gemm"),
            ]
        head_dim = getattr(module, "head_dim", None)
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
            dims.append(Dim(head_dim, f"{prefix}head_dim", "head_dim"))
    return dims


def build_meta_model(config: Config, vocab_size: int, registries: Registries | None = None) -> nn.Module:
    """Build the configured model without allocating its weights (meta device), for inspection only."""
    from speedtronic.engine.build import build_model

    with torch.device("meta"):
        return build_model(config, vocab_size, registries)


# -- the checks ------------------------------------------------------------------------------------
def _config_int(config: Config, dotted: str) -> int | None:
    """The integer a dotted config field (`model.n_head`, `model.options.head_dim`) holds, or None."""
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node if isinstance(node, int) and not isinstance(node, bool) else None


def _misaligned(value: int, alignment: int) -> bool:
    return alignment > 1 and value % alignment != 0


def _field_values(config: Config, vocab: int) -> list[tuple[str, str, int]]:
    """(code, field, value) of the config fields a module dimension may come from, in priority order:
    the model's own config says which (`shape_fields`, config/models.py)."""
    return config.model.shape_fields(vocab)


def _model_vocab(model: nn.Module, expected: int) -> int:
    """The model's vocabulary: `expected` (the resolved model.vocab_size) if an embedding has that many
    rows, else an embedding whose row count is also a Linear's output (a token embedding + its head)."""
    rows = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    if expected in rows or not rows:
        return expected
    heads = rows & {m.out_features for m in model.modules() if isinstance(m, nn.Linear)}
    return max(heads) if heads else expected


def _inspect(config: Config, model: nn.Module, data_vocab: int) -> tuple[list[Dim], int]:
    vocab = _model_vocab(model, config.model.vocab_size or data_vocab)
    return model_dims(model, vocab), vocab


def find_warnings(config: Config, dims: list[Dim], profile: ShapeProfile, vocab: int) -> list[ShapeWarning]:
    """The de-duplicated warnings, without suggestions (see `check_model` for those)."""
    if not profile.active:
        return []
    sv, data = config.shape_validation, config.data
    a = profile.alignment
    found: dict[tuple[str, str], ShapeWarning] = {}

    def add(
        code: str, field_: str, value: int, alignment: int, reason: str, where: str | None = None
    ) -> None:
        warning = found.setdefault((code, field_), ShapeWarning(code, field_, value, None, alignment, reason))
        if where and where not in warning.where:
            warning.where.append(where)

    if sv.check_sequence and _misaligned(data.block_size, a):
        add(
            SHAPE_SEQUENCE,
            "data.block_size",
            data.block_size,
            a,
            f"sequence length {data.block_size} sizes the attention matmuls and, with the micro batch, "
            f"the rows of every matmul; not a multiple of {a}",
        )
    rows = data.micro_batch_size * data.block_size
    if sv.check_batch and _misaligned(rows, a):
        accum = global_batch(config, 1)[1]
        add(
            SHAPE_BATCH,
            "data.micro_batch_size",
            data.micro_batch_size,
            a,
            f"micro batch {data.micro_batch_size} × block {data.block_size} = {rows} rows per matmul, not a "
            f"multiple of {a} (effective batch {data.micro_batch_size * accum} = "
            f"{data.micro_batch_size} × {accum} accumulation)",
        )

    fields = _field_values(config, vocab)
    head_dims = {d.value for d in dims if d.kind == "head_dim"}
    bad_heads = {h for h in head_dims if _misaligned(h, profile.head_alignment)}
    unmapped: dict[int, str] = {}
    for dim in dims:
        if dim.kind == "head_dim":
            if sv.check_model and dim.value in bad_heads:
                field_ = config.model.head_dim_field(dim.value) or f"model ({dim.where})"
                # The value is the field's own (n_head 4), not the head dim it gives (d_model 120 / 4
                # = 30): `--set FIELD=SUGGESTED` replaces that value. The reason names the head dim.
                own = _config_int(config, field_)
                add(
                    SHAPE_HEAD_DIM,
                    field_,
                    dim.value if own is None else own,
                    profile.head_alignment,
                    f"head dim {dim.value} is a GEMM dimension of every attention matmul; not a multiple "
                    f"of {profile.head_alignment}",
                    dim.where,
                )
            continue
        is_vocab = dim.kind == "vocab" or dim.value == vocab
        alignment = profile.vocab_alignment if is_vocab else a
        if not _misaligned(dim.value, alignment):
            continue
        if is_vocab:
            if sv.check_vocab:
                add(
                    SHAPE_VOCAB,
                    "model.vocab_size",
                    dim.value,
                    alignment,
                    f"vocabulary {dim.value} sizes the embedding and lm-head matmul; padding it to a "
                    f"multiple of {alignment} costs a few unused rows and avoids slow tail tiles",
                    dim.where,
                )
            continue
        if not sv.check_model:
            continue
        matches = [(code, f) for code, f, value in fields if value == dim.value and code != SHAPE_VOCAB]
        if matches:
            for code, f in matches:
                add(
                    code,
                    f,
                    dim.value,
                    a,
                    f"{f} = {dim.value} is a GEMM dimension; not a multiple of {a}",
                    dim.where,
                )
        elif any(dim.value % h == 0 for h in bad_heads):
            continue  # heads × a misaligned head dim: reported (and fixed) by the head-dim warning
        else:
            # Named after the first module that has it, so 40 layers sharing the value warn once.
            first = unmapped.setdefault(dim.value, f"model ({dim.where})")
            add(
                SHAPE_DIM,
                first,
                dim.value,
                a,
                f"module dimension {dim.value} (no config field holds it) is not a multiple of {a}",
                dim.where,
            )
    for warning in found.values():
        if len(warning.where) > 1:
            warning.reason += f"; used by {len(warning.where)} module dims (first: {warning.where[0]})"
        elif warning.where:
            warning.reason += f"; at {warning.where[0]}"
    return list(found.values())


# -- suggestions -----------------------------------------------------------------------------------
def apply_override(config: Config, dotted: str, value: Any) -> Config:
    """The config as the user would get it with `--set dotted=value`: re-validated from what they set
    (derived values such as model.max_seq_len are derived again). Raises ValueError if it is invalid."""
    from pydantic import ValidationError

    raw = config.model_dump(exclude_unset=True)
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        raise ValueError(str(error)) from None


def _multiples_near(value: int, alignment: int, *, up_only: bool = False, floor: int = 1) -> list[int]:
    low = (value // alignment) * alignment
    candidates = {low + k * alignment for k in range(-_MAX_CANDIDATES, _MAX_CANDIDATES + 1)}
    candidates = {c for c in candidates if c >= max(floor, 1) and c != value and (not up_only or c > value)}
    return sorted(candidates, key=lambda c: (abs(c - value), -c))[:_MAX_CANDIDATES]


def _candidates(config: Config, warning: ShapeWarning, floor_vocab: int) -> list[int]:
    a, value = warning.alignment, warning.value
    if warning.code == SHAPE_VOCAB:
        return _multiples_near(value, a, up_only=True, floor=floor_vocab)
    if warning.code == SHAPE_BATCH:
        t = config.data.block_size
        options = [m for m in range(1, 2 * value + a + 1) if (m * t) % a == 0 and m != value]
        return sorted(options, key=lambda m: (abs(m - value), -m))[:_MAX_CANDIDATES]
    if warning.field.startswith("model ("):
        return []  # no config field to change
    if warning.field.startswith("model."):
        own = config.model.shape_candidates(warning.field, value, a)  # e.g. head counts for n_head
        if own is not None:
            return own[:_MAX_CANDIDATES]
    return _multiples_near(value, a)


def _with_suggestions(
    config: Config,
    model: nn.Module,
    warnings: list[ShapeWarning],
    profile: ShapeProfile,
    data_vocab: int,
    registries: Registries | None = None,
) -> list[ShapeWarning]:
    dims, vocab = _inspect(config, model, data_vocab)
    before = {w.key for w in warnings}
    model_is_configured: bool | None = None  # a Trainer may be handed a model the config doesn't build
    for warning in warnings:
        fallback, best, best_left = None, None, len(before) + 1
        if warning.field.startswith("model.") and model_is_configured is None:
            try:
                model_is_configured = (
                    _inspect(config, build_meta_model(config, data_vocab, registries), data_vocab)[0] == dims
                )
            except (ValueError, TypeError, SpeedtronicError):
                model_is_configured = False
        if warning.field.startswith("model.") and not model_is_configured:
            continue  # rebuilding from the config would not change this model: no honest suggestion
        for candidate in _candidates(config, warning, data_vocab):
            try:
                trial = apply_override(config, warning.field, candidate)
                if warning.field.startswith("model."):
                    trial_model = build_meta_model(trial, data_vocab, registries)
                    trial_dims, trial_vocab = _inspect(trial, trial_model, data_vocab)
                else:
                    trial_dims, trial_vocab = dims, vocab
            except (ValueError, TypeError, SpeedtronicError):
                continue
            after = {w.key for w in find_warnings(trial, trial_dims, profile, trial_vocab)}
            if warning.key in after:
                continue
            if after <= before:
                # Adds no warning; among those, prefer the one that fixes the most (candidates come
                # nearest first, so ties keep the nearest): d_model 204 -> 192 also fixes head dim 34 -> 32.
                if len(after) < best_left:
                    best, best_left = candidate, len(after)
            elif fallback is None:
                fallback = candidate
        warning.suggested = best
        if best is None and fallback is not None:
            warning.suggested = fallback
            warning.reason += " (the suggestion changes another dimension too: re-run the check)"
        elif warning.suggested is None and (hint := _model_hint(config, warning)):
            warning.reason += f" ({hint})"
        elif warning.suggested is None:
            warning.reason += f" (no value of {warning.field} alone passes the other rules)"
    return warnings


def _model_hint(config: Config, warning: ShapeWarning) -> str | None:
    """What the model's config adds when no value of the warning's field alone fixes it."""
    if not warning.field.startswith("model."):
        return None
    return config.model.shape_hint(warning.field, warning.alignment)


def check_model(
    config: Config,
    model: nn.Module,
    profile: ShapeProfile,
    data_vocab: int,
    *,
    suggest: bool = True,
    registries: Registries | None = None,
) -> list[ShapeWarning]:
    """Warnings for a built model (any device, meta included) under `profile`, with suggestions."""
    if not profile.active:
        return []
    dims, vocab = _inspect(config, model, data_vocab)
    warnings = find_warnings(config, dims, profile, vocab)
    if not suggest:
        return warnings
    return _with_suggestions(config, model, warnings, profile, data_vocab, registries)


def check_config(
    config: Config,
    *,
    device: str | None = None,
    precision: str | None = None,
    gpu: str | None = None,
    data_vocab: int | None = None,
    suggest: bool = True,
    registries: Registries | None = None,
) -> tuple[ShapeProfile, list[ShapeWarning]]:
    """Build the configured model on the meta device and check it (what `speedtronic shapes` runs)."""
    profile = resolve_profile(config, device=device, precision=precision, gpu=gpu)
    if not profile.active:
        return profile, []
    vocab = data_vocab if data_vocab is not None else data_facts(config).vocab_size
    model = build_meta_model(config, vocab, registries)
    return profile, check_model(config, model, profile, vocab, suggest=suggest, registries=registries)


def warn_at_startup(
    config: Config,
    model: nn.Module,
    device: torch.device,
    plan: Any,
    data_vocab: int,
    registries: Registries | None = None,
) -> None:
    """The trainer's call: log each warning once; never fail a run (a checker bug is logged at debug)."""
    if not config.shape_validation.enabled:
        return
    try:
        profile = profile_for_run(config, device, plan)
        warnings = check_model(config, model, profile, data_vocab, registries=registries)
    except Exception as error:  # shape advice must never stop training
        logger.debug("shape validation skipped: %s", error)
        return
    for w in warnings:
        fix = f"; try --set {w.field}={w.suggested}" if w.suggested is not None else ""
        logger.warning("%s %s=%s: %s%s", w.code, w.field, w.value, w.reason, fix)
