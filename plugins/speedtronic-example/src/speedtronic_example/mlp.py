"""A fixed-window MLP language model, registered by the plugin as "example-mlp".

Each position sees the embeddings of its `context` newest tokens (itself included; zeros before the
start), concatenated, through one tanh hidden layer to the vocabulary:

    tokens -> embedding -> window of `context` -> Linear -> tanh -> Linear -> logits

It shows the smallest trainer contract (speedtronic/engine/batches.py): `forward(tokens)` — one
positional parameter that is not called `input_ids` — returns plain logits, and the trainer computes
the causal LM loss from them. Its settings come from its typed config (config.py), not from
`model.options`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speedtronic_example.config import ContextMLPConfig


class ContextMLP(nn.Module):
    def __init__(self, vocab_size: int, context: int, embed_size: int, hidden_size: int) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, embed_size)
        self.hidden = nn.Linear(context * embed_size, hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        b, t = tokens.shape
        x = F.pad(self.embed(tokens), (0, 0, self.context - 1, 0))  # zeros before the first token
        windows = x.unfold(1, self.context, 1).transpose(-1, -2).reshape(b, t, -1)  # [B, T, context·E]
        return self.head(torch.tanh(self.hidden(windows)))


def build_mlp(config: ContextMLPConfig) -> ContextMLP:
    """The registered factory's body: the engine hands the section as a ContextMLPConfig."""
    return ContextMLP(config.vocab_size or 256, config.context, config.embed_size, config.hidden_size)
