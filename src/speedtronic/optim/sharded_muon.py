"""Muon's whole-matrix step for row-sharded (FSDP2) matrices, with each matrix done by one owner rank.

Newton–Schulz needs a whole matrix, so a sharded matrix must be put together somewhere. Gathering it
on every rank (`schedule="gather"`) makes every rank run every matrix's iteration: N times the work.
The owner-rank schedule (as in torchtitan's and Dion's distributed Muon) spreads the matrices over the
ranks instead: each matrix's momentum update (and, for the cautious mask, its gradient) is gathered to
its owner alone, the owner computes the mask, the orthogonalisation and Muon+ on the whole matrix, and
scatters the result back, each rank receiving the rows it stores. Each rank runs 1/N of the
iterations, and a matrix crosses the network twice (in and out) instead of N−1 times.

Owners are chosen greedily by size (largest matrix first, to the least loaded rank): the same on every
rank, since every rank sees the same shapes in the same order. All gathers are issued before any
iteration runs and all scatters before any is waited on, so transfers overlap the work.

FSDP2 shards dim 0 like `torch.chunk`: rank k holds rows [k·c, min((k+1)·c, rows)) with c = ⌈rows/N⌉
(trailing ranks may hold none). Shards travel padded to c rows; the padding sits after each rank's
rows, so the padded chunks put end to end hold the matrix in its first `rows` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from speedtronic.optim.cautious import cautious_

# The update of one whole matrix, in storage orientation: (momentum update, gradient or None) → update.
WholeStep = Callable[[list[torch.Tensor], list[torch.Tensor | None]], list[torch.Tensor]]


def chunk_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def owners(shapes: list[tuple[int, ...]], world: int) -> list[int]:
    """The rank that computes each matrix: largest first, each to the least loaded rank."""
    load = [0] * world
    out = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[i] = rank
        load[rank] += shapes[i][0] * shapes[i][1]
    return out


def _padded(local: torch.Tensor, rows: int) -> torch.Tensor:
    if local.shape[0] == rows:
        return local.contiguous()
    pad = local.new_zeros((rows - local.shape[0], *local.shape[1:]))
    return torch.cat([local, pad])


def owner_step(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    whole_step: WholeStep,
) -> list[torch.Tensor]:
    """This rank's rows of each matrix's whole-matrix update. `params`, `updates` and `grads` are
    DTensors sharded on dim 0 over one mesh dimension; `grads` only where the step needs them (the
    cautious mask). `whole_step` turns whole momentum updates (and gradients) into whole updates."""
    mesh = params[0].device_mesh  # type: ignore[attr-defined]
    group = mesh.get_group()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    shapes = [tuple(p.shape) for p in params]
    owner = owners(shapes, world)
    cautious = grads is not None
    for shape, update in zip(shapes, updates, strict=True):
        c = chunk_rows(shape[0], world)
        held = update.to_local().shape[0]  # type: ignore[attr-defined]
        if held != max(0, min(c, shape[0] - me * c)):  # not torch.chunk's layout: rows would be misplaced
            raise RuntimeError(
                f"sharded Muon: rank {me} holds {held} rows of a {shape[0]}-row matrix, not torch.chunk's "
                f"share; use Muon(sharded_schedule='gather')"
            )

    # 1. every shard to its matrix's owner (momentum update and gradient side by side).
    incoming: list[list[torch.Tensor] | None] = []
    pending = []
    for i, (shape, update) in enumerate(zip(shapes, updates, strict=True)):
        c = chunk_rows(shape[0], world)
        local = update.to_local()  # type: ignore[attr-defined]
        if cautious:
            local = torch.cat([local, grads[i].to_local()], dim=1)  # type: ignore[index, attr-defined]
        payload = _padded(local, c)
        buffers = [torch.empty_like(payload) for _ in range(world)] if owner[i] == me else None
        pending.append(
            dist.gather(
                payload, buffers, dst=dist.get_global_rank(group, owner[i]), group=group, async_op=True
            )
        )
        incoming.append(buffers)
    for work in pending:
        work.wait()

    # 2. the owner computes its matrices whole.
    mine = [i for i in range(len(params)) if owner[i] == me]
    whole_updates, whole_grads = [], []
    for i in mine:
        whole = torch.cat(incoming[i])[: shapes[i][0]]  # type: ignore[arg-type]
        cols = shapes[i][1]
        whole_updates.append(whole[:, :cols])
        whole_grads.append(whole[:, cols:] if cautious else None)
    results = dict(zip(mine, whole_step(whole_updates, whole_grads), strict=True))

    # 3. each rank's rows back from the owner.
    out: list[torch.Tensor] = []
    pending = []
    for i, (shape, update) in enumerate(zip(shapes, updates, strict=True)):
        c = chunk_rows(shape[0], world)
        local_rows = update.to_local().shape[0]  # type: ignore[attr-defined]
        received = torch.empty((c, shape[1]), dtype=update.dtype, device=update.to_local().device)  # type: ignore[attr-defined]
        chunks = None
        if owner[i] == me:
            result = _padded(results[i].to(update.dtype), c * world)
            chunks = list(result.split(c))
        pending.append(
            dist.scatter(
                received, chunks, src=dist.get_global_rank(group, owner[i]), group=group, async_op=True
            )
        )
        out.append(received[:local_rows])
    for work in pending:
        work.wait()
    return out


def masked(updates: list[torch.Tensor], grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The cautious mask on whole matrices, where a gradient came along."""
    return [u if g is None else cautious_(u, g) for u, g in zip(updates, grads, strict=True)]


def is_row_sharded(tensor: Any) -> bool:
    """A DTensor sharded on dim 0 over a one-dimensional mesh (FSDP2's layout)."""
    if type(tensor).__name__ != "DTensor":
        return False
    placements = tensor.placements
    return (
        tensor.device_mesh.ndim == 1
        and len(placements) == 1
        and placements[0].is_shard()
        and placements[0].dim == 0
    )
