"""The DiLoCo master: a background outer loop that turns deltas on the bus into new global models.

`Master` (core.py) composes owned parts: the run's record (ledger.py), the durable state file
(state.py), the lease and fencing epoch (lease.py), who a round waits for (rounds.py), the peers'
scores and quarantine (peers.py), the status document (report.py), Streaming DiLoCo's fragment state
(fragments.py), the run's end (end.py), the outer momentum a takeover recovers (momentum.py) and
the files each global is sent as (broadcast.py). Receiving a delta is a pipeline (pipeline.py) of named
checks (checks.py), which plugins extend through `register_delta_checks`.
"""

from speedtronic.diloco.master.core import Master, planned_rounds

__all__ = ["Master", "planned_rounds"]
