"""`speedtronic export CHECKPOINT OUTDIR --format hf`: a checkpoint as a Hugging Face model folder."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, console, emit_json


class ExportFormat(str, Enum):
    """What `--format` can write (one format so far; the flag names it so that more can come)."""

    hf = "hf"


class ExportDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A step_*.pt file, or a checkpoint directory (its latest).",
            metavar="CHECKPOINT",
            show_default=False,
        ),
    ],
    outdir: Annotated[
        Path, typer.Argument(help="The folder to write (new or empty).", metavar="OUTDIR", show_default=False)
    ],
    export_format: Annotated[
        ExportFormat, typer.Option("--format", "-f", help="hf: a transformers model folder.")
    ] = ExportFormat.hf,
    dtype: Annotated[
        ExportDtype | None, typer.Option("--dtype", help="Weight dtype (default: the checkpoint's).")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Write into a non-empty OUTDIR.")] = False,
    push_to_hub: Annotated[
        str | None,
        typer.Option("--push-to-hub", help="Also upload to this Hub repo (owner/name).", metavar="REPO"),
    ] = None,
    endpoint: Annotated[
        str | None, typer.Option("--endpoint", help="Hub endpoint URL (default HF_ENDPOINT, then the Hub).")
    ] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the Hub repo as private.")] = False,
    json_: JsonOption = False,
) -> None:
    """Write a checkpoint as a Hugging Face folder (safetensors, config.json, generation_config.json,
    tokenizer) that transformers.AutoModelForCausalLM.from_pretrained loads; optionally push it.

    Example: `speedtronic export runs/shakespeare/checkpoints out/shakespeare-hf --format hf`.
    """
    from speedtronic.interop.hf_export import export_hf

    token = None
    if push_to_hub:  # fail before writing anything when there is no token to push with
        from speedtronic.interop.hub_upload import resolve_token

        token = resolve_token()
    writers = {ExportFormat.hf: export_hf}
    result = writers[export_format](
        checkpoint, outdir, dtype=dtype.value if dtype else None, overwrite=overwrite
    )
    if not json_:
        console.print(
            f"exported {result['checkpoint']} (step {result['step']}) as {result['architecture']} "
            f"to {result['output']}: {', '.join(result['files'])}",
            soft_wrap=True,
        )
    if push_to_hub:
        from speedtronic.interop.hub_upload import push_folder

        result["url"] = push_folder(outdir, push_to_hub, token=token, endpoint=endpoint, private=private)
        if not json_:
            console.print(f"pushed to {result['url']}", soft_wrap=True)
    if json_:
        emit_json(result)


def register(app: typer.Typer) -> None:
    app.command("export", rich_help_panel="Training")(export)
