"""Choosing next tokens: the one sampling rule and the one decoding loop every model shares.

`next_token` turns the last position's logits into a token: greedy (temperature 0) or temperature
sampling, optionally restricted by top-k and/or top-p (nucleus), after an optional repetition penalty.
Shared by the reference model's `generate`, the generic loop below, Hugging Face folders and plugin
models, so every model samples the same way for the same settings.

`stream_tokens` is the autoregressive loop, one token at a time. A model that has
`forward_cached(input_ids, cache) -> (last logits [B, V], cache)` (the reference transformer does; see
`Transformer.forward_cached`) is decoded with its KV cache: the prompt is prefilled once, then each step
feeds only the newest token. Any other model is decoded by re-running its forward over the whole
(cropped) context every step, through the training contract's calling convention (engine/batches.py).

The context window: a model sees at most `max_seq_len` tokens. When the sequence grows past it, the
cached loop re-prefills the last `max_seq_len` tokens for each further token: exactly the computation
full-context sampling does, so the text is the same at every length (a sliding KV cache would not be: the
cached keys of later layers were computed while older tokens were still visible). Only the tokens
that fit in the window are sped up. `window_refill=N` trades that exactness for speed: past the window,
only the last N tokens are prefilled and decoding continues one token a step until the window is full
again, so each token sees between N and max_seq_len tokens of context (the text then differs from
full-context sampling past the window, never within it).

`SamplingSettings` is the one frozen object that carries these settings (and the seed and the number of
tokens) from the command line through `sample_checkpoint` / `sample_folder` / `run_sampling` down to
`stream_tokens`; it checks them when made, so every layer below may trust them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def check_settings(
    temperature: float,
    top_k: int | None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    repetition_window: int | None = None,
) -> None:
    """Raise ValueError naming the setting that is out of range."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if repetition_window is not None and repetition_window <= 0:
        raise ValueError(f"repetition_window must be positive or None, got {repetition_window}")


# What torch.Generator.manual_seed accepts (a signed or an unsigned 64-bit integer).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingSettings:
    """How many tokens to generate and how to choose each; ValueError naming the setting when out of range.

    The defaults are `speedtronic sample`'s. `window_refill` is checked against the model's context window
    where that is known (`stream_tokens`); `seed` seeds the generator `run_sampling` draws from.
    """

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    repetition_window: int | None = None
    window_refill: int | None = None
    seed: int = 1337

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        check_settings(
            self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.repetition_window
        )
        if self.window_refill is not None and self.window_refill <= 0:
            raise ValueError(f"window_refill must be positive or None, got {self.window_refill}")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in {SEED_MIN}..{SEED_MAX}, got {self.seed}")

    @property
    def plain(self) -> bool:
        """No top-p and no repetition penalty: what a model's own `generate` can do as well."""
        return (self.top_p is None or self.top_p >= 1.0) and self.repetition_penalty == 1.0


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty, as in transformers: every token id in `history` [B, T] has its logit
    divided by `penalty` when positive and multiplied by it when negative, so penalty > 1 always makes
    it less likely (a plain division would make negative logits *more* likely). Returns a new tensor."""
    seen = history.to(device=logits.device, dtype=torch.long)
    scores = logits.gather(-1, seen)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.clone().scatter_(-1, seen, scores)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # The mass strictly before each token: a token is dropped once that alone already reaches top_p,
    # so the most likely token always survives and the kept set is the smallest one reaching top_p.
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] of the last position → next token ids [B, 1].

    The repetition penalty (over the token ids in `history` [B, T]) comes first, so it applies to
    greedy decoding too; then temperature, top-k and top-p. With top_p None (or 1) and penalty 1 the
    operations are exactly those of plain temperature/top-k sampling, so a seed gives the same tokens.
    """
    logits = logits.float()
    if repetition_penalty != 1.0 and history is not None and history.numel():
        logits = apply_repetition_penalty(logits, history, repetition_penalty)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = _top_p_filter(logits, top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether `model` declares incremental decoding: a callable `forward_cached` (the model contract)."""
    return callable(getattr(model, "forward_cached", None))


def _full_context_logits(model: nn.Module, context: torch.Tensor) -> torch.Tensor:
    from speedtronic.engine.batches import call_model, logits_from_output

    output, _ = call_model(model, {"input_ids": context}, pass_labels=False)
    return logits_from_output(output)[:, -1, :]


@torch.no_grad()
def stream_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    settings: SamplingSettings,
    *,
    max_seq_len: int,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield up to settings.max_new_tokens next-token tensors [B, 1] continuing `ids` [B, T], one per step.

    Uses the model's KV cache when it has one and `use_cache` is set (see the module docstring for the
    contract and the context window). The caller may stop early (e.g. at an end-of-sequence token): no
    forward is run for a token nobody asked for. The repetition penalty looks at the whole sequence so
    far (prompt included), as transformers does, or at its last `repetition_window` tokens (llama.cpp's
    repeat_last_n: with a byte-level model every common character is soon "seen", so a penalty over the
    whole sequence fades; over a short window it still breaks loops). The model's mode is left as it is.
    """
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    window_refill, window = settings.window_refill, settings.repetition_window
    if window_refill is not None and not 0 < window_refill <= max_seq_len:
        raise ValueError(f"window_refill must be in 1..max_seq_len ({max_seq_len}), got {window_refill}")
    cached = use_cache and supports_kv_cache(model)
    cache: Any = None
    cached_len = 0  # tokens the cache holds; it always ends one token before the end of `ids`
    for _ in range(settings.max_new_tokens):
        if not cached:
            logits = _full_context_logits(model, ids[:, -max_seq_len:])
        elif cache is None or cached_len + 1 > max_seq_len:
            # First step, or the window is full: prefill the last max_seq_len tokens from scratch
            # (past the window, the last window_refill when asked).
            keep = max_seq_len if cache is None or window_refill is None else window_refill
            context = ids[:, -keep:]
            logits, cache = model.forward_cached(context, None)
            cached_len = context.size(1)
        else:
            logits, cache = model.forward_cached(ids[:, -1:], cache)
            cached_len += 1
        nxt = next_token(
            logits,
            settings.temperature,
            settings.top_k,
            generator,
            top_p=settings.top_p,
            repetition_penalty=settings.repetition_penalty,
            history=ids if window is None else ids[:, -window:],
        ).to(ids.dtype)
        ids = torch.cat((ids, nxt), dim=1)
        yield nxt
