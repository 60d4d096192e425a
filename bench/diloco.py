"""DiLoCo against one worker and synchronous data-parallel: val loss, share of the gap closed, bytes sent.

    PYTHONPATH=src python bench/diloco.py [--corpus all] [--steps 300] [--workers 4] [--inner-steps 25] [--sweep ...]

About 10 minutes on 2 idle CPU cores with the defaults (a 2-layer, 64-wide byte-level model, batch 8×64,
one corpus, the Muon arms included). The one-seed table in docs/guides/diloco.md came from

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/diloco.py --corpus all --threads 1 --no-muon \
        --inner-steps 12 --steps 300 --sweep "0.7/0/12/int8,1.0/0/12/int8,..."

Corpora (`--corpus`, comma-separated or `all`; each byte-level, validation = its last 10%), all built
without the network and the same on every machine with the same Python and packages:

  tinyshakespeare  the embedded corpus (English plays, 1.1 MB)
  pystdlib         code: this Python's standard library .py files (tests and site-packages left out),
                   sorted by path, the first 1 MB
  pkgdocs          prose and markup: METADATA, LICENSE*, README*, COPYING* of the installed packages'
                   .dist-info folders in site-packages, sorted by path, the first 1 MB
  pyreference      held out (not in `all`, never used to choose a default): English technical prose,
                   the Python reference topics `help()` shows (pydoc_data.topics, sorted), about 465 KB

The summary at the end gives every arm's share of the gap closed on each corpus and its worst case —
the objective for the shipped defaults, so that they are not tuned to one corpus.

Same model, data, inner optimizer (AdamW + cosine schedule from the config defaults) and total
tokens for every arm, in one process on the CPU:

  (a) single   one worker, S steps of batch B
  (b) sync DP  S steps of batch k·B (what k workers all-reducing every step compute)
  (c) DiLoCo   k simulated workers, S inner steps each, an outer step every H steps, with the shipped
               defaults (outer lr, momentum and its warm-up, the default delta codec with error
               feedback), then a sweep of outer lr / momentum / warm-up / H / codec / workers.
  (a') control one worker with the same outer steps (k=1): an outer lr below 1 pulls each round part
               of the way back (like the Lookahead optimizer), which helps even without more workers;
               the difference between (a') and (c) is what the extra workers bring.
  (d) Muon     one worker with Muon (hybrid: hidden matrices on Muon, the rest on AdamW) as optimizer
  (e) MuLoCo   (c) with Muon as every worker's inner optimizer (as in MuLoCo; same outer step, codec
               and error feedback); its gap is measured against the AdamW arms (a) and (b), and
               against (d) to separate what Muon brings from what the workers bring. `--no-muon` skips both.
  (f) Streaming (c) with `--fragments P` fragments synced in turn and each fragment's global installed
               `--overlap τ` steps late (distributed.sync.fragments / overlap_steps), the fragments split
               by `--fragment-layout` (elements, the default: every P-th element of every tensor;
               layers: whole tensors); `--streaming 1/1,4/1,4/1/elements` runs several such arms.
               Prints each arm's peak upload per sync against a whole-model delta. Off unless asked.

"gap closed" = (loss_single − loss_diloco) / (loss_single − loss_dp). Bytes are per worker, uploads
only, measured on real encoded safetensors files: DP sends an fp32 gradient each step, DiLoCo one
delta per round. The goal: ≥ 50% of the gap closed with the defaults at ≥ 25× fewer bytes than DP.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import torch

from speedtronic.config import load_config
from speedtronic.config.schema import DistributedConfig
from speedtronic.diloco import codec
from speedtronic.diloco.fragments import LAYOUTS
from speedtronic.diloco.outer import OuterOptimizer, aggregate, planned_outer, sync_steps
from speedtronic.engine.batches import forward_loss
from speedtronic.engine.build import build_model, build_optimizer
from speedtronic.engine.data.text import read_default_corpus_bytes
from speedtronic.engine.schedule import build_scheduler
from speedtronic.plan import DataFacts, DeviceFacts, plan_run

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


CORPUS_BYTES = 1_000_000  # each built corpus: the first this many bytes of its files in sorted order


def _concat_sorted(paths: list[Path], root: Path, budget: int) -> bytes:
    """The files' bytes, in sorted order of their path relative to root, cut at `budget` bytes."""
    out = bytearray()
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        if len(out) >= budget:
            break
        try:
            out += path.read_bytes() + b"\n"
        except OSError:
            continue
    return bytes(out[:budget])


