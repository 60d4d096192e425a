"""The `distributed` section of a run config: ranks of one node (DDP or FSDP) and DumbDiLoCo between
nodes. It is read as a few subsections, one per concern, so a person finds a setting by what it is for:

    distributed:
      strategy, enabled, mode     how ranks of one node share the model; whether this is a DiLoCo node
      fsdp:      FSDP's options (strategy: fsdp)
      node:      this node: its role, id, lease and how often it polls the bus
      sync:      the DiLoCo algorithm: inner steps, the outer step, fragments, overlap, the wire format
      bus:       where the run lives and how its client talks to it: repo, endpoint, token, retries, budgets
      worker:    a worker's upload queue, its background poll, how far it may run ahead, when it gives up
      master:    the master: whether it trains, its lease, state, who may send deltas
      rounds:    when a round closes (quorum, grace, min_deltas, max_wait), staleness, the run's end
      defences:  the checks and weights that hold against hostile peers, and how deltas are combined

Configs written before the split used one flat section (`distributed.inner_steps`); those keys still
work, in YAML and in `--set`, each with one warning naming its new place (`MOVED`). Its own module so
config/schema.py stays about how the sections fit together; re-exported there. Never imports torch.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from speedtronic.config.section import Section
from speedtronic.errors import ConfigError

log = logging.getLogger("speedtronic.config")


# A lease shorter than a second expires between two renewals of a busy process; one longer than a week
# locks a node id (or the run) out for that long after a crash. Either is a typo, not a setting.
MIN_LEASE_S, MAX_LEASE_S = 1.0, 7 * 24 * 3600.0


class FsdpConfig(Section):
    """FSDP's options, used with `distributed.strategy: fsdp` (engine/parallel/fsdp.py)."""

    reshard_after_forward: bool = Field(
        True,
        description="fsdp: free each block's gathered parameters after its forward (less memory, one more "
        "all-gather in backward); false keeps them until backward.",
    )
    cpu_offload: bool = Field(
        False, description="fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory."
    )


class NodeConfig(Section):
    """This DiLoCo node: its role, its id and the lease on it, and how often it polls the bus."""

    role: Literal["master", "worker"] | None = Field(
        None, description="Derived when unset: master when id is unset or 'master', else worker."
    )
    id: str | None = Field(
        None, description="This node's id (default master; a worker: --node-id, else host-<output hash>)."
    )
    lease_s: float = Field(
        300.0,
        ge=MIN_LEASE_S,
        le=MAX_LEASE_S,
        description="Lease on a node id (s, 1 to a week), renewed every third (docs/guides/diloco.md).",
    )
    poll_interval: float = Field(
        30.0, gt=0, description="Seconds between polls for a new global model or deltas."
    )
    wait_poll_interval: float | None = Field(
        None,
        gt=0,
        description="Seconds between polls while a node waits on the bus: a worker whose training waits "
        "for the global that answers its delta (sync.overlap_steps), a master whose round has deltas and "
        "waits for the rest or has just taken an outer step (for one poll_interval: the next "
        "round may come at any moment). Default: poll_interval / 5. A Hub bus stretches it to fit its request "
        "budget, like poll_interval (at most half the budget goes to polls).",
    )

    def resolved_role(self) -> str:
        """The role this node plays: `role`, or (documented rule) master for a node without an id or
        named "master", worker for any other named node."""
        if self.role is not None:
            return self.role
        return "master" if self.id in (None, "master") else "worker"

    @model_validator(mode="after")
    def _polls(self) -> NodeConfig:
        if self.wait_poll_interval is not None and self.wait_poll_interval > self.poll_interval:
            raise ValueError(
                f"distributed.node.wait_poll_interval ({self.wait_poll_interval:g}) must be <= "
                f"distributed.node.poll_interval ({self.poll_interval:g}): it is the faster poll while a node waits"
            )
        return self


