"""Optimizer benchmark: step time of our Muon vs torch.optim.Muon, and steps to a target loss vs AdamW.

    python bench/optimizers.py [--steps 300] [--sweep 3] [--json-out results.json]

(a) Step time. The Muon-routed matrices of the reference model (shakespeare dims unless --config),
    with random gradients; our Muon (iteration dtype chosen per device: fp32 on a CPU without native
    bf16, bf16 on CUDA) and torch.optim.Muon (always bf16) alternate over rounds; the median ratio is
    printed. Goal: ≤ 1.0 on CPU, ≤ 0.5 on a GPU (batched). Ours forced to bf16 is shown too, like for like.
(b) Sample efficiency on tinyshakespeare (byte level). Every optimizer trains the same model on the
    same batches with the same schedule and seed, at each LR of a small sweep around its own centre;
    a sweep whose best LR is at an edge is widened (``--extend``), then the best LR (lowest final
    val loss) is kept. Runs go `--jobs` at a time, single-threaded, and each curve is cached under
    ``--out``, so an interrupted benchmark resumes where it stopped. The target is the val loss the best AdamW reaches at
    its final step; we report the first evaluation step at which each optimizer reaches it, and the
    ratio to AdamW's. Goal: hybrid Muon ≤ 0.75× AdamW's steps.

Everything runs in this one process; prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from speedtronic.config import load_config
from speedtronic.engine.build import build_model
from speedtronic.engine.trainer import Trainer
from speedtronic.optim.muon import Muon
from speedtronic.optim.routing import route_parameters

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
OPTIMIZERS = {
    "adamw": {"name": "adamw"},
    "muon": {"name": "muon"},
    "muon_plus": {"name": "muon_plus"},
    "adamw+cautious": {"name": "adamw", "cautious": True},
    "muon+cautious": {"name": "muon", "cautious": True},
    "muon_plus+cautious": {"name": "muon_plus", "cautious": True},
}
# Each optimizer's sweep is centred on its own default; Muon's updates are scaled to 0.2·lr RMS
# (match_rms_adamw), below AdamW's early-training RMS, so its best LR on short runs sits higher.
CENTRE_LR = {"adamw": 4e-3, "muon": 8e-3, "muon_plus": 8e-3}
LR_MULTIPLIERS = (1.0, 0.5, 2.0, 0.25, 4.0)


def base_config(args: argparse.Namespace, out: Path, optimizer: dict[str, Any], lr: float) -> Any:
    data: dict[str, Any] = {
        "block_size": 128,
        "micro_batch_size": 16,
        "val_batches": args.val_batches,
        "seed": 0,
    }
    if SHARED_TEXT.exists():
        data["text_path"] = str(SHARED_TEXT)
    return load_config(
        {
            "run": {
                "name": "bench",
                "seed": 0,
                "max_steps": args.steps,
                "log_every": args.steps,
                "eval_every": args.eval_every,
                "output_dir": str(out),
            },
            "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "dropout": 0.0},
            "data": data,
            "optimizer": {**optimizer, "lr": lr, "weight_decay": 0.1},
            "scheduler": {"name": "cosine", "warmup_steps": max(1, args.steps // 12), "min_lr_ratio": 0.1},
            "checkpoint": {"enabled": False},
            "logging": {"hooks": []},
        }
    )


class EvalLog:
    def __init__(self) -> None:
        self.curve: list[tuple[int, float]] = []

    def on_eval(self, payload: dict[str, Any]) -> None:
        self.curve.append((payload["step"], payload["val_loss"]))


def train_curve(
    args: argparse.Namespace, optimizer: dict[str, Any], lr: float, out: Path
) -> list[tuple[int, float]]:
    log = EvalLog()
    Trainer(base_config(args, out, optimizer, lr), progress=False, hooks={"evals": log}).train()
    return log.curve


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def _run(task: tuple[argparse.Namespace, str, dict[str, Any], float, Path]) -> tuple[str, float, list]:
    """One training run, or its cached curve from an earlier invocation with the same settings."""
    args, label, optimizer, lr, out = task
    cache = out / "curve.json"
    if cache.exists():
        return label, lr, [tuple(point) for point in json.loads(cache.read_text())]
    torch.set_num_threads(args.threads or 1)
    curve = train_curve(args, optimizer, lr, out)
    cache.write_text(json.dumps(curve))
    return label, lr, curve


def _next_lrs(tried: dict[float, list], extended: int, limit: int) -> list[float]:
    """Widen a sweep whose best LR is at its edge (up to `limit` times), so "best" is a real optimum."""
    if extended >= limit or len(tried) < 2:
        return []
    lrs = sorted(tried)
    best = min(lrs, key=lambda lr: tried[lr][-1][1])
    if best == lrs[0]:
        return [lrs[0] / 2]
    if best == lrs[-1]:
        return [lrs[-1] * 2]
    return []


def sample_efficiency(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    root = out / f"steps{args.steps}-eval{args.eval_every}x{args.val_batches}"
    labels = [label for label in OPTIMIZERS if not args.only or label in args.only]
    tried: dict[str, dict[float, list]] = {label: {} for label in labels}
    extended = dict.fromkeys(labels, 0)
    pending = []
    for label in labels:
        centre = CENTRE_LR[OPTIMIZERS[label]["name"]]
        # Variants (Muon+, cautious) get their own, usually shorter, sweep around the same centre.
        size = args.sweep if label in ("adamw", "muon") else args.variant_sweep
        pending += [(label, centre * m) for m in LR_MULTIPLIERS[: max(1, size)]]
    started = time.perf_counter()
    # Runs are independent and single-threaded: `--jobs` of them share the machine's cores.
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        while pending:
            tasks = [(args, label, OPTIMIZERS[label], lr, root / f"{label}-{lr:g}") for label, lr in pending]
            for task in tasks:
                task[4].mkdir(parents=True, exist_ok=True)
            for label, lr, curve in pool.map(_run, tasks):
                tried[label][lr] = curve
                print(
                    f"  {label:<20} lr {lr:<8.3g} final val {curve[-1][1]:.4f}  ({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            pending = []
            for label in labels:
                if label not in ("adamw", "muon"):
                    continue  # variants keep their single LR unless --variant-sweep widens them
                for lr in _next_lrs(tried[label], extended[label], args.extend):
                    extended[label] += 1
                    pending.append((label, lr))
    results: dict[str, Any] = {}
    for label in labels:
        lrs = sorted(tried[label])
        best = min(lrs, key=lambda lr: tried[label][lr][-1][1])
        edge = len(lrs) > 1 and best in (lrs[0], lrs[-1])
        results[label] = {
            "best_lr": best,
            "best_lr_at_sweep_edge": edge,
            "final_val": tried[label][best][-1][1],
            "curve": tried[label][best],
            "sweep": [{"lr": lr, "final_val": tried[label][lr][-1][1]} for lr in lrs],
        }
    target = results["adamw"]["final_val"]
    adamw_steps = steps_to(results["adamw"]["curve"], target)
    for entry in results.values():
        entry["steps_to_target"] = steps_to(entry["curve"], target)
        entry["ratio_to_adamw"] = (
            entry["steps_to_target"] / adamw_steps if entry["steps_to_target"] and adamw_steps else None
        )
    return {"target_val_loss": target, "adamw_steps": adamw_steps, "optimizers": results}


def step_time(args: argparse.Namespace) -> dict[str, Any]:
    config = (
        load_config(args.config) if args.config else base_config(args, Path("."), {"name": "adamw"}, 1e-3)
    )
    model = build_model(config, 256)
    matrices = [p.detach() for _, p in route_parameters(model).muon]
    grads = [torch.randn_like(m) for m in matrices]

    def timer(make: Any) -> float:
        params = [torch.nn.Parameter(m.clone()) for m in matrices]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer = make(params)
        optimizer.step()  # warm-up: state allocation
        started = time.perf_counter()
        for _ in range(args.time_steps):
            optimizer.step()
        return (time.perf_counter() - started) / args.time_steps

    rows: dict[str, list[float]] = {"ours": [], "ours_bf16": [], "torch": []}
    for _ in range(args.rounds):
        rows["torch"].append(timer(lambda ps: torch.optim.Muon(ps, lr=0.02)))
        rows["ours"].append(timer(lambda ps: Muon(ps, lr=0.02)))
        rows["ours_bf16"].append(timer(lambda ps: Muon(ps, lr=0.02, ns_dtype=torch.bfloat16)))
    ratios = [o / t for o, t in zip(rows["ours"], rows["torch"], strict=True)]
    ratios_bf16 = [o / t for o, t in zip(rows["ours_bf16"], rows["torch"], strict=True)]
    return {
        "matrices": len(matrices),
        "parameters": sum(m.numel() for m in matrices),
        "torch_ms": 1000 * statistics.median(rows["torch"]),
        "ours_ms": 1000 * statistics.median(rows["ours"]),
        "ours_bf16_ms": 1000 * statistics.median(rows["ours_bf16"]),
        "ratio": statistics.median(ratios),
        "ratio_bf16": statistics.median(ratios_bf16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches per evaluation")
    parser.add_argument(
        "--sweep", type=int, default=3, help="LRs tried for adamw and muon: centre, x0.5, x2, x0.25, x4"
    )
    parser.add_argument(
        "--variant-sweep", type=int, default=1, help="LRs tried for muon_plus and the cautious variants"
    )
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once (each single-threaded)")
    parser.add_argument(
        "--extend", type=int, default=2, help="max extra LRs when the best is at a sweep edge"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the step-time comparison")
    parser.add_argument("--time-steps", type=int, default=10)
    parser.add_argument("--config", help="model dims for the step-time part (default: the bench model)")
    parser.add_argument("--only", nargs="*", help="limit part (b) to these optimizers (adamw always runs)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="/tmp/speedtronic-bench-optimizers")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args()
    if args.only and "adamw" not in args.only:
        args.only.append("adamw")
    if args.threads:
        # On a shared, oversubscribed machine, one thread per process avoids OpenMP spin-waiting,
        # which can make a step tens of times slower; it changes timings, not the losses.
        torch.set_num_threads(args.threads)

    timing = step_time(args)
    print(f"(a) Muon step over {timing['matrices']} matrices ({timing['parameters']:,} parameters)")
    print(
        f"    torch.optim.Muon {timing['torch_ms']:.2f} ms · ours {timing['ours_ms']:.2f} ms "
        f"· ours in bf16 {timing['ours_bf16_ms']:.2f} ms"
    )
    print(f"    ratio ours / torch = {timing['ratio']:.3f} (bf16 like for like: {timing['ratio_bf16']:.3f})")
    report: dict[str, Any] = {"step_time": timing}
    if not args.skip_training:
        efficiency = sample_efficiency(args, Path(args.out))
        report["sample_efficiency"] = efficiency
        print(
            f"(b) steps to AdamW's final val loss {efficiency['target_val_loss']:.4f} "
            f"({args.steps} steps, eval every {args.eval_every})"
        )
        print(f"    {'optimizer':<20} {'best lr':>8} {'final val':>10} {'steps':>6} {'× adamw':>8}")
        for label, entry in efficiency["optimizers"].items():
            steps = entry["steps_to_target"]
            ratio = entry["ratio_to_adamw"]
            print(
                f"    {label:<20} {entry['best_lr']:>8.2g} {entry['final_val']:>10.4f} "
                f"{steps if steps is not None else 'never':>6} {f'{ratio:.2f}' if ratio else '-':>8}"
            )
        for entry in efficiency["optimizers"].values():
            entry.pop("curve")
    line = json.dumps(report)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
