"""A global sent as an int8 update from the one before it (`distributed.sync.global_codec: int8`).

Every round each worker downloads the new global: in fp32 that is 4 bytes per parameter per worker per
round, most of DiLoCo's traffic on a slow link once its deltas are int8. With `global_codec: int8` the
master publishes, next to each full global, an update file: the difference from the global it published
one outer step before, quantised blockwise like an int8 delta (~1.06 bytes per parameter). A worker
holding that previous global downloads the update instead and rebuilds the new global from it.

Exactness. The master does not publish its own weights θ but what a worker rebuilds:
g_t = g_{t-1} + dequantise(quantise(θ_t − g_{t-1})), computed with the same functions (`rebuild`) on both
sides, elementwise fp32 products and sums that IEEE arithmetic rounds the same way on every CPU. The full
global file holds g_t too, so a joiner, `eval --global` and a master that takes over read exactly what
the workers hold. θ itself never leaves the master; the rounding left in g_t is not lost but carried:
the next update is quantised from θ_{t+1} − g_t (error feedback on the master's side, as the workers
do for their deltas), so g stays within one round's rounding of θ.

Checks. The update's header names the outer step it leads to and the one it starts from, the master's
epoch, and `target_checksum`, the sha256 of the full global it rebuilds to (the same checksum the full
file carries). A worker that does not hold exactly that previous global, or whose rebuild does not hit
the checksum, or that finds the update missing or malformed, reads the full global instead (one log line):
the update only ever saves bytes, it is never the only way to a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedtronic.diloco import codec

KIND = "update"
CODEC = "int8"


@dataclass(frozen=True)
class Published:
    """A global as the workers hold it: its outer step and fp32 tensors (never modified in place)."""

    step: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Encoded:
    """One publish's files: the full global (fp32), its update from the previous global (None where
    there is none to send), and the global both rebuild to."""

    full: bytes
    update: bytes | None
    published: Published | None  # None: not kept (no update will start from it)


def rebuild(base: dict[str, torch.Tensor], change: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """base + change, tensor by tensor: the one sum master and workers both compute."""
    return {name: base[name] + change[name] for name in base}


def full_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The checksum the full global file of `tensors` carries (codec.encode under fp32)."""
    return codec.checksum(codec.compress(tensors, "fp32"))


def encode(
    weights: dict[str, torch.Tensor], step: int, meta: dict[str, str], base: Published | None, keep: bool
) -> Encoded:
    """The files of global `step` for the master's weights. Without a `base` one outer step back, the
    full weights alone (kept as the next base when `keep`); with one, the int8 update from it and the
    full global it rebuilds to."""
    if base is None or base.step != step - 1:
        exact = {name: t.detach().float().clone() for name, t in weights.items()} if keep else weights
        return Encoded(codec.encode(exact, "fp32", meta), None, Published(step, exact) if keep else None)
    diff = {name: weights[name].detach().float() - base.tensors[name] for name in base.tensors}
    wire = codec.compress(diff, CODEC)
    specs = {name: codec.ParamSpec(tuple(t.shape), "float32") for name, t in diff.items()}
    new = rebuild(base.tensors, codec.decompress(wire, CODEC, specs))
    full = codec.encode(new, "fp32", meta)
    header = {**meta, "kind": KIND, "base_outer_step": str(base.step), "target_checksum": full_checksum(new)}
    return Encoded(full, codec.encode_wire(wire, CODEC, header), Published(step, new))


def apply(
    data: bytes, base: Published, specs: dict[str, codec.ParamSpec], step: int, max_bytes: int
) -> tuple[dict[str, torch.Tensor], codec.Decoded]:
    """The global of outer step `step` rebuilt from an update file and the previous global `base`;
    codec.Rejected (with the reason) for an update that is not exactly that."""
    decoded = codec.decode(data, specs, kind=KIND, max_bytes=max_bytes)
    if decoded.meta.get("codec") != CODEC:
        raise codec.Rejected(f"an update must be {CODEC}, not {decoded.meta.get('codec')!r}")
    if decoded.int("outer_step", -1) != step or decoded.int("base_outer_step", -1) != base.step:
        raise codec.Rejected(
            f"the update leads from outer step {decoded.meta.get('base_outer_step')!r} to "
            f"{decoded.meta.get('outer_step')!r}, not from {base.step} to {step}"
        )
    tensors = rebuild(base.tensors, decoded.tensors)
    if full_checksum(tensors) != decoded.meta.get("target_checksum"):
        raise codec.Rejected("the rebuilt global does not match the checksum of the global it updates to")
    return tensors, decoded
