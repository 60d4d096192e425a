"""`speedtronic sample CHECKPOINT`: generate text from a trained model so a person can see what it learned."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from speedtronic.cli.common import JsonOption, emit_json


def _positive(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """--top-p in (0, 1], --repetition-penalty > 0 (click's FloatRange has no open bound through typer)."""
    if value is None:
        return None
    if not value > 0 or (param.name == "top_p" and value > 1):
        bounds = "0 < P <= 1" if param.name == "top_p" else "> 0"
        raise typer.BadParameter(f"{value} is not in the range {bounds}")
    return value


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
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="Text to continue. Default: a newline.", show_default=False)
    ] = "\n",
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", "-n", min=0, help="Default 200 (a folder: its generation_config)."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature",
            "-t",
            min=0.0,
            help="0 is greedy: always the most likely token, the same text for every seed (small models "
            "tend to loop; see --repetition-penalty). Default 0.8 (a folder: its generation_config).",
        ),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option(
            "--top-k",
            min=1,
            help="Sample among the K most likely tokens. Default none (a folder: its generation_config).",
        ),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            "--top-p",
            callback=_positive,
            help="Nucleus sampling: sample among the fewest most likely tokens whose probabilities add up "
            "to P (0 < P <= 1; 1 keeps all). Default 1 (a folder: its generation_config).",
        ),
    ] = None,
    repetition_penalty: Annotated[
        float | None,
        typer.Option(
            "--repetition-penalty",
            callback=_positive,
            help="Make tokens already in the prompt or the text less likely (> 1; greedy too): their logits "
            "are divided by it (multiplied when negative), as in transformers. Default 1, off (a folder: "
            "its generation_config).",
        ),
    ] = None,
    repetition_window: Annotated[
        int | None,
        typer.Option(
            "--repetition-window",
            min=1,
            help="Penalise only the last N tokens (llama.cpp's repeat_last_n), not the whole text: a "
            "byte-level model soon has every common character in it. Default: the whole text.",
        ),
    ] = None,
    window_refill: Annotated[
        int | None,
        typer.Option(
            "--window-refill",
            min=1,
            help="Past the model's context window, re-read only the last N tokens and go on with the KV "
            "cache: faster, but each token then sees N to a whole window of context. Default: the whole "
            "window for every token, the same text as without a cache.",
        ),
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

    Prints the text as it is generated; --json prints one object at the end, with tokens_per_s.

    The built-in transformer decodes with a KV cache: the prompt is read once, then one token a step.

    Example: `speedtronic sample runs/shakespeare/checkpoints --prompt "ROMEO:" --top-p 0.9`.
    """
    from speedtronic.interop.hf_folder import is_hf_folder

    pending = [prompt]  # the prompt is echoed with the first piece: after a failed load, nothing is printed

    def echo(piece: str) -> None:
        # click.echo flushes, so each piece shows as soon as it is decoded.
        typer.echo("".join(pending) + piece, nl=False)
        pending.clear()

    on_text = None if json_ else echo
    extra: dict[str, Any] = {}
    if is_hf_folder(checkpoint):
        from speedtronic.interop.hf_folder import sample_folder

        sampled, extra["generation"] = sample_folder(
            checkpoint,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            repetition_window=repetition_window,
            window_refill=window_refill,
            seed=seed,
            device=device,
            on_text=on_text,
        )
    else:
        from speedtronic.engine.sampling import sample_checkpoint
        from speedtronic.plugins import registries

        sampled = sample_checkpoint(
            checkpoint,
            prompt=prompt,
            max_new_tokens=200 if max_new_tokens is None else max_new_tokens,
            temperature=0.8 if temperature is None else temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            repetition_window=repetition_window,
            window_refill=window_refill,
            seed=seed,
            device=device,
            registries=registries(),
            on_text=on_text,
        )
    if json_:
        emit_json(
            {
                "prompt": prompt,
                "text": sampled.text,
                "checkpoint": str(checkpoint),
                **sampled.report(),
                **extra,
            }
        )
    else:
        echo("\n")


def register(app: typer.Typer) -> None:
    app.command("sample", rich_help_panel="Training")(sample)
