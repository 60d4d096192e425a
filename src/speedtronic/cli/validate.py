"""`speedtronic validate CONFIG`: validate a config and show the run plan it gives.

Two sections: the config exactly as the user's values make it (unset fields stay null, meaning
"derived"), and the plan derived from it for this machine (`--nproc`, `--device`). In text mode the
plan is printed as YAML comments below the config, so the whole output, saved to a file, is itself a
valid config that gives the same plan; `--json` prints `{"valid", "config", "plan"}`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, console, emit_json, load_cli_config

if TYPE_CHECKING:
    from speedtronic.config import Config
    from speedtronic.plan import RunPlan


def validate(
    config: ConfigArgument,
    set_: SetOption = None,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Plan for this many data-parallel processes.")
    ] = 1,
    device: Annotated[
        str | None, typer.Option("--device", help="Plan for this device (default run.device).")
    ] = None,
    json_: JsonOption = False,
) -> None:
    """Validate a config and print it (token redacted) with the run plan derived from it.

    Example: `speedtronic validate shakespeare --set optimizer.lr=1e-3 --nproc 2`.
    """
    import yaml
    from rich.markup import escape

    from speedtronic.config import config_to_yaml, dump_config

    extra = [f"run.device={device}"] if device is not None else []
    cfg = load_cli_config(config, set_, extra)
    check_registered_names(cfg)
    plan = plan_for(cfg, nproc)
    resume = existing_checkpoint(cfg)
    if json_:
        emit_json({"valid": True, "config": dump_config(cfg), "plan": plan.as_dict(), "resume": resume})
        return
    plan_text = yaml.safe_dump(plan.as_dict(), sort_keys=False).rstrip("\n")
    typer.echo(config_to_yaml(cfg), nl=False)
    typer.echo("# --- run plan (derived from the config above; not part of it) ---")
    typer.echo("\n".join(f"# {line}" for line in plan_text.splitlines()))
    if resume is not None:
        console.print(f"[yellow]note:[/yellow] {escape(resume['says'])}", soft_wrap=True)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
    console.print(
        f"[green]✓[/green] {config} is valid: {plan.describe_steps()}, "
        f"{plan.accum_steps} accumulation step(s) × {plan.world_size} rank(s), vocab {plan.vocab_size:,}"
    )


def plan_for(cfg: Config, nproc: int) -> RunPlan:
    """The plan `speedtronic train` would make for `cfg` on `nproc` ranks of its device, here."""
    from speedtronic.engine.data_facts import data_facts
    from speedtronic.engine.device import facts_for_spec
    from speedtronic.plan import plan_run

    # A CPU run is planned without importing torch (seconds): validate stays as fast as --help.
    return plan_run(cfg, world_size=nproc, data=data_facts(cfg), device=facts_for_spec(cfg.run.device))


# Checkpoint names as engine/checkpoint/files.py writes them; read here without importing torch.
_STEP_NAME = re.compile(r"step_(\d+)\.(pt|dcp)")


def existing_checkpoint(cfg: Config) -> dict[str, Any] | None:
    """The checkpoint `train` would resume for this config, read from its directory's names only (no
    torch, no unpickling), with what resuming it would do: None when there is none.

    `{"checkpoint", "step", "complete", "says"}`: a run name reused by an edited copy of a config
    would otherwise resume (and fail on, or silently extend) the earlier run."""
    setting = cfg.checkpoint.resume
    if cfg.distributed.enabled or (not cfg.checkpoint.enabled and setting is not True):
        return None  # a DiLoCo node keeps its checkpoints per node (master/worker say what they resume)
    directory = Path(cfg.checkpoint_dir())
    if not directory.is_dir():
        return None
    try:
        named = {path.name: path for path in directory.iterdir() if _STEP_NAME.fullmatch(path.name)}
    except OSError:
        return None  # `train` says what is wrong with the directory
    try:
        pointer = (directory / "latest").read_text(encoding="utf-8", errors="replace")[:4096].strip()
    except OSError:
        pointer = ""
    latest = named.get(pointer) or max(named.values(), default=None, key=_step_of)
    if latest is None:
        return None
    step, total, name = _step_of(latest), cfg.max_steps(), cfg.run.name
    if setting is False:
        says = (
            f"{latest} already exists; with checkpoint.resume false `train` refuses to overwrite it: "
            f"set another run.name (--set run.name=NEW) for a new run"
        )
    elif step >= total:
        says = (
            f"run {name} is already complete: {latest} is at step {step} of run.max_steps={total}, so "
            f"`train` has nothing to do; extend it with --set run.max_steps=N (N > {step}), or set another "
            "run.name for a new run"
        )
    else:
        says = (
            f"a checkpoint of run {name} exists ({latest}, step {step}): `train` resumes it and trains steps "
            f"{step + 1}…{total} with its weights and optimizer state (a changed model cannot resume it: "
            "set another run.name for a new run)"
        )
    return {"checkpoint": str(latest), "step": step, "complete": step >= total, "says": says}


def _step_of(path: Path) -> int:
    match = _STEP_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else -1


def check_registered_names(cfg: object) -> None:
    """Names that select plugins (model, optimizer, hooks) must be registered; no torch is imported."""
    from speedtronic.plugins import registries

    found = registries()
    found.models.get(cfg.model.name)  # type: ignore[attr-defined]
    found.optimizers.get(cfg.optimizer.name)  # type: ignore[attr-defined]
    for hook in cfg.logging.hooks:  # type: ignore[attr-defined]
        found.hooks.get(hook)


def register(app: typer.Typer) -> None:
    app.command("validate", rich_help_panel="Configuration")(validate)