def corpus_stdlib(budget: int = CORPUS_BYTES) -> bytes:
    """Code: the Python standard library's own .py sources (no site-packages, no tests)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "test", "tests", "idle_test"}
        & set(p.relative_to(root).parts)
    ]
    return _concat_sorted(paths, root, budget)


def corpus_pkgdocs(budget: int = CORPUS_BYTES) -> bytes:
    """Prose and markup: METADATA (package descriptions) and LICENSE/README texts of the installed
    packages' .dist-info folders in this interpreter's site-packages."""
    root = Path(sysconfig.get_paths()["purelib"])
    paths = [
        p
        for p in root.glob("*.dist-info/**/*")
        if p.is_file()
        and (p.name == "METADATA" or p.name.upper().startswith(("LICENSE", "README", "COPYING")))
    ]
    return _concat_sorted(paths, root, budget)


def corpus_pyreference(budget: int = CORPUS_BYTES) -> bytes:
    """English technical prose: the Python reference's topic texts that `help()` shows (pydoc_data,
    shipped with CPython), in sorted order of topic (about 465 KB)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode()[:budget]


CORPORA = {
    "tinyshakespeare": read_default_corpus_bytes,  # plays (English verse and prose), 1.1 MB
    "pystdlib": corpus_stdlib,  # Python code
    "pkgdocs": corpus_pkgdocs,  # package descriptions and licenses (English prose, Markdown/RST)
}
# Not in `all`, never used to choose a default: where the choice is checked on text it was not tuned on.
HELD_OUT = {"pyreference": corpus_pyreference}


def load_tokens(path: str | None, corpus: str = "tinyshakespeare") -> torch.Tensor:
    if path:
        data = Path(path).read_bytes()
    elif corpus == "tinyshakespeare" and SHARED_TEXT.exists():
        data = SHARED_TEXT.read_bytes()
    else:
        data = {**CORPORA, **HELD_OUT}[corpus]()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Setup:
    def __init__(self, args: argparse.Namespace, corpus: str = "tinyshakespeare") -> None:
        self.args = args
        tokens = load_tokens(args.text, corpus)
        # pystdlib and pkgdocs are built from this interpreter's files: the digest tells whether two
        # machines trained on the same bytes (pkgdocs changes with the installed packages).
        self.digest = hashlib.sha256(tokens.to(torch.uint8).numpy().tobytes()).hexdigest()[:12]
        split = int(tokens.numel() * 0.9)  # validation: the last 10% of the corpus
        self.train, val = tokens[:split], tokens[split:]
        self.val_tokens = val
        self.configs = {}
        for optimizer in ("adamw", "muon"):
            self.configs[optimizer] = load_config(
                None,
                [
                    f"model.n_layer={args.n_layer}",
                    f"model.n_head={args.n_head}",
                    f"model.d_model={args.d_model}",
                    f"data.block_size={args.block}",
                    f"data.micro_batch_size={args.batch}",
                    f"optimizer.lr={args.lr}",
                    f"run.max_steps={args.steps}",
                    "scheduler.warmup_steps=" + str(max(1, args.steps // 20)),
                    "run.device=cpu",
                    f"optimizer.name={optimizer}",
                    f"run.seed={1337 + args.seed}",
                ],
            )
        self.config = self.configs["adamw"]
        T = args.block
        g = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, val.numel() - T - 1, (args.val_batches * args.batch,), generator=g)
        windows = torch.stack([val[s : s + T + 1] for s in starts.tolist()])
        self.val = [{"input_ids": w[:, :-1], "labels": w[:, 1:]} for w in windows.split(args.batch)]

    def batch(self, generator: torch.Generator, size: int) -> dict[str, torch.Tensor]:
        T = self.args.block
        starts = torch.randint(0, self.train.numel() - T - 1, (size,), generator=generator)
        w = torch.stack([self.train[s : s + T + 1] for s in starts.tolist()])
        return {"input_ids": w[:, :-1], "labels": w[:, 1:]}

    def worker(self, seed: int, optimizer: str = "adamw"):
        config = self.configs[optimizer]
        torch.manual_seed(config.run.seed)  # every arm and worker starts from the same weights
        model = build_model(config, 256)
        opt = build_optimizer(config, model)
        plan = plan_run(config, data=DataFacts(256), device=DeviceFacts("cpu"))
        sched = build_scheduler(opt, plan)
        return model, opt, sched, torch.Generator().manual_seed(seed + 1000 * self.args.seed)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        model.eval()
        loss = sum(forward_loss(model, b, True).item() for b in self.val) / len(self.val)
        model.train()
        return loss


def inner_step(setup: Setup, model, opt, sched, gen, size: int) -> None:
    loss = forward_loss(model, setup.batch(gen, size), True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), setup.config.optimizer.grad_clip or 1e9)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def run_single(setup: Setup, batch_multiplier: int, optimizer: str = "adamw") -> float:
    model, opt, sched, gen = setup.worker(seed=0, optimizer=optimizer)
    for _ in range(setup.args.steps):
        inner_step(setup, model, opt, sched, gen, setup.args.batch * batch_multiplier)
    return setup.evaluate(model)


