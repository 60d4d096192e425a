"""The DiLoCo master's crash-safe state file: fp32 global weights, outer momentum, outer step, applied
delta ids and checksums, per-node high-water marks, rejections, counters and the arrival history that
round deadlines are learnt from.

One safetensors file (tensors `g/<param>` and `m/<param>`, everything else as JSON strings in its
metadata), written atomically; never pickled. The master writes it *before* it publishes a new global
and deletes processed deltas (master.py explains why that makes a crash safe).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco import codec

logger = logging.getLogger("speedtronic.diloco")
STATE_FILE = "master_state.safetensors"


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
    }
    data = save(tensors, metadata=meta)
    master.state_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(master.state_path, data)


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
    master.rounds.load(json.loads(meta.get("rounds", "{}")))
    logger.info(
        "DiLoCo master: resumed state at outer step %d (%d deltas applied)",
        master.outer_step,
        len(master.applied),
    )
    return True
