"""Text generation from a checkpoint: rebuild the model from its stored plan (engine/checkpoint/load_run.py's
`load_run`, the one way back from a checkpoint), continue a prompt, stream the text as it comes.

Works for any registered model. Which loop runs (`iter_new_tokens`):
  * a model with `forward_cached` (the KV-cache contract, engine/decoding.py; the reference transformer)
    is decoded incrementally: prompt prefilled once, then one token per step;
  * otherwise a model with its own `generate(input_ids, max_new_tokens, temperature=, top_k=,
    generator=)` is asked for the tokens, unless top-p or a repetition penalty is wanted (its generate
    does not take them), which falls through to
  * the plain loop that re-runs the forward over the whole (cropped) context for each token.
`Sampled` carries the text, the token ids and the timings `speedtronic sample --json` reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.engine.checkpoint.load_run import load_run
from speedtronic.engine.decoding import check_settings, stream_tokens, supports_kv_cache
from speedtronic.errors import ConfigError, SpeedtronicError
from speedtronic.registry import Registries


def iter_new_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    max_seq_len: int,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    repetition_window: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    window_refill: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens [B, 1] continuing `ids` [B, T], choosing the loop as the module docstring says."""
    check_settings(temperature, top_k, top_p, repetition_penalty, repetition_window)
    plain = (top_p is None or top_p >= 1.0) and repetition_penalty == 1.0
    own_generate = callable(getattr(model, "generate", None))
    # A model with a cache always takes the shared loop (streamed, and use_cache=False can compare).
    if own_generate and plain and not supports_kv_cache(model):
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator
            )
        yield from out[:, ids.size(1) :].split(1, dim=1)
        return
    yield from stream_tokens(
        model,
        ids,
        max_new_tokens,
        max_seq_len=max_seq_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        repetition_window=repetition_window,
        generator=generator,
        use_cache=use_cache,
        window_refill=window_refill,
    )


def generate_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    max_seq_len: int,
    *,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    repetition_window: int | None = None,
    use_cache: bool = True,
    window_refill: int | None = None,
) -> torch.Tensor:
    """`ids` [B, T] followed by max_new_tokens new tokens: [B, T + new]."""
    new = list(
        iter_new_tokens(
            model,
            ids,
            max_new_tokens,
            max_seq_len=max_seq_len,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            repetition_window=repetition_window,
            generator=generator,
            use_cache=use_cache,
            window_refill=window_refill,
        )
    )
    return torch.cat([ids, *new], dim=1)


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
    *,
    max_seq_len: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    repetition_window: int | None = None,
    window_refill: int | None = None,
    seed: int = 1337,
    eos_ids: Sequence[int] = (),
    on_text: Callable[[str], None] | None = None,
) -> Sampled:
    """Continue `prompt_ids` (batch 1) and time it; an eos id stops generation and is not kept.

    `on_text`, when given, receives the continuation's text piece by piece as it is decoded (the pieces
    add up to the returned text).
    """
    if window_refill is not None and not 0 < window_refill <= max_seq_len:
        raise ConfigError(
            f"window_refill {window_refill} is outside this model's context window (1..{max_seq_len}); "
            f"use at most {max_seq_len}"
        )
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    generator = torch.Generator(device=dev).manual_seed(seed)
    stream = TextStream(decode) if on_text is not None else None
    new: list[int] = []
    eos = set(eos_ids)
    first: float | None = None
    start = time.perf_counter()
    tokens = iter_new_tokens(
        model,
        ids,
        max_new_tokens,
        max_seq_len=max_seq_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        repetition_window=repetition_window,
        generator=generator,
        window_refill=window_refill,
    )
    for nxt in tokens:
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
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    repetition_window: int | None = None,
    window_refill: int | None = None,
    seed: int = 1337,
    device: str = "cpu",
    registries: Registries | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Sampled:
    """The continuation (without the prompt) of `prompt` by the model in checkpoint `path`, with timings."""
    try:
        check_settings(temperature, top_k, top_p, repetition_penalty, repetition_window)
    except ValueError as error:
        raise ConfigError(str(error)) from None
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
        model,
        tokenizer.decode,
        prompt_ids,
        max_seq_len=run.plan.max_seq_len,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        repetition_window=repetition_window,
        window_refill=window_refill,
        seed=seed,
        on_text=on_text,
    )


def generate_text(path: str | Path, *, prompt: str, **settings: Any) -> str:
    """The continuation (without the prompt) of `prompt`; `sample_checkpoint`'s settings, text only."""
    return sample_checkpoint(path, prompt=prompt, **settings).text