def run_diloco(
    setup: Setup,
    k: int,
    H: int,
    outer_lr: float,
    momentum: float,
    wire: str,
    ramp: bool = False,
    sync_start: int = 0,
    optimizer: str = "adamw",
    warm: int = 0,
    aggregation: str | None = None,
    hostile: int = 0,
    attack: str = "reverse",
) -> tuple[float, int, int]:
    """Val loss of the global model after S inner steps per worker, bytes sent by worker 0, rounds.

    With `hostile` > 0, the last `hostile` workers train honestly but send an attacked delta (see
    ATTACKS) — each within the master's norm check, so the aggregation alone has to hold."""
    workers = [setup.worker(seed=100 + w, optimizer=optimizer) for w in range(k)]
    outer = OuterOptimizer(codec.snapshot(workers[0][0]), outer_lr, momentum, warm)
    residual = [None] * k
    attack_gen = torch.Generator().manual_seed(1234)  # not a worker's data stream
    aggregation = aggregation or DistributedConfig().defences.aggregation  # the shipped default unless told
    sent = 0
    steps = setup.args.steps
    points = (
        sync_steps(steps, H, ramp)
        if sync_start == 0
        else [*range(1, sync_start + 1), *(p + sync_start for p in sync_steps(steps - sync_start, H, ramp))]
    )
    if not points or points[-1] != steps:
        points.append(steps)  # a last, shorter round so every arm ends on a global model
    previous = 0
    for point in points:
        h, previous = point - previous, point
        deltas = []
        for w, (model, opt, sched, gen) in enumerate(workers):
            for _ in range(h):
                inner_step(setup, model, opt, sched, gen, setup.args.batch)
            local = codec.snapshot(model)
            delta = {n: outer.weights[n] - local[n] for n in local}
            if residual[w] is not None:
                delta = {n: d + residual[w][n] for n, d in delta.items()}
            received = codec.roundtrip(delta, wire)
            residual[w] = {n: delta[n] - received[n] for n in delta}  # error feedback
            if w == 0:
                sent += len(codec.encode(delta, wire, {"kind": "delta"}))
            if w >= k - hostile:
                received = ATTACKS[attack](received, attack_gen)
            deltas.append((received, 1.0))
        outer.step(aggregate(deltas, aggregation))
        for model, *_ in workers:
            with torch.no_grad():
                for name, p in codec.unique_params(model).items():
                    p.copy_(outer.weights[name])
    model = workers[0][0]
    return setup.evaluate(model), sent, len(points)


