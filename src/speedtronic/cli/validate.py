"""`speedtronic validate CONFIG`: validate a config and show the run plan it gives.

Two sections: the config exactly as the user's values make it (unset fields stay null, meaning
"derived"), and the plan derived from it for this machine (`--nproc`, `--device`). In text mode the
plan is printed as YAML comments below the config, so the whole output, saved to a file, is itself a
valid config that gives the same plan; `--json` prints `{"valid", "config", "plan"}`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

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

    from speedtronic.config import config_to_yaml, dump_config

    extra = [f"run.device={device}"] if device is not None else []
    cfg = load_cli_config(config, set_, extra)
    check_registered_names(cfg)
    plan = plan_for(cfg, nproc)
    if json_:
        emit_json({"valid": True, "config": dump_config(cfg), "plan": plan.as_dict()})
        return
    plan_text = yaml.safe_dump(plan.as_dict(), sort_keys=False).rstrip("\n")
    typer.echo(config_to_yaml(cfg), nl=False)
    typer.echo("# --- run plan (derived from the config above; not part of it) ---")
    typer.echo("\n".join(f"# {line}" for line in plan_text.splitlines()))
    console.print(
        f"[green]✓[/green] {config} is valid: {plan.describe_steps()}, "
        f"{plan.accum_steps} accumulation step(s) × {plan.world_size} rank(s), vocab {plan.vocab_size:,}"
    )


def plan_for(cfg: Config, nproc: int) -> RunPlan:
    """The plan `speedtronic train` would make for `cfg` on `nproc` ranks of its device, here."""
    from speedtronic.engine.data_facts import data_facts
    from speedtronic.engine.device import device_facts, resolve_device
    from speedtronic.plan import plan_run

    device = resolve_device(cfg.run.device)
    return plan_run(cfg, world_size=nproc, data=data_facts(cfg), device=device_facts(device))


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
