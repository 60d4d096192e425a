"""Model sections: the base every model's typed config extends, the generic section, and how a
`model:` mapping finds its class.

Each registered model may declare its own config class (`register("name", factory, config=Cls)`,
a subclass of `BaseModelConfig`); the `model:` section of a run is validated by the class registered
for its `model.name`, so a model's fields, defaults and rules (d_model divisible by n_head, …) belong
to the model, and errors still name the dotted field (`model.n_head`). A model registered without a
config class — and a name nobody registered, which `validate`/`train` then report — gets the
generic `ModelConfig`: the fields earlier versions had for every model, with `model.options` for
the plugin's own settings.

The engine reads the common fields (`vocab_size`, `max_seq_len`, `gradient_checkpointing`,
`init_from`) of any model config, and asks it for the facts below through methods with neutral
defaults; it never looks at a model's name:

    shape_fields(vocab_size)          config fields whose values may be module dims (shape checker)
    head_dim_field(head_dim)          the field that sets an attention head dim, if any
    shape_candidates(field, value, a) values to try for a field (None: multiples of a near value)
    shape_hint(field, alignment)      a sentence to add when no value of `field` alone fixes it
    estimate_memory(vocab, rows)      a lower bound on training bytes (None: no check), with the
    memory_fields                     fields it depends on (the culprit named when it cannot fit)
    activation_bytes(s, b, e, ckpt)   activations of one micro-batch (None: unknown)

This module never imports torch.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator

from speedtronic.config.registered import registered_class, resolve_registered
from speedtronic.config.section import Section
from speedtronic.registry import Registries

DEFAULT_MODEL = "transformer"


class BaseModelConfig(Section):
    """What every model's config has; a model's own config subclasses it and adds its fields."""

    name: str = Field(
        DEFAULT_MODEL, min_length=1, description="A registered model (see `speedtronic plugins`)."
    )
    vocab_size: int | None = Field(None, gt=0, description="Default: the tokenizer's vocabulary size.")
    max_seq_len: int | None = Field(None, gt=0, description="Context length (default data.block_size).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )
    init_from: str | None = Field(
        None,
        description="A Hugging Face model folder (config.json + safetensors) whose weights initialise the "
        "model before step 0 (continued pretraining); model fields must match its config.",
    )

    # Fields the memory estimate depends on; the one whose default shrinks it most is named.
    memory_fields: ClassVar[tuple[str, ...]] = ()

    def shape_fields(self, vocab_size: int) -> list[tuple[str, str, int]]:
        """(warning code, dotted field, value) of the fields a module dimension may come from, in
        priority order. Default: the vocabulary, then every positive integer field of the model's own."""
        out = [("SHAPE_VOCAB", "model.vocab_size", vocab_size)]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name not in BaseModelConfig.model_fields and _positive_int(value):
                out.append(("SHAPE_DIM", f"model.{name}", value))
        return out

    def head_dim_field(self, head_dim: int) -> str | None:
        """The field that sets an attention head dim of `head_dim` (None: no field does)."""
        return None

    def shape_candidates(self, field: str, value: int, alignment: int) -> list[int] | None:
        """Values of `field` to try for a shape warning (None: multiples of `alignment` near `value`)."""
        return None

    def shape_hint(self, field: str, alignment: int) -> str | None:
        """Said when no value of `field` alone fixes its warning (e.g. which other field to change)."""
        return None

    def estimate_memory(self, vocab_size: int, rows: int) -> int | None:
        """A lower bound on the bytes training needs for `rows` tokens per micro-batch (None: unknown,
        so the run is not checked against the device's memory)."""
        return None

    def activation_bytes(
        self, block_size: int, micro_batch: int, elem_bytes: int, checkpointing: bool
    ) -> float | None:
        """Activations one micro-batch keeps for backward, without the logits (None: unknown)."""
        return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ---------------------------------------------------------------------- shared decoder arithmetic
def decoder_activation_bytes(
    layers: int, d_model: int, n_head: int, s: int, b: int, elem: int, checkpointing: bool
) -> float:
    """s·b·h·(34 + 5·a·s/h) bytes per block at 16 bits (Korthikanti et al., 2022; no fused
    attention), scaled to `elem`; with checkpointing the block inputs plus one block's activations."""
    per_block = s * b * d_model * (34 + 5 * n_head * s / d_model) * elem / 2
    if checkpointing:
        return layers * s * b * d_model * elem + per_block
    return layers * per_block


