"""The typed config of "example-mlp": how a plugin model declares its own `model:` fields.

    register("example-mlp", mlp_factory, config=ContextMLPConfig)      # plugin.py

With `config=` the run's `model:` section is validated by this class when `model.name` is
example-mlp: its fields sit directly under `model:` (no `model.options`), they have defaults and
descriptions, and a bad value is a one-line error naming the field (`model.context: ...`, exit 2)
from `speedtronic validate` on, before anything is built. The class extends
`speedtronic.config.models.BaseModelConfig`, which brings the fields every model has (name,
vocab_size, max_seq_len, gradient_checkpointing, init_from) and the methods the engine asks a model
config (shape fields, memory estimate; the defaults serve here).

This module must not import torch: speedtronic imports the plugin (and so this class) for `--help`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator
from speedtronic.config.models import BaseModelConfig


class ContextMLPConfig(BaseModelConfig):
    """`model.name: example-mlp`: a fixed-window MLP language model (Bengio et al., 2003)."""

    context: int = Field(4, gt=0, le=64, description="Tokens each prediction sees (the newest last).")
    embed_size: int = Field(32, gt=0, description="Width of each token's embedding.")
    hidden_size: int = Field(128, gt=0, description="Width of the hidden layer.")

    # The fields estimate_memory depends on: a run too big for the device names the one to lower.
    memory_fields: ClassVar[tuple[str, ...]] = ("hidden_size", "embed_size", "context")

    @model_validator(mode="after")
    def _window(self) -> ContextMLPConfig:
        if self.max_seq_len is not None and self.context > self.max_seq_len:
            raise ValueError(
                f"model.context ({self.context}) exceeds model.max_seq_len ({self.max_seq_len}); "
                "lower model.context"
            )
        return self

    def estimate_memory(self, vocab_size: int, rows: int) -> int | None:
        """Weights, gradients and Adam state in fp32, plus the hidden layer and logits per token."""
        params = vocab_size * self.embed_size + self.context * self.embed_size * self.hidden_size
        params += self.hidden_size * vocab_size
        return 16 * params + 4 * rows * (self.context * self.embed_size + self.hidden_size + vocab_size)
