"""What `speedtronic master`, `speedtronic worker` and `speedtronic hub …` do, minus the argument parsing.

Per-node settings: each node checkpoints under `<output_dir>/<node>/` and shuffles its data with
`data.seed + crc32(node)`, so two nodes on one machine never share a checkpoint directory and never
train on the same batches. The master's own state lives in `distributed.master.state_dir` (default
`<output_dir>/diloco-master`), and a master that trains keeps its own node's deltas there too
(bus/local_deltas.py: they never cost a Hub commit). Nothing here prints a token; errors are SpeedtronicErrors (exit 1)
or ConfigErrors (exit 2: a usage mistake, and any mismatch with the run's config — its model, fragments,
a master's inner steps).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from speedtronic.errors import ConfigError, SpeedtronicError

if TYPE_CHECKING:
    from torch import nn

    from speedtronic.config import Config
    from speedtronic.diloco.bus.base import Bus, DeltaRef, Head
    from speedtronic.diloco.codec import ParamSpec
    from speedtronic.diloco.documents import Manifest
    from speedtronic.diloco.master import Master
    from speedtronic.diloco.spec import RunSpec
    from speedtronic.diloco.worker import Coordinator
    from speedtronic.engine.data import DataBundle
    from speedtronic.engine.report import TrainResult
    from speedtronic.plan import RunPlan

logger = logging.getLogger("speedtronic.diloco")


def resolve_repo(cfg: Config, repo: str | None) -> str:
    repo = repo or cfg.distributed.bus.repo_id
    if not repo:
        raise ConfigError(
            "give --repo REPO (owner/name, file://PATH or s3://BUCKET/PREFIX) or set distributed.bus.repo_id"
        )
    return repo


def default_node(cfg: Config) -> str:
    """A worker's id without --node-id or distributed.node.id: `<host>-<hash of the output directory>`
    (diloco/identity.py): unique per output directory on a machine, stable across restarts."""
    from speedtronic.diloco.identity import default_node_id

    return default_node_id(cfg)


def node_config(base: Config, node: str, role: str) -> Config:
    """The config one node trains with: `base` (the YAML with its --set overrides, loaded once) with its
    own output directory and data order."""
    from speedtronic.config import dump_config, load_config

    extra = [
        "distributed.enabled=true",
        f"distributed.node.id={node}",
        f"distributed.node.role={role}",
        f"run.output_dir={Path(base.output_dir()) / node}",
        f"data.seed={(_data_seed(base) + zlib.crc32(node.encode())) % (2**31)}",
    ]
    return load_config(dump_config(base, redact=False), extra)


def _data_seed(cfg: Config) -> int:
    return cfg.data.seed if cfg.data.seed is not None else cfg.run.seed


class Reference(NamedTuple):
    """The run's reference model and data, and the plan they were built with (planned once)."""

    model: nn.Module
    bundle: DataBundle
    plan: RunPlan


def build_reference(cfg: Config) -> Reference:
    """The model and data bundle built as a Trainer builds them (engine/build.py: the same functions,
    `model.init_from` included), on the CPU, seeded by run.seed."""
    import torch

    from speedtronic.engine.build import build_data_for, build_model_for
    from speedtronic.engine.data_facts import data_facts
    from speedtronic.plan import DeviceFacts, plan_run
    from speedtronic.plugins import registries

    plan = plan_run(cfg, data=data_facts(cfg), device=DeviceFacts("cpu"))
    bundle = build_data_for(cfg, plan)
    torch.manual_seed(cfg.run.seed)
    return Reference(build_model_for(cfg, plan, registries()), bundle, plan)


def wait_for_manifest(bus: Bus, wait_s: float) -> Manifest:
    """The run's manifest, parsed (diloco/documents.py: a tampered one is one clear error), once the
    master has written it."""
    from speedtronic.diloco.documents import Manifest

    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        manifest = bus.read_manifest()  # PermissionDenied propagates: fail fast
        if manifest is not None:
            return Manifest.parse(manifest, f"{bus.url}: manifest.json")
        if time.monotonic() > deadline:
            raise SpeedtronicError(f"{bus.url}: no manifest.json after {wait_s:.0f}s; start the master first")
        if not announced:
            logger.info("waiting for the run's manifest on %s", bus.url)
            announced = True
        time.sleep(0.5)