class SyncConfig(Section):
    """The DiLoCo algorithm: inner steps between syncs, the outer step, Streaming DiLoCo's fragments,
    overlapped syncs and the deltas' wire format (diloco/outer.py, fragments.py, overlap.py)."""

    inner_steps: int = Field(500, gt=0, description="Local optimizer steps between syncs (H).")
    outer_lr: float = Field(0.7, gt=0, description="Outer (Nesterov SGD) learning rate.")
    outer_momentum: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Outer Nesterov momentum. Default: 0.8 (the DiLoCo paper's 0.9 overshoots short runs "
        "of larger models), grown over outer_momentum_warmup rounds (see diloco/outer.py and "
        "bench/diloco.py).",
    )
    outer_momentum_warmup: int = Field(
        10,
        ge=0,
        description="Rounds over which the outer momentum grows linearly from momentum/N to its value "
        "(0: full momentum from the first round, which overshoots in short runs).",
    )
    ramp: bool = Field(
        False,
        description="Start nearly synchronous: the first syncs come after 1, 2, 4, … steps, doubling up "
        "to inner_steps (about log2(inner_steps) extra syncs per run; no clear gain in bench/diloco.py).",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo: split the model into this many fragments (contiguous layers, "
        "balanced by size) that sync in turn, fragment p at inner steps where step % inner_steps == "
        "p*inner_steps//fragments, so each sync uploads 1/fragments of the model (1: the whole model "
        "at once; diloco/fragments.py).",
    )
    fragment_layout: Literal["elements", "layers"] = Field(
        "elements",
        description="How fragments split the model when fragments > 1: elements (fragment p holds "
        "elements p, p+fragments, … of every tensor, so every layer syncs a share at every sync point) "
        "or layers (contiguous groups of whole tensors, as in the Streaming DiLoCo paper). In "
        "bench/diloco.py at P=4, H=25, pooled over 4 seeds, elements closed 56% of the single → DP gap "
        "on the worst of three corpora (plain DiLoCo 54%, layers 48%; docs/guides/diloco.md).",
    )
    overlap_steps: int = Field(
        1,
        ge=0,
        description="Overlapped sync: keep training while a delta uploads and the new global downloads, "
        "and install the global that answers it exactly this many inner steps after the sync, keeping "
        "the local progress made meanwhile (waits, logged, up to rounds.max_wait if it is late). Default 1: "
        "nearly synchronous, because every inner step a global comes late costs (bench/late_globals.py). "
        "0: never wait, install a global whenever it arrives: a worker then runs ahead of a slow master "
        "and the outer momentum can diverge (diloco/worker/overlap.py).",
    )
    reset_inner_optimizer: bool = Field(
        False, description="Clear inner optimizer state when a new global model is installed."
    )
    delta_codec: Literal["fp32", "bf16", "int8", "int4"] = Field(
        "int8",
        description="Wire format of deltas (int8, int4: blockwise absmax with worker-side error feedback).",
    )
    global_codec: Literal["fp32", "int8"] = Field(
        "fp32",
        description="How the master sends each global (diloco/global_update.py). fp32: the full model. "
        "int8: also its blockwise int8 difference from the previous global (~1.06 bytes per parameter "
        "instead of 4), which a worker holding that global downloads instead; the published global is "
        "what the update rebuilds to, the rounding carried into the next update (master-side error "
        "feedback), checked by checksum, the full file the fallback. For slow links; workers need no "
        "setting.",
    )

    @model_validator(mode="after")
    def _schedule(self) -> SyncConfig:
        if self.fragments > 1 and self.ramp:
            raise ValueError(
                "distributed.sync.fragments > 1 needs a fixed schedule: set distributed.sync.ramp=false "
                "(or distributed.sync.fragments=1)"
            )
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"distributed.sync.fragments ({self.fragments}) must be <= distributed.sync.inner_steps "
                f"({self.inner_steps}): each fragment needs its own sync step"
            )
        if self.overlap_steps >= self.inner_steps and "overlap_steps" not in self.model_fields_set:
            # The default where it cannot apply (inner_steps 1): no overlap. The model is frozen, so
            # its own validator sets the field as pydantic would have.
            object.__setattr__(self, "overlap_steps", self.inner_steps - 1)
        if self.overlap_steps >= self.inner_steps:
            raise ValueError(
                f"distributed.sync.overlap_steps ({self.overlap_steps}) must be < distributed.sync.inner_steps "
                f"({self.inner_steps}): a fragment's global is installed before its next sync"
            )
        return self


