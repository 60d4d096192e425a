"""GPU benchmark (for a lent H100/H200): MFU of a ~124M-parameter model, ooo_backprop, Muon vs AdamW.

    python bench/gpu.py [--steps 40] [--batch 16] [--seq 1024] [--no-compile]

Four runs of the reference transformer at GPT-2-small size (12 layers, d 768, 12 heads, vocab 50304,
~124M parameters) on synthetic tokens, bf16 autocast, torch.compile, through the normal Trainer:

    adamw · muon (hybrid) · adamw without compile · adamw + ooo_backprop without compile (its stream
    hooks do not survive compilation, so it is compared with the eager run)

MFU is the trainer's own (tokens/s × FLOPs per token / the device's bf16 dense peak), averaged over
the logged windows after the first (compilation and warm-up). Prints a table, the ratios
(ooo / plain step time, muon / adamw step time, compiled / eager tokens/s) and one JSON line.
Goal: MFU ≥ 45% with compile. The whole script stays under ~5 minutes on an H200.
On a machine without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

import torch

from speedtronic.config import load_config
from speedtronic.engine.trainer import Trainer


class Windows:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_step(self, payload: dict[str, Any]) -> None:
        self.steps.append(payload)


def run(args: argparse.Namespace, label: str, **overrides: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        config = {
            "run": {
                "name": label.replace("+", "-"),  # a run name takes no "+"
                "max_steps": args.steps,
                "log_every": 5,
                "eval_every": 0,
                "output_dir": out,
            },
            "model": {**args.dims, "max_seq_len": args.seq},
            "data": {
                "synthetic": True,
                "vocab_size": args.dims["vocab_size"],
                "num_tokens": 20_000_000 if not args.smoke else 200_000,
                "block_size": args.seq,
                "micro_batch_size": args.batch,
                "val_batches": 0,
            },
            "optimizer": {"name": "adamw", "lr": 6e-4},
            "precision": {"mode": "auto" if args.smoke else "bf16"},
            "compile": not args.no_compile,
            "checkpoint": {"enabled": False},
            "logging": {"hooks": []},
        }
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            if key:
                config.setdefault(section, {})[key] = value
            else:
                config[section] = value
        windows = Windows()
        result = Trainer(load_config(config), progress=False, hooks={"w": windows}).train()
    steady = windows.steps[1:] or windows.steps
    return {
        "label": label,
        "parameters": result.parameters,
        "tokens_per_s": statistics.mean(w["tokens_per_s"] for w in steady),
        "step_time_s": statistics.mean(w["step_time_s"] for w in steady),
        "mfu": statistics.mean(w["mfu"] or 0.0 for w in steady),
        "compile_s": result.compile_s,
        "max_memory_gb": max((w.get("mem_alloc_mib") or 0.0) for w in steady) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny dims on any device: checks the script itself"
    )
    args = parser.parse_args()
    args.dims = {"n_layer": 12, "n_head": 12, "d_model": 768, "vocab_size": 50304}
    if args.smoke:
        args.dims = {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 256}
        args.steps, args.batch, args.seq, args.no_compile = 12, 2, 32, True
    elif not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU; none here, nothing measured.")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = [
        run(args, "adamw"),
        # ooo_backprop's stream hooks do not survive torch.compile, so it is compared eager to eager.
        run(args, "adamw+ooo", ooo_backprop=True, compile=False),
        run(args, "muon", **{"optimizer.name": "muon"}),
        run(args, "adamw-eager", compile=False),
    ]
    by = {r["label"]: r for r in rows}
    print(
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu (smoke)'} · {rows[0]['parameters']:,} parameters · batch {args.batch}×{args.seq}"
    )
    print(f"{'run':<14} {'tok/s':>10} {'step s':>8} {'MFU':>6} {'compile s':>9} {'mem GB':>7}")
    for r in rows:
        print(
            f"{r['label']:<14} {r['tokens_per_s']:>10,.0f} {r['step_time_s']:>8.3f} {r['mfu']:>6.1%} "
            f"{r['compile_s'] or 0:>9.1f} {r['max_memory_gb']:>7.1f}"
        )
    ratios = {
        "ooo_step_time_ratio": by["adamw+ooo"]["step_time_s"] / by["adamw-eager"]["step_time_s"],
        "muon_step_time_ratio": by["muon"]["step_time_s"] / by["adamw"]["step_time_s"],
        "compile_speedup": by["adamw"]["tokens_per_s"] / by["adamw-eager"]["tokens_per_s"],
    }
    print(
        f"ooo/plain step time (both eager) {ratios['ooo_step_time_ratio']:.3f} · muon/adamw step time "
        f"{ratios['muon_step_time_ratio']:.3f} · compiled/eager tok/s {ratios['compile_speedup']:.2f}"
    )
    print(json.dumps({"runs": rows, **ratios}))


if __name__ == "__main__":
    main()