def run_master(
    config_path: Path,
    sets: list[str] | None,
    repo: str | None,
    endpoint: str | None,
    train: bool | None,
    outer_steps: int | None,
    max_steps: int | None,
    standby: bool = False,
) -> dict[str, Any]:
    """The master: refused (exit 2) while another master holds the run's lease, unless `standby`:
    then it waits, ready, and takes over when that lease lapses (diloco/master/lease.py)."""
    from speedtronic.config import load_config
    from speedtronic.diloco import codec
    from speedtronic.diloco.bus.local_deltas import LocalDeltas
    from speedtronic.diloco.bus.registry import open_bus
    from speedtronic.diloco.identity import claim_node
    from speedtronic.diloco.master import planned_rounds
    from speedtronic.diloco.spec import RunSpec
    from speedtronic.diloco.worker import Coordinator
    from speedtronic.engine.logs import setup_logging

    base = load_config(config_path, sets or [])
    setup_logging(base.logging.level, base.logging.file)
    repo = resolve_repo(base, repo)
    node = check_node_id(base.distributed.node.id or "master", "distributed.node.id")
    cfg = node_config(base, node, "master")
    bus = open_bus(repo, config=cfg.distributed.bus, endpoint=endpoint)
    reference = build_reference(cfg)
    manifest = _open_run(bus, cfg, codec.param_specs(reference.model), repo)
    spec = RunSpec.of_run(manifest, cfg)  # the run's one description, shared by the master and its node
    state_dir = cfg.distributed.master.state_dir or str(Path(base.output_dir()) / "diloco-master")
    trains = cfg.distributed.master.trains if train is None else train
    if trains:
        # The master's own deltas stay in this process (never a Hub commit): bus/local_deltas.py.
        bus = LocalDeltas(bus, node, Path(state_dir) / "deltas")
    master = _start_master(
        cfg, bus, manifest, spec, reference, state_dir, standby, quiet=None if trains else node
    )
    result = None
    coordinator = lease = None
    try:
        if trains:
            bus.check_worker_access(node)
            lease = claim_node(bus, node, cfg.distributed.node.lease_s, where="master")
            coordinator = Coordinator(cfg, bus, node, manifest, lease=lease, spec=spec)
            result = train_node(cfg, coordinator, max_steps)  # as a worker's
        if result is None or not result.interrupted:
            dist = cfg.distributed
            end = outer_steps or spec.outer_steps or planned_rounds(cfg)
            master.wait(end, idle_s=dist.rounds.max_wait, linger_s=dist.rounds.late_join_wait)
    finally:
        master.stop()
        _untrack(master)  # stop() showed the trackers the final pick
        master.fence.release()  # a standby need not wait for the lease to lapse
        if lease is not None:  # None for the node "master": the master role lease guards it
            lease.close(release=coordinator is None or coordinator.join(0))
    return _master_result(master, result, coordinator)


def _open_run(bus: Bus, cfg: Config, specs: dict[str, ParamSpec], repo: str) -> Manifest:
    """The run's manifest, created here where the bus creates runs on the master's start; parsed
    (diloco/documents.py), checked against this model, and the master's access to the bus."""
    from speedtronic.diloco.documents import Manifest
    from speedtronic.diloco.manifest import build_manifest, check_inner_steps, check_manifest

    manifest = bus.read_manifest()
    if manifest is None:
        if not bus.creates_on_master_start:
            raise SpeedtronicError(
                f"{repo}: no manifest.json; create the run with `speedtronic hub init {repo} --config …`"
            )
        bus.create_run()
        manifest = build_manifest(cfg, specs)
        bus.write_manifest(manifest)
        logger.info("initialised DiLoCo run %s", bus.url)
    run = Manifest.parse(manifest, f"{bus.url}: manifest.json")
    check_manifest(manifest, specs, repo)
    check_inner_steps(manifest, cfg, repo)  # the run's rounds were planned with its inner steps
    bus.check_master_access()
    return run


