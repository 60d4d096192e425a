"""Text generation from a checkpoint: rebuild the model from the config stored in it, load the weights,
continue a prompt. Works for any registered model: uses its `generate` when it has one, otherwise a
plain autoregressive loop over the logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.config import load_config
from speedtronic.engine import checkpoint as ckpt
from speedtronic.engine.build import build_model
from speedtronic.engine.decoding import next_token
from speedtronic.engine.device import resolve_device
from speedtronic.errors import CheckpointError, SpeedtronicError


def load_model_from_checkpoint(path: str | Path, device: str = "cpu") -> tuple[nn.Module, Any, Any]:
    """(model in eval mode, tokenizer, config) from a checkpoint file or directory."""
    from speedtronic.engine.data import load_tokenizer

    payload = ckpt.load_checkpoint(path)
    if not isinstance(payload.get("config"), dict):
        raise CheckpointError(f"{path} has no stored config, so its model cannot be rebuilt")
    config = load_config(payload["config"])
    tokenizer = load_tokenizer(config.data.tokenizer)
    vocab = config.model.vocab_size or config.data.vocab_size or tokenizer.vocab_size
    model = build_model(config, vocab)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as error:
        raise CheckpointError(f"{path}: weights do not fit the stored model config ({error})") from None
    return model.to(resolve_device(device)).eval(), tokenizer, config


@torch.no_grad()
def generate_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    max_seq_len: int,
) -> torch.Tensor:
    if hasattr(model, "generate"):
        return model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    for _ in range(max_new_tokens):
        output = model(input_ids=ids[:, -max_seq_len:])
        logits = (
            output["logits"]
            if isinstance(output, dict)
            else (output[0] if isinstance(output, tuple) else output)
        )
        nxt = next_token(logits[:, -1, :], temperature, top_k, generator)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def generate_text(
    path: str | Path,
    *,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 1337,
    device: str = "cpu",
) -> str:
    """The continuation (without the prompt) of `prompt` by the model in checkpoint `path`."""
    model, tokenizer, config = load_model_from_checkpoint(path, device)
    dev = next(model.parameters()).device
    prompt_ids = tokenizer.encode(prompt) or [0]
    vocab = config.model.vocab_size or tokenizer.vocab_size
    if max(prompt_ids) >= vocab:
        raise SpeedtronicError(
            f"the prompt has token id {max(prompt_ids)}, outside this model's vocabulary ({vocab}); "
            "was it trained on synthetic tokens? Use a prompt the training tokenizer can express"
        )
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    generator = torch.Generator(device=dev).manual_seed(seed)
    out = generate_tokens(
        model,
        ids,
        max_new_tokens,
        temperature,
        top_k,
        generator,
        config.model.max_seq_len or config.data.block_size,
    )
    return tokenizer.decode(out[0, len(prompt_ids) :].tolist())
