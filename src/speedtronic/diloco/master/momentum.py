"""The outer momentum across a takeover: recovered from the last globals the previous master published.

A master that adopts the bus's global (a hot standby taking over, a restarted master whose state is
behind the bus) used to start with a zero momentum buffer and its warm-up clock at 0: every failover
threw away the outer Nesterov direction and ramped the momentum up again over `outer_momentum_warmup`
rounds. In a 30-minute soak with 16 failovers that was a fifth of the rounds.

Nothing new is sent for it. Each head names the globals its master published just before (`chain`:
outer step, path, the version to read it at, and the momentum that produced it; at most KEEP_GLOBALS,
which the bus keeps anyway) and the master's round count (`steps`, the warm-up's clock). One Nesterov
step is m' = μ·m + d, w' = w − lr·(d + μ·m'), so the update u = (w − w')/lr gives

    m' = (u + μ·m) / (1 + μ)

With m unknown at the oldest global (taken as 0), its weight in the result shrinks by μ/(1+μ) per step
(0.44 at μ = 0.8): two steps back leave a fifth of it, four a twenty-fifth. A round of folded
deltas fed the momentum only c·Δ (outer.momentum_feed; m' = (c·u + μ·m) / (1 + c·μ)): the chain does
not say c, so the recovery takes c = 1 there, a momentum somewhat too large for that one step, under
the same bounds as any other. A step the master took without the momentum (outer.py: one that
overshot) says μ 0, and m' = u is then its round, as the master restarted it (c aside). Only the tensors (or elements, for Streaming DiLoCo's fragments) a step
moved are updated: a weight a step left alone is bit-identical, and so is its momentum.

Everything is untrusted: the chain is parsed defensively, each global is read with the run's size cap
and decoded against the model's specs (shapes, dtypes, finiteness), steps must be consecutive, and a
recovered buffer that is not finite, or larger than the updates could have made it, is dropped. Any
failure leaves the reset momentum of before, with one log line saying why.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Bus, BusError, Head

if TYPE_CHECKING:
    from speedtronic.diloco.outer import OuterOptimizer

logger = logging.getLogger("speedtronic.diloco")

MAX_CHAIN = 8  # entries read from a head, whatever it lists


@dataclass(frozen=True)
class Link:
    """One published global: its outer step, where it is, the version to read it at, and the momentum
    of the outer step that produced it."""

    step: int
    path: str
    version: str
    mu: float


def head_entry(outer: OuterOptimizer, chain: list[Link]) -> dict[str, Any]:
    """head.json's "momentum": the master's round count and the links of its recent globals."""
    return {
        "steps": outer.steps,
        "mu": outer.last_mu,
        "chain": [[x.step, x.path, x.version, x.mu] for x in chain],
    }


def parse_chain(head: Head) -> tuple[list[Link], int | None]:
    """(the links a head names, oldest first, ending with the head's own global; its round count).
    Malformed entries end the chain where they are."""
    entry = head.get("momentum")
    if not isinstance(entry, dict):
        return [], None
    steps = entry.get("steps")
    links: list[Link] = []
    raw = entry.get("chain")
    for item in (raw if isinstance(raw, list) else [])[-MAX_CHAIN:]:
        link = _link(item)
        if link is None:
            links = []  # everything before a bad entry is cut off from the head's own global
            continue
        links.append(link)
    own = _link([head.get("outer_step"), head.get("global"), head.version, entry.get("mu")])
    if own is None:
        return [], None
    links.append(own)
    return _consecutive(links), steps if isinstance(steps, int) and steps >= 0 else None


def _link(item: Any) -> Link | None:
    if not isinstance(item, list) or len(item) != 4:
        return None
    step, path, version, mu = item
    if not isinstance(step, int) or not isinstance(path, str) or not isinstance(version, str):
        return None
    if not isinstance(mu, (int, float)) or not 0 <= float(mu) < 1:
        return None
    return Link(step, path[:300], version[:200], float(mu))


def _consecutive(links: list[Link]) -> list[Link]:
    """The longest run of links ending with the last whose steps go up by one."""
    out = [links[-1]]
    for link in reversed(links[:-1]):
        if link.step != out[0].step - 1:
            break
        out.insert(0, link)
    return out


def recover(
    bus: Bus,
    head: Head,
    current: dict[str, torch.Tensor],
    specs: dict[str, codec.ParamSpec],
    cap: int,
    lr: float,
) -> tuple[dict[str, torch.Tensor], int, int] | None:
    """(momentum buffers, the round count, globals used) from the globals `head` chains back to, or
    None (logged) when there is nothing to recover from. `current`: the head's own global, read."""
    links, steps = parse_chain(head)
    if len(links) < 2 or lr <= 0:
        return None
    # Newest first, back to the first that cannot be read: the chain must stay consecutive.
    weights: list[dict[str, torch.Tensor]] = [current]
    for link in reversed(links[:-1]):
        try:
            data = bus.read_global_capped(Head({"global": link.path}, link.version), cap)
            weights.insert(0, codec.decode(data, specs, kind="global", max_bytes=cap).tensors)
        except (BusError, codec.Rejected) as error:
            logger.info(
                "DiLoCo master: momentum: cannot read the global of outer step %d (%s)", link.step, error
            )
            break
    links = links[len(links) - len(weights) :]
    if len(weights) < 2:
        return None
    momentum = rebuild(weights, [x.mu for x in links[1:]], lr)
    return (momentum, steps if steps is not None else 0, len(weights)) if momentum is not None else None


@torch.no_grad()
def rebuild(
    weights: list[dict[str, torch.Tensor]], mus: list[float], lr: float
) -> dict[str, torch.Tensor] | None:
    """Momentum after the last of `weights` (consecutive globals), given the μ of each step between
    them (m' = (u + μ·m) / (1 + μ), m = 0 before the first); None when the result cannot be right."""
    m = {n: torch.zeros_like(t) for n, t in weights[-1].items()}
    largest = 0.0
    for before, after, mu in zip(weights[:-1], weights[1:], mus, strict=True):
        for name, w in after.items():
            u = (before[name] - w) / lr
            moved = u != 0
            m[name] = torch.where(moved, (u + mu * m[name]) / (1 + mu), m[name])
        largest = max(
            largest, math.sqrt(sum(float(((b - after[n]) / lr).square().sum()) for n, b in before.items()))
        )
    size = math.sqrt(sum(float(t.square().sum()) for t in m.values()))
    # |m'| <= (|u| + μ|m|)/(1+μ) <= max |u| by induction: a larger one was not made by these steps.
    if not math.isfinite(size) or size > largest * (1 + 1e-3) + 1e-12:
        logger.warning(
            "DiLoCo master: momentum: the recovered buffer (norm %.3g) does not fit the updates", size
        )
        return None
    return m


def adopt(
    bus: Bus, head: Head, outer: OuterOptimizer, specs: dict[str, codec.ParamSpec], cap: int
) -> tuple[str, list[Link]]:
    """After `outer.adopt` (momentum reset): recover the momentum and the round count where the head
    allows. (What happened, for the adoption's log line; the head's links, which the new master's
    heads carry on until its own replace them, so a second takeover soon after can recover too.)"""
    found = recover(bus, head, outer.weights, specs, cap, outer.lr)
    links, _ = parse_chain(head)
    if found is None:
        return "momentum reset", links
    buffers, steps, used = found
    outer.resume(buffers, steps, links[-1].mu)
    return f"momentum recovered from {used} globals, outer round {steps}", links
