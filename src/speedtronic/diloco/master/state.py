"""The DiLoCo master's crash-safe state file: fp32 global weights, outer momentum, outer step, applied
delta ids and checksums, per-node high-water marks, rejections, counters, the arrival history that
round deadlines are learnt from, and the globals it published; and how the master prunes those globals.

One safetensors file (tensors `g/<param>` and `m/<param>`, everything else as JSON strings in its
metadata), written atomically; never pickled. The master writes it *before* it publishes a new global
and deletes processed deltas (core.py explains why that makes a crash safe). Each part of the master
serialises its own share (`to_meta`/`to_json`); `StateFile` only puts them together, in the format
master states have always had, so existing state files resume.

Old globals: the master remembers every global it published ([outer step, path as the bus returned
it in head["global"]]) in PUBLISHED_FILE next to its state, written with the state and again right
after each publish (the state is written before the publish and would always lag one behind), and on
each publish has the bus delete its own globals older than the newest KEEP_GLOBALS outer steps
(`Bus.publish(prune=)`). It never deletes by name pattern: junk under global/
(`outer_99999999.safetensors`, a FIFO) is never touched and can never make it delete the global the
head names. What it does not know it wrote, it leaves: a master that adopts a run (a
standby, a restart without state, a restart that finds a newer head) starts with an empty list and
prunes nothing older; the step-0 global of `hub init` stays; and after a crash between a publish and
the rewrite of PUBLISHED_FILE (milliseconds), that one global stays.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Bus, Head
from speedtronic.diloco.global_update import Encoded
from speedtronic.diloco.master.broadcast import Broadcast
from speedtronic.diloco.master.momentum import Link

if TYPE_CHECKING:
    import torch

    from speedtronic.diloco.master.fragments import FragmentState
    from speedtronic.diloco.master.ledger import Ledger
    from speedtronic.diloco.master.norms import NormHistory
    from speedtronic.diloco.master.peers import Peers
    from speedtronic.diloco.master.report import Report
    from speedtronic.diloco.master.rounds import Rounds
    from speedtronic.diloco.outer import OuterOptimizer

logger = logging.getLogger("speedtronic.diloco")
STATE_FILE = "master_state.safetensors"
PUBLISHED_FILE = "published_globals.json"
# Globals kept per master: a worker that read the head of step N-1 can still download its global
# while N and N+1 are being published; and a master that takes over recovers the outer momentum from
# the last ones (momentum.py: the unknown start weighs 0.44^4 = 4% after four steps at μ = 0.8).
KEEP_GLOBALS = 5


@dataclass
class Durable:
    """The parts whose state the file holds (each serialises its own share)."""

    outer: OuterOptimizer
    ledger: Ledger
    norms: NormHistory
    peers: Peers
    report: Report
    rounds: Rounds
    fragments: FragmentState


class StateFile:
    """The state file of one master, the list of globals it published (PUBLISHED_FILE), and the files
    each global is sent as (broadcast.py: the newest one published is the next update's base)."""

    def __init__(self, state_dir: str | Path, broadcast: Broadcast | None = None) -> None:
        self.path = Path(state_dir) / STATE_FILE
        self.broadcast = broadcast or Broadcast("fp32", False, "")
        self.published: list[list[Any]] = []  # [outer step, global path] this master published
        # The latest globals this process published, for the next head's momentum chain (momentum.py).
        self.chain: list[Link] = []
        # Delta ids applied (in the saved state) since the last publish that succeeded: their files stay on
        # the bus until a published global includes them, and the master publishes again (core.py).
        self.unpublished: set[str] = set()

    def applied(self, ids: set[str]) -> None:
        """Deltas of a round just saved as applied, and not yet in a published global."""
        self.unpublished |= ids

    def forget_published(self, links: list[Link] | None = None) -> None:
        """Adopted a global from the bus: what the bus holds is not known to be this master's (nothing
        of it is pruned here, and no update starts from it); `links`, the adopted head's momentum chain,
        is carried on in its heads."""
        self.published = []
        self.chain = list(links or [])[-KEEP_GLOBALS:]
        self.broadcast.forget()

    def global_files(
        self, weights: dict[str, torch.Tensor], step: int, meta: dict[str, str], exact: bool
    ) -> Encoded:
        """The files global `step` is sent as (broadcast.py); `exact`: the weights as they are."""
        return self.broadcast.encode(weights, step, meta, exact)

    def publish_own(self, bus: Bus, files: Encoded, head: dict[str, Any], expected: Head | None) -> Head:
        """Publish a global (and its update, global_update.py) through the bus (expected = the master's
        last head), pruning the files this master published more than KEEP_GLOBALS outer steps ago;
        remember the new ones."""
        data, update = files.full, files.update
        step = int(head["outer_step"])
        # Older than the newest KEEP_GLOBALS steps, or this same step published before (a republish: the
        # final status, the final pick; a bus that never overwrites stores it under another name).
        prune = [path for s, path in self.published if s <= step - KEEP_GLOBALS or s == step]
        if update is None:
            new = bus.publish(data, head, expected=expected, prune=prune)
        else:
            new = bus.publish(data, head, expected=expected, prune=prune, update=update)
        self.unpublished.clear()  # the head just published includes every applied delta
        path = str(new.get("global") or "")
        paths = [path, *([str(new["update"])] if update is not None and new.get("update") else [])]
        self.published = [[s, p] for s, p in self.published if p not in prune and p not in paths]
        self.published += [[step, p] for p in paths]  # a failed deletion is logged by the bus and forgotten
        mu = float((head.get("momentum") or {}).get("mu", 0.0))
        link = Link(step, path, new.version, mu)
        older = [x for x in self.chain if step - KEEP_GLOBALS < x.step < step]  # the ones not pruned
        self.chain = [*older, link]
        self._save_published()
        self.broadcast.published(files)  # the next update starts from what the bus now holds
        return new

    def links_before(self, step: int) -> list[Link]:
        """The globals this process published before outer step `step` that its publish keeps (the
        next head's chain)."""
        return [x for x in self.chain if step - KEEP_GLOBALS < x.step < step]

    def _save_published(self) -> None:
        try:
            atomic_write_bytes(self.path.parent / PUBLISHED_FILE, json.dumps(self.published).encode())
        except OSError as error:  # the global is out; not knowing it later costs storage, not correctness
            logger.warning("DiLoCo master: cannot record the globals it published (%s)", error)

    def save(self, parts: Durable, epoch: int) -> None:
        from safetensors.torch import save

        tensors = {f"g/{n}": t for n, t in parts.outer.weights.items()}
        tensors.update({f"m/{n}": t for n, t in parts.outer.momentum_buffers.items()})
        meta = {
            "format": str(codec.FORMAT_VERSION),
            **parts.ledger.to_meta(),
            "norm_history": parts.norms.to_json(),
            "feedback": parts.report.feedback_json(),
            "peers": parts.peers.to_json(),
            "rounds": json.dumps(parts.rounds.to_json()),  # arrival offsets and intervals (rounds.py)
            "fragment_rounds": parts.fragments.to_json(),  # Streaming DiLoCo (fragments.py)
            "epoch": str(epoch),  # the master epoch it was saved under (lease.Fence.newer)
        }
        data = save(tensors, metadata=meta)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, data)
        self._save_published()  # after an adoption: the empty list, so a crash cannot bring an old one back

    def load(self, parts: Durable) -> int | None:
        """Fill the parts from the state file; its epoch, or None when there is none (a fresh master)."""
        if not self.path.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata()
            for n in list(parts.outer.weights):
                parts.outer.load(n, f.get_tensor(f"g/{n}"), f.get_tensor(f"m/{n}"))
        parts.ledger.load_meta(meta)
        parts.norms.load(meta.get("norm_history", "[]"))
        parts.report.load_feedback(meta.get("feedback", "{}"))
        parts.peers.load(meta.get("peers", "{}"))
        parts.fragments.load(meta.get("fragment_rounds", "null"))
        self.published = _load_published(self.path.parent / PUBLISHED_FILE)
        parts.rounds.load(json.loads(meta.get("rounds", "{}")))
        logger.info(
            "DiLoCo master: resumed state at outer step %d (%d deltas applied)",
            parts.ledger.outer_step,
            len(parts.ledger.applied_ids),
        )
        return int(meta.get("epoch", "0"))


def _load_published(path: Path) -> list[list[Any]]:
    """The globals a master published; none when the file is missing or unreadable (an older state:
    its globals are not known to be its own, and stay)."""
    try:
        entries = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return []
    return [
        [e[0], e[1]]
        for e in (entries if isinstance(entries, list) else [])
        if isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], str)
    ]
