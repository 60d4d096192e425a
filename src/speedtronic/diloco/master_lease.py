"""The workers' side of the master's fence, where coordinator.py imports it from (the master's side is
diloco/master/lease.py, where these live; the worker package takes them from there directly later)."""

from speedtronic.diloco.master.lease import EpochFence, epoch_of

__all__ = ["EpochFence", "epoch_of"]
