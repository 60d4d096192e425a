"""The DiLoCo master's crash-safe state file: fp32 global weights, outer momentum, outer step, applied
delta ids and checksums, per-node high-water marks, rejections, counters, the arrival history that
round deadlines are learnt from, and the globals it published; and how the master prunes those globals.

One safetensors file (tensors `g/<param>` and `m/<param>`, everything else as JSON strings in its
metadata), written atomically; never pickled. The master writes it *before* it publishes a new global
and deletes processed deltas (master.py explains why that makes a crash safe).

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
from pathlib import Path
from typing import Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Head

logger = logging.getLogger("speedtronic.diloco")
STATE_FILE = "master_state.safetensors"
PUBLISHED_FILE = "published_globals.json"
# Globals kept per master: a worker that read the head of step N-1 can still download its global
# while N and N+1 are being published.
KEEP_GLOBALS = 3


def publish_own(master: Any, data: bytes, head: dict[str, Any]) -> Head:
    """Publish a global through the bus (expected = the master's last head), pruning the globals this
    master published more than KEEP_GLOBALS outer steps ago; remember the new one."""
    step = int(head["outer_step"])
    # Older than the newest KEEP_GLOBALS steps, or this same step published before (a republish: the
    # final status, the final pick; a bus that never overwrites stores it under another name).
    prune = [path for s, path in master.published if s <= step - KEEP_GLOBALS or s == step]
    new = master.bus.publish(data, head, expected=master.head, prune=prune)
    path = str(new.get("global") or "")
    master.published = [[s, p] for s, p in master.published if p not in prune and p != path]
    master.published.append([step, path])  # a failed deletion is logged by the bus and forgotten
    _save_published(master)
    return new


def _save_published(master: Any) -> None:
    try:
        atomic_write_bytes(master.state_path.parent / PUBLISHED_FILE, json.dumps(master.published).encode())
    except OSError as error:  # the global is out; not knowing it later costs storage, not correctness
        logger.warning("DiLoCo master: cannot record the globals it published (%s)", error)


def save_state(master: Any) -> None:
    from safetensors.torch import save

    tensors = {f"g/{n}": t for n, t in master.outer.weights.items()}
    tensors.update({f"m/{n}": t for n, t in master.outer.momentum_buffers.items()})
    meta = {
        "format": str(codec.FORMAT_VERSION),
        "outer_step": str(master.outer_step),
        "applied": json.dumps(master.applied),
        "hwm": json.dumps(master.hwm),
        "nodes": json.dumps(master.nodes),
        "norm_history": json.dumps(master.norm_history),
        "checksums": json.dumps(master.checksums),
        "finished": json.dumps(sorted(master.finished)),
        "rejected": json.dumps(master.rejected[-1000:]),
        "rejected_versions": json.dumps(sorted(master.rejected_versions)[-1000:]),
        "val_losses": json.dumps(master.val_losses),
        "per_node": json.dumps(master.per_node),
        "feedback": json.dumps(master.feedback),
        "peers": json.dumps(master.peers),
        "rounds": json.dumps(master.rounds.to_json()),  # arrival offsets and intervals (master_rounds.py)
        "bytes_in": str(master.bytes_in),
        "fragment_rounds": json.dumps(master.fragment_rounds),  # Streaming DiLoCo (diloco/fragments.py)
        "epoch": str(master.epoch),  # the master epoch it was saved under (master_lease.newer)
    }
    data = save(tensors, metadata=meta)
    master.state_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(master.state_path, data)
    _save_published(master)  # after an adoption: the empty list, so a crash cannot bring an old one back


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


def load_state(master: Any) -> bool:
    """Fill `master` from its state file; False when there is none (a fresh master)."""
    if not master.state_path.exists():
        return False
    from safetensors import safe_open

    with safe_open(str(master.state_path), framework="pt") as f:
        meta = f.metadata()
        for n in master.outer.weights:
            master.outer.weights[n] = f.get_tensor(f"g/{n}").float()
            master.outer.momentum_buffers[n] = f.get_tensor(f"m/{n}").float()
    master.outer_step = int(meta["outer_step"])
    master.applied = json.loads(meta["applied"])
    master.hwm = {k: int(v) for k, v in json.loads(meta["hwm"]).items()}
    # [node, norm] pairs; an older state's bare floats (accepted norms only, of unknown nodes: the
    # history that could lock honest peers out) are dropped.
    master.norm_history = [
        [str(e[0]), float(e[1])]
        for e in json.loads(meta.get("norm_history", "[]"))
        if isinstance(e, list) and len(e) == 2 and isinstance(e[1], (int, float))
    ]
    master.nodes = json.loads(meta.get("nodes", "{}"))
    master.val_losses = [tuple(v) for v in json.loads(meta.get("val_losses", "[]"))]
    master.checksums = json.loads(meta.get("checksums", "{}"))
    master.finished = set(json.loads(meta.get("finished", "[]")))
    master.rejected = json.loads(meta.get("rejected", "[]"))
    master.rejected_versions = set(json.loads(meta.get("rejected_versions", "[]")))
    master.per_node = json.loads(meta.get("per_node", "{}"))
    master.feedback = json.loads(meta.get("feedback", "{}"))
    master.peers = json.loads(meta.get("peers", "{}"))
    master.bytes_in = int(meta.get("bytes_in", "0"))
    rounds = json.loads(meta.get("fragment_rounds", "null"))
    if isinstance(rounds, list) and len(rounds) == len(master.fragment_rounds):
        master.fragment_rounds = [int(r) for r in rounds]
    master.state_epoch = int(meta.get("epoch", "0"))
    master.published = _load_published(master.state_path.parent / PUBLISHED_FILE)
    master.rounds.load(json.loads(meta.get("rounds", "{}")))
    logger.info(
        "DiLoCo master: resumed state at outer step %d (%d deltas applied)",
        master.outer_step,
        len(master.applied),
    )
    return True
