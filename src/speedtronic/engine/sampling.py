"""Text generation from a checkpoint: rebuild the model from its stored plan (engine/restore.py's
`load_run`, the one way back from a checkpoint), continue a prompt. Works for any registered model: uses its `generate` when it has one, otherwise a
plain autoregressive loop over the logits."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from speedtronic.engine.decoding import next_token
from speedtronic.engine.restore import load_run
from speedtronic.errors import SpeedtronicError
from speedtronic.registry import Registries


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
    from speedtronic.engine.batches import call_model, logits_from_output

    for _ in range(max_new_tokens):
        # The training contract's calling convention (engine/batches.py): forward(x) models too.
        output, _ = call_model(model, {"input_ids": ids[:, -max_seq_len:]}, pass_labels=False)
        logits = logits_from_output(output)
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
    registries: Registries | None = None,
) -> str:
    """The continuation (without the prompt) of `prompt` by the model in checkpoint `path`."""
    run = load_run(path, device=device, registries=registries)
    model, tokenizer = run.model, run.tokenizer
    assert model is not None
    dev = next(model.parameters()).device
    prompt_ids = tokenizer.encode(prompt) or [0]
    vocab = run.plan.vocab_size
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
        run.plan.max_seq_len,
    )
    return tokenizer.decode(out[0, len(prompt_ids) :].tolist())
