"""`speedtronic sample CHECKPOINT`: generate text from a trained model so a person can see what it learned."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, emit_json


def sample(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A step_*.pt file, a checkpoint directory (its latest), or a Hugging Face model folder "
            "(e.g. from `speedtronic export`).",
            metavar="CHECKPOINT",
            show_default=False,
        ),
    ],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue.")] = "\n",
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", "-n", min=0, help="Default 200 (a folder: its generation_config)."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature", "-t", min=0.0, help="0 is greedy. Default 0.8 (a folder: its generation_config)."
        ),
    ] = None,
    top_k: Annotated[
        int | None, typer.Option("--top-k", min=1, help="Default none (a folder: its generation_config).")
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the sampling RNG (same seed, same text).")
    ] = 1337,
    device: Annotated[
        str, typer.Option("--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.")
    ] = "auto",
    json_: JsonOption = False,
) -> None:
    """Continue a prompt with the model stored in a checkpoint or a Hugging Face model folder.

    Example: `speedtronic sample runs/shakespeare/checkpoints --prompt "ROMEO:" --temperature 0`.
    """
    from speedtronic.interop.hf_folder import is_hf_folder

    extra = {}
    if is_hf_folder(checkpoint):
        from speedtronic.interop.hf_folder import sample_folder

        text, extra["generation"] = sample_folder(
            checkpoint,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            device=device,
        )
    else:
        from speedtronic.engine.sampling import generate_text
        from speedtronic.plugins import registries

        text = generate_text(
            checkpoint,
            prompt=prompt,
            max_new_tokens=200 if max_new_tokens is None else max_new_tokens,
            temperature=0.8 if temperature is None else temperature,
            top_k=top_k,
            seed=seed,
            device=device,
            registries=registries(),
        )
    if json_:
        emit_json({"prompt": prompt, "text": text, "checkpoint": str(checkpoint), **extra})
    else:
        typer.echo(prompt + text)


def register(app: typer.Typer) -> None:
    app.command("sample", rich_help_panel="Training")(sample)
