"""The run manifest: what every participant must agree on before it may touch the run.

    {"format": 1, "kind": "speedtronic-diloco-run", "fingerprint": "sha256:…",
     "params": {name: {"shape": [...], "dtype": "float32"}},
     "run": {model, block size, inner_steps, outer_steps (the run's end), outer optimizer, codec,
             tokens_per_step, max_delta_tokens (what one delta may claim), fragments (Streaming
             DiLoCo's count, offsets and partition digest; only when there are several) …},
     "collaborators": {node: {"user": …, "delta_repo": … | null, "added_at": …}}}

`max_delta_tokens` is one node's plan for one round, inner_steps × tokens_per_step, the weight a
delta may claim at most (the master clips past it). tokens_per_step is data.target_batch_size ×
block_size when the batch is fixed, else micro_batch_size × block_size × MAX_NODE_RANKS (a node of up
to that many ranks; one with more is under-weighted, never refused; diloco/spec.py). Manifests written
before these fields are still read: every role then derives the same bound from its own config
(`RunSpec.of_run`). The manifest is read back through one validating parser (diloco/documents.py).

The fingerprint covers parameter names, shapes and dtypes (see codec.fingerprint); a worker whose
model differs is refused with the first difference spelled out. The manifest never holds secrets.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from speedtronic.diloco import codec
from speedtronic.errors import ConfigError, SpeedtronicError

if TYPE_CHECKING:
    from speedtronic.config import Config

KIND = "speedtronic-diloco-run"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def build_manifest(config: Config, specs: dict[str, codec.ParamSpec]) -> dict[str, Any]:
    """A new run's manifest, written from its RunSpec (diloco/spec.py): what the master plans is what
    every node reads back (outer lr and momentum resolved from their defaults, never null)."""
    from speedtronic.diloco.spec import RunSpec, tokens_per_step

    spec = RunSpec.from_config(config, specs)
    manifest = {
        "format": codec.FORMAT_VERSION,
        "kind": KIND,
        "fingerprint": spec.fingerprint,
        "params": codec.specs_to_json(specs),
        "run": {
            "name": config.run.name,
            "model": config.model.model_dump(mode="json"),
            "block_size": config.data.block_size,
            "max_steps": config.max_steps(),
            "inner_steps": config.distributed.sync.inner_steps,
            # The run's explicit end, which every worker reads: the master's planned outer steps.
            # (Streaming DiLoCo: one outer step per fragment sync, diloco/fragments.py.)
            "outer_steps": spec.outer_steps,
            "sync_ramp": config.distributed.sync.ramp,
            "outer_lr": spec.outer_lr,
            "outer_momentum": spec.outer_momentum,
            "delta_codec": spec.delta_codec,
            "tokens_per_step": tokens_per_step(config),
            "max_delta_tokens": spec.max_delta_tokens,
        },
        "collaborators": {},
        "created_at": now(),
    }
    if spec.fragments.count > 1:  # P=1 manifests stay as they were; a missing entry reads as one fragment
        manifest["run"]["fragments"] = spec.fragments.manifest_entry()
    return manifest


def check_manifest(manifest: dict[str, Any], specs: dict[str, codec.ParamSpec], where: str) -> None:
    """Raise ConfigError (exit 2) saying why this model may not join the run described by `manifest`."""
    if manifest.get("kind") != KIND or manifest.get("format") != codec.FORMAT_VERSION:
        raise ConfigError(
            f"{where}: manifest.json is not a speedtronic DiLoCo run of format {codec.FORMAT_VERSION} "
            f"(kind {manifest.get('kind')!r}, format {manifest.get('format')!r})"
        )
    mine = codec.fingerprint(specs)
    if manifest.get("fingerprint") == mine:
        return
    theirs = codec.specs_from_json(manifest.get("params") or {})
    reason = "parameter lists differ"
    for name in sorted(set(theirs) | set(specs)):
        if name not in specs:
            reason = f"the run has parameter {name} {list(theirs[name].shape)}, this model does not"
            break
        if name not in theirs:
            reason = f"this model has parameter {name} {list(specs[name].shape)}, the run does not"
            break
        if theirs[name] != specs[name]:
            reason = (
                f"{name} is {list(specs[name].shape)} {specs[name].dtype} here but "
                f"{list(theirs[name].shape)} {theirs[name].dtype} in the run"
            )
            break
    raise ConfigError(
        f"{where}: this model does not match the run's model fingerprint ({reason}); use the run's "
        f"config (manifest run.model: {manifest.get('run', {}).get('model')})"
    )


def check_inner_steps(manifest: dict[str, Any], config: Config, where: str) -> None:
    """A master restarted on a run with another distributed.sync.inner_steps is refused (ConfigError):
    the run's rounds, token bounds and end were planned with the manifest's."""
    run = manifest.get("run") if isinstance(manifest.get("run"), dict) else {}
    theirs, mine = run.get("inner_steps"), config.distributed.sync.inner_steps
    if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs != mine:
        raise ConfigError(
            f"{where}: distributed.sync.inner_steps is {mine} here, but the run syncs every {theirs} inner "
            f"steps (manifest.json run.inner_steps); set distributed.sync.inner_steps={theirs}"
        )


def add_collaborator(
    manifest: dict[str, Any], node: str, user: str | None = None, delta_repo: str | None = None
) -> dict[str, Any]:
    if not codec.NODE_RE.match(node):
        raise SpeedtronicError(f"invalid collaborator/node id {node!r} (letters, digits, . _ - only)")
    collaborators = dict(manifest.get("collaborators") or {})
    collaborators[node] = {"user": user or node, "delta_repo": delta_repo, "added_at": now()}
    return {**manifest, "collaborators": collaborators}
