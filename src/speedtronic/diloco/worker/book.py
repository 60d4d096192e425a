"""A DiLoCo worker's book-keeping of its weights against the global model (all fp32 CPU tensors keyed by
unique parameter):

  anchor     θ_global of the last installed global model (per fragment: the last global installed for it)
  accounted  the part of (anchor − θ) already handed to the upload queue since that install

At a sync point of fragment p the delta x = (anchor − θ) − accounted over p's tensors is taken (it has the
sign of a gradient) and added to accounted; installing global G keeps the local progress not yet queued:
θ ← G − ((anchor − θ) − accounted) (overlap.merge). The book also counts, per fragment, the round and outer
step of the global installed for it, the outer step of the newest global taken, and the tokens trained
since the last delta. It reads and writes the model's weights; it never talks to the bus.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from speedtronic.diloco import codec, fragments
from speedtronic.diloco.worker.overlap import Global, merge
from speedtronic.diloco.worker.upload_item import Item

logger = logging.getLogger("speedtronic.diloco")


class Book:
    def __init__(self, node: str, frags: fragments.Plan) -> None:
        self.node = node
        self.frags = frags
        self.anchor: dict[str, torch.Tensor] | None = None
        self.accounted: dict[str, torch.Tensor] = {}
        self.fragment_rounds = [-1] * frags.count  # per fragment: the round of the global installed for it
        self.anchor_steps = [-1] * frags.count  # ... and its outer step
        self.outer_step = -1  # the newest global taken
        self.installs = 0  # after_step reports a change when this moves
        self.sent_since_install = 0  # deltas queued since the last install (max_rounds_ahead)
        self.tokens_since = 0  # tokens trained since the last delta was queued
        self.last_tokens = 0
        self.last_install: float | None = None

    def state_dict(self) -> dict[str, Any]:
        """The book's part of the worker's checkpoint (diloco/worker/state.py)."""
        return {
            "outer_step": self.outer_step,
            "anchor": dict(self.anchor or {}),
            "accounted": dict(self.accounted),
            "tokens_since": self.tokens_since,
            "fragment_rounds": list(self.fragment_rounds),
            "anchor_steps": list(self.anchor_steps),
        }

    def load_state_dict(self, state: dict[str, Any], count: int) -> None:
        self.outer_step = int(state["outer_step"])
        self.anchor = dict(state["anchor"]) or None
        self.accounted = dict(state["accounted"])
        self.tokens_since = int(state.get("tokens_since", 0))
        self.fragment_rounds = [int(r) for r in state.get("fragment_rounds", [-1] * count)]
        self.anchor_steps = [int(r) for r in state.get("anchor_steps", [self.outer_step] * count)]

    def take(self, g: Global) -> None:
        """Global `g` is the newest taken (installed now, or held for an overlap's due step)."""
        self.outer_step = g.outer_step

    def forget(self) -> None:
        """Start over from the next global (the master has moved past this book's deltas)."""
        self.anchor, self.accounted = None, {}

    def start_tokens(self, tokens: int) -> None:
        """At attach: the trainer's running token count, from which the next delta's tokens count."""
        self.last_tokens = tokens

    def count_tokens(self, tokens: int) -> None:
        """The trainer's token count after a step (`tokens`: its running total)."""
        self.tokens_since += tokens - self.last_tokens
        self.last_tokens = tokens

    def delta(self, model: nn.Module, step: int, fragment: int, seq: int) -> Item:
        """Fragment `fragment`'s delta at a sync point, numbered `seq`: x = (anchor − θ) − accounted,
        now accounted for."""
        assert self.anchor is not None
        share = self.frags.part  # the fragment's tensors (P=1: all; "elements": strided views)
        anchor, now, accounted = (
            share(fragment, d) for d in (self.anchor, codec.snapshot(model), self.accounted)
        )
        x = {n: anchor[n] - now[n] - accounted[n] for n in anchor}
        for n in x:
            accounted[n] += x[n]  # in place: a view writes self.accounted's tensor
        base = self.anchor_steps[fragment]
        item = Item(seq, x, base, step, self.tokens_since, fragment, self.fragment_rounds[fragment])
        self.sent_since_install += 1
        self.tokens_since = 0
        return item

    def moved(self, g: Global, fragment: int) -> bool:
        """Whether global `g` moved `fragment` past what this node installed for it (a head without
        fragment rounds, P=1: any newer global moves the whole model)."""
        if g.rounds is not None:
            return g.rounds[fragment] > self.fragment_rounds[fragment]
        return g.outer_step > self.anchor_steps[fragment]

    @torch.no_grad()
    def install(
        self, model: nn.Module, inner_step: int, g: Global, moved: set[int], fresh: bool = False
    ) -> None:
        """θ ← G + (θ_now − θ_at_sync) for the tensors of the fragments in `moved` (overlap.merge): the
        local progress not yet queued is kept, so no local step is thrown away."""
        tensors = g.tensors
        whole = len(moved) == self.frags.count
        names = list(tensors) if whole else [n for p in sorted(moved) for n in self.frags.groups[p]]
        params = codec.unique_params(model)
        # "elements" fragments, some moved: each tensor takes the moved fragments' shares only.
        shares = self.frags.layout == "elements" and not whole and self.anchor is not None and not fresh
        if self.anchor is None or fresh:
            for name, p in params.items():
                p.copy_((tensors[name] - torch.zeros_like(tensors[name])).to(p.device, p.dtype))
            self.anchor, self.accounted = {}, {}
        elif shares:
            self._install_shares(model, params, tensors, moved)
        else:
            now = codec.snapshot(model)
            for name in names:
                new = merge(tensors[name], now[name], self.anchor[name], self.accounted[name])
                params[name].copy_(new.to(params[name].device, params[name].dtype))
        if not shares:
            for name in names:
                self.anchor[name] = tensors[name].clone()
                self.accounted[name] = torch.zeros_like(self.anchor[name])
        self._installed(g, moved, inner_step, whole)

    def _installed(self, g: Global, moved: set[int], inner_step: int, whole: bool) -> None:
        for p in moved:
            self.anchor_steps[p] = g.outer_step
            self.fragment_rounds[p] = g.rounds[p] if g.rounds is not None else g.outer_step
        self.installs += 1  # after_step reports a change, so the trainer broadcasts and resets its optimizer
        self.sent_since_install = 0
        self.last_install = time.time()
        logger.info(
            "DiLoCo node %s: installed global model of outer step %d at inner step %d%s",
            self.node,
            g.outer_step,
            inner_step,
            "" if whole else f" (fragment {', '.join(map(str, sorted(moved)))})",
        )

    def _install_shares(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        tensors: dict[str, torch.Tensor],
        moved: set[int],
    ) -> None:
        """install for "elements" fragments, some but not all moved: each moved share merged on its own
        (the same rule, elementwise), its anchor and accounted reset to the global's share."""
        assert self.anchor is not None
        share = self.frags.part
        now = codec.snapshot(model)
        for p in sorted(moved):
            g, cur, anchor, accounted = (share(p, d) for d in (tensors, now, self.anchor, self.accounted))
            for name in g:
                cur[name].copy_(merge(g[name], cur[name], anchor[name], accounted[name]))
                anchor[name].copy_(g[name])
                accounted[name].zero_()
        for name, param in params.items():
            param.copy_(now[name].to(param.device, param.dtype))