class BusConfig(Section):
    """The bus a run lives on (directory, Hub or S3; diloco/bus/) and how its client talks to it:
    endpoint, token, timeouts, retries and the Hub's request and commit budgets."""

    repo_id: str | None = Field(
        None, description="The run: owner/name (Hub), file://PATH or s3://BUCKET/PREFIX (default of --repo)."
    )
    endpoint: str | None = Field(
        None, description="Hub or S3 endpoint URL (default HF_ENDPOINT for the Hub, AWS_ENDPOINT_URL for S3)."
    )
    token: SecretStr | None = Field(
        None, description="Hub token (default HF_TOKEN, then the stored login). Secret."
    )
    cache_dir: str | None = Field(
        None, description="Where Hub downloads land briefly (default: the temp dir)."
    )
    request_timeout: float = Field(60.0, gt=0, description="Seconds before a Hub request is abandoned.")
    retry_initial: float = Field(
        1.0, gt=0, description="First backoff delay (s) after a transient bus error."
    )
    retry_max: float = Field(60.0, gt=0, description="Longest backoff delay (s).")
    retry_attempts: int = Field(8, ge=0, description="Attempts before a transient bus error is fatal.")
    hub_request_budget: int = Field(
        1000,
        gt=0,
        description="Hub API requests this token may make per hub_request_window (free tier 1000, PRO "
        "2500); requests are paced under it and the master's poll interval grows to fit it.",
    )
    hub_request_window: float = Field(300.0, gt=0, description="Seconds of the Hub's request window.")
    hub_commit_budget: int = Field(
        128, gt=0, description="Commits per repo per hub_commit_window (the Hub allows about 128/hour)."
    )
    hub_commit_window: float = Field(3600.0, gt=0, description="Seconds of the per-repo commit window.")
    squash_every: int = Field(
        50, ge=0, description="Squash the Hub run repo's history every N outer steps (0: never)."
    )

    @model_validator(mode="after")
    def _retry_bounds(self) -> BusConfig:
        if self.retry_max < self.retry_initial:
            raise ValueError(
                f"distributed.bus.retry_max ({self.retry_max}) must be >= distributed.bus.retry_initial "
                f"({self.retry_initial})"
            )
        return self


class WorkerConfig(Section):
    """A worker's side of the sync: its delta upload queue, the background poll for globals, how far it
    may run ahead of the master, and when it stops because its deltas are rejected."""

    async_upload: bool = Field(True, description="Upload deltas on a background thread.")
    upload_queue_size: int = Field(
        2, gt=0, description="Deltas waiting for upload before upload_overflow applies."
    )
    upload_overflow: Literal["block", "drop_oldest", "coalesce"] = Field(
        "block", description="When the upload queue is full: wait, drop the oldest, or merge into the newest."
    )
    upload_shutdown_timeout: float = Field(
        300.0, ge=0, description="Seconds to wait for pending uploads at exit."
    )
    async_global_poll: bool = Field(True, description="Poll for global models on a background thread.")
    max_rounds_ahead: int | None = Field(
        None,
        ge=1,
        description="A worker that has sent this many deltas without receiving a newer global waits for "
        "one at its next sync point (null: never waits; 1: nearly synchronous DiLoCo).",
    )
    global_wait: float | None = Field(
        None,
        gt=0,
        description="Seconds a worker waits for the global that answers its delta (sync.overlap_steps) or "
        "lets it run ahead again (max_rounds_ahead) before it trains on without it, installing it when it "
        "comes; its next delta is then a round staler, and it waits no more until some global arrives. "
        "Meanwhile it keeps one unanswered delta on the bus and folds the next ones into one, sent once "
        "the master answers. Short values keep workers training through a bus outage or a master "
        "failover (default null: rounds.max_wait).",
    )
    max_consecutive_rejections: int | None = Field(
        5,
        ge=1,
        description="A worker whose last this many uploaded deltas were all rejected by the master (head.json "
        "says why; the worker logs each reason) stops with an error instead of training on for "
        "nothing (null: never stops). Deltas rejected as stale that were built on the same global "
        "count once (a backlog made while a master failed over).",
    )