def _start_master(
    cfg: Config,
    bus: Bus,
    manifest: Manifest,
    spec: RunSpec,
    reference: Reference,
    state_dir: str,
    standby: bool,
    quiet: str | None,
) -> Master:
    """The master with its outer optimizer's plan, holding the run's lease, started. `quiet`: the
    master's own node when it does not train (rounds never wait for it)."""
    from speedtronic.diloco import codec
    from speedtronic.diloco.master import Master, planned_rounds
    from speedtronic.diloco.node_eval import Evaluator
    from speedtronic.diloco.outer import planned_outer

    rounds = planned_rounds(cfg)
    lr, momentum = planned_outer(cfg.distributed.sync.outer_lr, cfg.distributed.sync.outer_momentum, rounds)
    # The master's state is a copy (codec.snapshot): the evaluator may write the reference model's weights.
    evaluator = Evaluator.for_run(cfg, *reference)
    master = Master(
        cfg,
        bus,
        manifest,
        codec.snapshot(reference.model),
        state_dir=state_dir,
        momentum=momentum,
        lr=lr,
        evaluate=evaluator,
        spec=spec,
    )
    master.take_over(standby)  # the run's lease and epoch, then start_state
    logger.info(
        "DiLoCo master on %s: outer lr %g, momentum %.2f (grown over %d rounds; %d planned rounds), "
        "rounds: %s",
        bus.url,
        lr,
        momentum,
        cfg.distributed.sync.outer_momentum_warmup,
        rounds,
        master.rounds.describe(),
    )
    if quiet is not None:  # the master sends no deltas itself: rounds never wait for it
        others = max(1, len(master.allowed - {quiet})) if master.allowed else None
        master.rounds.silence(quiet, others if cfg.distributed.rounds.min_deltas is None else None)
    _track(cfg, master, state_dir)
    master.start()
    return master


def _track(cfg: Config, master: Master, state_dir: str) -> None:
    """The swarm's metrics in the trackers `logging.hooks` names (master/tracking.py), once per outer step."""
    from speedtronic.diloco.master.tracking import Tracking
    from speedtronic.plugins import registries

    if cfg.logging.hooks:
        master.report.watchers.append(Tracking.for_master(cfg, state_dir, registries()))


def _untrack(master: Master) -> None:
    for watcher in master.report.watchers:
        close = getattr(watcher, "close", None)
        if close is not None:
            close()


def _master_result(
    master: Master, result: TrainResult | None, coordinator: Coordinator | None
) -> dict[str, Any]:
    if master.error is not None:
        said = str(master.error)  # a lost lease says "DiLoCo master: …" itself: once is enough
        raise SpeedtronicError(said if said.startswith("DiLoCo master:") else f"DiLoCo master: {said}")
    out = master.summary()  # with the epoch, the lease and where it took over
    out["train"] = result.as_dict() if result is not None else None
    out["worker"] = coordinator.summary() if coordinator is not None else None
    return out


def train_node(cfg: Config, coordinator: Coordinator, max_steps: int | None) -> TrainResult:
    """Train this node with `coordinator` as its sync. Its evaluations ride in its deltas, so
    `hub status` shows them beside the global's."""
    from speedtronic.api import Trainer  # with the start-up advice (engine/preflight/advice.py)
    from speedtronic.diloco import node_eval
    from speedtronic.plugins import registries

    trainer = Trainer(cfg, sync=coordinator, registries=registries())
    trainer.events.add("diloco-node-eval", node_eval.Recorder(coordinator))
    return trainer.train(max_steps=max_steps)


