"""Trainer overhead: tokens/s of `Trainer` against a hand-written minimal loop, same model/batch/optimizer.

    python bench/overhead.py [--steps 60] [--rounds 3] [--config configs/shakespeare.yaml] [--precision fp32 bf16]

The minimal loop is nanoGPT's: random windows from the embedded corpus as one byte tensor, forward
(under the same autocast as the trainer's), backward, clip, AdamW step, schedule step. Both sides build
the model, optimizer and schedule through the same calls and the same run plan, run in this process,
alternate over several rounds (this machine is noisy), and the median of the per-round ratios is
printed for each precision — of wall-clock tokens/s and of tokens per CPU second of this process
(the steadier figure when other processes share the cores; run it with OMP_NUM_THREADS=1). Goal: trainer / minimal ≥ 0.97 under fp32 and under bf16 autocast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speedtronic.config import load_config
from speedtronic.engine.batches import forward_loss
from speedtronic.engine.build import build_model, build_optimizer
from speedtronic.engine.data.text import read_default_corpus_bytes
from speedtronic.engine.schedule import build_scheduler
from speedtronic.engine.trainer import Trainer
from speedtronic.plan import DataFacts, DeviceFacts, plan_run


def minimal_loop(config, steps: int) -> tuple[float, float]:
    torch.manual_seed(config.run.seed)
    tokens = torch.frombuffer(bytearray(read_default_corpus_bytes()), dtype=torch.uint8).long()
    model = build_model(config, 256)
    optimizer = build_optimizer(config, model)
    plan = plan_run(config, data=DataFacts(256), device=DeviceFacts("cpu"))
    scheduler = build_scheduler(optimizer, plan)
    autocast = config.precision.mode == "bf16"
    B, T = config.data.micro_batch_size, config.data.block_size
    generator = torch.Generator().manual_seed(0)

    def step() -> torch.Tensor:
        starts = torch.randint(0, tokens.numel() - T - 1, (B,), generator=generator)
        window = torch.stack([tokens[s : s + T + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = forward_loss(
                model, {"input_ids": window[:, :-1], "labels": window[:, 1:]}, pass_labels=True
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.detach()

    step()  # warm-up, like the trainer's first step
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = step()
    loss.item()
    return rates(steps * B * T, start, cpu)


def trainer_loop(config, steps: int) -> tuple[float, float]:
    trainer = Trainer(config, progress=False)
    trainer.train(max_steps=1)  # warm-up step
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train(max_steps=steps + 1)
    return rates(steps * config.data.micro_batch_size * config.data.block_size, start, cpu)


def rates(tokens: int, wall_start: float, cpu_start: float) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process). The CPU-time rate is what
    overhead costs even when other processes share the cores (wall time then mostly measures them)."""
    return tokens / (time.perf_counter() - wall_start), tokens / (time.process_time() - cpu_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shakespeare.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args()
    overrides = [
        "checkpoint.enabled=false",
        "compile.enabled=false",  # the minimal loop is eager
        "logging.hooks=[]",
        "run.eval_every=0",
        "data.val_batches=0",
        f"run.max_steps={args.steps + 1}",
        "scheduler.warmup_steps=1",
        "run.log_every=1000000",
        "run.name=bench-overhead",
    ]
    for precision in args.precision:
        config = load_config(args.config, [*overrides, f"precision.mode={precision}", "run.device=cpu"])
        wall, cpu = [], []
        for round_ in range(args.rounds):
            ours, ours_cpu = trainer_loop(config, args.steps)
            base, base_cpu = minimal_loop(config, args.steps)
            wall.append(ours / base)
            cpu.append(ours_cpu / base_cpu)
            print(
                f"{precision} round {round_ + 1}: trainer {ours:,.0f} tok/s · minimal loop {base:,.0f} tok/s · "
                f"ratio {ours / base:.3f} (per CPU second: {ours_cpu / base_cpu:.3f})"
            )
        print(
            f"{precision}: trainer/minimal tokens/s ratio (median of {args.rounds}): wall "
            f"{statistics.median(wall):.3f}, per CPU second {statistics.median(cpu):.3f} (goal ≥ 0.97)"
        )


if __name__ == "__main__":
    main()
