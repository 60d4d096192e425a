"""`speedtronic master CONFIG` and `speedtronic worker CONFIG --repo REPO`: DumbDiLoCo training.

REPO is `owner/name` (a Hugging Face Hub run repo), `file://PATH` (a shared directory) or
`s3://BUCKET/PREFIX` (an S3-compatible bucket); speedtronic.diloco.bus.registry picks the bus. The Hub
endpoint comes from --endpoint, then distributed.bus.endpoint, then HF_ENDPOINT. Like every CLI module,
this one never imports torch at import time (the work happens in speedtronic.diloco.launch).
"""

from __future__ import annotations

from typing import Annotated

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, emit_json

RepoOption = Annotated[
    str | None,
    typer.Option(
        "--repo",
        help="The run: owner/name (Hub), file://PATH (directory) or s3://BUCKET/PREFIX; "
        "default distributed.bus.repo_id.",
    ),
]
EndpointOption = Annotated[
    str | None,
    typer.Option(
        "--endpoint",
        help="Hub or S3 endpoint URL (default distributed.bus.endpoint, then HF_ENDPOINT, or AWS_ENDPOINT_URL for s3://).",
    ),
]
MaxStepsOption = Annotated[
    int | None, typer.Option("--max-steps", min=1, help="Stop local training after this step (resumable).")
]


def master(
    config: ConfigArgument,
    repo: RepoOption = None,
    set_: SetOption = None,
    endpoint: EndpointOption = None,
    train: Annotated[
        bool | None,
        typer.Option(
            "--train/--no-train",
            help="Also train as a worker (default distributed.master.trains).",
            show_default=False,
        ),
    ] = None,
    outer_steps: Annotated[
        int | None,
        typer.Option(
            "--outer-steps",
            min=1,
            help="Stop after this outer step (default: the manifest's run.outer_steps, one per sync point: "
            "max_steps / inner_steps, times distributed.sync.fragments).",
        ),
    ] = None,
    max_steps: MaxStepsOption = None,
    standby: Annotated[
        bool,
        typer.Option(
            "--standby",
            help="While another master holds the run's lease, wait as a hot standby and take over when "
            "it lapses (default: refuse, exit 2).",
        ),
    ] = False,
    json_: JsonOption = False,
) -> None:
    """Run the outer loop: collect deltas, take Nesterov outer steps, publish the global model.

    Example: `speedtronic master diloco-local` (a file:// bus; it also trains as node "master").
    One master per run: a second one exits 2 naming the first, or with --standby takes over when the
    first one's lease (distributed.master.lease_s) lapses.
    """
    from speedtronic.diloco.launch import run_master

    out = run_master(config, set_, repo, endpoint, train, outer_steps, max_steps, standby)
    if json_:
        emit_json(out)
    else:
        typer.echo(
            f"master done: outer step {out['outer_step']} · {len(out['applied'])} deltas applied · "
            f"{len(out['rejected'])} rejected"
        )
    if out.get("train") and out["train"]["interrupted"]:
        raise typer.Exit(130)


def worker(
    config: ConfigArgument,
    repo: RepoOption = None,
    node_id: Annotated[
        str | None,
        typer.Option(
            "--node-id",
            help="This node's id (default distributed.node.id, then <host>-<hash of the output directory>, "
            "stable across restarts of one directory). One id is one worker: a second process with a live "
            "id exits 2 (distributed.node.lease_s).",
        ),
    ] = None,
    set_: SetOption = None,
    endpoint: EndpointOption = None,
    max_steps: MaxStepsOption = None,
    json_: JsonOption = False,
) -> None:
    """Train locally and exchange deltas / global models with the run every inner_steps steps.

    Example: `speedtronic worker diloco-local --node-id w1`.
    """
    from speedtronic.diloco.launch import run_worker

    out = run_worker(config, set_, repo, endpoint, node_id, max_steps)
    if "node" not in out:  # a DDP rank other than 0 (under torchrun): rank 0 reports for the worker
        raise typer.Exit(130 if out["interrupted"] else 0)
    if json_:
        emit_json(out)
    else:
        typer.echo(
            f"worker {out['node']} done: step {out['steps']} · outer step {out['outer_step']} · "
            f"{len(out['uploaded'])} deltas sent ({out['bytes_sent'] / 1e6:.2f} MB)"
        )
    if out["interrupted"]:
        raise typer.Exit(130)


def register(app: typer.Typer) -> None:
    app.command("master", rich_help_panel="DiLoCo")(master)
    app.command("worker", rich_help_panel="DiLoCo")(worker)