def check_node_id(node: str, where: str) -> str:
    """A node id names files and repos: letters, digits, `. _ -` only (never a path like ../x)."""
    from speedtronic.diloco import codec

    if not codec.NODE_RE.match(node):
        raise ConfigError(
            f"{where}: invalid node id {node!r}; use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return node


def run_worker(
    config_path: Path,
    sets: list[str] | None,
    repo: str | None,
    endpoint: str | None,
    node_id: str | None,
    max_steps: int | None,
) -> dict[str, Any]:
    from speedtronic.api import Trainer  # with the start-up advice (engine/preflight/advice.py)
    from speedtronic.config import load_config
    from speedtronic.diloco.bus.registry import open_bus
    from speedtronic.diloco.documents import not_listed
    from speedtronic.diloco.identity import check_worker_node
    from speedtronic.diloco.spec import RunSpec
    from speedtronic.engine.logs import setup_logging
    from speedtronic.plugins import registries

    base = load_config(config_path, sets or [])
    rank = int(os.environ.get("RANK", "0"))  # > 0: a DDP rank under torchrun, which trains silently
    setup_logging(base.logging.level if rank == 0 else "WARNING", base.logging.file if rank == 0 else None)
    repo = resolve_repo(base, repo)
    if node_id is not None and not node_id.strip():  # `--node-id ''` is a mistake, not "the default"
        raise ConfigError(
            "--node-id: empty; give the node an id (letters, digits, '.', '_', '-') or leave it out"
        )
    given = node_id or (base.distributed.node.id if base.distributed.node.id != "master" else None)
    where = "--node-id" if node_id else "distributed.node.id" if given else "default"
    node = check_node_id(given or default_node(base), where)
    check_worker_node(node, where)  # "master" is the master's own training node
    cfg = node_config(base, node, "worker")
    if rank > 0:
        # Under torchrun a worker is several ranks: rank 0 alone talks to the bus. DDP ranks take the
        # global weights it installs by broadcast (engine/trainer.py); FSDP ranks gather and scatter
        # the weights with it at sync points (engine/fsdp_sync.py). The other ranks just train.
        return Trainer(cfg, registries=registries()).train(max_steps=max_steps).as_dict()
    bus = open_bus(repo, config=cfg.distributed.bus, endpoint=endpoint)
    manifest = wait_for_manifest(bus, cfg.distributed.rounds.max_wait)
    if not manifest.lists(node):  # on every bus, as the Hub refuses it: its deltas would be ignored
        raise not_listed(bus.url, node)
    spec = RunSpec.of_run(manifest, cfg)  # the run's one description (diloco/spec.py)
    if warning := short_sync_warning(cfg.distributed.sync.inner_steps, manifest.run.inner_steps):
        logger.warning(warning)
    return _train_worker(cfg, bus, node, where, manifest, spec, max_steps)


def short_sync_warning(mine: int, runs: int | None) -> str | None:
    """What a worker that syncs more often than the run (its distributed.sync.inner_steps under the
    manifest's) is told: the master stretches its short deltas to a round, and they still cost. Two
    slow workers at H/4 beside two fast ones raised the loss on every seed in bench/uneven_rules.py
    (+0.044 pooled; syncing at H, each delta staleness-weighted: -0.005) and in bench/uneven.py's real
    processes (docs/guides/uneven-peers.md)."""
    if runs is None or mine >= runs:
        return None
    return (
        f"distributed.sync.inner_steps is {mine} here, under the run's {runs}: the master stretches this "
        "node's short deltas to a round, and such deltas were measured to raise the run's loss "
        f"(docs/guides/uneven-peers.md); a slow node costs less syncing every {runs} of its own steps"
    )


def _train_worker(
    cfg: Config, bus: Bus, node: str, where: str, manifest: Manifest, spec: RunSpec, max_steps: int | None
) -> dict[str, Any]:
    """Hold the node directory and the node's lease (a bus down at start is waited for, as a retry
    policy says), train, and release both once nothing of the node is being written any more."""
    from speedtronic.diloco.identity import claim_node, node_directory_lock
    from speedtronic.diloco.worker import Coordinator
    from speedtronic.retry import RetryPolicy

    predecessor, dir_lock = node_directory_lock(Path(cfg.output_dir()), node, where)
    try:
        policy = RetryPolicy.from_config(cfg.distributed.bus)
        policy.call("checking write access", lambda: bus.check_worker_access(node))
        lease = policy.call(  # before the node's files
            "claiming the node's lease",
            lambda: claim_node(bus, node, cfg.distributed.node.lease_s, where=where, predecessor=predecessor),
        )
        coordinator = None
        try:
            coordinator = Coordinator(cfg, bus, node, manifest, lease=lease, spec=spec)
            result = train_node(cfg, coordinator, max_steps)
        finally:
            if lease is not None:
                lease.close(release=coordinator is None or coordinator.join(0))
    finally:
        if dir_lock is not None:
            dir_lock.close()
    return {**result.as_dict(), **coordinator.summary()}


def init_run(
    repo: str,
    config_path: Path,
    sets: list[str] | None,
    endpoint: str | None,
    private: bool,
    gated: bool,
) -> dict[str, Any]:
    """Create the run: its storage (repo, directory, bucket prefix), manifest, and the global model of
    outer step 0."""
    from speedtronic.config import load_config
    from speedtronic.diloco import codec
    from speedtronic.diloco.bus.base import PermissionDenied
    from speedtronic.diloco.bus.registry import open_bus
    from speedtronic.diloco.manifest import add_collaborator, build_manifest, now

    cfg = load_config(config_path, sets or [])
    bus = open_bus(repo, config=cfg.distributed.bus, endpoint=endpoint)
    try:
        existing = bus.read_manifest()
    except PermissionDenied:
        existing = None  # no such repo yet (creating it below fails clearly if we may not)
    if existing is not None:
        raise SpeedtronicError(f"{repo} already holds a DiLoCo run (manifest.json); use another repo")
    model = build_reference(cfg).model
    manifest = build_manifest(cfg, codec.param_specs(model))
    facts = bus.create_run(private=private, gated=gated)
    if facts.get("owner"):
        manifest = add_collaborator(manifest, "master", facts["owner"], facts.get("delta_repo"))
    bus.write_manifest(manifest)
    weights = codec.snapshot(model)
    data = codec.encode(weights, "fp32", {"kind": "global", "outer_step": "0", "node": "master"})
    bus.publish(
        data, {"format": codec.FORMAT_VERSION, "outer_step": 0, "updated_at": now(), "hwm": {}, "nodes": {}}
    )
    return {
        "repo": repo,
        "fingerprint": manifest["fingerprint"],
        "outer_step": 0,
        "private": facts.get("private", private),
        "gated": facts.get("gated", gated),
    }


def add_collaborator_to_run(
    repo: str,
    user: str,
    node_id: str | None,
    delta_repo: str | None,
    endpoint: str | None,
    record_only: bool = False,
) -> dict[str, Any]:
    """List `user` as node `node_id` (default: the user name) and give them what the bus can (read
    access to a gated Hub run); a run they could not read is refused (ConfigError) unless
    `record_only`."""
    from speedtronic.diloco.bus.registry import open_bus
    from speedtronic.diloco.manifest import add_collaborator

    bus = open_bus(repo, endpoint=endpoint)
    manifest = bus.read_manifest()
    if manifest is None:
        raise SpeedtronicError(
            f"{repo}: no manifest.json; run `speedtronic hub init {repo} --config …` first"
        )
    node = check_node_id(user if node_id is None else node_id, "--node-id" if node_id is not None else "USER")
    given = bus.add_collaborator(user, node, delta_repo, record_only=record_only)
    bus.write_manifest(add_collaborator(manifest, node, user, given.get("delta_repo")))
    return {
        "repo": repo,
        "node": node,
        "user": user,
        "delta_repo": given.get("delta_repo"),
        "granted_read_access": given.get("granted_read_access"),
        "readable": given.get("readable"),
        "warning": given.get("warning"),
    }


def _unprocessed(name: str, hwm: int) -> bool:
    """A delta file the master has not processed yet (processed ones stay in collaborators' own repos
    until the worker's next upload prunes them)."""
    from speedtronic.diloco import codec

    try:
        return codec.parse_delta_name(name)[1] > hwm
    except codec.Rejected:
        return True


def run_status(repo: str, endpoint: str | None, retry_budget_s: float = 10.0) -> dict[str, Any]:
    """The run as its master last published it (head.json's "status", the same document as the
    master's metrics.json: master/report.status): outer step, applied, rejected (the latest with
    reasons), pending and finished, in total and per node, with each node's last applied delta, lag,
    tokens, score, quarantine and last seen. The bus listing adds only what the master has not seen
    yet: per node `new_on_bus`, delta files newer than the head. Hub calls give up after
    `retry_budget_s` seconds of retries (a status check should answer in seconds, not minutes)."""
    from speedtronic.diloco.bus.registry import open_bus

    bus = open_bus(
        repo,
        endpoint=endpoint,
        retry_budget_s=retry_budget_s,
        retry_attempts=3,
        retry_max=2.0,
        request_timeout=max(1.0, retry_budget_s),
    )
    manifest = bus.read_manifest()
    if manifest is None:
        raise SpeedtronicError(f"{repo}: no DiLoCo run here (manifest.json is missing)")
    head = bus.read_head() or {}
    listed = manifest.get("collaborators") or {}
    on_bus = bus.list_deltas(listed or None, exhaustive=True)  # a status check looks everywhere
    published = head.get("status") if isinstance(head.get("status"), dict) else {}
    per_node = {k: v for k, v in (published.get("nodes") or {}).items() if isinstance(v, dict)}
    nodes = sorted(set(listed) | set(head.get("nodes") or {}) | set(per_node) | {r.node for r in on_bus})
    collaborators = [_collaborator(node, head, listed, per_node, on_bus) for node in nodes]
    return _status(repo, manifest, head, published, per_node, collaborators)


def _collaborator(
    node: str,
    head: Head | dict[str, Any],
    listed: dict[str, Any],
    per_node: dict[str, dict[str, Any]],
    on_bus: list[DeltaRef],
) -> dict[str, Any]:
    """One node's line of `hub status`: the master's published word on it, and its delta files on the
    bus the master has not seen yet (`new_on_bus`)."""
    from speedtronic.diloco import node_eval

    outer = _count(head.get("outer_step"), -1)
    rejected_ids = set(head.get("rejected_ids") or [])
    peers = {k: v for k, v in (head.get("peers") or {}).items() if isinstance(v, dict)}
    entry = per_node.get(node) or {}
    last = _mapping(_mapping(head.get("nodes")).get(node))
    hwm = _count(_mapping(head.get("hwm")).get(node), -1)
    known = set(entry.get("pending_deltas") or [])
    new = sorted(
        r.name
        for r in on_bus
        if r.node == node and r.name not in known and r.id not in rejected_ids and _unprocessed(r.name, hwm)
    )
    return {
        "node": node,
        "listed": node in listed or not listed,
        "delta_repo": (listed.get(node) or {}).get("delta_repo"),
        "applied": _count(entry.get("applied")),
        "rejected": _count(entry.get("rejected", _mapping(head.get("rejected")).get(node))),
        "pending": sorted(known),  # what the master has seen and not settled yet
        "pending_count": _count(entry.get("pending")),
        "new_on_bus": new,  # on the bus, newer than the master's last published status
        "finished": bool(entry.get("finished", False)),
        "latest_applied_seq": last.get("seq"),
        "latest_applied_outer_step": last.get("outer_step"),
        "latest_applied_at": last.get("at"),
        "last_seen_at": entry.get("last_seen_at") or last.get("at"),
        "last_seen_s_ago": _seconds_since(entry.get("last_seen_at") or last.get("at")),
        "lag": outer - last["outer_step"] if isinstance(last.get("outer_step"), int) else None,
        "tokens": last.get("tokens", 0),
        "tokens_claimed": last.get("claimed"),  # claimed by its applied deltas (null: an older master)
        # The node's own latest evaluation (diloco/node_eval.py), checked again: head.json is
        # the master's word, but anyone with write access to the bus could have edited it.
        "eval": node_eval.valid(entry.get("eval") or last.get("eval")),
        # Rejections in a row and the latest reason, and the agreement score (master/peers.py).
        "consecutive_rejections": _count(entry.get("consecutive_rejections")),
        "last_rejection": entry.get("last_rejection"),
        "score": peers.get(node),
        "quarantined": bool((peers.get(node) or {}).get("quarantined", False)),
    }


def _status(
    repo: str,
    manifest: dict[str, Any],
    head: Head | dict[str, Any],
    published: dict[str, Any],
    per_node: dict[str, dict[str, Any]],
    collaborators: list[dict[str, Any]],
) -> dict[str, Any]:
    """The whole `hub status` document: the master's published totals and the nodes' lines."""
    from speedtronic.diloco import codec, node_eval

    return {
        "repo": repo,
        "outer_step": _count(head.get("outer_step"), -1),
        "end": (manifest.get("run") or {}).get("outer_steps"),
        "updated_at": head.get("updated_at"),
        "status_at": published.get("updated_at"),
        # The master's totals, as published (the same numbers as its metrics.json).
        "applied": _count(published.get("applied", head.get("applied_total"))),
        "rejected": _count(
            published.get("rejected", sum(map(_count, _mapping(head.get("rejected")).values())))
        ),
        "rejected_recent": published.get("rejected_recent") or [],
        "pending": _count(published.get("pending")),
        "finished": list(published.get("finished") or []),
        "new_on_bus": sum(len(c["new_on_bus"]) for c in collaborators),
        # The global model's evaluation (val loss, run.eval_tasks, CORE), in the nodes' shape.
        "global_eval": node_eval.valid(published.get("global_eval")),
        # Its val loss at each outer step so far ([outer step, loss], the latest 500): the dashboard's curve.
        "global_val_losses": _curve(published.get("global_val_losses")),
        # What other parts of the master add to its status: the fencing epoch and the master's lease,
        # the round rule at work (quorum, grace, who it waits on), and once over, why and the final pick;
        # untrusted_only: the live nodes when every one of them weighs 0 (quarantined, probed out).
        **{k: published.get(k) for k in ("epoch", "lease", "round", "end_reason", "final", "untrusted_only")},
        "applied_total": head.get("applied_total"),
        "fingerprint": manifest.get("fingerprint"),
        "format": codec.FORMAT_VERSION,
        "nodes": {
            c["node"]: {**per_node.get(c["node"], {}), "new_on_bus": c["new_on_bus"]} for c in collaborators
        },
        "collaborators": collaborators,
    }


def _count(value: object, default: int = 0) -> int:
    """A count from head.json (anyone who can write the bus could edit it): an int, or `default`."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, str) and value.isdigit() and len(value) <= 18 else default


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _curve(points: object, limit: int = 500) -> list[list[float]]:
    """[[outer step, loss], …] from head.json (anyone who can write the bus could edit it): only pairs of
    an integer step and a finite number, at most `limit` of them."""
    import math

    if not isinstance(points, list):
        return []
    out: list[list[float]] = []
    for point in points[-limit:]:
        if (
            isinstance(point, list)
            and len(point) == 2
            and isinstance(point[0], int)
            and not isinstance(point[0], bool)
            and isinstance(point[1], (int, float))
            and not isinstance(point[1], bool)
            and math.isfinite(point[1])
        ):
            out.append([point[0], float(point[1])])
    return out


def _seconds_since(stamp: object) -> float | None:
    from datetime import datetime, timezone

    if not isinstance(stamp, str):
        return None
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return round(max(0.0, (datetime.now(timezone.utc) - then).total_seconds()), 1)
