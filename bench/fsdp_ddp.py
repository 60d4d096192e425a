"""FSDP2 against DDP on the GPUs of one machine: step time and peak memory per rank.

    python bench/fsdp_ddp.py [--steps 30] [--batch 8] [--seq 1024] [--nproc N]   # N: the GPUs here
    python bench/fsdp_ddp.py --smoke        # 2 gloo ranks on CPU, tiny dims: checks the script itself

Starts itself under torchrun (NCCL, one GPU per rank). The reference transformer at GPT-2-small size
(12 layers, d 768, vocab 50304) is trained on random tokens with AdamW under each wrap, in turn, in the
same processes:

    ddp           DistributedDataParallel, bf16 autocast (what `distributed.strategy: ddp` runs)
    fsdp          fully_shard per block + root, bf16 parameters, fp32 gradient reduction
                  (engine/fsdp.apply_fsdp with the run plan's defaults: `distributed.strategy: fsdp`)
    fsdp-offload  the same with parameters, gradients and optimizer state on the CPU
                  (`distributed.fsdp.cpu_offload: true`)

The wraps are the project's own (engine/parallel.wrap_ddp, engine/fsdp.apply_fsdp); the loop is a plain
forward / backward / step so that only the wrap differs. Each arm reports the median step time after
`--warmup` steps and `torch.cuda.max_memory_allocated` on rank 0, then the ratios fsdp / ddp. On one GPU
the ranks are one, so FSDP shards nothing and the figures are its overhead against DDP, and what CPU
offload saves; with N GPUs each rank holds 1/N of the state. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def relaunch(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += [str(args.nproc), __file__, *sys.argv[1:], "--child"]
    return subprocess.call(command)


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    """A fresh model (same seed every arm) and its run plan, from a config like `speedtronic train`'s."""
    from speedtronic.config import load_config
    from speedtronic.engine.build import build_model
    from speedtronic.engine.data_facts import data_facts
    from speedtronic.engine.device import device_facts
    from speedtronic.plan import plan_run

    config = load_config(
        {
            "run": {"name": "fsdp-ddp", "max_steps": args.steps},
            "model": {**args.dims, "max_seq_len": args.seq},
            "data": {
                "synthetic": True,
                "vocab_size": args.dims["vocab_size"],
                "block_size": args.seq,
                "micro_batch_size": args.batch,
            },
            "distributed": {"strategy": "fsdp"},
        }
    )
    world = dist.get_world_size()
    plan = plan_run(config, world_size=world, data=data_facts(config), device=device_facts(device))
    torch.manual_seed(0)
    return build_model(config, args.dims["vocab_size"]).to(device), plan


def arm(args: argparse.Namespace, name: str, device: torch.device) -> dict[str, Any]:
    from speedtronic.engine.parallel.fsdp import apply_fsdp
    from speedtronic.engine.parallel.wrap import wrap_ddp

    model, plan = build(args, device)
    if name == "ddp":
        wrapped = wrap_ddp(model, device)
        autocast = device.type == "cuda"
    else:
        plan = dataclasses.replace(plan, fsdp_cpu_offload=name == "fsdp-offload")
        wrapped = apply_fsdp(model, plan, device)
        autocast = False  # FSDP's mixed-precision policy casts the parameters to bf16 itself
    fused = device.type == "cuda" and name != "fsdp-offload"
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=3e-4, fused=fused or None)
    generator = torch.Generator().manual_seed(dist.get_rank())
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        tokens = torch.randint(0, args.dims["vocab_size"], (args.batch, args.seq + 1), generator=generator)
        tokens = tokens.to(device, non_blocking=True)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = wrapped(tokens[:, :-1], labels=tokens[:, 1:])["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    steady = times[args.warmup :] or times
    step_s = statistics.median(steady)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    row = {
        "arm": name,
        "step_time_s": step_s,
        "tokens_per_s_per_rank": args.batch * args.seq / step_s,
        "peak_memory_gib": peak,
        "final_loss": float(loss.detach()),
    }
    del wrapped, model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def child(args: argparse.Namespace) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if not args.smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rows = [arm(args, name, device) for name in args.arms.split(",")]
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
        print(f"{where} · {world} rank(s) · batch {args.batch}×{args.seq} per rank · {args.steps} steps")
        print(f"{'arm':<13} {'step s':>8} {'tok/s/rank':>11} {'peak GiB':>9} {'loss':>7}")
        for r in rows:
            print(
                f"{r['arm']:<13} {r['step_time_s']:>8.4f} {r['tokens_per_s_per_rank']:>11,.0f} "
                f"{r['peak_memory_gib']:>9.2f} {r['final_loss']:>7.3f}"
            )
        by = {r["arm"]: r for r in rows}
        ratios = {}
        if "ddp" in by:
            for name in by:
                if name != "ddp":
                    ratios[f"{name}_step_time_ratio"] = by[name]["step_time_s"] / by["ddp"]["step_time_s"]
                    if by["ddp"]["peak_memory_gib"]:
                        ratios[f"{name}_memory_ratio"] = (
                            by[name]["peak_memory_gib"] / by["ddp"]["peak_memory_gib"]
                        )
            print(" · ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        print(json.dumps({"ranks": world, "device": where, "runs": rows, **ratios}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--arms", default="ddp,fsdp,fsdp-offload")
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks (default: the GPUs here; 2 with --smoke)"
    )
    parser.add_argument("--smoke", action="store_true", help="2 gloo ranks on CPU at tiny size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dims = {"n_layer": 12, "n_head": 12, "d_model": 768, "vocab_size": 50304}
    if args.smoke:
        args.dims = {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 256}
        args.steps, args.warmup, args.batch, args.seq = 4, 1, 2, 32
        args.arms = args.arms.replace(",fsdp-offload", "")  # CPU offload needs a GPU to offload from
    if args.child:
        child(args)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("bench/fsdp_ddp.py needs CUDA GPUs (or --smoke); none here, nothing measured.")
        return 0
    args.nproc = args.nproc or (2 if args.smoke else torch.cuda.device_count())
    return relaunch(args)


if __name__ == "__main__":
    sys.exit(main())
