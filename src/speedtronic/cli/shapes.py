"""`speedtronic shapes CONFIG`: check batch, sequence, vocabulary and model dims against tensor-core alignment.

The model is built on the meta device (no weights allocated) and read module by module; see
speedtronic/engine/preflight/shapes.py for the checks and the alignment table. A CUDA profile needs no GPU
(`--device cuda --precision bf16 --gpu H100` plans for a machine you do not have). Exit 0 even with
warnings: they are advice.
"""

from __future__ import annotations

from typing import Annotated

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, console, emit_json, load_cli_config


def shapes(
    config: ConfigArgument,
    set_: SetOption = None,
    device: Annotated[
        str | None, typer.Option("--device", help="Judge for this device: auto, cpu, cuda, cuda:N or mps.")
    ] = None,
    precision: Annotated[
        str | None, typer.Option("--precision", help="Judge for this precision: auto, fp32, bf16 or fp16.")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu", help="Plan for this GPU model when none is present, e.g. H100 (64-wide tiles)."
        ),
    ] = None,
    memory: Annotated[
        bool,
        typer.Option(
            "--memory",
            help="Also print the memory plan: estimated bytes per rank for parameters, gradients, "
            "optimizer state and activations under ddp and fsdp.",
        ),
    ] = False,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Ranks the memory plan is for (with --memory).")
    ] = 1,
    json_: JsonOption = False,
) -> None:
    """Warn about matmul dimensions that are slow on the device's tensor cores, with a fix for each;
    with --memory, estimate each rank's memory under ddp and fsdp.

    Example: `speedtronic shapes shakespeare --device cuda --precision bf16 --gpu H100` (no GPU needed);
    `speedtronic shapes shakespeare --memory --nproc 8`.
    """
    extra = []
    if device is not None:
        extra.append(f"run.device={device}")
    elif gpu is not None:
        extra.append("run.device=cuda")  # naming a GPU means planning for CUDA
    if precision is not None:
        extra.append(f"precision.mode={precision}")
    cfg = load_cli_config(config, set_, extra)

    from speedtronic.engine.preflight.shapes import check_config
    from speedtronic.plugins import registries

    profile, warnings = check_config(cfg, gpu=gpu, registries=registries())
    plan = None
    if memory:
        from speedtronic.engine.preflight.memory_plan import memory_plan

        plan = memory_plan(cfg, nproc, registries())
    if json_:
        report = {"profile": profile.as_dict(), "warnings": [w.as_dict() for w in warnings]}
        emit_json({**report, "memory": plan} if plan is not None else report)
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    out = Console(highlight=False)
    if plan is not None:
        from speedtronic.engine.preflight.memory_plan import describe_rows

        table = Table(
            "strategy",
            "params",
            "grads",
            "optimizer",
            "gathered",
            "activations",
            "total",
            title=f"memory per rank (MiB, estimated) on {nproc} rank(s): {plan['parameters']:,} parameters, "
            f"{plan['precision']}, micro-batch {plan['micro_batch'][0]}×{plan['micro_batch'][1]}",
        )
        for row in describe_rows(plan):
            table.add_row(*row)
        out.print(table)
    out.print(f"profile: {escape(profile.describe())}", soft_wrap=True)
    if not warnings:
        out.print("[green]✓[/green] no shape warnings" if profile.active else "no checks on this profile")
        return
    # The reasons are long sentences: in a table column rich would cut them ("…") at 80 columns and
    # off a terminal, so the table holds the short facts and each reason follows as a whole line.
    table = Table("code", "field", "value", "suggested", "alignment")
    for column in table.columns:
        column.overflow = "fold"
    for w in warnings:
        suggested = "—" if w.suggested is None else str(w.suggested)
        table.add_row(w.code, w.field, str(w.value), suggested, str(w.alignment))
    out.print(table)
    for w in warnings:
        out.print(f"{w.code} {escape(w.field)}: {escape(w.reason)}", soft_wrap=True)
    console.print(f"{len(warnings)} shape warning(s); apply a fix with --set FIELD=SUGGESTED")


def register(app: typer.Typer) -> None:
    app.command("shapes", rich_help_panel="Configuration")(shapes)
