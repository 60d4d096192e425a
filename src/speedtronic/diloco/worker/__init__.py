"""The worker side of DiLoCo: `Coordinator` (coordinator.py), the `Sync` a worker's Trainer calls after
every optimizer step, and the parts it composes, each owning its state: `Book` (weights against the
global), `Uploader` (upload queue and thread), `Poller` (head and global polling thread), `Overlap` (late
install), `Numbering` (delta numbers), `Ending` (where the node stops). The checkpoint part is state.py.
"""

from speedtronic.diloco.worker.coordinator import Coordinator

__all__ = ["Coordinator"]