class MasterConfig(Section):
    """The master: whether it also trains, its lease, its state directory, and who may send deltas."""

    trains: bool = Field(True, description="The master also trains as a worker.")
    lease_s: float | None = Field(
        None,
        ge=MIN_LEASE_S,
        le=MAX_LEASE_S,
        description="Master lease (s, 1 to a week); a --standby takes over when it lapses (60; Hub 600)",
    )
    state_dir: str | None = Field(None, description="Master state (default <output_dir>/diloco-master).")
    collaborators: list[str] = Field(
        default_factory=list,
        description="Node ids whose deltas the master accepts (default: the manifest's list; empty: all).",
    )
    membership_refresh_s: float = Field(
        60.0,
        ge=0,
        description="Seconds between the master's re-reads of manifest.json's collaborators (0: every "
        "poll; unused when collaborators pins the list); a worker re-reads its own listing as often (at "
        "least 1 s apart) and stops once removed.",
    )


class RoundsConfig(Section):
    """When the master's round closes (min_deltas, or the quorum and the learnt grace, up to max_wait),
    how stale a delta may be, and how long the master waits at the run's end (diloco/master/rounds.py)."""

    min_deltas: int | None = Field(
        None,
        gt=0,
        description="Deltas a round waits for (up to max_wait), replacing the quorum + grace rule "
        "(default null: the rule, diloco/master/rounds.py).",
    )
    max_wait: float = Field(
        600.0,
        gt=0,
        description="Upper bound (s) of a round's wait, counted from its first delta: it then proceeds "
        "with what it has; also the longest a node counts as live without a new delta.",
    )
    quorum: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Fraction of the round's expected (live) nodes whose deltas let the learnt grace "
        "close the round; below it the round waits for all of them up to max_wait.",
    )
    initial_grace: float = Field(
        120.0,
        gt=0,
        description="The upper bound of a round's grace (s after its first delta) before any arrival "
        "history exists: until a quorum is in it is the grace, then the round's own arrival offsets "
        "give it; later graces are learnt: median + grace_mad_k × MAD of arrival offsets.",
    )
    grace_mad_k: float = Field(
        3.0, ge=0, description="k in the learnt grace, median + k × MAD of the nodes' arrival offsets."
    )
    slow_factor: float | None = Field(
        2.0,
        gt=1,
        description="A live node whose typical interval between deltas is over this × the fastest "
        "node's is slow: rounds do not wait for it and its deltas fill no quorum, but they count when they "
        "come (weighted by tokens and staleness); null waits for every live node (diloco/master/pace.py).",
    )
    max_staleness: int = Field(
        4, ge=0, description="Deltas built on a global this many outer steps old still count, at 1/(1+s)."
    )
    late_join_wait: float | None = Field(
        None,
        ge=0,
        description="Seconds the master stays after the run's end, with every node done, for late "
        "joiners' deltas; within them work built past the end still counts (default: 0, the run ends once "
        "its last outer step is out and every node it heard from is done).",
    )
    never_heard_wait: float | None = Field(
        None,
        gt=0,
        description="Seconds after the master starts that a listed node it never heard from still "
        "counts as live for the run's end (default: max_wait).",
    )


class DefencesConfig(Section):
    """What holds against hostile or broken peers: size and norm checks, quarantine, the loss probe,
    robust aggregation, and the rejection feedback workers read (diloco/master/checks.py, master/peers.py)."""

    outlier_factor: float = Field(
        10.0,
        gt=1,
        description="Reject a delta whose norm exceeds this × the reference: the median over nodes of "
        "each node's recent candidate norms (one vote per node), and any over this × the global "
        "weights' norm.",
    )
    norm_floor: float = Field(
        0.01,
        gt=0,
        le=1,
        description="The outlier check's reference norm is never below this × the global weights' norm, "
        "so tiny deltas can never lock honest ones out (diloco/master/checks.py).",
    )
    max_delta_mb: float | None = Field(None, gt=0, description="Size limit of one delta (default 1.5× fp32).")
    aggregation: Literal["mean", "trimmed_mean", "median", "clipped_mean"] = Field(
        "clipped_mean",
        description="How the master combines a round's deltas: clipped_mean (default: each delta's norm "
        "and token claim (per round it spans) clipped to the round's median, then the token-weighted mean; within 0.6% of "
        "mean on three corpora clean, and it holds against a ×5 delta that ruins mean, bench/diloco.py); "
        "mean; or "
        "coordinate-wise median / trimmed_mean (drops the n/5 largest and smallest values), which "
        "ignore token claims and hold against a minority of hostile peers but cost ~1.4% clean at 4 "
        "workers (diloco/outer.py aggregate).",
    )
    quarantine_below: float | None = Field(
        0.0,
        ge=-1,
        le=1,
        description="Quarantine a node whose agreement score (moving average of the cosine between its "
        "delta and the other nodes' deltas) falls below this: its deltas are received but weigh 0 "
        "until the score recovers (diloco/master/peers.py). Default 0: honest peers agree positively, a "
        "reversed or colluding delta scores below 0 (bench/attacks.py); null: scores are kept and "
        "shown, nobody is quarantined.",
    )
    loss_probe: bool | Literal["auto"] = Field(
        "auto",
        description="Before a round, the master applies each delta alone to the global model, at its "
        "share of the outer step (the outer lr ÷ the round's nodes), and evaluates its validation "
        "batches; a delta that raises the loss weighs 0 that round. Costs "
        "one evaluation per delta per round. auto (default): on where the master has validation "
        "data, off (with one log line) where it has none; true: warn where it has none "
        "(diloco/master/peers.py).",
    )
    rejection_feedback_s: float = Field(
        60.0,
        ge=0,
        description="While rounds reject deltas without an outer step, the master republishes head.json "
        "(rejected nodes read why there) at most this often, in seconds (0: on every such poll).",
    )


