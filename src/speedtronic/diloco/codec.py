"""The wire format of DumbDiLoCo: deltas and global models as safetensors, their codecs and validation.

A file on the bus is one safetensors blob. Its string metadata says what it is (`kind` delta|global),
who made it (`node`), from which global (`base_outer_step`), after how many local steps and tokens,
with which `codec`, and a sha256 `checksum` over the tensor payload. Codecs:

- ``fp32``: the tensors as they are (4 bytes/value).
- ``bf16``: rounded to bfloat16 (2 bytes/value).
- ``int8``: blockwise absmax quantisation, one fp32 scale per ``INT8_BLOCK`` values (~1.06 bytes/value).
  The worker keeps the rounding error and adds it to its next delta (error feedback), so nothing is
  lost over time, only delayed.
- ``int4``: the same with 4-bit values (−7…7, two per byte) and one fp32 scale per ``INT8_BLOCK``
  values (~0.56 bytes/value); it relies on the error feedback even more than int8.

Parameters are keyed by *unique* parameter: `named_parameters()` yields a tied weight once, under its
first name, so tied embeddings travel once (safetensors refuses shared tensors anyway).

This module never unpickles: `safetensors.torch.load` parses a JSON header and raw little-endian
buffers only. Everything read from the network goes through `decode`, which checks the file name,
size, header, checksum, keys, shapes, dtypes and finiteness before a tensor is used.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FORMAT_VERSION = 1
CODECS = ("fp32", "bf16", "int8", "int4")
INT8_BLOCK = 64
# Node ids and delta file names: letters, digits, dot, dash, underscore; never a path.
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Sequence numbers are zero-padded to 8 digits and may grow to 12, so a worker can never run out.
DELTA_NAME_RE = re.compile(r"^(?P<node>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})--(?P<seq>\d{8,12})\.safetensors$")
# A worker only believes its own files on the bus up to this far past the master's high-water mark:
# anything beyond is someone else's garbage, and numbering after it could run past the name format.
SEQ_WINDOW = 10_000


class Rejected(ValueError):
    """A file from the bus that must not be used; the message says why."""


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: str


def unique_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The floating parameters a delta covers, each tied parameter once (under its first name)."""
    return {name: p for name, p in model.named_parameters() if p.is_floating_point()}


