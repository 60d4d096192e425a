"""Choosing the next token from logits: greedy (temperature 0) or temperature + top-k sampling.

Shared by the reference model's `generate`, the generic sampling loop and plugin models, so every
model samples the same way for the same settings.
"""

from __future__ import annotations

import torch


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] of the last position → next token ids [B, 1]."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)
