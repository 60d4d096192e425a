"""`speedtronic sample CHECKPOINT`: generate text from a trained model so a person can see what it learned."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from speedtronic.cli.common import JsonOption, emit_json

if TYPE_CHECKING:
    from speedtronic.engine.sampling import Sampled, SamplingFlags


def _positive(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """--top-p in (0, 1], --repetition-penalty > 0 (click's FloatRange has no open bound through typer)."""
    if value is None:
        return None
    if not value > 0 or (param.name == "top_p" and value > 1):
        bounds = "0 < P <= 1" if param.name == "top_p" else "> 0"
        raise typer.BadParameter(f"{value} is not in the range {bounds}")
    return value


def _seed_in_range(value: int) -> int:
    """--seed fits torch's generator (a signed or unsigned 64-bit integer): one line and exit 2 if not."""
    from speedtronic.engine.decoding import SEED_MAX, SEED_MIN

    if not SEED_MIN <= value <= SEED_MAX:
        raise typer.BadParameter(f"{value} is not in the range {SEED_MIN}..{SEED_MAX} (a 64-bit integer)")
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
        int,
        typer.Option(
            "--seed", callback=_seed_in_range, help="Seed of the sampling RNG (same seed, same text)."
        ),
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
    from speedtronic.engine.sampling import SamplingFlags

    flags = SamplingFlags(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        repetition_window=repetition_window,
        window_refill=window_refill,
        seed=seed,
    )
    echo = _Echo(prompt)
    sampled, extra = _generate(checkpoint, prompt, flags, device, None if json_ else echo)
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


class _Echo:
    """Prints the text as it comes; the prompt is echoed with the first piece, so that after a failed
    load nothing is printed."""

    def __init__(self, prompt: str) -> None:
        self._pending = prompt

    def __call__(self, piece: str) -> None:
        # click.echo flushes, so each piece shows as soon as it is decoded.
        typer.echo(self._pending + piece, nl=False)
        self._pending = ""


def _generate(
    checkpoint: Path,
    prompt: str,
    flags: SamplingFlags,
    device: str,
    on_text: Callable[[str], None] | None,
) -> tuple[Sampled, dict[str, Any]]:
    """(the continuation, extra --json fields) from a Hugging Face folder or a checkpoint."""
    from speedtronic.interop.hf_folder import is_hf_folder

    if is_hf_folder(checkpoint):
        from speedtronic.interop.hf_folder import sample_folder

        sampled, generation = sample_folder(
            checkpoint, prompt=prompt, flags=flags, device=device, on_text=on_text
        )
        return sampled, {"generation": generation}
    from speedtronic.engine.sampling import sample_checkpoint
    from speedtronic.plugins import registries

    settings = flags.settings()
    sampled = sample_checkpoint(
        checkpoint,
        prompt=prompt,
        settings=settings,
        device=device,
        registries=registries(),
        on_text=on_text,
    )
    return sampled, {}


def register(app: typer.Typer) -> None:
    app.command("sample", rich_help_panel="Training")(sample)
