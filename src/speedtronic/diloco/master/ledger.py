"""The master's record of the run: what it applied and rejected, per node and in total.

`Ledger` owns the outer step, the applied delta ids and their payload checksums (replays are
recognised by them), the per-node high-water mark ("hwm", what workers prune by and number from),
each node's last applied delta, the finished nodes, the rejected files (and the versions it could not
delete), the global val losses and the per-node counts. Everything here is durable: the state file
(state.py) writes `to_meta()` and reads it back with `load_meta()`; the format is the one master
states have always had, so old state files resume.

A rejected file never moves a node's state: only `applied()` moves the high-water mark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from speedtronic.diloco.bus.base import DeltaRef, Head
from speedtronic.diloco.codec import Rejected, parse_delta_name
from speedtronic.diloco.manifest import now

Counts = dict[str, int]


@dataclass
class Ledger:
    """The run's durable record as this master knows it."""

    outer_step: int = 0
    applied_ids: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    rejected_versions: set[str] = field(default_factory=set)  # "id@etag" of files rejected, not deletable
    checksums: dict[str, str] = field(default_factory=dict)  # payload checksum -> id of the applied delta
    finished: set[str] = field(default_factory=set)  # nodes whose last processed delta was marked final
    hwm: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> last applied {seq, ...}
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    per_node: dict[str, Counts] = field(default_factory=dict)  # node -> {applied, rejected, bytes}
    bytes_in: int = 0

    # -- questions ----------------------------------------------------------------------------------
    def mark(self, node: str) -> int:
        """The node's high-water mark (-1: nothing applied yet)."""
        return self.hwm.get(node, -1)

    def processed(self, ref: DeltaRef, seq: int) -> bool:
        """Applied before (a replay, or a crash between the commit and the delete)."""
        return ref.id in self.applied_ids or seq <= self.mark(ref.node)

    def was_rejected(self, ref: DeltaRef) -> bool:
        return f"{ref.id}@{ref.etag}" in self.rejected_versions

    def replay_of(self, checksum: str) -> str | None:
        return self.checksums.get(checksum)

    def last_loss(self, step: int | None = None) -> float | None:
        """The latest global val loss (of outer step `step` when given)."""
        if not self.val_losses or (step is not None and self.val_losses[-1][0] != step):
            return None
        return float(self.val_losses[-1][1])

    # -- changes --------------------------------------------------------------------------------------
    def count(self, node: str, what: str, n: int = 1) -> None:
        entry = self.per_node.setdefault(node, {"applied": 0, "rejected": 0, "bytes": 0})
        entry[what] += n

    def read_bytes(self, node: str, n: int) -> None:
        self.bytes_in += n
        self.count(node, "bytes", n)

    def reject(self, ref: DeltaRef, reason: str, check: str) -> None:
        """Remember a bad file by name and version (the check that refused it shows in the status)."""
        self.rejected.append({"id": ref.id, "reason": reason, "check": check})
        self.rejected_versions.add(f"{ref.id}@{ref.etag}")
        self.count(ref.node, "rejected")

    def apply(
        self,
        ref: DeltaRef,
        seq: int,
        checksum: str,
        tokens: int,
        meta: dict[str, str],
        eval_: dict[str, Any] | None,
    ) -> None:
        """A delta applied (or received at weight 0): its id, checksum, the node's mark and last entry."""
        self.applied_ids.append(ref.id)
        self.checksums[checksum] = ref.id
        self.hwm[ref.node] = max(self.mark(ref.node), seq)
        before = self.nodes.get(ref.node, {})
        self.nodes[ref.node] = {
            "seq": seq,
            "outer_step": self.outer_step,
            "at": now(),
            "tokens": before.get("tokens", 0) + tokens,  # as bounded
            # What its applied deltas claimed, before the bound (the dashboard shows both).
            "claimed": _claim(before.get("claimed")) + _claim(meta.get("tokens")),
            # The node's own latest evaluation, untrusted and validated (diloco/node_eval.py).
            "eval": eval_ or before.get("eval"),
        }
        # A final delta says the node is done; a later one (a rejoin) makes it active again.
        (self.finished.add if meta.get("final") == "1" else self.finished.discard)(ref.node)
        self.count(ref.node, "applied")

    def finish(self, node: str) -> None:
        self.finished.add(node)

    def finish_all(self, nodes: set[str]) -> None:
        self.finished |= nodes

    def step(self, to: int | None = None) -> int:
        """Move to the next outer step (or to `to`); the new step."""
        self.outer_step = self.outer_step + 1 if to is None else to
        return self.outer_step

    def loss(self, step: int, value: float) -> None:
        self.val_losses.append((step, value))

    def adopt(self, head: Head, step: int) -> None:
        """Take the bus's outer step, high-water marks and node entries (a newer global adopted).

        The head's marks replace this ledger's: what it applied beyond them was never published. A
        master that lost its lease between its commit point and its publish keeps those deltas as
        applied in its saved state; restarted on that state after another master took the run over at
        an older outer step, it adopts that master's head — and, keeping its own marks (as before), its
        takeover head told the workers those deltas were applied, so they pruned the files and no
        global ever held them (7 deltas lost in a 30-minute S3 chaos soak, during a 500 storm). Their
        ids and checksums are forgotten too: the files are applied again when they come, not refused as
        already applied or as replays."""
        marks = {str(node): int(seq) for node, seq in (head.get("hwm") or {}).items()}
        unpublished = {i for i in self.applied_ids if _seq_of(i) > marks.get(i.split("/", 1)[0], -1)}
        self.applied_ids = [i for i in self.applied_ids if i not in unpublished]
        self.checksums = {c: i for c, i in self.checksums.items() if i not in unpublished}
        self.outer_step = step
        self.hwm = marks
        self.nodes.update(head.get("nodes") or {})

    # -- the state file -----------------------------------------------------------------------------
    def to_meta(self) -> dict[str, str]:
        return {
            "outer_step": str(self.outer_step),
            "applied": json.dumps(self.applied_ids),
            "hwm": json.dumps(self.hwm),
            "nodes": json.dumps(self.nodes),
            "checksums": json.dumps(self.checksums),
            "finished": json.dumps(sorted(self.finished)),
            "rejected": json.dumps(self.rejected[-1000:]),
            "rejected_versions": json.dumps(sorted(self.rejected_versions)[-1000:]),
            "val_losses": json.dumps(self.val_losses),
            "per_node": json.dumps(self.per_node),
            "bytes_in": str(self.bytes_in),
        }

    def load_meta(self, meta: dict[str, str]) -> None:
        self.outer_step = int(meta["outer_step"])
        self.applied_ids = json.loads(meta["applied"])
        self.hwm = {k: int(v) for k, v in json.loads(meta["hwm"]).items()}
        self.nodes = json.loads(meta.get("nodes", "{}"))
        self.val_losses = [tuple(v) for v in json.loads(meta.get("val_losses", "[]"))]
        self.checksums = json.loads(meta.get("checksums", "{}"))
        self.finished = set(json.loads(meta.get("finished", "[]")))
        self.rejected = json.loads(meta.get("rejected", "[]"))
        self.rejected_versions = set(json.loads(meta.get("rejected_versions", "[]")))
        self.per_node = json.loads(meta.get("per_node", "{}"))
        self.bytes_in = int(meta.get("bytes_in", "0"))


def _claim(value: object) -> int:
    """A claimed token count: a delta's metadata string of digits, or the running sum (an int, also from a
    head.json adopted from the bus); anything else counts 0."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isdigit() and len(text) <= 18 else 0


def _seq_of(delta_id: str) -> int:
    """The sequence number of an applied delta's id ("w1/w1--00000007.safetensors" -> 7); -1 for an id
    that does not parse (counted as published: never forgotten)."""
    try:
        return parse_delta_name(delta_id.rsplit("/", 1)[-1])[1]
    except Rejected:
        return -1
