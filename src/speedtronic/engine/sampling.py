"""Text generation from a checkpoint: rebuild the model from its stored plan (engine/checkpoint/load_run.py's
`load_run`, the one way back from a checkpoint), continue a prompt, stream the text as it comes.

Works for any registered model. Which loop runs (`iter_new_tokens`):
  * a model with `forward_cached` (the KV-cache contract, engine/decoding.py; the reference transformer)
    is decoded incrementally: prompt prefilled once, then one token per step;
  * otherwise a model with its own `generate(input_ids, max_new_tokens, temperature=, top_k=,
    generator=)` is asked for the tokens, unless top-p or a repetition penalty is wanted (its generate
    does not take them), which falls through to
  * the plain loop that re-runs the forward over the whole (cropped) context for each token.
What to sample with is one `SamplingSettings` (engine/decoding.py), made and checked once by the caller
(`SamplingFlags.settings()` for a checkpoint, `resolve_generation` for a Hugging Face folder).
`Sampled` carries the text, the token ids and the timings `speedtronic sample --json` reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.engine.checkpoint.load_run import load_run
from speedtronic.engine.decoding import SamplingSettings, stream_tokens, supports_kv_cache
from speedtronic.errors import ConfigError, SpeedtronicError
from speedtronic.registry import Registries

DEFAULT_SETTINGS = SamplingSettings()  # `speedtronic sample`'s defaults


@dataclass(frozen=True)
class SamplingFlags:
    """What `speedtronic sample`'s flags asked for: None where a flag was not given, so that a Hugging
    Face folder's generation_config (interop/hf_folder.py), then `DEFAULT_SETTINGS`, decide."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    repetition_window: int | None = None
    window_refill: int | None = None
    seed: int = DEFAULT_SETTINGS.seed

    def given(self) -> dict[str, Any]:
        """The settings the flags set, as `SamplingSettings` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def settings(self) -> SamplingSettings:
        """The flags over `DEFAULT_SETTINGS` (a checkpoint has no generation_config); ConfigError naming
        the setting when one is out of range."""
        try:
            return replace(DEFAULT_SETTINGS, **self.given())
        except ValueError as error:
            raise ConfigError(str(error)) from None


def iter_new_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    settings: SamplingSettings,
    *,
    max_seq_len: int,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens [B, 1] continuing `ids` [B, T], choosing the loop as the module docstring says."""
    own_generate = callable(getattr(model, "generate", None))
    # A model with a cache always takes the shared loop (streamed, and use_cache=False can compare).
    if own_generate and settings.plain and not supports_kv_cache(model):
        with torch.no_grad():
            out = model.generate(
                ids,
                settings.max_new_tokens,
                temperature=settings.temperature,
                top_k=settings.top_k,
                generator=generator,
            )
        yield from out[:, ids.size(1) :].split(1, dim=1)
        return
    yield from stream_tokens(
        model, ids, settings, max_seq_len=max_seq_len, generator=generator, use_cache=use_cache
    )


def generate_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    settings: SamplingSettings,
    *,
    max_seq_len: int,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """`ids` [B, T] followed by settings.max_new_tokens new tokens: [B, T + new]."""
    tokens = iter_new_tokens(
        model, ids, settings, max_seq_len=max_seq_len, generator=generator, use_cache=use_cache
    )
    return torch.cat([ids, *tokens], dim=1)


class TextStream:
    """Turns token ids, one at a time, into the text to print now.

    The whole continuation is decoded again on each token (decoding is not always concatenative: a byte
    tokenizer's multi-byte character arrives in pieces), and a piece is held back while the text ends in
    U+FFFD, an incomplete character that the next token may complete.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._printed = ""

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self._printed):
            return ""
        piece, self._printed = text[len(self._printed) :], text
        return piece

    def finish(self) -> str:
        """What is left to print once generation has stopped."""
        text = self._decode(self._ids)
        common = 0  # a tokenizer that re-merged the end: print from where the texts first differ
        for a, b in zip(text, self._printed, strict=False):
            if a != b:
                break
            common += 1
        self._printed = text
        return text[common:]


@dataclass
class Sampled:
    """One continuation and how fast it came."""

    text: str
    token_ids: list[int]
    generation_s: float  # from the first forward (the prefill) to the last token
    time_to_first_token_s: float | None
    kv_cache: bool

    @property
    def tokens_per_s(self) -> float | None:
        if not self.token_ids or self.generation_s <= 0:
            return None
        return len(self.token_ids) / self.generation_s

    def report(self) -> dict[str, Any]:
        """The JSON fields `speedtronic sample --json` adds."""
        tps, ttft = self.tokens_per_s, self.time_to_first_token_s
        return {
            "new_tokens": len(self.token_ids),
            "tokens_per_s": None if tps is None else round(tps, 2),
            "time_to_first_token_s": None if ttft is None else round(ttft, 4),
            "generation_s": round(self.generation_s, 4),
            "kv_cache": self.kv_cache,
        }


def run_sampling(
    model: nn.Module,
    decode: Callable[[Sequence[int]], str],
    prompt_ids: list[int],
    settings: SamplingSettings,
    *,
    max_seq_len: int,
    eos_ids: Sequence[int] = (),
    on_text: Callable[[str], None] | None = None,
) -> Sampled:
    """Continue `prompt_ids` (batch 1) and time it; an eos id stops generation and is not kept.

    `on_text`, when given, receives the continuation's text piece by piece as it is decoded (the pieces
    add up to the returned text).
    """
    refill = settings.window_refill
    if refill is not None and not 0 < refill <= max_seq_len:
        raise ConfigError(
            f"window_refill {refill} is outside this model's context window (1..{max_seq_len}); "
            f"use at most {max_seq_len}"
        )
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    generator = torch.Generator(device=dev).manual_seed(settings.seed)
    stream = TextStream(decode) if on_text is not None else None
    new: list[int] = []
    eos = set(eos_ids)
    first: float | None = None
    start = time.perf_counter()
    for nxt in iter_new_tokens(model, ids, settings, max_seq_len=max_seq_len, generator=generator):
        token = int(nxt[0, 0])  # .item(): waits for the device, so the clock below is honest
        if first is None:
            first = time.perf_counter() - start
        if token in eos:
            break
        new.append(token)
        if stream is not None and on_text is not None:
            piece = stream.push(token)
            if piece:
                on_text(piece)
    seconds = time.perf_counter() - start
    if stream is not None and on_text is not None:
        rest = stream.finish()
        if rest:
            on_text(rest)
    return Sampled(decode(new), new, seconds, first, supports_kv_cache(model))


def sample_checkpoint(
    path: str | Path,
    *,
    prompt: str,
    settings: SamplingSettings = DEFAULT_SETTINGS,
    device: str = "cpu",
    registries: Registries | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Sampled:
    """The continuation (without the prompt) of `prompt` by the model in checkpoint `path`, with timings."""
    run = load_run(path, device=device, registries=registries)
    model, tokenizer = run.model, run.tokenizer
    assert model is not None
    prompt_ids = tokenizer.encode(prompt) or [0]
    vocab = run.plan.vocab_size
    if max(prompt_ids) >= vocab:
        raise SpeedtronicError(
            f"the prompt has token id {max(prompt_ids)}, outside this model's vocabulary ({vocab}); "
            "was it trained on synthetic tokens? Use a prompt the training tokenizer can express"
        )
    return run_sampling(
        model, tokenizer.decode, prompt_ids, settings, max_seq_len=run.plan.max_seq_len, on_text=on_text
    )