def head_count_candidates(d_model: int, n_head: int, alignment: int) -> list[int]:
    """Head counts that divide d_model into head dims that are multiples of `alignment`, nearest first."""
    options = [n for n in range(1, d_model + 1) if d_model % n == 0 and (d_model // n) % alignment == 0]
    return sorted(options, key=lambda n: (abs(n - n_head), n))[:8]


def head_hint(d_model: int, alignment: int) -> str | None:
    if d_model % alignment:
        return (
            f"no n_head fixes it while model.d_model {d_model} is not a multiple of {alignment}: "
            "apply the model.d_model suggestion"
        )
    return None


class AttentionHeadShapes:
    """The shape checker's questions about `model.n_head`, for a config with `d_model` and `n_head`
    fields (the transformer's and the generic section): which head counts to try, and what to say when
    none fits. A plain mixin (no fields of its own), listed before the pydantic base."""

    def shape_candidates(self, field: str, value: int, alignment: int) -> list[int] | None:
        if field == "model.n_head":
            return head_count_candidates(self.d_model, self.n_head, alignment)  # type: ignore[attr-defined]
        return None

    def shape_hint(self, field: str, alignment: int) -> str | None:
        return head_hint(self.d_model, alignment) if field == "model.n_head" else None  # type: ignore[attr-defined]


class ModelConfig(AttentionHeadShapes, BaseModelConfig):
    """The generic model section: for a model registered without a config class of its own (its
    settings go in `model.options`), and for a name nobody registered."""

    n_layer: int = Field(4, gt=0, description="Blocks (for plugin models that read it).")
    n_head: int = Field(4, gt=0, description="Attention heads (for plugin models that read it).")
    n_kv_head: int | None = Field(None, gt=0, description="Key/value heads (for plugin models that read it).")
    d_model: int = Field(256, gt=0, description="Width (for plugin models that read it).")
    d_ff: int | None = Field(None, gt=0, description="Feed-forward width (for plugin models that read it).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (0: none).")
    tie_weights: bool = Field(True, description="Share the output head with the token embedding.")
    rope_base: float = Field(10000.0, gt=0, description="Rotary embedding base (for models that read it).")
    norm_eps: float = Field(1e-6, gt=0, description="Norm epsilon (for models that read it).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for a plugin model's factory."
    )

    def shape_fields(self, vocab_size: int) -> list[tuple[str, str, int]]:
        out = [
            ("SHAPE_VOCAB", "model.vocab_size", vocab_size),
            ("SHAPE_HIDDEN", "model.d_model", self.d_model),
        ]
        if self.d_ff is not None:
            out.append(("SHAPE_FFN", "model.d_ff", self.d_ff))
        for key, value in sorted(self.options.items()):
            if _positive_int(value):
                out.append(("SHAPE_DIM", f"model.options.{key}", value))
        return out

    def head_dim_field(self, head_dim: int) -> str | None:
        options = [k for k, v in self.options.items() if v == head_dim]
        return f"model.options.{options[0]}" if options else "model.n_head"

    def activation_bytes(
        self, block_size: int, micro_batch: int, elem_bytes: int, checkpointing: bool
    ) -> float | None:
        return decoder_activation_bytes(
            self.n_layer, self.d_model, self.n_head, block_size, micro_batch, elem_bytes, checkpointing
        )


# ------------------------------------------------------------------------------------ resolution
def model_config_class(name: Any, registries: Registries | None = None) -> type[BaseModelConfig]:
    """The config class registered for model `name` in `registries` (None: the built-ins, then the
    installed plugins — asked only for a name that is not built in); `ModelConfig` when the model
    declared none or nobody registered the name."""
    return registered_class("models", name, ModelConfig, registries)


def resolve_model_section(value: Any, registries: Registries | None = None) -> BaseModelConfig:
    """A `model:` section (mapping, model config or a bare model name) validated by its model's class."""
    return resolve_registered(
        value,
        kind="models",
        family=BaseModelConfig,
        fallback=ModelConfig,
        default_name=DEFAULT_MODEL,
        registries=registries,
    )


def validate_model_field(value: Any, info: ValidationInfo) -> BaseModelConfig:
    """The `model` field's validator (Config and ModelSectionOnly): the registries to resolve the
    class from come in the validation context (`{"registries": ...}`), else the default lookup."""
    return resolve_model_section(value, (info.context or {}).get("registries"))


class ModelSectionOnly(Section):
    """A model section on its own, validated as in a Config (errors are located under `model.`)."""

    model: SerializeAsAny[BaseModelConfig]

    @field_validator("model", mode="wrap")
    @classmethod
    def _resolve(cls, value: Any, handler: Any, info: ValidationInfo) -> BaseModelConfig:
        return validate_model_field(value, info)
