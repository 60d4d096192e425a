"""Built-in model: the reference decoder-only transformer, registered as "transformer".

An ordinary plugin: it registers through `register_models` like a third party's, with its typed config
`TransformerModelConfig` (the `model:` section when `model.name` is transformer, the default). The
config owns the transformer's fields, their rules (d_model divisible by n_head, …) and the facts the
engine asks a model config for (shape fields, a memory lower bound, activation bytes); no engine code
looks at the name. Importing this module never imports torch; the factory does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from speedtronic.config.models import AttentionHeadShapes, BaseModelConfig, decoder_activation_bytes
from speedtronic.hookspecs import Register, hookimpl

NAME = "transformer"


def default_ffn(d_model: int) -> int:
    """The SwiGLU hidden size when d_ff is unset: about 8/3·d_model, rounded up to 64 (engine/model.py)."""
    return ((int(8 / 3 * d_model) + 63) // 64) * 64


class TransformerModelConfig(AttentionHeadShapes, BaseModelConfig):
    """The reference transformer's section (`model.name: transformer`, the default)."""

    n_layer: int = Field(4, gt=0, description="Transformer blocks.")
    n_head: int = Field(4, gt=0, description="Attention heads; d_model / n_head is the head size (even).")
    n_kv_head: int | None = Field(
        None, gt=0, description="Key/value heads for grouped-query attention (default n_head)."
    )
    d_model: int = Field(256, gt=0, description="Width of the residual stream (embedding size).")
    d_ff: int | None = Field(
        None, gt=0, description="SwiGLU hidden size (default about 8/3·d_model, rounded to 64)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (0: none).")
    tie_weights: bool = Field(True, description="The output head shares the token embedding matrix.")
    rope_base: float = Field(10000.0, gt=0, description="Base of the rotary position embedding frequencies.")
    norm_eps: float = Field(
        1e-6, gt=0, description="RMSNorm epsilon (Hugging Face rms_norm_eps; Llama checkpoints use 1e-5)."
    )

    memory_fields: ClassVar[tuple[str, ...]] = ("d_model", "n_layer", "d_ff")

    @model_validator(mode="before")
    @classmethod
    def _no_options(cls, values: Any) -> Any:
        # Configs (and checkpoints) written before the typed config carry `options: {}`: drop it.
        if isinstance(values, dict) and "options" in values:
            if values["options"]:
                raise ValueError(
                    f"model.options is not used by the transformer: {sorted(values['options'])}; "
                    "remove it (the transformer's fields are model.n_layer, model.d_model, ...)"
                )
            values = {k: v for k, v in values.items() if k != "options"}
        return values

    @model_validator(mode="after")
    def _heads(self) -> TransformerModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(
                f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head ({self.n_kv_head})"
            )
        if (self.d_model // self.n_head) % 2:
            raise ValueError("model.d_model / model.n_head must be even (rotary embeddings rotate pairs)")
        return self

    # -- what the engine asks of a model config (config/models.py) ----------------------------------
    def shape_fields(self, vocab_size: int) -> list[tuple[str, str, int]]:
        return [
            ("SHAPE_VOCAB", "model.vocab_size", vocab_size),
            ("SHAPE_HIDDEN", "model.d_model", self.d_model),
            ("SHAPE_FFN", "model.d_ff", self.d_ff or default_ffn(self.d_model)),
        ]

    def head_dim_field(self, head_dim: int) -> str | None:
        return "model.n_head"

    def estimate_memory(self, vocab_size: int, rows: int) -> int | None:
        """Weights and gradients at 2 bytes each (bf16; fp32 and optimizer state need more), plus one
        bf16 value per token per layer and the logits kept for backward: a lower bound, so refusing on it
        is never wrong; it only has to tell a mistake (a d_model of 2^40) from a run."""
        d, layers = self.d_model, self.n_layer
        d_ff = self.d_ff or 4 * d
        params = layers * (4 * d * d + 3 * d * d_ff) + vocab_size * d
        return 4 * params + 2 * rows * (layers * d + vocab_size)

    def activation_bytes(
        self, block_size: int, micro_batch: int, elem_bytes: int, checkpointing: bool
    ) -> float | None:
        return decoder_activation_bytes(
            self.n_layer, self.d_model, self.n_head, block_size, micro_batch, elem_bytes, checkpointing
        )


def build_transformer(config: TransformerModelConfig) -> Any:
    from speedtronic.engine.model import Transformer, TransformerConfig

    return Transformer(
        TransformerConfig(
            vocab_size=config.vocab_size or 256,
            max_seq_len=config.max_seq_len or 256,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_kv_head=config.n_kv_head,
            d_model=config.d_model,
            d_ff=config.d_ff,
            dropout=config.dropout,
            tie_weights=config.tie_weights,
            rope_base=config.rope_base,
            norm_eps=config.norm_eps,
            gradient_checkpointing=config.gradient_checkpointing,
        )
    )


@hookimpl
def register_models(register: Register) -> None:
    register(NAME, build_transformer, config=TransformerModelConfig)
