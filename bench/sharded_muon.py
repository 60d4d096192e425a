"""Sharded Muon: each matrix on one owner rank against every matrix gathered on every rank.

    python bench/sharded_muon.py [--ranks 2] [--layers 8] [--dim 512] [--steps 10]

Starts itself under torchrun (gloo on CPU, NCCL where each rank has a GPU). A stack of `--layers`
square and 4×-wide Linear layers (a transformer block's matrices) is sharded with FSDP2's
`fully_shard`; the same random gradients are fed to Muon with `sharded_schedule="owner"` (the
default: each rank runs 1/N of the Newton–Schulz iterations, optim/sharded_muon.py) and with
`"gather"` (every rank runs them all). Both are timed over the same steps, alternating, best of the
rounds, and checked to give the same weights. Prints the step times and the ratio gather / owner
(above 1: the owner schedule is faster), and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def build(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.dim, args.dim, bias=False), nn.Linear(args.dim, 4 * args.dim, bias=False)]
    return nn.Sequential(*layers)


def bench(args: argparse.Namespace) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from speedtronic.optim.muon import Muon

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda" if device is not None else "cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(1)
    reference = build(args)
    grads = [[torch.randn(m.weight.shape, generator=generator) for m in reference] for _ in range(args.steps)]
    models, optimizers = {}, {}
    for schedule in ("owner", "gather"):
        model = build(args).to(device or "cpu")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models[schedule] = model
        optimizers[schedule] = Muon(model.parameters(), lr=0.02, sharded_schedule=schedule)
    sharded = [[distribute_tensor(g.to(device or "cpu"), mesh, [Shard(0)]) for g in step] for step in grads]
    times: dict[str, list[float]] = {"owner": [], "gather": []}
    for _ in range(args.rounds):
        for schedule in ("owner", "gather"):
            model, optimizer = models[schedule], optimizers[schedule]
            dist.barrier()
            started = time.perf_counter()
            for step in sharded:
                for layer, g in zip(model, step, strict=True):
                    layer.weight.grad = g
                optimizer.step()
            if device is not None:
                torch.cuda.synchronize()
            dist.barrier()
            times[schedule].append((time.perf_counter() - started) / len(sharded))
    diff = max(
        (a.weight.full_tensor() - b.weight.full_tensor()).abs().max().item()
        for a, b in zip(models["owner"], models["gather"], strict=True)
    )
    best = {k: min(v) for k, v in times.items()}
    return {
        "ranks": dist.get_world_size(),
        "matrices": len(reference),
        "dim": args.dim,
        "device": "cuda" if device is not None else "cpu",
        "owner_step_s": best["owner"],
        "gather_step_s": best["gather"],
        "ratio_gather_over_owner": best["gather"] / best["owner"],
        "max_weight_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:  # start this script on --ranks ranks
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        command += [str(args.ranks), __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(command))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = bench(args)
        if dist.get_rank() == 0:
            print(
                f"{result['ranks']} ranks, {result['matrices']} matrices ({args.dim}×{args.dim} and "
                f"{4 * args.dim}×{args.dim}), {result['device']}: owner {result['owner_step_s'] * 1e3:.1f} ms/step, "
                f"gather {result['gather_step_s'] * 1e3:.1f} ms/step → gather / owner = "
                f"{result['ratio_gather_over_owner']:.2f} (weights differ by {result['max_weight_diff']:.1e})"
            )
            print(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
