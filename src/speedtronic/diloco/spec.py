"""RunSpec: what every role of one DiLoCo run derives from the config and the run's manifest, computed once.

The master writes the manifest from a RunSpec (`RunSpec.from_config`), and every role that joins the run —
the master itself, a standby, each worker — builds its RunSpec from the manifest it read
(`RunSpec.of_run`): the manifest is the run's authority, so two nodes with different local configs still
agree on parameter specs, fingerprint, fragments, sync points, the run's end and the bounds a file on the
bus must respect. Nothing here touches a bus or a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from speedtronic.diloco import codec
from speedtronic.diloco.fragments import Plan
from speedtronic.diloco.outer import planned_outer

if TYPE_CHECKING:
    from collections.abc import Mapping

    from speedtronic.config.schema import Config
    from speedtronic.diloco.documents import Manifest

# Ranks one node may have when data.target_batch_size is unset (the batch then grows with the ranks).
MAX_NODE_RANKS = 8
# A global is fp32 with a header; anything past 1.5x its payload + 1 MiB is not a global of this run.
HEADER_SLACK = 1 << 20


def tokens_per_step(config: Config) -> int:
    """The most tokens one optimizer step of a node of this run may see: the fixed global batch, or
    (the batch grows with the ranks) the micro-batch × block × MAX_NODE_RANKS."""
    data = config.data
    if data.target_batch_size:
        return int(data.target_batch_size) * int(data.block_size)
    return int(data.micro_batch_size) * int(data.block_size) * MAX_NODE_RANKS


def one_rank_round(config: Config, max_delta_tokens: int) -> int:
    """The tokens of one round of a one-rank node at the run's inner_steps: the claim bound itself with
    a fixed global batch, else the bound over MAX_NODE_RANKS (master/pipeline.py `stretches`)."""
    return max_delta_tokens if config.data.target_batch_size else max(1, max_delta_tokens // MAX_NODE_RANKS)


@dataclass(frozen=True)
class RunSpec:
    specs: Mapping[str, codec.ParamSpec]
    fingerprint: str
    fragments: Plan
    delta_codec: str
    max_delta_tokens: int  # what one delta may claim: one node's plan for one round
    outer_steps: int | None  # the run's end (None: a manifest older than the field)
    outer_lr: float
    outer_momentum: float

    @classmethod
    def from_config(cls, config: Config, specs: Mapping[str, codec.ParamSpec]) -> RunSpec:
        """The spec of a new run (the master, before it writes the manifest)."""
        dist = config.distributed
        plan = Plan.from_config(dict(specs), dist)
        outer_steps = max(1, len(plan.points(config.max_steps())))
        lr, momentum = planned_outer(dist.sync.outer_lr, dist.sync.outer_momentum, outer_steps)
        return cls(
            specs=MappingProxyType(dict(specs)),
            fingerprint=codec.fingerprint(dict(specs)),
            fragments=plan,
            delta_codec=dist.sync.delta_codec,
            max_delta_tokens=dist.sync.inner_steps * tokens_per_step(config),
            outer_steps=outer_steps,
            outer_lr=lr,
            outer_momentum=momentum,
        )

    @classmethod
    def of_run(cls, manifest: Manifest, config: Config) -> RunSpec:
        """The spec of a run that exists: its manifest's specs and bounds; what an older manifest does
        not say comes from this node's config, as it did before the field existed."""
        dist = config.distributed
        specs = manifest.specs()
        run = manifest.run
        inner = run.inner_steps or dist.sync.inner_steps
        planned = cls.from_config(config, specs)
        return cls(
            specs=MappingProxyType(specs),
            fingerprint=manifest.fingerprint or codec.fingerprint(specs),
            fragments=planned.fragments,
            delta_codec=run.delta_codec or dist.sync.delta_codec,
            max_delta_tokens=run.max_delta_tokens or inner * tokens_per_step(config),
            outer_steps=run.outer_steps,
            outer_lr=run.outer_lr if run.outer_lr is not None else planned.outer_lr,
            outer_momentum=run.outer_momentum if run.outer_momentum is not None else planned.outer_momentum,
        )

    @property
    def max_global_bytes(self) -> int:
        return global_bytes_cap(self.specs)

    def sync_points(self, total_steps: int) -> list[int]:
        """The inner steps (1-based, up to `total_steps`) after which this run syncs some fragment."""
        return self.fragments.points(total_steps)


def global_bytes_cap(specs: Mapping[str, codec.ParamSpec]) -> int:
    """The most bytes a global model file of these parameters may be (fp32 with slack for headers):
    a larger file is never read whole (bus.read_global_capped)."""
    return int(1.5 * codec.wire_bytes(dict(specs), "fp32")) + HEADER_SLACK
