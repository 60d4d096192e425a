"""Muon for hidden 2-D matrices, with the Muon+ and cautious variants.

One step for a matrix W with gradient G (same maths as ``torch.optim.Muon`` when the options match):

    B ← β·B + (1−β)·G                          momentum as an EMA (β = ``momentum``)
    U ← G + β·(B − G)  if nesterov, else B     (G.lerp(B, β): the Nesterov look-ahead)
    U ← U · mask / max(mean(mask), 1e-3)       cautious only: mask = (U ⊙ G > 0)
    O ← NewtonSchulz(U)                        approximate polar factor, see newton_schulz.py
    O ← normalise rows / columns of O          Muon+ only (arXiv 2602.21545)
    W ← W·(1 − lr·λ) − lr·s(A, B)·O            decoupled weight decay, shape-aware LR scale s

The cautious mask is applied *before* orthogonalisation, as in the cautious-optimizer reference
(arXiv 2411.16085): orthogonalising mixes every entry of the update, so masking afterwards would no
longer mean "only move where the momentum agrees with the gradient".

``adjust_lr`` picks s for a matrix of A rows and B columns: ``original`` is max(1, A/B)^½ (Keller
Jordan's), ``match_rms_adamw`` is 0.2·max(A, B)^½ (Moonlight, arXiv 2502.16982): it gives the update
the RMS of a typical AdamW update, so AdamW's learning rate and weight decay carry over.

Sharded matrices (FSDP2 DTensor parameters, engine/parallel/fsdp.py) get exactly the unsharded update:
Newton–Schulz of a row shard is not the shard of Newton–Schulz of the matrix (the Gram matrix mixes
every row), so the cautious mask, orthogonalisation and Muon+ are computed on each whole matrix by
one owner rank, which sends every rank back the rows it stores (optim/sharded_muon.py: each rank
runs 1/N of the iterations); `sharded_schedule="gather"` gathers every matrix whole on every rank
instead (see `_full` and `_my_rows`). The momentum buffer itself stays sharded and elementwise, like
the gradient.

The iteration runs in bfloat16 where the device has native bf16 matrix units (CUDA with bf16, or a
CPU with AMX/AVX512-BF16) and in float32 elsewhere: emulated bf16 would be slower *and* less exact.
On CUDA, same-shaped matrices are stacked and orthogonalised in one batched iteration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from speedtronic.hardware import cpu_has_native_bf16, cuda_supports_bf16
from speedtronic.optim.cautious import cautious_
from speedtronic.optim.newton_schulz import coefficient_schedule, orthogonalize
from speedtronic.optim.sharded_muon import is_row_sharded, masked, owner_step

AdjustLR = Literal["original", "match_rms_adamw"]
MUON_PLUS_MODES = ("row", "col", "row_col", "col_row")


def adjusted_lr(lr: float, adjust_lr: str | None, shape: Sequence[int]) -> float:
    """The learning rate Muon applies to a matrix of this shape (see the module docstring)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr is None or adjust_lr == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr must be 'original' or 'match_rms_adamw', got {adjust_lr!r}")


def normalize_plus(update: torch.Tensor, mode: str, eps: float = 1e-7) -> torch.Tensor:
    """Muon+: scale the rows and/or columns of `update` (…, m, n) to unit L2 norm, in the given order.

    ``row_col`` normalises rows first, then columns; ``col_row`` the reverse. A zero row or column
    stays zero rather than becoming NaN.
    """
    if mode not in MUON_PLUS_MODES:
        raise ValueError(f"Muon+ mode must be one of {', '.join(MUON_PLUS_MODES)}, got {mode!r}")
    for axis in mode.split("_"):
        dim = -1 if axis == "row" else -2  # a row's entries run along the last dimension
        update = update / torch.linalg.vector_norm(update, dim=dim, keepdim=True).clamp(min=eps)
    return update


