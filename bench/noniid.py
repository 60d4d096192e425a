"""DiLoCo with each worker on its own corpus (non-i.i.d.) against every worker on the mix, pooled over seeds.

    PYTHONPATH=src python bench/noniid.py [--seeds 4] [--steps 150] [--inner-steps 12] [--json out.json]

Three byte-level corpora of bench/diloco.py (tinyshakespeare: plays, pystdlib: Python code, pkgdocs:
package descriptions and licences), each split 90/10 into train and validation. Every arm trains the same
model from the same weights with the same inner optimizer, schedule and tokens; the data is drawn by the
real data.sources loader (engine/data/mixture.py), equal weights:

  (a) single    one worker on the mix, S steps of batch B
  (b) sync DP   one worker on the mix, S steps of batch k·B (what k workers all-reducing compute)
  (c) DiLoCo, mix       k = 3 workers, each on the whole mix (its own seed), an outer step every H
  (d) DiLoCo, non-iid   k = 3 workers, worker w on corpus w alone (DiLoCo's non-i.i.d. setting)

(c) and (d) use bench/diloco.py's simulation with the shipped defaults (outer lr and momentum, its
warm-up, the int8 delta codec with error feedback, clipped-mean aggregation). Loss is the mean over the
three corpora's validation sets (the mix's). "gap closed" = (loss_single − loss_arm) / (loss_single −
loss_dp), per seed, then its mean and spread over the seeds. The guide's figure (docs/guides/
data-mixtures.md) came from the command in bench/results/noniid/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from diloco import CORPORA, Setup, load_tokens, run_diloco, run_single  # noqa: E402

from speedtronic.config.schema import DistributedConfig  # noqa: E402
from speedtronic.diloco.outer import planned_outer  # noqa: E402
from speedtronic.engine.batches import forward_loss  # noqa: E402
from speedtronic.engine.data.mixture import MixtureLoader, WeightedSource  # noqa: E402
from speedtronic.engine.data.sources import TokenArray  # noqa: E402


class Feed:
    """A worker's batches: the mixture loader of its sources, one per batch size asked for."""

    def __init__(self, sources: list[WeightedSource], block: int, seed: int) -> None:
        self.sources, self.block, self.seed = sources, block, seed
        self.loaders: dict[int, MixtureLoader] = {}

    def take(self, size: int) -> dict[str, torch.Tensor]:
        if size not in self.loaders:
            self.loaders[size] = MixtureLoader(
                self.sources, block_size=self.block, micro_batch_size=size, seed=self.seed
            )
        return next(self.loaders[size])


