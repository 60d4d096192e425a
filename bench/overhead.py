"""Trainer overhead: tokens/s of `Trainer` against a hand-written minimal loop, eager and compiled.

    OMP_NUM_THREADS=2 python bench/overhead.py [--steps 30] [--rounds 5] [--precision fp32 bf16]
        [--config configs/shakespeare.yaml] [--set model.d_model=256 ...] [--arms ...]

Four arms, same model, batch, optimizer and schedule (built through the same calls and run plan):

- `bare eager`: nanoGPT's loop — random windows from the embedded corpus as one byte tensor,
  forward (under the trainer's autocast), backward, clip, AdamW step, schedule step;
- `bare compiled`: the same loop over `torch.compile(model)`, with the config's compile options;
- `trainer eager` / `trainer compiled`: `Trainer.train` with `compile.enabled` false / true.

Every arm is built and warmed up once (the compiled arms compile there, so compile time is
excluded), then the arms take turns for `--rounds` rounds of `--steps` steps each, in this process
(this machine is noisy: alternating spreads the noise over all arms). Printed per precision: each
arm's median tokens/s (wall clock and per CPU second of this process — the steadier figure when
other processes share the cores), and the median of the per-round ratios trainer eager / bare eager
and trainer compiled / bare compiled. Goal: both ratios ≥ 0.97 under fp32 and under bf16 autocast.
The thread count is set once (`--threads`, default OMP_NUM_THREADS or torch's) and used by every arm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from speedtronic.config import Config, load_config
from speedtronic.engine.batches import forward_loss
from speedtronic.engine.build import build_model, build_optimizer
from speedtronic.engine.data.text import read_default_corpus_bytes
from speedtronic.engine.schedule import build_scheduler
from speedtronic.engine.trainer import Trainer
from speedtronic.plan import DataFacts, DeviceFacts, plan_run

ARMS = ("bare eager", "bare compiled", "trainer eager", "trainer compiled")
Rates = tuple[float, float]  # tokens per wall second, tokens per CPU second of this process


def bare_loop(config: Config, compiled: bool) -> Callable[[int], Rates]:
    """The minimal loop, built and warmed up (compiled there, if asked); returns `run(steps)`."""
    torch.manual_seed(config.run.seed)
    tokens = torch.frombuffer(bytearray(read_default_corpus_bytes()), dtype=torch.uint8).long()
    model = build_model(config, 256)
    optimizer = build_optimizer(config, model)
    plan = plan_run(config, data=DataFacts(256), device=DeviceFacts("cpu"))
    scheduler = build_scheduler(optimizer, plan)
    forward = model
    if compiled:
        options = config.compile
        kwargs = {"fullgraph": options.fullgraph, **({"mode": options.mode} if options.mode else {})}
        if options.dynamic is not None:
            kwargs["dynamic"] = options.dynamic
        forward = torch.compile(model, **kwargs)
    autocast = config.precision.mode == "bf16"
    B, T = config.data.micro_batch_size, config.data.block_size
    generator = torch.Generator().manual_seed(0)

    def step() -> torch.Tensor:
        starts = torch.randint(0, tokens.numel() - T - 1, (B,), generator=generator)
        # Inputs and labels stacked apart, as nanoGPT does (and as contiguous as the trainer's batches):
        # a strided `window[:, 1:]` view would make torch.compile specialise on another stride.
        inputs = torch.stack([tokens[s : s + T] for s in starts.tolist()])
        labels = torch.stack([tokens[s + 1 : s + T + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = forward_loss(forward, {"input_ids": inputs, "labels": labels}, pass_labels=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.detach()

    for _ in range(2):  # warm-up (and compilation), like the trainer's first steps
        step().item()

    def run(steps: int) -> Rates:
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = step()
        loss.item()
        return rates(steps * B * T, start, cpu)

    return run


def trainer_loop(config: Config, compiled: bool) -> Callable[[int], Rates]:
    """A Trainer, built and warmed up (compiled there, if asked); returns `run(steps)`."""
    options = config.compile.model_copy(update={"enabled": compiled})
    trainer = Trainer(config.model_copy(update={"compile": options}), progress=False)
    trainer.train(max_steps=2)  # warm-up (and compilation)
    if trainer.compiled != compiled:
        raise SystemExit(
            f"the trainer's compiled state is {trainer.compiled}: {trainer.compiled_step.failure}"
        )
    tokens_per_step = config.data.micro_batch_size * config.data.block_size * trainer.plan.accum_steps

    def run(steps: int) -> Rates:
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train(max_steps=trainer.step + steps)
        return rates(steps * tokens_per_step, start, cpu)

    return run


def rates(tokens: int, wall_start: float, cpu_start: float) -> Rates:
    """(tokens per wall second, tokens per CPU second of this process). The CPU-time rate is what
    overhead costs even when other processes share the cores (wall time then mostly measures them)."""
    return tokens / (time.perf_counter() - wall_start), tokens / (time.process_time() - cpu_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shakespeare.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="config overrides")
    args = parser.parse_args()
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads()
    torch.set_num_threads(threads)
    overrides = [
        "checkpoint.enabled=false",
        "logging.hooks=[]",
        "run.eval_every=0",
        "data.val_batches=0",
        f"run.max_steps={2 + args.steps * args.rounds}",
        "scheduler.warmup_steps=1",
        "run.log_every=1000000",
        "run.name=bench-overhead",
        *args.sets,
    ]
    builders = {
        "bare eager": lambda c: bare_loop(c, False),
        "bare compiled": lambda c: bare_loop(c, True),
        "trainer eager": lambda c: trainer_loop(c, False),
        "trainer compiled": lambda c: trainer_loop(c, True),
    }
    print(f"threads {threads} · steps {args.steps} × rounds {args.rounds} · overrides {args.sets}")
    for precision in args.precision:
        config = load_config(args.config, [*overrides, f"precision.mode={precision}", "run.device=cpu"])
        runs = {}
        for arm in args.arms:
            started = time.perf_counter()
            runs[arm] = builders[arm](config)
            print(f"{precision} {arm}: built and warmed up in {time.perf_counter() - started:.1f} s")
        results: dict[str, list[Rates]] = {arm: [] for arm in args.arms}
        for round_ in range(args.rounds):
            order = args.arms if round_ % 2 == 0 else args.arms[::-1]  # alternate who goes first
            for arm in order:
                results[arm].append(runs[arm](args.steps))
            print(
                f"{precision} round {round_ + 1}: "
                + " · ".join(f"{arm} {results[arm][-1][0]:,.0f}" for arm in args.arms)
                + " tok/s"
            )
        for arm in args.arms:
            wall = statistics.median(r[0] for r in results[arm])
            cpu = statistics.median(r[1] for r in results[arm])
            print(f"{precision} {arm}: {wall:,.0f} tok/s · {cpu:,.0f} tok per CPU second (medians)")
        for ours, base in (("trainer eager", "bare eager"), ("trainer compiled", "bare compiled")):
            if ours in results and base in results:
                pairs = list(zip(results[ours], results[base], strict=True))
                wall = statistics.median(o[0] / b[0] for o, b in pairs)
                cpu = statistics.median(o[1] / b[1] for o, b in pairs)
                print(
                    f"{precision}: {ours} / {base} (median of {args.rounds} rounds): wall {wall:.3f}, "
                    f"per CPU second {cpu:.3f} (goal ≥ 0.97)"
                )
        if "bare compiled" in results and "bare eager" in results:
            pairs = list(zip(results["bare compiled"], results["bare eager"], strict=True))
            wall = statistics.median(c[0] / e[0] for c, e in pairs)
            cpu = statistics.median(c[1] / e[1] for c, e in pairs)
            print(f"{precision}: bare compiled / bare eager: wall {wall:.3f}, per CPU second {cpu:.3f}")


if __name__ == "__main__":
    main()