def run_streaming(
    setup: Setup,
    k: int,
    H: int,
    count: int,
    tau: int,
    outer_lr: float,
    momentum: float,
    wire: str,
    warm: int,
    layout: str = "layers",
) -> tuple[float, int, int, int]:
    """Streaming DiLoCo (diloco/fragments.py, diloco/worker/overlap.py) with k simulated workers in lockstep:
    fragment p syncs at steps s % H == p·H//count, its deltas are aggregated and outer-stepped on their
    own (its momentum, its round count), and each worker installs the new fragment `tau` steps later
    as θ ← G + (θ_now − θ_sync). `layout`: fragments of whole tensors ("layers") or of every tensor's
    every count-th element ("elements"). Val loss of the global model (every pending fragment installed
    at the end), total and peak bytes of worker 0's uploads, and the number of syncs."""
    from speedtronic.diloco import fragments
    from speedtronic.diloco.worker import overlap

    workers = [setup.worker(seed=100 + w) for w in range(k)]
    specs = codec.param_specs(workers[0][0])
    plan = fragments.Plan(specs, count, H, False, layout)
    outer = OuterOptimizer(codec.snapshot(workers[0][0]), outer_lr, momentum, warm)
    rounds = [0] * count
    anchor = [codec.snapshot(workers[0][0]) for _ in range(k)]  # per worker: the global it installed
    residual: list[dict[str, torch.Tensor]] = [
        {n: torch.zeros(s.shape) for n, s in specs.items()} for _ in range(k)
    ]
    due: dict[int, tuple[int, list[dict[str, torch.Tensor]]]] = {}  # fragment -> (step, θ_sync per worker)
    sent = peak = syncs = 0

    def install(p: int) -> None:
        _, at_sync = due.pop(p)
        new_global = {n: t.clone() for n, t in plan.part(p, outer.weights).items()}
        for w, (model, *_) in enumerate(workers):
            with torch.no_grad():
                now = codec.snapshot(model)
                mine, sync, base = plan.part(p, anchor[w]), plan.part(p, at_sync[w]), plan.part(p, now)
                merged = {
                    n: overlap.merge(g, base[n], mine[n], mine[n] - sync[n]) for n, g in new_global.items()
                }
                now = plan.merged(p, now, merged)
                params = codec.unique_params(model)
                for n in plan.groups[p]:
                    params[n].copy_(now[n])
                anchor[w] = plan.merged(p, anchor[w], new_global)

    for step in range(1, setup.args.steps + 1):
        for model, opt, sched, gen in workers:
            inner_step(setup, model, opt, sched, gen, setup.args.batch)
        p = plan.at(step)
        if p is not None:
            syncs += 1
            deltas, snapshots = [], []
            for w, (model, *_) in enumerate(workers):
                local = codec.snapshot(model)
                snapshots.append(local)
                mine, now, carried = plan.part(p, anchor[w]), plan.part(p, local), plan.part(p, residual[w])
                delta = {n: mine[n] - now[n] + carried[n] for n in mine}
                received = codec.roundtrip(delta, wire)
                residual[w] = plan.merged(p, residual[w], {n: delta[n] - received[n] for n in delta})
                if w == 0:
                    size = len(codec.encode(delta, wire, {"kind": "delta"}))
                    sent, peak = sent + size, max(peak, size)
                deltas.append((received, 1.0))
            outer.step(
                aggregate(deltas, DistributedConfig().defences.aggregation), rounds[p], view=plan.viewer(p)
            )
            rounds[p] += 1
            due[p] = (step + tau, snapshots)
        for q in [q for q, (at, _) in due.items() if at <= step]:
            install(q)
    for q in list(due):
        install(q)
    return setup.evaluate(workers[0][0]), sent, peak, syncs