class MixSetup(Setup):
    """bench/diloco.py's Setup with the data of the mixture: `worker(seed)` hands out a Feed, whose
    sources are the whole mix, or (non-iid, workers seeded 100 + w) corpus w alone."""

    def __init__(self, args: argparse.Namespace, noniid: bool) -> None:
        args.text = None
        super().__init__(args, "tinyshakespeare")  # the model configs; the data is replaced below
        self.noniid = noniid
        self.sources, self.vals = [], {}
        g = torch.Generator().manual_seed(1234)
        for name in CORPORA:
            tokens = load_tokens(None, name)
            split = int(tokens.numel() * 0.9)
            self.sources.append(WeightedSource(name, 1.0, TokenArray(tokens[:split], name)))
            val = tokens[split:]
            starts = torch.randint(
                0, val.numel() - args.block - 1, (args.val_batches * args.batch,), generator=g
            )
            windows = torch.stack([val[s : s + args.block + 1] for s in starts.tolist()])
            self.vals[name] = [
                {"input_ids": w[:, :-1], "labels": w[:, 1:]} for w in windows.split(args.batch)
            ]

    def worker(self, seed: int, optimizer: str = "adamw"):
        model, opt, sched, _ = super().worker(seed, optimizer)
        w = seed - 100
        sources = [self.sources[w]] if self.noniid and 0 <= w < len(self.sources) else self.sources
        return model, opt, sched, Feed(sources, self.args.block, seed + 1000 * self.args.seed)

    def batch(self, generator: Feed, size: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return generator.take(size)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        return statistics.fmean(self.by_corpus(model).values())

    @torch.no_grad()
    def by_corpus(self, model: torch.nn.Module) -> dict[str, float]:
        model.eval()
        out = {
            name: sum(forward_loss(model, b, True).item() for b in batches) / len(batches)
            for name, batches in self.vals.items()
        }
        model.train()
        return out


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, float]:
    args.seed = seed
    k, dist = len(CORPORA), DistributedConfig()
    outer = planned_outer(dist.sync.outer_lr, dist.sync.outer_momentum, args.steps // args.inner_steps)
    mix, noniid = MixSetup(args, noniid=False), MixSetup(args, noniid=True)
    single, dp = run_single(mix, 1), run_single(mix, k)
    common = dict(wire=dist.sync.delta_codec, warm=dist.sync.outer_momentum_warmup)
    on_mix, _, _ = run_diloco(mix, k, args.inner_steps, *outer, **common)
    apart, _, _ = run_diloco(noniid, k, args.inner_steps, *outer, **common)
    gap = single - dp
    return {
        "single": single,
        "dp": dp,
        "diloco_mix": on_mix,
        "diloco_noniid": apart,
        "closed_mix": (single - on_mix) / gap if gap else float("nan"),
        "closed_noniid": (single - apart) / gap if gap else float("nan"),
    }


ARMS = {
    "single": "single worker",
    "dp": "sync DP (3× batch)",
    "diloco_mix": "DiLoCo, all on the mix",
    "diloco_noniid": "DiLoCo, one corpus each",
}


def plot(results: dict, out: Path) -> None:
    """Each arm's validation loss (the mix's) per seed, with the pooled mean, as a PNG (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = results["seeds"]
    figure, axes = plt.subplots(figsize=(7, 3.6), dpi=120)
    for x, key in enumerate(ARMS):
        values = [row[key] for row in seeds]
        axes.scatter([x] * len(values), values, color=f"C{x}", alpha=0.6, s=18)
        mean = results["pooled"][key]["mean"]
        axes.hlines(mean, x - 0.25, x + 0.25, color=f"C{x}", linewidth=2)
        axes.annotate(f"{mean:.3f}", (x + 0.28, mean), va="center", fontsize=8)
    axes.set_xticks(range(len(ARMS)), list(ARMS.values()), fontsize=8)
    axes.set_xlim(-0.5, len(ARMS) - 0.2)
    axes.set_ylabel("val loss (mean of 3 corpora)")
    s = results["settings"]
    axes.set_title(
        f"{len(seeds)} seeds · {s['steps']} inner steps per worker, H={s['inner_steps']} · dots: seeds, "
        "bars: mean",
        fontsize=9,
    )
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150, help="S: inner steps per worker")
    parser.add_argument("--inner-steps", type=int, default=12, help="H")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="also draw the results as a PNG here (matplotlib)")
    parser.add_argument("--from", dest="source", default=None, help="plot this results JSON; run nothing")
    args = parser.parse_args()
    if args.source:
        plot(json.loads(Path(args.source).read_text()), Path(args.plot or "noniid.png"))
        return
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = []
    for seed in range(args.seeds):
        row = one_seed(args, seed)
        rows.append(row)
        print(
            f"seed {seed}: single {row['single']:.4f} · DP {row['dp']:.4f} · DiLoCo mix {row['diloco_mix']:.4f} "
            f"({row['closed_mix']:.0%} closed) · DiLoCo non-iid {row['diloco_noniid']:.4f} "
            f"({row['closed_noniid']:.0%} closed)",
            flush=True,
        )
    pooled = {
        key: {
            "mean": statistics.fmean(r[key] for r in rows),
            "stdev": statistics.pstdev(r[key] for r in rows),
        }
        for key in rows[0]
    }
    print(
        f"pooled over {args.seeds} seeds: gap closed — all workers on the mix {pooled['closed_mix']['mean']:.0%} "
        f"(± {pooled['closed_mix']['stdev']:.0%}), each worker on its own corpus "
        f"{pooled['closed_noniid']['mean']:.0%} (± {pooled['closed_noniid']['stdev']:.0%}); "
        f"{time.perf_counter() - started:.0f} s"
    )
    skip = ("json", "seed", "text", "plot", "source")
    results = {
        "settings": {k: v for k, v in vars(args).items() if k not in skip},
        "seeds": rows,
        "pooled": pooled,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
