"""A small gated-recurrent (GRU) language model, registered by the plugin as "example-gru".

Unlike the built-in transformer there is no attention and no position encoding: stacked GRU layers
carry a hidden state along the sequence, so every token costs the same however long the context is,
and generation feeds only the newest token instead of re-reading the whole prompt.

    tokens -> embedding -> GRU x n_layer -> (projection) -> LayerNorm -> head (tied to the embedding)

The trainer's contract (see `speedtronic.hookspecs.register_models`): `forward(input_ids, labels=None)`
returns {"logits", "loss"}. Labels arrive already shifted by the data pipeline (labels[t] is the target
at position t), so nothing is shifted here; -100 marks positions to ignore.

This module imports torch at the top, so the plugin imports it only inside its factory (plugin.py):
`speedtronic --help` loads every plugin and must not pay for torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from speedtronic.engine.decoding import next_token
from torch import nn

if TYPE_CHECKING:
    from speedtronic.config import ModelConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GRUOptions:
    """The model's own settings, read from `model.options` in the run config."""

    hidden_size: int | None = None  # width of the recurrent state (default: model.d_model)
    # std of the normal init of the embedding (and projection). Larger than GPT-2's 0.02: the embedding
    # feeds the GRU gates directly, with no norm in between, and 0.02-sized inputs barely move them
    # (classic RNN LMs use U(-0.1, 0.1)). On the synthetic smoke data: loss 3.2 vs 4.5 after 30 steps.
    init_std: float = 0.1

    @classmethod
    def parse(cls, options: dict[str, Any]) -> GRUOptions:
        """Validate `model.options`; a typo must fail loudly, not be ignored."""
        known = [f.name for f in fields(cls)]
        for key in options:
            if key not in known:
                raise ValueError(
                    f"unknown model.options key {key!r}; example-gru accepts: {', '.join(known)}"
                )
        hidden = options.get("hidden_size")
        # bool is an int subclass: reject `hidden_size: true` explicitly.
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0):
            raise ValueError(f"model.options.hidden_size must be a positive integer, not {hidden!r}")
        std = options.get("init_std", cls.init_std)
        if isinstance(std, bool) or not isinstance(std, (int, float)) or std <= 0:
            raise ValueError(f"model.options.init_std must be a positive number, not {std!r}")
        return cls(hidden_size=hidden, init_std=float(std))


class GRULM(nn.Module):
    """Embedding -> stacked GRU -> projection to d_model (when the state is wider) -> LayerNorm -> head."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layer: int,
        max_seq_len: int,
        dropout: float = 0.0,
        hidden_size: int | None = None,
        tie_weights: bool = True,
        init_std: float = 0.1,
    ) -> None:
        super().__init__()
        hidden = hidden_size or d_model
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.drop = nn.Dropout(dropout)
        # nn.GRU runs the whole recurrence in one fused kernel (cuDNN on GPU); a Python loop over time
        # steps would launch T times as many kernels. Its own dropout acts only between stacked layers
        # (and warns when there is a single layer), hence the explicit dropout around it.
        self.gru = nn.GRU(
            d_model, hidden, num_layers=n_layer, batch_first=True, dropout=dropout if n_layer > 1 else 0.0
        )
        # Back to d_model so the output head can share the embedding matrix whatever the state width.
        self.proj: nn.Module = nn.Linear(hidden, d_model, bias=False) if hidden != d_model else nn.Identity()
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.embed.weight  # one matrix reads tokens in and scores them out
        # The GRU keeps PyTorch's default uniform init (±1/sqrt(hidden)), which suits its gates.
        nn.init.normal_(self.embed.weight, std=init_std)
        if not tie_weights:
            nn.init.normal_(self.head.weight, std=init_std)
        if isinstance(self.proj, nn.Linear):
            nn.init.normal_(self.proj.weight, std=init_std)

    def _run(self, input_ids: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, V] for `input_ids` [B, T], continuing from `state`; returns the new state too."""
        x = self.drop(self.embed(input_ids))
        x, state = self.gru(x, state)
        return self.head(self.norm(self.proj(self.drop(x)))), state

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if input_ids.size(1) > self.max_seq_len:
            raise ValueError(f"sequence length {input_ids.size(1)} exceeds max_seq_len {self.max_seq_len}")
        logits, _ = self._run(input_ids, None)
        out = {"logits": logits}
        if labels is not None:
            # float32 softmax for a stable loss under autocast; labels are already shifted.
            out["loss"] = F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX
            )
        return out

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue `ids` [B, T]; returns prompt + new tokens. `speedtronic sample` calls this.

        The state summarises everything read so far, so each new token is one GRU step and there is
        no context window to crop (max_seq_len only bounds what forward sees in training).
        """
        logits, state = self._run(ids, None)
        for _ in range(max_new_tokens):
            nxt = next_token(logits[:, -1, :], temperature, top_k, generator)
            ids = torch.cat([ids, nxt], dim=1)
            logits, state = self._run(nxt, state)
        return ids


def build_gru(config: ModelConfig) -> GRULM:
    """The registered factory's body: a GRULM from the run's `model` section."""
    options = GRUOptions.parse(config.options)
    return GRULM(
        vocab_size=config.vocab_size or 256,
        d_model=config.d_model,
        n_layer=config.n_layer,
        max_seq_len=config.max_seq_len or 256,
        dropout=config.dropout,
        hidden_size=options.hidden_size,
        tie_weights=config.tie_weights,
        init_std=options.init_std,
    )