def _random_like(delta: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random direction at the delta's own norm."""
    noise = {n: torch.randn(t.shape, generator=gen) for n, t in delta.items()}
    scale = codec.norm(delta) / max(codec.norm(noise), 1e-30)
    return {n: t * scale for n, t in noise.items()}


_BIAS: dict[str, torch.Tensor] = {}


def _drift(delta: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Δ plus the same direction every round (one per run, shared by all hostile workers) at 20% of
    Δ's norm: a slow, consistent bias that still agrees with the honest deltas."""
    if not _BIAS or _BIAS.keys() != delta.keys():
        _BIAS.clear()
        _BIAS.update(
            {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(99)) for n, t in delta.items()}
        )
    scale = 0.2 * codec.norm(delta) / max(codec.norm(_BIAS), 1e-30)
    return {n: t + scale * _BIAS[n] for n, t in delta.items()}


# What a hostile worker sends instead of its honest delta Δ (all pass the master's norm check, which
# refuses over 10× the reference norm): its reverse, 5 × Δ, a random direction at Δ's norm, or Δ with
# a small consistent bias (drift).
ATTACKS = {
    "reverse": lambda delta, gen: {n: -t for n, t in delta.items()},
    "scale5": lambda delta, gen: {n: 5 * t for n, t in delta.items()},
    "random": _random_like,
    "drift": _drift,
}


class StreamingArm(NamedTuple):
    count: int
    tau: int
    layout: str = "layers"
    outer_lr: float | None = None  # None: the shipped outer step's
    momentum: float | None = None

    @property
    def key(self) -> str:
        """The row's name: layers and the shipped outer step are left unsaid."""
        key = f"streaming P={self.count} tau={self.tau}" + (
            f" {self.layout}" if self.layout != "layers" else ""
        )
        key += f" lr{self.outer_lr:g}" if self.outer_lr is not None else ""
        return key + (f" mu{self.momentum:g}" if self.momentum is not None else "")


def streaming_arms(args: argparse.Namespace) -> list[StreamingArm]:
    """The (f) arms: --streaming's P/τ[/layout][/lrX][/muX] list, else --fragments/--overlap/
    --fragment-layout."""
    if args.streaming:
        arms = []
        for entry in args.streaming.split(","):
            parts = entry.strip().split("/")
            if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
                raise SystemExit(f"--streaming: {entry!r} is not P/tau[/layers|elements][/lrX][/muX]")
            arm = StreamingArm(int(parts[0]), int(parts[1]))
            for part in parts[2:]:
                try:
                    if part in LAYOUTS:
                        arm = arm._replace(layout=part)
                    elif part.startswith("lr"):
                        arm = arm._replace(outer_lr=float(part[2:]))
                    elif part.startswith("mu"):
                        arm = arm._replace(momentum=float(part[2:]))
                    else:
                        raise ValueError(part)
                except ValueError:
                    raise SystemExit(
                        f"--streaming: {part!r} in {entry!r} is not layers, elements, lrX or muX"
                    ) from None
            arms.append(arm)
        return arms
    if args.fragments > 1 or args.overlap > 0:
        return [StreamingArm(args.fragments, args.overlap, args.fragment_layout)]
    return []


def bench_corpus(args: argparse.Namespace, corpus: str) -> dict:
    """All arms on one corpus: prints its table, returns {key: gap closed} and the losses."""
    defaults = DistributedConfig()
    setup = Setup(args, corpus)
    k, H, S = args.workers, args.inner_steps, args.steps
    started = time.perf_counter()
    params = sum(p.numel() for p in setup.worker(0)[0].parameters())
    print(
        f"\n== {corpus}: {setup.train.numel():,} train / {setup.train.numel() // 9:,} val bytes; model "
        f"{args.n_layer}x{args.d_model} ({params:,} params), block {args.block}, batch {args.batch}, "
        f"S={S}, k={k}, H={H}, lr {args.lr:g}; corpus sha256 {setup.digest}",
        flush=True,
    )

    if args.known is not None:  # exploring: reuse baselines measured by an earlier full run
        single, dp = args.known
    else:
        single = run_single(setup, 1)
        print(f"  single {single:.4f}", flush=True)
        dp = run_single(setup, k)
        print(f"  sync DP {dp:.4f}", flush=True)
    fp32_bytes = sum(4 * p.numel() for p in codec.unique_params(setup.worker(0)[0]).values())
    dp_bytes = S * fp32_bytes
    rows = [("(a) single worker", single, "-", 0), ("(b) sync DP, k x batch", dp, "-", dp_bytes)]
    gaps: dict[str, float] = {}

    def gap(loss: float) -> float:
        return (single - loss) / (single - dp) if single != dp else math.nan

    ramp, warm = defaults.sync.ramp, defaults.sync.outer_momentum_warmup
    lr, mu = planned_outer(defaults.sync.outer_lr, defaults.sync.outer_momentum, len(sync_steps(S, H, ramp)))
    if args.skip_defaults:
        loss, sent, rounds = math.nan, 0, len(sync_steps(S, H, ramp))
    else:
        loss, sent, rounds = run_diloco(setup, k, H, lr, mu, defaults.sync.delta_codec, ramp, warm=warm)
        gaps["defaults"] = gap(loss)
    label = f"(c) DiLoCo defaults lr {lr:g} mu {mu:.2f} warm{warm} H {H} {defaults.sync.delta_codec}"
    label += f" {defaults.defences.aggregation}"
    print(f"  defaults: {loss:.4f}", flush=True)
    rows.append((label, loss, f"{gap(loss):.0%}", sent))
    default_loss, default_rounds = loss, rounds
    # distributed.defences.aggregation: the defaults with each robust aggregation (clean), and under attack.
    for aggregation in filter(None, args.aggregation.split(",")):
        for attack in ["", *filter(None, args.attack.split(","))]:
            if aggregation == defaults.defences.aggregation and not attack:
                continue  # that is the defaults row above
            loss, sent, _ = run_diloco(
                setup,
                k,
                H,
                lr,
                mu,
                defaults.sync.delta_codec,
                ramp,
                warm=warm,
                aggregation=aggregation,
                hostile=args.hostile if attack else 0,
                attack=attack or "reverse",
            )
            key = f"{aggregation}" + (f" {args.hostile} hostile {attack}" if attack else "")
            print(f"  aggregation {key}: {loss:.4f}", flush=True)
            rows.append((f"(c) defaults, aggregation {key}", loss, f"{gap(loss):.0%}", sent))
            gaps[f"aggregation {key}"] = gap(loss)
    if not args.skip_defaults:
        # Control: the same outer step with one worker (Lookahead-style). What DiLoCo gains beyond this
        # comes from the k workers, not from the outer step alone.
        loss, sent, _ = run_diloco(setup, 1, H, lr, mu, defaults.sync.delta_codec, ramp, warm=warm)
        print(f"  control k=1: {loss:.4f}", flush=True)
        rows.append(("(a') one worker with the same outer step", loss, f"{gap(loss):.0%}", sent))
        gaps["control k=1"] = gap(loss)
    arms = streaming_arms(args)
    whole = (  # a whole-model delta's bytes, what each arm's peak upload is measured against
        len(
            codec.encode(
                {n: torch.zeros(s.shape) for n, s in codec.param_specs(setup.worker(0)[0]).items()},
                defaults.sync.delta_codec,
                {"kind": "delta"},
            )
        )
        if arms
        else 0
    )
    for arm in arms:
        # Streaming DiLoCo against the defaults row: the same outer step (unless the arm names its own)
        # and codec, per fragment.
        arm_lr = lr if arm.outer_lr is None else arm.outer_lr
        arm_mu = mu if arm.momentum is None else arm.momentum
        loss, sent, peak, syncs = run_streaming(
            setup, k, H, arm.count, arm.tau, arm_lr, arm_mu, defaults.sync.delta_codec, warm, arm.layout
        )
        key = arm.key
        print(
            f"  {key}: {loss:.4f}; peak upload {peak:,} B per sync against {whole:,} B for the whole model "
            f"({whole / peak:.2f}x less), {syncs} syncs",
            flush=True,
        )
        rows.append((f"(f) {key}", loss, f"{gap(loss):.0%}", sent))
        gaps[key] = gap(loss)
    if not args.no_muon:
        lr, mu = planned_outer(
            defaults.sync.outer_lr, defaults.sync.outer_momentum, len(sync_steps(S, H, ramp))
        )
        muon_single = run_single(setup, 1, "muon")
        print(f"  Muon single {muon_single:.4f}", flush=True)
        rows.append(("(d) one worker, Muon", muon_single, f"{gap(muon_single):.0%}", 0))
        muon_dp = run_single(setup, k, "muon")
        print(f"  Muon sync DP {muon_dp:.4f}", flush=True)
        rows.append(("(d') sync DP, k x batch, Muon", muon_dp, f"{gap(muon_dp):.0%}", dp_bytes))
        loss, sent, _ = run_diloco(
            setup, k, H, lr, mu, defaults.sync.delta_codec, ramp, optimizer="muon", warm=warm
        )
        muon_gap = (muon_single - loss) / (muon_single - muon_dp) if muon_single != muon_dp else math.nan
        print(f"  MuLoCo defaults: {loss:.4f} ({muon_gap:.0%} of the Muon single-DP gap)", flush=True)
        rows.append(("(e) MuLoCo: (c) with Muon inner", loss, f"{gap(loss):.0%}", sent))
        gaps["MuLoCo defaults"] = gap(loss)
    for spec in filter(None, args.sweep.split(",")):
        lr_s, mu_s, h_s, wire, *flags = spec.split("/")
        h, ramp = int(h_s), "ramp" in flags
        lr, mu = planned_outer(
            None if lr_s == "auto" else float(lr_s),
            None if mu_s == "auto" else float(mu_s),
            len(sync_steps(S, h, ramp)),
        )
        sync_start = next((int(f[4:]) for f in flags if f.startswith("sync")), 0)
        warm = next((int(f[4:]) for f in flags if f.startswith("warm")), 0)
        optimizer = "muon" if "muon" in flags else "adamw"
        workers = next((int(f[1:]) for f in flags if f.startswith("k")), k)
        loss, sent, _ = run_diloco(setup, workers, h, lr, mu, wire, ramp, sync_start, optimizer, warm)
        print(f"  {spec}: {loss:.4f}", flush=True)
        label = f"    sweep lr {lr:g} mu {mu:.2f} H {h}{' ramp' if ramp else ''} {wire}"
        label += f" sync{sync_start}" if sync_start else ""
        label += f" warm{warm}" if warm else ""
        label += " Muon" if optimizer == "muon" else ""
        label += f" k={workers}" if workers != k else ""
        rows.append((label, loss, f"{gap(loss):.0%}", sent))
        gaps[spec] = gap(loss)

    print(f"\n{'arm':<52} {'val loss':>8} {'gap closed':>10} {'bytes/worker':>13} {'x fewer':>8}")
    for label, loss, closed, nbytes in rows:
        ratio = f"{dp_bytes / nbytes:.1f}" if nbytes and nbytes != dp_bytes else "1.0" if nbytes else "-"
        print(f"{label:<52} {loss:>8.4f} {closed:>10} {nbytes:>13,} {ratio:>8}")
    print(f"\nbytes per worker for the default DiLoCo schedule ({default_rounds} syncs) under each codec:")
    specs = codec.param_specs(setup.worker(0)[0])
    zeros = {n: torch.zeros(s.shape) for n, s in specs.items()}
    for wire in codec.CODECS:
        per_round = len(codec.encode(zeros, wire, {"kind": "delta"}))
        total = per_round * default_rounds
        print(
            f"  {wire:<5} {per_round:>10,} B/sync x {default_rounds} = {total:>12,} B  "
            f"({dp_bytes / total:.1f}x fewer than DP's {dp_bytes:,} B)"
        )
    wall = time.perf_counter() - started
    print(f"\n{corpus}: defaults close {gap(default_loss):.0%} of the gap · {wall:.0f}s", flush=True)
    return {
        "corpus": corpus,
        "sha256": setup.digest,
        "single": single,
        "dp": dp,
        "rows": [(label, loss, nbytes) for label, loss, _, nbytes in rows],
        "gaps": gaps,
        "rounds": default_rounds,
        "dp_bytes": dp_bytes,
        "seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus",
        default="tinyshakespeare",
        help=f"comma-separated corpora, or 'all': {', '.join(CORPORA)}; held out: {', '.join(HELD_OUT)} "
        "(ignored with --text)",
    )
    parser.add_argument("--steps", type=int, default=300, help="S: inner steps per worker")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=25, help="H")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument(
        "--seed", type=int, default=0, help="another initialisation and other batches (0: the guide's)"
    )
    parser.add_argument("--text", default=None, help="a file to use as the one corpus")
    parser.add_argument(
        "--sweep",
        default="0.7/0.9/25/fp32,1.0/0.0/25/fp32,0.7/0.0/50/int8",
        help="comma-separated outer_lr/momentum/H/codec[/ramp][/syncN][/warmN][/muon][/kN] ('auto' = "
        "chosen from the rounds; warmN: outer momentum grows linearly over the first N rounds; muon: "
        "Muon as the inner optimizer; kN: N workers)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-defaults", action="store_true", help="exploring: only the sweep")
    parser.add_argument("--no-muon", action="store_true", help="skip the Muon arms (d) and (e)")
    parser.add_argument(
        "--known",
        type=float,
        nargs="+",
        metavar="LOSS",
        help="skip (a) and (b), use these losses: SINGLE DP for each corpus, in order",
    )
    parser.add_argument(
        "--aggregation",
        default="",
        help="distributed.defences.aggregation values to run the defaults with, comma-separated "
        "(mean,trimmed_mean,median,clipped_mean); the shipped one is the defaults row",
    )
    parser.add_argument(
        "--attack",
        default="",
        help=f"also run each --aggregation with --hostile workers sending attacked deltas: comma-separated "
        f"from {', '.join(ATTACKS)}",
    )
    parser.add_argument("--hostile", type=int, default=1, help="hostile workers for --attack (of --workers)")
    parser.add_argument(
        "--fragments", type=int, default=1, help="also run Streaming DiLoCo with this many fragments (f)"
    )
    parser.add_argument(
        "--overlap", type=int, default=0, help="... installing each fragment's global this many steps late"
    )
    parser.add_argument(
        "--fragment-layout",
        choices=LAYOUTS,
        default=DistributedConfig().sync.fragment_layout,
        help="... fragments of whole tensors, or of every tensor's every P-th element",
    )
    parser.add_argument(
        "--streaming",
        default="",
        help="several (f) arms, comma-separated P/tau[/layout][/lrX][/muX], e.g. 1/1,4/1,4/1/elements,"
        "4/1/elements/lr0.5 (instead of --fragments/--overlap/--fragment-layout); an arm without a layout "
        "is layers, and its row is named without one; lrX / muX: its own outer lr / momentum",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    streaming_arms(args)  # a bad --streaming spec is refused before anything runs
    torch.set_num_threads(args.threads)
    corpora = list(CORPORA) if args.corpus == "all" else args.corpus.split(",")
    if args.text:
        corpora = [Path(args.text).name]
    unknown = [c for c in corpora if c not in {**CORPORA, **HELD_OUT} and not args.text]
    if unknown:
        names = ", ".join([*CORPORA, *HELD_OUT])
        parser.error(f"unknown corpus {unknown[0]!r} (choose from {names} or all)")
    if args.known is not None and len(args.known) != 2 * len(corpora):
        parser.error("--known takes SINGLE DP for each corpus")
    started = time.perf_counter()
    known = args.known
    results = []
    for i, corpus in enumerate(corpora):
        args.known = known[2 * i : 2 * i + 2] if known else None
        results.append(bench_corpus(args, corpus))
    args.known = known
    wall = time.perf_counter() - started

    keys = [key for key in results[0]["gaps"]]
    print(
        f"\nsummary: gap closed (single -> sync DP) per corpus, S={args.steps}, H={args.inner_steps}, "
        f"k={args.workers}, model {args.n_layer}x{args.d_model}"
    )
    print(f"{'arm':<34}" + "".join(f"{r['corpus'][:15]:>16}" for r in results) + f"{'worst':>8}")
    print(f"{'single / sync DP loss':<34}" + "".join(f"{r['single']:>8.3f}/{r['dp']:<7.3f}" for r in results))
    for key in keys:
        values = [r["gaps"].get(key, math.nan) for r in results]
        print(f"{key:<34}" + "".join(f"{v:>16.0%}" for v in values) + f"{min(values):>8.0%}")
    print(f"total {wall:.0f}s")
    if args.json:
        import json

        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results, "seconds": wall}, indent=1)
        )


if __name__ == "__main__":
    main()
