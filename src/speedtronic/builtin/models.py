"""Built-in model: the reference decoder-only transformer, registered as "transformer"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speedtronic.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from speedtronic.config import ModelConfig


def build_transformer(config: ModelConfig) -> Any:
    from speedtronic.engine.model import Transformer, TransformerConfig

    if config.options:
        raise ValueError(f"model.options is not used by the transformer: {sorted(config.options)}")
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
    register("transformer", build_transformer)
