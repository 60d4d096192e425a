"""The seeded fp32 loss curves that refactors must keep bitwise identical (torchtitan's rule).

Four short runs — AdamW and Muon, on `configs/smoke.yaml` (synthetic tokens) and on a text config
(the embedded corpus, with gradient accumulation) — each at fp32 precision, eager, one compute thread.
`tests/test_loss_curves.py` compares them with `tests/data/loss_curves.json`.

fp32 kernels differ between CPUs: torch's own kernels by its CPU capability (AVX2, AVX512, …), and the
BLAS and oneDNN kernels under them by the CPU's vendor and instruction-set extensions (measured: an
Intel Xeon with AMX and an AMD EPYC with AVX512-BF16, both "AVX512" to torch, round the same AdamW run
differently from its second step). So a record is keyed by all three (`machine_key`), and a machine
with no record of its own is compared with the others within a tolerance. To record the current
machine's curves — for a new machine, or after a change that is *meant* to move them (say so in the
commit message, with the reason):

    python tests/loss_curves.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD_FILE = Path(__file__).resolve().parent / "data" / "loss_curves.json"
STEPS = 12

# Each run: a config file and the overrides that pin it to a seeded, short, fp32, eager run.
COMMON = [
    f"run.max_steps={STEPS}",
    "run.log_every=1",
    "run.eval_every=0",
    "precision.mode=fp32",
    "compile.enabled=false",
    "checkpoint.enabled=false",
    "logging.hooks=[]",
]
TEXT = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "data.block_size=64",
    "data.micro_batch_size=4",
    "data.target_batch_size=8",
    "scheduler.warmup_steps=3",
]
RUNS: dict[str, tuple[str, list[str]]] = {
    "smoke-adamw": ("configs/smoke.yaml", []),
    "smoke-muon": ("configs/smoke.yaml", ["optimizer.name=muon"]),
    "text-adamw": ("configs/shakespeare.yaml", TEXT),
    "text-muon": ("configs/shakespeare.yaml", [*TEXT, "optimizer.name=muon"]),
}


def capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


# The extensions that select different BLAS/oneDNN fp32 kernels on x86 (the rest of the flags do not).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_key() -> str:
    """torch's CPU capability, the CPU vendor and its kernel-selecting extensions, e.g.
    "AVX512|GenuineIntel|amx_bf16+avx2+avx512_bf16+avx512f"."""
    import platform

    from speedtronic.hardware import cpu_flags

    vendor = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = "+".join(sorted(set(KERNEL_FLAGS) & cpu_flags())) or "-"
    return f"{capability()}|{vendor}|{flags}"


def profile_is_forced() -> bool:
    """SPEEDTRONIC_CPU_BF16 forces a CPU profile other than this CPU's (the records are the real one's)."""
    from speedtronic.hardware import cpu_flags_have_bf16, forced_cpu_bf16

    forced = forced_cpu_bf16()
    return forced is not None and forced != cpu_flags_have_bf16()


def run_curve(name: str, output_dir: Path) -> list[float]:
    """The per-step training losses of one recorded run."""
    import torch

    from speedtronic import Trainer, load_config

    torch.set_num_threads(1)
    path, overrides = RUNS[name]
    config = load_config(ROOT / path, [*COMMON, *overrides, f"run.output_dir={output_dir / name}"])
    losses: list[float] = []

    class Recorder:
        def on_step(self, payload: dict[str, Any]) -> None:
            losses.append(payload["loss"])

    Trainer(config, hooks={"record": Recorder()}, progress=False).train()
    return losses


def load_records() -> dict[str, dict[str, list[str]]]:
    return json.loads(RECORD_FILE.read_text()) if RECORD_FILE.exists() else {}


def record(output_dir: Path) -> None:
    records = load_records()
    records[machine_key()] = {name: [x.hex() for x in run_curve(name, output_dir)] for name in RUNS}
    RECORD_FILE.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(RUNS)} curves for {machine_key()} in {RECORD_FILE}")


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/loss_curves.py --record")
    with tempfile.TemporaryDirectory() as tmp:
        record(Path(tmp))
