"""Trainer overhead: tokens/s of `Trainer` against a hand-written minimal loop, same model/batch/optimizer.

    python bench/overhead.py [--steps 60] [--rounds 3] [--config configs/shakespeare.yaml]

The minimal loop is nanoGPT's: random windows from the embedded corpus as one byte tensor, forward, backward,
clip, AdamW step, schedule step. Both sides build the model and optimizer through the same registry
calls, run in this process, alternate over several rounds (this machine is noisy), and the median of
the per-round ratios is printed. Goal: trainer / minimal ≥ 0.97.
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


def minimal_loop(config, steps: int) -> float:
    torch.manual_seed(config.run.seed)
    tokens = torch.frombuffer(bytearray(read_default_corpus_bytes()), dtype=torch.uint8).long()
    model = build_model(config, 256)
    optimizer = build_optimizer(config, model)
    scheduler = build_scheduler(optimizer, config.scheduler)
    B, T = config.data.micro_batch_size, config.data.block_size
    generator = torch.Generator().manual_seed(0)

    def step() -> torch.Tensor:
        starts = torch.randint(0, tokens.numel() - T - 1, (B,), generator=generator)
        window = torch.stack([tokens[s : s + T + 1] for s in starts.tolist()])
        loss = forward_loss(model, {"input_ids": window[:, :-1], "labels": window[:, 1:]}, pass_labels=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.detach()

    step()  # warm-up, like the trainer's first step
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    return steps * B * T / (time.perf_counter() - start)


def trainer_loop(config, steps: int) -> float:
    trainer = Trainer(config, progress=False)
    trainer.train(max_steps=1)  # warm-up step
    start = time.perf_counter()
    trainer.train(max_steps=steps + 1)
    return steps * config.data.micro_batch_size * config.data.block_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shakespeare.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
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
    config = load_config(args.config, overrides)
    ratios = []
    for round_ in range(args.rounds):
        ours = trainer_loop(config, args.steps)
        base = minimal_loop(config, args.steps)
        ratios.append(ours / base)
        print(
            f"round {round_ + 1}: trainer {ours:,.0f} tok/s · minimal loop {base:,.0f} tok/s · ratio {ours / base:.3f}"
        )
    print(
        f"trainer/minimal tokens/s ratio (median of {args.rounds}): {statistics.median(ratios):.3f} (goal ≥ 0.97)"
    )


if __name__ == "__main__":
    main()
