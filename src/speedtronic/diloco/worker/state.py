"""A DiLoCo worker's checkpoint part (the training checkpoint's "sync"): what `Coordinator.state_dict`
saves and `load_state_dict` restores, so a resumed node continues its delta numbering exactly once.

Saved: the node id, the outer step of the newest global taken, the next sequence number, anchor (the
global last installed, per tensor), accounted (what was queued since), the error-feedback residual, the
upload queue, counters; and for Streaming DiLoCo (diloco/fragments.py) each fragment's installed
round and outer step and its overlap due step (diloco/worker/overlap.py). anchor − accounted is each
fragment's sync snapshot (its weights at its last sync), so a resume between two fragment syncs
computes the next fragment's delta from the same baseline the dead process had: no delta id is lost or
sent twice. A checkpoint written before fragments existed loads as one fragment. No I/O here.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from speedtronic.diloco import fragments
from speedtronic.diloco.worker.book import Book
from speedtronic.diloco.worker.defer import Deferral
from speedtronic.diloco.worker.ending import Ending
from speedtronic.diloco.worker.numbering import Numbering
from speedtronic.diloco.worker.overlap import Overlap
from speedtronic.diloco.worker.poller import Poller
from speedtronic.diloco.worker.uploader import Uploader
from speedtronic.errors import SpeedtronicError

logger = logging.getLogger("speedtronic.diloco")


class Parts(Protocol):
    """The worker's parts whose state the checkpoint holds (the coordinator has them)."""

    node: str
    frags: fragments.Plan
    numbering: Numbering
    book: Book
    uploader: Uploader
    overlap: Overlap
    ending: Ending
    poller: Poller
    deferral: Deferral


def state_dict(c: Parts) -> dict[str, Any]:
    """The checkpoint's "sync" part: each owner's share under the keys it always had."""
    return {
        "node": c.node,
        "seq": c.numbering.seq,
        **c.book.state_dict(),
        **c.uploader.state_dict(),
        "fragments": c.frags.count,
        "overlap": c.overlap.pending.to_json(),
    }


def load_state_dict(c: Parts, state: dict[str, Any]) -> None:
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
    c.numbering.load(state.get("seq"))
    c.book.load_state_dict(state, count)
    c.uploader.load_state_dict(state)
    c.overlap.pending.load(state.get("overlap", []), count)


def progress(c: Parts, step: int) -> None:
    """The worker's progress line, logged at each sync point."""
    synced = [t for t in (c.book.last_install, c.uploader.last_upload) if t is not None]
    ago = f"{time.time() - max(synced):.0f}s ago" if synced else "never"
    logger.info(
        "DiLoCo node %s · inner step %d · outer step %d · last sync %s · sent %.2f MB in %d deltas · %d queued"
        " · waited %.1fs for globals",
        c.node,
        step,
        c.book.outer_step,
        ago,
        c.uploader.bytes_sent / 1e6,
        len(c.uploader.uploaded),
        len(c.uploader.queue),
        c.poller.waited_s,
    )


def summary(c: Parts) -> dict[str, Any]:
    """What `speedtronic worker --json` reports about the node's sync."""
    return {
        "node": c.node,
        "outer_step": c.book.outer_step,
        "uploaded": list(c.uploader.uploaded),
        "bytes_sent": c.uploader.bytes_sent,
        "dropped": c.uploader.dropped,
        "folded": c.uploader.folded,  # deltas folded into a later one while the master did not answer
        "queued": len(c.uploader.queue),
        "ended_early": c.ending.ended_early,
        "fragments": c.frags.count,
        "peak_delta_bytes": c.uploader.peak_delta_bytes,  # the largest single upload (Streaming DiLoCo cuts it)
        # Globals fetched whole or rebuilt from an int8 update (global_codec), and their bytes.
        "globals_read": dict(c.poller.reads),
        # Seconds training stood still waiting for a global (overlap's due step, max_rounds_ahead): the
        # sync's cost in this process's life, not counting the uploads and downloads it overlapped.
        "waited_for_global_s": round(c.poller.waited_s, 3),
        # Globals held for the next sync instead of installed as they came: a node much slower than the
        # master's rounds (defer.py).
        "globals_deferred": c.deferral.deferred,
    }
