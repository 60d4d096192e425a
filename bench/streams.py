"""ooo_backprop on a GPU: step time of the same model with and without side-stream branches.

    python bench/streams.py [--steps 30] [--rounds 3] [--streams 2]

For each size (a small model whose matmuls cannot fill a big GPU, and a GPT-2-small-like one) both
variants train from the same initial weights on the same batches in bf16 autocast with AdamW,
alternating over several rounds; the median of the per-round ratios is printed, as
sequential / ooo (above 1: ooo_backprop is faster). The first step's losses are compared too: the
streams change where kernels are queued, not what they compute. On a machine without CUDA it prints
why it skipped and exits 0 (ooo_backprop is a no-op there).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from speedtronic.engine.model import Transformer, TransformerConfig
from speedtronic.engine.streams import CudaStreamOps, StreamScheduler

SIZES = {
    "small d256 L4 B8x256": (
        TransformerConfig(vocab_size=50304, max_seq_len=256, n_layer=4, n_head=4, d_model=256),
        8,
        256,
    ),
    "gpt2-small d768 L12 B16x1024": (
        TransformerConfig(vocab_size=50304, max_seq_len=1024, n_layer=12, n_head=12, d_model=768),
        16,
        1024,
    ),
}


def timed_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], labels=ids[:, 1:])["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(batches)


def first_loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return model(ids[:, :-1], labels=ids[:, 1:])["loss"].item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/streams.py: no CUDA device here; skipped (ooo_backprop is a no-op on CPU/MPS)")
        return
    device = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(device)} · torch {torch.__version__} · {args.streams} streams")
    for label, (cfg, batch, seq) in SIZES.items():
        torch.manual_seed(0)
        plain = Transformer(cfg).to(device)
        ooo = copy.deepcopy(plain)
        scheduler = StreamScheduler(ooo, args.streams, CudaStreamOps(device)).attach()
        generator = torch.Generator(device=device).manual_seed(0)
        batches = [
            torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device, generator=generator)
            for _ in range(args.steps)
        ]
        first_loss(ooo, batches[0])  # the first forward traces the forks (sequentially)
        loss_plain, loss_ooo = first_loss(plain, batches[0]), first_loss(ooo, batches[0])
        opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (plain, ooo)}
        for model in (plain, ooo):  # warm-up: kernels, allocator, optimizer state
            timed_steps(model, opts[model], batches[:3])
        ratios, times = [], {"sequential": [], "ooo": []}
        for _ in range(args.rounds):
            t_plain = timed_steps(plain, opts[plain], batches)
            t_ooo = timed_steps(ooo, opts[ooo], batches)
            times["sequential"].append(t_plain)
            times["ooo"].append(t_ooo)
            ratios.append(t_plain / t_ooo)
        assert scheduler.plan is not None
        # Same weights, same batches, same number of steps: the parameters should agree (exactly, unless
        # a kernel is non-deterministic, e.g. the embedding backward's atomic adds).
        drift = max(
            (a - b).abs().max().item() for a, b in zip(plain.parameters(), ooo.parameters(), strict=True)
        )
        print(
            f"{label}: sequential {statistics.median(times['sequential']) * 1e3:.1f} ms/step · ooo "
            f"{statistics.median(times['ooo']) * 1e3:.1f} ms/step · ratio sequential/ooo "
            f"{statistics.median(ratios):.3f} (>1: ooo faster) · first loss equal: {loss_plain == loss_ooo} "
            f"({loss_plain:.6f} vs {loss_ooo:.6f}) · max parameter difference after training {drift:.3g} · "
            f"{scheduler.plan.describe()}"
        )
        del plain, ooo, opts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
