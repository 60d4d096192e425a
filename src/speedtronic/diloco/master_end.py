"""How a DiLoCo run ends on the master: who has finished, who has left, when the master stops, why,
and which global it publishes as the final one.

A node's end. A node is finished once the master has processed a delta of it marked final
(metadata `final="1"`, coordinator.py) — applied, or rejected for what it contains: too stale, a norm
outlier. A final delta past `max_staleness` is rejected from the mean like any other stale delta
(its work was done on a global the run has moved far past; weighting it in would apply it to a model
it never saw), and it still ends its node. A file only ends a node when it has passed the checks of
who sent it: it decoded, its payload checksum matched, its metadata names the node it is filed
under, it is no replay of an applied payload and its local step is sane (`rejected_final`). Garbage
or a copy planted under an honest node's name therefore never ends that node. (Files are not signed:
whoever can write under a node's name can forge a well-formed final delta; access control on the
bus is what stops that.)

Who is known: the listed collaborators (less the master when it sends nothing), every node with an
applied delta and every finished node. A known node has *left* when it has not been heard from (a
new delta of it seen on the bus; for a node never heard from: since this master started) for its
liveness window, `liveness_window` (learnt from its own intervals; `distributed.rounds.never_heard_wait`,
default max_wait, for a node never heard from) — or, never heard from, once the run's end and the late
joiners' window (`late_join_wait`) after it are past.

The master stops (`wait`), and says why in the log, metrics.json, the summary (`end_reason`) and
head.json (`final.reason`):
- complete: outer step `end` reached at least `linger_s` ago (late joiners' window), every known
  node finished or left, and nothing valid pending — confirmed by a poll that started after all of
  that was true ("all 8 nodes finished", "7 of 8 nodes finished; w3 left (last heard 300 s ago)");
- idle: no outer step and no new delta for `idle_s` (3 × that while valid deltas are pending: a
  round always settles them), whatever the outer step ("idle for 600 s at outer step 3 of 10 …").
Before the run's end an idle timeout is the only way out: more nodes may still join to reach it.

The final pick. The master evaluates every global it publishes when it has held-out data
(launch.make_evaluator) and keeps the best one in memory (`remember`): the lowest val loss since it
was taken, and at most RECENT outer steps old (when it gets older, the current global takes its
place, so the pick never rolls a run back further than that). At the end the final global is
evaluated; if the kept one is better, the master publishes its weights as a new outer step (outer
momentum reset: the weights jumped back) — a normal newer global for any worker still running — and
head.json says so: `final: {outer_step, from_outer_step, val_loss, last_val_loss, chosen:
"best"|"last", reason}`. Otherwise it republishes the last global with that entry (chosen "last").
The kept weights are not saved: after a restart the pick looks only at globals since.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from speedtronic.diloco import master_report
from speedtronic.diloco.bus.base import BusError, DeltaRef
from speedtronic.diloco.codec import Decoded
from speedtronic.errors import SpeedtronicError

logger = logging.getLogger("speedtronic.diloco")
RECENT = 8  # outer steps the final pick may look back


@dataclass
class Best:
    """The best recent global: its outer step, val loss and fp32 weights (a copy)."""

    outer_step: int
    val_loss: float
    weights: dict[str, torch.Tensor]


def rejected_final(master: Any, ref: DeltaRef, decoded: Decoded) -> None:
    """A delta that passed the sender checks was rejected for its content: if it was the node's final
    one, the node is finished all the same (it will send nothing more)."""
    if decoded.meta.get("final") != "1":
        return
    master.finished.add(ref.node)
    logger.info(
        "DiLoCo master: %s was %s's final delta: rejected from the mean, the node counts as finished",
        ref.name,
        ref.node,
    )


def remember(master: Any, loss: float) -> None:
    """Keep the current global if it is the best recent one (see the module docstring)."""
    best: Best | None = master.best
    step = int(master.outer_step)
    if not math.isfinite(loss):
        return  # a diverged global is never the one to go back to
    if best is not None and loss >= best.val_loss and step - best.outer_step < RECENT:
        return
    weights = master.outer.weights
    if best is None or best.weights.keys() != weights.keys():
        master.best = Best(step, loss, {n: t.detach().clone() for n, t in weights.items()})
        return
    for name, tensor in weights.items():
        best.weights[name].copy_(tensor)  # reuse the buffers: this happens on most outer steps
    best.outer_step, best.val_loss = step, loss


def liveness_window(master: Any, node: str) -> float:
    """Seconds without news after which a node counts as gone: the window the round rule learnt from
    the node's own intervals (master_rounds.py: a few of its intervals, at most max_wait); never_heard_wait
    (default max_wait) for a node never heard from: only the run's end asks (rounds have their own
    rule for joiners, master_rounds.py), so a test can end a run with a ghost listed quickly."""
    if node not in master._heard:
        wait = master.dist.rounds.never_heard_wait
        return float(master.dist.rounds.max_wait if wait is None else wait)
    return float(master.rounds.window(master, node))


def known_nodes(master: Any) -> set[str]:
    listed = set(master.allowed or ()) - set(master.silent)
    return listed | set(master.nodes) | set(master.finished)


def left_nodes(master: Any, now: float, late_join_over: bool = False) -> dict[str, float | None]:
    """{node: seconds since it was last heard from (None: never)} of the known unfinished nodes
    that have been silent past their liveness window. A listed node never heard from has also left
    once the run's end is past and the late joiners' window with it (`late_join_over`): it had the
    whole run and `late_join_wait` to show up."""
    out: dict[str, float | None] = {}
    for node in known_nodes(master) - set(master.finished):
        heard = master._heard.get(node)
        quiet = now - (heard if heard is not None else master._started)
        if quiet > liveness_window(master, node) or (heard is None and late_join_over):
            out[node] = round(quiet) if heard is not None else None
    return out


def describe_left(left: dict[str, float | None]) -> str:
    """'w3 (last heard 300 s ago), w4 (never heard from)'."""
    return ", ".join(
        f"{n} (last heard {q:.0f} s ago)" if q is not None else f"{n} (never heard from)"
        for n, q in sorted(left.items())
    )


def done_reason(master: Any, left: dict[str, float | None]) -> str:
    known = known_nodes(master)
    finished = len(known & set(master.finished))
    if not left:
        return f"all {finished} nodes finished"
    return f"{finished} of {len(known)} nodes finished; {len(left)} left: {describe_left(left)}"


def idle_reason(master: Any, quiet: float, end: int, now: float) -> str:
    unfinished = sorted(known_nodes(master) - set(master.finished))
    left = left_nodes(master, now)
    parts = [
        f"idle for {quiet:.0f} s at outer step {master.outer_step} of {end} with "
        f"{master.pending_count} deltas pending"
    ]
    if unfinished:
        parts.append(f"no final delta from {', '.join(unfinished)}")
    if left:
        parts.append(f"left: {describe_left(left)}")
    return "; ".join(parts)


def wait(master: Any, end: int, idle_s: float, linger_s: float | None = None, busy: Any = None) -> str:
    """Block until the run is over (module docstring; while `busy()` is true, keep waiting
    regardless); then stop the outer loop, make the final pick and return why the run ended."""
    linger_s = idle_s if linger_s is None else linger_s
    last, last_change = master.outer_step, master.clock()
    last_log = master.clock()
    ended_at: float | None = None
    confirm: int | None = None  # rounds done when the end was first seen
    while master._thread is not None and master._thread.is_alive():
        now = master.clock()
        if master.outer_step != last:
            last, last_change = master.outer_step, now
        if ended_at is None and master.outer_step >= end:
            ended_at = now
        quiet = now - max(last_change, master._last_arrival)
        left = left_nodes(master, now, ended_at is not None and now - ended_at >= linger_s)
        unfinished = sorted(known_nodes(master) - set(master.finished) - set(left))
        if busy is None or not busy():
            over = (
                ended_at is not None
                and now - ended_at >= linger_s
                and master.pending_count == 0
                and not unfinished
            )
            # pending_count is from the latest poll: the end needs one that *started* after the end
            # was seen (two rounds done since: the one in progress then may have listed before).
            confirm = (master.rounds_done if confirm is None else confirm) if over else None
            if over and confirm is not None and master.rounds_done >= confirm + 2:
                return finish(master, done_reason(master, left), end, complete=True)
            # Pending deltas are always settled by a round (applied or rejected); give them longer.
            if quiet > idle_s * (3 if master.pending_count else 1):
                return finish(master, idle_reason(master, quiet, end, now), end, complete=False)
        if now - last_log >= max(30.0, master.dist.node.poll_interval):
            last_log = now
            logger.info(
                "DiLoCo master: %s",
                master_report.progress_line(master, end, unfinished, idle_s - quiet, ended_at, linger_s),
            )
        time.sleep(min(0.5, master.dist.node.poll_interval))
    master.end_reason = f"the outer loop stopped: {master.error}" if master.error else "stopped"
    return master.end_reason


def finish(master: Any, reason: str, end: int, *, complete: bool) -> str:
    """Stop the outer loop, publish the final pick, and say why the run ended (one log line)."""
    master._stop.set()
    if master._thread is not None:
        master._thread.join()
        master._thread = None
    master.end_reason = reason
    final = pick_final(master, reason)
    if final["chosen"] == "best":
        said = (
            f"final global: outer step {final['outer_step']} = the weights of outer step "
            f"{final['from_outer_step']} (val loss {final['val_loss']:.4f}; the last global, outer step "
            f"{final['outer_step'] - 1}, had {final['last_val_loss']:.4f})"
        )
    elif final["val_loss"] is not None:
        said = f"final global: outer step {final['outer_step']}, the last (val loss {final['val_loss']:.4f})"
    else:
        said = f"final global: outer step {final['outer_step']}, the last (no held-out data to evaluate)"
    logger.log(
        logging.INFO if complete else logging.WARNING,
        "DiLoCo master: %s at outer step %d (end %d): %s; %d deltas applied, %d rejected; %s",
        "run complete" if complete else "stopping",
        master.outer_step,
        end,
        reason,
        len(master.applied),
        len(master.rejected),
        said,
    )
    return reason


def pick_final(master: Any, reason: str) -> dict[str, Any]:
    """Evaluate the last global, publish the best recent one as final when it is better, and record
    the pick in `master.final` (and head.json)."""
    step = int(master.outer_step)
    loss: float | None = None
    if master.evaluate is not None:
        if master.val_losses and master.val_losses[-1][0] == step:
            loss = float(master.val_losses[-1][1])
        else:
            loss = float(master.evaluate(master.outer.weights))
            master.val_losses.append((step, loss))
            remember(master, loss)
    best: Best | None = master.best
    final: dict[str, Any] = {
        "outer_step": step,
        "from_outer_step": step,
        "val_loss": loss,
        "last_val_loss": loss,
        "chosen": "last",
        "reason": reason,
    }
    worse = loss is not None and (not math.isfinite(loss) or (best is not None and best.val_loss < loss))
    if worse and best is not None and best.outer_step != step:
        for name, tensor in best.weights.items():
            master.outer.weights[name].copy_(tensor)
        master.outer.reset_momentum()  # the weights jumped back: the old direction no longer applies
        master.outer_step = step + 1
        # Every fragment moved (Streaming DiLoCo): a worker still running installs all of it.
        master.fragment_rounds = [r + 1 for r in master.fragment_rounds]
        master.val_losses.append((master.outer_step, best.val_loss))
        final.update(
            outer_step=step + 1, from_outer_step=best.outer_step, val_loss=best.val_loss, chosen="best"
        )
    master.final = final
    try:
        master.save_state()  # the commit point, as for any outer step
        master.publish()
    except (BusError, OSError) as error:
        logger.warning("DiLoCo master: could not publish the final global (%s)", error)
    except SpeedtronicError as error:  # another master advanced the run: this one says so and stops
        master.error = error
        logger.error("%s", error)
    return final