def param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    return {
        name: ParamSpec(tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for name, p in unique_params(model).items()
    }


def fingerprint(specs: dict[str, ParamSpec]) -> str:
    """sha256 over the sorted (name, shape, dtype) list: equal iff the models are wire-compatible."""
    text = json.dumps([[n, list(s.shape), s.dtype] for n, s in sorted(specs.items())])
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def specs_to_json(specs: dict[str, ParamSpec]) -> dict[str, Any]:
    return {name: {"shape": list(s.shape), "dtype": s.dtype} for name, s in sorted(specs.items())}


def specs_from_json(data: dict[str, Any]) -> dict[str, ParamSpec]:
    return {name: ParamSpec(tuple(int(d) for d in v["shape"]), str(v["dtype"])) for name, v in data.items()}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the unique floating parameters."""
    return {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in unique_params(model).items()}


def delta_name(node: str, seq: int) -> str:
    return f"{node}--{seq:08d}.safetensors"


def parse_delta_name(name: str) -> tuple[str, int]:
    """(node, seq) of a delta file name, or Rejected for anything else (paths, odd characters)."""
    match = DELTA_NAME_RE.match(name)
    if not match or ".." in name:
        raise Rejected(f"bad file name {name!r}")
    return match["node"], int(match["seq"])


# ------------------------------------------------------------------------------------------ encoding


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % INT8_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1) / 127.0
    q = torch.round(blocks / scale.clamp_min(1e-30).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1), scale.float()


def _dequantize_int8(q: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    values = (q.view(-1, INT8_BLOCK).float() * scale.unsqueeze(1)).reshape(-1)
    return values[:numel].reshape(shape)


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % INT8_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1) / 7.0
    q = torch.round(blocks / scale.clamp_min(1e-30).unsqueeze(1)).clamp_(-7, 7).to(torch.uint8) + 8
    pairs = q.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous(), scale.float()


def _dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).float() - 8
    values = (q.view(-1, INT8_BLOCK) * scale.unsqueeze(1)).reshape(-1)
    return values[:numel].reshape(shape)


def compress(tensors: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """The wire tensors for fp32 tensors under `codec` (int8 stores `name:q` and `name:scale`, int4
    `name:q4` — two values per byte — and `name:scale`)."""
    if codec == "fp32":
        return {n: t.float().contiguous() for n, t in tensors.items()}
    if codec == "bf16":
        return {n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()}
    if codec == "int8":
        out: dict[str, torch.Tensor] = {}
        for n, t in tensors.items():
            out[f"{n}:q"], out[f"{n}:scale"] = _quantize_int8(t.float())
        return out
    if codec == "int4":
        out = {}
        for n, t in tensors.items():
            out[f"{n}:q4"], out[f"{n}:scale"] = _quantize_int4(t.float())
        return out
    raise ValueError(f"unknown codec {codec!r} (choose {', '.join(CODECS)})")


def decompress(
    wire: dict[str, torch.Tensor], codec: str, specs: dict[str, ParamSpec]
) -> dict[str, torch.Tensor]:
    """fp32 tensors back from wire tensors; raises Rejected when keys, shapes or dtypes are wrong."""
    out: dict[str, torch.Tensor] = {}
    if codec in ("fp32", "bf16"):
        want = torch.float32 if codec == "fp32" else torch.bfloat16
        if set(wire) != set(specs):
            raise Rejected(_key_problem(set(wire), set(specs)))
        for name, spec in specs.items():
            t = wire[name]
            if t.dtype != want:
                raise Rejected(f"{name} has dtype {t.dtype}, expected {want} for codec {codec}")
            if tuple(t.shape) != spec.shape:
                raise Rejected(f"{name} has shape {tuple(t.shape)}, expected {spec.shape}")
            out[name] = t.float()
        return out
    if codec in ("int8", "int4"):
        # Blockwise absmax: per block of INT8_BLOCK values, one fp32 scale and the quantized values
        # (int8: one per byte; int4: two per byte, packed into uint8).
        key, dtype, per_byte = ("q", torch.int8, 1) if codec == "int8" else ("q4", torch.uint8, 2)
        dequantize = _dequantize_int8 if codec == "int8" else _dequantize_int4
        expected = {f"{n}:{part}" for n in specs for part in (key, "scale")}
        if set(wire) != expected:
            raise Rejected(_key_problem(set(wire), expected))
        for name, spec in specs.items():
            q, scale = wire[f"{name}:{key}"], wire[f"{name}:scale"]
            numel = 1
            for d in spec.shape:
                numel *= d
            blocks = -(-numel // INT8_BLOCK)
            if q.dtype != dtype or scale.dtype != torch.float32:
                raise Rejected(f"{name}: {codec} codec needs {str(dtype)[6:]} values and fp32 scales")
            if q.shape != (blocks * INT8_BLOCK // per_byte,) or scale.shape != (blocks,):
                raise Rejected(f"{name}: {codec} payload of shape {tuple(q.shape)} does not fit {spec.shape}")
            out[name] = dequantize(q, scale, spec.shape)
        return out
    raise Rejected(f"unknown codec {codec!r}")


def _key_problem(got: set[str], want: set[str]) -> str:
    missing, extra = sorted(want - got), sorted(got - want)
    return f"tensor names do not match the manifest (missing {missing[:3]}, unexpected {extra[:3]})"


def checksum(wire: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(wire):
        t = wire[name].contiguous()
        digest.update(name.encode() + b"\0" + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + digest.hexdigest()


def encode(tensors: dict[str, torch.Tensor], codec: str, meta: dict[str, Any]) -> bytes:
    """safetensors bytes for fp32 `tensors` under `codec`; `meta` values are stored as strings/JSON."""
    return encode_wire(compress(tensors, codec), codec, meta)


def encode_wire(wire: dict[str, torch.Tensor], codec: str, meta: dict[str, Any]) -> bytes:
    """safetensors bytes for tensors already compressed under `codec` (`compress`)."""
    from safetensors.torch import save

    header = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    header.update({"format": str(FORMAT_VERSION), "codec": codec, "checksum": checksum(wire)})
    return save(wire, metadata=header)


def roundtrip(tensors: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """What the receiver will decode for `tensors` (used for error feedback)."""
    if codec == "fp32":
        return {n: t.float() for n, t in tensors.items()}
    specs = {n: ParamSpec(tuple(t.shape), "float32") for n, t in tensors.items()}
    return decompress(compress(tensors, codec), codec, specs)


@dataclass
class Decoded:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]
    nbytes: int

    def int(self, key: str, default: int = 0) -> int:
        try:
            return int(self.meta.get(key, default))
        except ValueError:
            return default

    def json(self, key: str, default: Any = None) -> Any:
        try:
            return json.loads(self.meta[key])
        except (KeyError, ValueError):
            return default


def decode(
    data: bytes,
    specs: dict[str, ParamSpec],
    *,
    kind: str,
    max_bytes: int | None = None,
    select: Callable[[dict[str, str], dict[str, ParamSpec]], dict[str, ParamSpec]] | None = None,
) -> Decoded:
    """Parse and validate one bus file; raises Rejected with the reason for anything unusable.
    `select(meta, specs)` narrows the tensors the file must carry (a Streaming DiLoCo fragment's).
    The steps, in order, are the functions below (the master runs them one by one as named checks:
    diloco/master/checks.py)."""
    check_size(data, max_bytes)
    meta, wire = parse(data)
    check_header(meta, kind)
    check_checksum(meta, wire)
    tensors = unpack(meta, wire, specs, select)
    check_finite(tensors)
    return Decoded(tensors, meta, len(data))


def check_size(data: bytes, max_bytes: int | None) -> None:
    if max_bytes is not None and len(data) > max_bytes:
        raise Rejected(f"{len(data):,} bytes is over the size limit of {max_bytes:,}")


def parse(data: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, wire tensors) of a safetensors file; Rejected when it is not one."""
    from safetensors.torch import load

    if len(data) < 8:
        raise Rejected("truncated (shorter than a safetensors header)")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > min(len(data) - 8, 16 << 20):
        raise Rejected("truncated or corrupt safetensors header")
    try:
        header = json.loads(data[8 : 8 + header_len])
        meta = dict(header.get("__metadata__") or {})
        wire = load(data)
    except Exception as error:
        raise Rejected(f"not a valid safetensors file ({type(error).__name__}: {str(error)[:120]})") from None
    return meta, wire


def check_header(meta: dict[str, str], kind: str) -> None:
    if meta.get("kind") != kind:
        raise Rejected(f"kind is {meta.get('kind')!r}, expected {kind!r}")
    if meta.get("format") != str(FORMAT_VERSION):
        raise Rejected(f"format {meta.get('format')!r} is not {FORMAT_VERSION}")


def check_checksum(meta: dict[str, str], wire: dict[str, torch.Tensor]) -> None:
    if meta.get("checksum") != checksum(wire):
        raise Rejected("checksum mismatch (corrupt or tampered)")


def unpack(
    meta: dict[str, str],
    wire: dict[str, torch.Tensor],
    specs: dict[str, ParamSpec],
    select: Callable[[dict[str, str], dict[str, ParamSpec]], dict[str, ParamSpec]] | None = None,
) -> dict[str, torch.Tensor]:
    """The fp32 tensors of a parsed file: keys, shapes and dtypes checked against `specs`."""
    if select is not None:
        specs = select(meta, specs)
    return decompress(wire, meta.get("codec", ""), specs)


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise Rejected(f"non-finite values in {name}")


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))


def wire_bytes(specs: dict[str, ParamSpec], codec: str) -> int:
    """Payload bytes of one delta under `codec` (the safetensors header adds a few KB)."""
    total = 0
    for spec in specs.values():
        numel = 1
        for d in spec.shape:
            numel *= d
        if codec == "int8":
            blocks = -(-numel // INT8_BLOCK)
            total += blocks * INT8_BLOCK + 4 * blocks
        elif codec == "int4":
            blocks = -(-numel // INT8_BLOCK)
            total += blocks * INT8_BLOCK // 2 + 4 * blocks
        else:
            total += numel * (4 if codec == "fp32" else 2)
    return total