def resolve_plus_mode(muon_plus: bool | str | None) -> str | None:
    """Config value → mode: False/None is off, True means ``col`` (the paper's default)."""
    if muon_plus is None or muon_plus is False:
        return None
    if muon_plus is True:
        return "col"
    if muon_plus not in MUON_PLUS_MODES:
        raise ValueError(
            f"muon_plus must be a bool or one of {', '.join(MUON_PLUS_MODES)}, got {muon_plus!r}"
        )
    return muon_plus


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device multiplies bf16 natively, fp32 elsewhere and under run.deterministic
    (which turns on torch's deterministic algorithms)."""
    if torch.are_deterministic_algorithms_enabled():
        return torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if cuda_supports_bf16(device) else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32


class Muon(Optimizer):
    """Muon for 2-D parameters. ``ns_dtype=None`` chooses the iteration dtype per device;
    ``batched=None`` batches same-shaped matrices on CUDA only (on CPU a loop is as fast)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_schedule: str | Sequence[float] = "keller",
        eps: float = 1e-7,
        adjust_lr: AdjustLR | None = "original",
        muon_plus: bool | str | None = None,
        cautious: bool = False,
        ns_dtype: torch.dtype | None = None,
        batched: bool | None = None,
        sharded_schedule: Literal["owner", "gather"] = "owner",
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        coefficient_schedule(ns_schedule, ns_steps)  # validates both now, not at the first step
        adjusted_lr(1.0, adjust_lr, (1, 1))
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_schedule": ns_schedule if isinstance(ns_schedule, str) else tuple(ns_schedule),
            "eps": eps,
            "adjust_lr": adjust_lr,
            "muon_plus": resolve_plus_mode(muon_plus),
            "cautious": cautious,
        }
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.batched = batched
        if sharded_schedule not in ("owner", "gather"):
            raise ValueError(f"Muon: sharded_schedule must be 'owner' or 'gather', got {sharded_schedule!r}")
        self.sharded_schedule = sharded_schedule
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only optimises 2-D matrices, got a parameter of shape {tuple(p.shape)}; "
                        "route it to AdamW (the hybrid 'muon' optimizer does this for you)"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, updates, grads = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError(f"Muon does not support sparse gradients (parameter {tuple(p.shape)})")
                if grad.ndim != 2:
                    raise RuntimeError(f"Muon needs 2-D gradients, got shape {tuple(grad.shape)}")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf.clone()
                params.append(p)
                updates.append(update)
                grads.append(grad)
            if params:
                self._apply(group, params, updates, grads)
        return loss

    def _apply(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        updates: list[torch.Tensor],
        grads: list[torch.Tensor],
    ) -> None:
        """Whole-matrix updates for the group's matrices, then each rank's rows applied. Sharded
        matrices go to their owner ranks (optim/sharded_muon.py) or, with sharded_schedule "gather",
        are gathered whole on every rank."""
        owned = [i for i, p in enumerate(params) if self.sharded_schedule == "owner" and is_row_sharded(p)]
        if owned:
            cautious = bool(group["cautious"])
            rows = owner_step(
                [params[i] for i in owned],
                [updates[i] for i in owned],
                [grads[i] for i in owned] if cautious else None,
                lambda us, gs: self._whole(group, masked(us, gs)),
            )
            for i, update in zip(owned, rows, strict=True):
                self._descend(group, params[i], update)
        done = set(owned)
        rest = [i for i in range(len(params)) if i not in done]
        if not rest:
            return
        # A sharded matrix: everything past the elementwise momentum needs the whole matrix.
        whole = [_full(updates[i]) for i in rest]
        if group["cautious"]:
            whole = [cautious_(u, _full(grads[i])) for u, i in zip(whole, rest, strict=True)]
        for i, update in zip(rest, self._whole(group, whole), strict=True):
            self._descend(group, params[i], _my_rows(params[i], update))

    def _whole(self, group: dict[str, Any], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole momentum updates → whole Muon updates (orthogonalised, Muon+), stored orientation."""
        if not updates:
            return []
        # A "transposed" group holds matrices stored (in, out), like transformers' Conv1D: Muon+'s
        # rows/columns (and the LR scaling, in _descend) are defined on the (out, in) orientation.
        transposed = bool(group.get("transposed", False))
        out = []
        for ortho in self._orthogonalize_all(group, updates):
            oriented = ortho.mT if transposed else ortho
            if group["muon_plus"]:
                oriented = normalize_plus(oriented, group["muon_plus"])
            out.append(oriented.mT if transposed else oriented)
        return out

    def _descend(self, group: dict[str, Any], p: torch.Tensor, update: torch.Tensor) -> None:
        """Weight decay and the scaled step on this rank's part of `p` (`update`: those rows)."""
        shape = tuple(p.shape)
        oriented = (shape[1], shape[0]) if group.get("transposed", False) else shape
        lr = float(group["lr"])
        target = _local(p)  # this rank's rows of a sharded matrix, else the matrix itself
        target.mul_(1 - lr * group["weight_decay"])
        target.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr"], oriented))

    def _orthogonalize_all(self, group: dict[str, Any], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        device = updates[0].device
        dtype = self.ns_dtype or newton_schulz_dtype(device)
        options = {
            "steps": group["ns_steps"],
            "schedule": group["ns_schedule"],
            "eps": group["eps"],
            "dtype": dtype,
        }
        batched = self.batched if self.batched is not None else device.type == "cuda"
        if not batched:
            return [orthogonalize(u, **options) for u in updates]
        # One batched iteration per shape: far fewer kernel launches for a deep model's many
        # identical matrices.
        out: list[torch.Tensor | None] = [None] * len(updates)
        by_shape: dict[tuple[Any, ...], list[int]] = {}
        for i, u in enumerate(updates):
            by_shape.setdefault((tuple(u.shape), u.device), []).append(i)
        for indices in by_shape.values():
            if len(indices) == 1:
                out[indices[0]] = orthogonalize(updates[indices[0]], **options)
                continue
            stacked = orthogonalize(torch.stack([updates[i] for i in indices]), **options)
            for i, matrix in zip(indices, stacked.unbind(0), strict=True):
                out[i] = matrix
        return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------- sharded matrices


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a sharded (DTensor) one, gathered from every rank; a plain tensor as is."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The part of `param` this rank stores (a DTensor's local shard), updated in place."""
    return param.to_local() if _is_dtensor(param) else param  # type: ignore[attr-defined]


def _my_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The slice of a whole-matrix update `full` that lines up with this rank's shard of `param`."""
    if not _is_dtensor(param):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
    )
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
