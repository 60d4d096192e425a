"""Parallel training inside one node: the process group and its ranks (distributed.py), FSDP2 sharding
(fsdp.py, and fsdp_sync.py for a DiLoCo sync over sharded parameters), and the wrap a run's model gets
(wrap.py: fsdp sharding or DDP)."""
