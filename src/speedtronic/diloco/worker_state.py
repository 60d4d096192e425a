"""A DiLoCo worker's checkpoint part (the training checkpoint's "sync"): what `Coordinator.state_dict`
saves and `load_state_dict` restores, so a resumed node continues its delta numbering exactly once.

Saved: the node id, the outer step of the newest global taken, the next sequence number, anchor (the
global last installed, per tensor), accounted (what was queued since), the error-feedback residual, the
upload queue, counters; and for Streaming DiLoCo (diloco/fragments.py) each fragment's installed
round and outer step and its overlap due step (diloco/overlap.py). anchor − accounted is each
fragment's sync snapshot (its weights at its last sync), so a resume between two fragment syncs
computes the next fragment's delta from the same baseline the dead process had: no delta id is lost or
sent twice. A checkpoint written before fragments existed loads as one fragment. No I/O here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from speedtronic.diloco.upload_item import Item
from speedtronic.errors import SpeedtronicError

logger = logging.getLogger("speedtronic.diloco")


def state_dict(c: Any) -> dict[str, Any]:
    with c._cond:
        queue = [
            {
                "seq": i.seq,
                "x": dict(i.x),
                "base": i.base,
                "local_step": i.local_step,
                "tokens": i.tokens,
                "fragment": i.fragment,
                "fragment_round": i.fragment_round,
            }
            for i in c.queue
        ]
    return {
        "node": c.node,
        "outer_step": c.outer_step,
        "seq": c.seq,
        "anchor": dict(c.anchor or {}),
        "accounted": dict(c.accounted),
        "residual": dict(c.residual),
        "queue": queue,
        "tokens_since": c.tokens_since,
        "bytes_sent": c.bytes_sent,
        "uploaded": list(c.uploaded[-1000:]),
        "fragments": c.frags.count,
        "fragment_rounds": list(c.fragment_rounds),
        "anchor_steps": list(c.anchor_steps),
        "overlap": c.pending.to_json(),
        "peak_delta_bytes": c.peak_delta_bytes,
    }


def load_state_dict(c: Any, state: dict[str, Any]) -> None:
    if state.get("node") != c.node:
        raise SpeedtronicError(
            f"the checkpoint belongs to DiLoCo node {state.get('node')!r}, not {c.node!r}; resume "
            "with the same --node-id or use another checkpoint.directory"
        )
    count = int(state.get("fragments", 1))
    if count != c.frags.count:
        raise SpeedtronicError(
            f"the checkpoint was written with distributed.sync.fragments={count}, this run has "
            f"{c.frags.count}; resume with distributed.sync.fragments={count} or use another checkpoint.directory"
        )
    c.outer_step = int(state["outer_step"])
    c.seq = int(state["seq"]) if state.get("seq") is not None else None
    c.anchor = dict(state["anchor"]) or None
    c.accounted = dict(state["accounted"])
    c.residual = dict(state["residual"])
    with c._cond:  # an uploader left running by a timed-out close() pops only its own item
        c.queue = deque(
            Item(
                q["seq"],
                dict(q["x"]),
                q["base"],
                q["local_step"],
                q["tokens"],
                fragment=int(q.get("fragment", 0)),
                fragment_round=int(q.get("fragment_round", -1)),
            )
            for q in state["queue"]
        )
    c.tokens_since = int(state.get("tokens_since", 0))
    c.bytes_sent = int(state.get("bytes_sent", 0))
    c.uploaded = list(state.get("uploaded", []))
    c.fragment_rounds = [int(r) for r in state.get("fragment_rounds", [-1] * count)]
    c.anchor_steps = [int(r) for r in state.get("anchor_steps", [c.outer_step] * count)]
    c.pending.load(state.get("overlap", []), count)
    c.peak_delta_bytes = int(state.get("peak_delta_bytes", 0))


def progress(c: Any, step: int) -> None:
    """The worker's progress line, logged at each sync point."""
    ago = f"{time.time() - c.last_sync:.0f}s ago" if c.last_sync else "never"
    logger.info(
        "DiLoCo node %s · inner step %d · outer step %d · last sync %s · sent %.2f MB in %d deltas · %d queued",
        c.node,
        step,
        c.outer_step,
        ago,
        c.bytes_sent / 1e6,
        len(c.uploaded),
        len(c.queue),
    )


def summary(c: Any) -> dict[str, Any]:
    """What `speedtronic worker --json` reports about the node's sync."""
    return {
        "node": c.node,
        "outer_step": c.outer_step,
        "uploaded": list(c.uploaded),
        "bytes_sent": c.bytes_sent,
        "dropped": c.dropped,
        "queued": len(c.queue),
        "ended_early": c.ended_early,
        "fragments": c.frags.count,
        "peak_delta_bytes": c.peak_delta_bytes,  # the largest single upload (Streaming DiLoCo cuts it)
    }


def wait_for_head(c: Any) -> Any:
    """The run's head, once the master has published one (SpeedtronicError past max_wait)."""
    deadline = time.monotonic() + c.dist.rounds.max_wait
    while True:
        head = c.bus.read_head()
        if head is not None:
            return head
        if time.monotonic() > deadline:
            raise SpeedtronicError(
                f"{c.bus.url}: no global model was published within {c.dist.rounds.max_wait:.0f}s"
            )
        time.sleep(min(c.dist.node.poll_interval, 1.0))
