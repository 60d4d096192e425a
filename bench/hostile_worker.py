"""A hostile DiLoCo worker for the attack suite: the real `speedtronic worker`, lying about its deltas.

    PYTHONPATH=src python bench/hostile_worker.py --attack reverse [--victim w1 --bus DIR] -- \
        worker CONFIG --repo file://DIR --node-id h1 --json

It runs the normal worker CLI in this process (same protocol, same node lease, same numbering, same
error feedback, so the master cannot tell it from an honest worker by anything but what it sends) with
`Uploader.encode` (diloco/worker/uploader.py) wrapped: the honest delta is encoded as usual (its
residual, and so the node's own training, stay honest), then decoded back to exactly what the master would receive, transformed by the
attack, and re-encoded with the same metadata. What a listed collaborator can do, nothing more: it
writes only its own node's files.

Attacks (each transforms the honest received delta h):
  reverse  −h: reverses this node's progress at exactly a plausible norm
  random   a random direction at ‖h‖
  scale5   5·h (under the master's 10× outlier bound)
  tokens   −h claiming 10^12 tokens (its weight in the mean, if believed)
  tiny     h·1e-6 for its first 3 deltas (the norm-history lock-out), honest after
  replay   another node's (`--victim`) oldest delta not replayed yet, captured from the bus while it was
           pending (the victim's current one when it is the only one), re-sent as this node's own
           (its own name and metadata; the payload is the victim's)
  collude  the reverse of the last round's global progress (G_now − G_prev, which every node sees), at
           ‖h‖; two nodes with this attack send the same direction without talking to each other
  drift    h + 0.2‖h‖·b, b one fixed random direction (seed 99: the same for every hostile node)

This is an attack tool for the bench and the tests; it lives outside src/ on purpose.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ATTACKS = ("reverse", "random", "scale5", "tokens", "tiny", "replay", "collude", "drift")
TINY_FIRST = 3
BIAS_SEED = 99


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))


def _at_norm(tensors: dict[str, torch.Tensor], target: float) -> dict[str, torch.Tensor]:
    scale = target / max(_norm(tensors), 1e-30)
    return {n: (t * scale).float() for n, t in tensors.items()}


class Capture:
    """Copies the victim's delta files from the directory bus into memory as they appear (the master
    deletes them once processed), oldest first."""

    def __init__(self, bus_dir: Path, victim: str) -> None:
        self.folder = bus_dir / "deltas" / victim
        self.files: dict[str, bytes] = {}
        self.used: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="hostile-capture", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                names = sorted(p.name for p in self.folder.glob("*.safetensors"))
            except OSError:
                names = []
            for name in names:
                if name not in self.files:
                    try:
                        data = (self.folder / name).read_bytes()
                    except OSError:
                        continue
                    with self._lock:
                        self.files[name] = data
            time.sleep(0.02)

    def oldest_unused(self, wait_s: float = 60.0) -> bytes | None:
        """The victim's oldest captured delta not replayed yet, waiting up to `wait_s` for one to appear
        (its first delta is on the bus by this node's first upload: every round waits for both)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                for name in sorted(self.files):
                    if name not in self.used:
                        self.used.add(name)
                        return self.files[name]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)


def install(attack: str, capture: Capture | None) -> None:
    """Wrap the Coordinator so that every delta this process uploads is the attack's."""
    from speedtronic.diloco import codec
    from speedtronic.diloco.worker import Coordinator
    from speedtronic.diloco.worker.uploader import Uploader

    attach, encode, install_global = Coordinator.attach, Uploader.encode, Coordinator.install_global
    state: dict[str, Any] = {"sent": 0, "previous": None, "bias": None}
    gen = torch.Generator().manual_seed(1234)

    def hostile_attach(self: Any, model: Any, **kwargs: Any) -> None:
        state["worker"] = self  # its weights' specs and its anchor (the global it last installed)
        return attach(self, model, **kwargs)

    def hostile_install(self: Any, model: Any, inner_step: int, g: Any, fresh: bool = False):
        anchor = self.book.anchor
        state["previous"] = None if anchor is None else {n: t.clone() for n, t in anchor.items()}
        return install_global(self, model, inner_step, g, fresh)

    def hostile_encode(self: Any, item: Any) -> tuple[bytes, dict[str, torch.Tensor]]:
        data, residual = encode(self, item)  # the honest wire bytes and the honest error feedback
        worker = state["worker"]
        specs, anchor = worker.poller.specs, worker.book.anchor
        decoded = codec.decode(data, specs, kind="delta")
        h = decoded.tensors
        meta = {k: v for k, v in decoded.meta.items() if k not in ("format", "codec", "checksum")}
        state["sent"] += 1
        if attack == "reverse":
            sent = {n: -t for n, t in h.items()}
        elif attack == "random":
            sent = _at_norm({n: torch.randn(t.shape, generator=gen) for n, t in h.items()}, _norm(h))
        elif attack == "scale5":
            sent = {n: 5 * t for n, t in h.items()}
        elif attack == "tokens":
            sent = {n: -t for n, t in h.items()}
            meta["tokens"] = str(10**12)
        elif attack == "tiny":
            sent = {n: t * 1e-6 for n, t in h.items()} if state["sent"] <= TINY_FIRST else h
        elif attack == "replay":
            assert capture is not None
            old = capture.oldest_unused()
            sent = codec.decode(old, specs, kind="delta").tensors if old is not None else h
        elif attack == "collude":
            previous = state["previous"]
            if previous is None or anchor is None:
                sent = {n: -t for n, t in h.items()}
            else:  # Δ = G_now − G_prev: applied as θ − η·Δ it walks the global back to G_prev
                sent = _at_norm({n: anchor[n] - previous[n] for n in h}, _norm(h))
        elif attack == "drift":
            if state["bias"] is None:
                g = torch.Generator().manual_seed(BIAS_SEED)
                state["bias"] = {n: torch.randn(t.shape, generator=g) for n, t in sorted(h.items())}
            bias = _at_norm(state["bias"], 0.2 * _norm(h))
            sent = {n: t + bias[n] for n, t in h.items()}
        else:
            raise SystemExit(f"--attack: unknown attack {attack!r} (one of {', '.join(ATTACKS)})")
        return codec.encode(sent, self.dist.sync.delta_codec, meta), residual

    Coordinator.attach = hostile_attach  # type: ignore[method-assign]
    Uploader.encode = hostile_encode  # type: ignore[method-assign]
    Coordinator.install_global = hostile_install  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: hostile_worker.py --attack MODE [--victim NODE --bus DIR] -- worker ...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--attack", required=True, choices=ATTACKS)
    parser.add_argument("--victim", default=None, help="replay: the node whose deltas are replayed")
    parser.add_argument("--bus", default=None, help="replay: the directory bus to capture them from")
    args = parser.parse_args(argv[:split])
    if args.attack == "replay" and not (args.victim and args.bus):
        parser.error("--attack replay needs --victim and --bus")

    from speedtronic import interrupts

    interrupts.install()
    capture = Capture(Path(args.bus), args.victim) if args.attack == "replay" else None
    install(args.attack, capture)
    from speedtronic.cli import main as cli_main

    sys.argv = ["speedtronic", *argv[split + 1 :]]
    cli_main()


if __name__ == "__main__":
    main()