class DistributedConfig(Section):
    """Ranks of one node (ddp or fsdp) and DumbDiLoCo between nodes (src/speedtronic/diloco/,
    docs/guides/diloco.md), one subsection per concern."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How ranks of one node share the model: ddp replicates it on every rank; fsdp shards "
        "parameters, gradients and optimizer state over the ranks (FSDP2, engine/parallel/fsdp.py).",
    )
    enabled: bool = Field(False, description="Train as a DiLoCo node (the master/worker commands set it).")
    mode: Literal["diloco"] = Field("diloco", description="Distributed algorithm.")
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig, description="FSDP's options.")
    node: NodeConfig = Field(
        default_factory=NodeConfig, description="This DiLoCo node: role, id, lease, polls."
    )
    sync: SyncConfig = Field(default_factory=SyncConfig, description="The DiLoCo algorithm.")
    bus: BusConfig = Field(default_factory=BusConfig, description="The bus and its client.")
    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="A worker's uploads and polls.")
    master: MasterConfig = Field(default_factory=MasterConfig, description="The master node.")
    rounds: RoundsConfig = Field(
        default_factory=RoundsConfig, description="When a round closes; the run's end."
    )
    defences: DefencesConfig = Field(
        default_factory=DefencesConfig, description="Checks and weights against hostile peers."
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, values: Any) -> Any:
        # Configs (and checkpoints' stored configs) written before the subsections: move each key.
        return migrate_flat_keys(values) if isinstance(values, dict) else values


SUBSECTIONS: tuple[str, ...] = ("fsdp", "node", "sync", "bus", "worker", "master", "rounds", "defences")

# The flat key each setting had before the subsections → (subsection, its name there).
MOVED: dict[str, tuple[str, str]] = {
    "fsdp_reshard_after_forward": ("fsdp", "reshard_after_forward"),
    "fsdp_cpu_offload": ("fsdp", "cpu_offload"),
    "role": ("node", "role"),
    "node_id": ("node", "id"),
    "node_lease_s": ("node", "lease_s"),
    "poll_interval": ("node", "poll_interval"),
    "wait_poll_interval": ("node", "wait_poll_interval"),
    "inner_steps": ("sync", "inner_steps"),
    "outer_lr": ("sync", "outer_lr"),
    "outer_momentum": ("sync", "outer_momentum"),
    "outer_momentum_warmup": ("sync", "outer_momentum_warmup"),
    "sync_ramp": ("sync", "ramp"),
    "fragments": ("sync", "fragments"),
    "fragment_layout": ("sync", "fragment_layout"),
    "overlap_steps": ("sync", "overlap_steps"),
    "reset_inner_optimizer": ("sync", "reset_inner_optimizer"),
    "delta_codec": ("sync", "delta_codec"),
    "repo_id": ("bus", "repo_id"),
    "endpoint": ("bus", "endpoint"),
    "token": ("bus", "token"),
    "cache_dir": ("bus", "cache_dir"),
    "request_timeout": ("bus", "request_timeout"),
    "retry_initial": ("bus", "retry_initial"),
    "retry_max": ("bus", "retry_max"),
    "retry_attempts": ("bus", "retry_attempts"),
    "hub_request_budget": ("bus", "hub_request_budget"),
    "hub_request_window": ("bus", "hub_request_window"),
    "hub_commit_budget": ("bus", "hub_commit_budget"),
    "hub_commit_window": ("bus", "hub_commit_window"),
    "squash_every": ("bus", "squash_every"),
    "async_delta_upload": ("worker", "async_upload"),
    "delta_upload_queue_size": ("worker", "upload_queue_size"),
    "delta_upload_overflow": ("worker", "upload_overflow"),
    "delta_upload_shutdown_timeout": ("worker", "upload_shutdown_timeout"),
    "async_global_poll": ("worker", "async_global_poll"),
    "max_rounds_ahead": ("worker", "max_rounds_ahead"),
    "max_consecutive_rejections": ("worker", "max_consecutive_rejections"),
    "global_wait": ("worker", "global_wait"),
    "master_trains": ("master", "trains"),
    "master_lease_s": ("master", "lease_s"),
    "state_dir": ("master", "state_dir"),
    "collaborators": ("master", "collaborators"),
    "membership_refresh_s": ("master", "membership_refresh_s"),
    "min_deltas": ("rounds", "min_deltas"),
    "max_wait": ("rounds", "max_wait"),
    "quorum": ("rounds", "quorum"),
    "initial_grace": ("rounds", "initial_grace"),
    "grace_mad_k": ("rounds", "grace_mad_k"),
    "max_staleness": ("rounds", "max_staleness"),
    "slow_factor": ("rounds", "slow_factor"),
    "late_join_wait": ("rounds", "late_join_wait"),
    "never_heard_wait": ("rounds", "never_heard_wait"),
    "outlier_factor": ("defences", "outlier_factor"),
    "norm_floor": ("defences", "norm_floor"),
    "max_delta_mb": ("defences", "max_delta_mb"),
    "aggregation": ("defences", "aggregation"),
    "quarantine_below": ("defences", "quarantine_below"),
    "loss_probe": ("defences", "loss_probe"),
    "rejection_feedback_s": ("defences", "rejection_feedback_s"),
}


_warned: set[str] = set()  # old keys already warned about in this process


def _warn_moved(old: str) -> str:
    """The new dotted path of flat key `old`, logging the one-line warning the first time it is seen."""
    section, name = MOVED[old]
    new = f"distributed.{section}.{name}"
    if old not in _warned:
        _warned.add(old)
        log.warning("config: distributed.%s is now %s (the old key still works; write the new one)", old, new)
    return new


def moved_key(dotted: str) -> str:
    """A `--set` key with a flat `distributed.<old>` replaced by its new path (warned once); any other
    key unchanged."""
    parts = dotted.split(".")
    if len(parts) >= 2 and parts[0] == "distributed" and parts[1] in MOVED:
        return ".".join([_warn_moved(parts[1]), *parts[2:]])
    return dotted


def migrate_flat_keys(section: dict[str, Any]) -> dict[str, Any]:
    """A copy of a `distributed` mapping with every flat key moved into its subsection (warned once per
    key). A subsection written as null (every line commented out) is empty. Setting both a flat key and
    its new key is an error naming both."""
    data = {key: ({} if key in SUBSECTIONS and value is None else value) for key, value in section.items()}
    for old in [key for key in data if key in MOVED]:
        sub, name = MOVED[old]
        target = data.get(sub, {})
        if isinstance(target, BaseModel):
            target = target.model_dump(exclude_unset=True)
        if not isinstance(target, dict):
            continue  # validation reports the subsection's own type error
        new = _warn_moved(old)
        if name in target:
            raise ConfigError(
                f"distributed.{old} and {new} are both set; keep {new} (distributed.{old} is its old name)"
            )
        data[sub] = {**target, name: data.pop(old)}
    return data


def global_wait_s(dist: DistributedConfig) -> float:
    """How long a worker waits for a global before training on (worker.global_wait, default max_wait)."""
    wait = dist.worker.global_wait
    return dist.rounds.max_wait if wait is None else min(wait, dist.rounds.max_wait)


def wait_poll_s(node: NodeConfig) -> float:
    """The poll interval while a node waits on the bus (distributed.node.wait_poll_interval, default
    poll_interval / 5)."""
    return node.wait_poll_interval if node.wait_poll_interval is not None else node.poll_interval / 5
