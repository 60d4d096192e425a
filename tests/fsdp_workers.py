"""Scenarios the FSDP tests run on two gloo ranks (`torchrun ... tests/fsdp_workers.py NAME OUT`).

Each writes a JSON result from rank 0 to OUT. Kept in a script of its own so the multi-rank set-up is
plain torchrun, exactly as a user runs it.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def muon_equivalence() -> dict:
    """Sharded Muon (hybrid groups: plain, transposed, cautious, Muon+) against single-process Muon
    on the same gradients, and a shard-local Newton–Schulz (torch.optim.Muon on DTensors) against it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from speedtronic.optim.muon import Muon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    # 96×64 (the layer), 97×48 (uneven rows over 2 ranks), 40×72 (wide).
    shapes = [(64, 96), (48, 97), (72, 40)]
    reference = nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in shapes])
    results: dict[str, float] = {}
    variants = {
        "plain": {},
        "no_nesterov": {"nesterov": False},
        "cautious": {"cautious": True},
        "muon_plus": {"muon_plus": "row_col", "adjust_lr": "match_rms_adamw"},
        "polar_express": {"ns_schedule": "polar_express"},
    }
    grads = [[torch.randn(o, i) for i, o in shapes] for _ in range(3)]

    def make(options: dict, model: nn.Module) -> Muon:
        groups = [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[2].weight], "transposed": True},
        ]
        return Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, **options)

    def run(model: nn.Module, optimizer: torch.optim.Optimizer, shard: bool) -> list[torch.Tensor]:
        from torch.distributed.tensor import Shard, distribute_tensor

        for step_grads in grads:
            for layer, g in zip(model, step_grads, strict=True):
                layer.weight.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]) if shard else g.clone()
            optimizer.step()
        return [(layer.weight.full_tensor() if shard else layer.weight).detach().clone() for layer in model]

    def sharded_copy() -> nn.Module:
        model = copy.deepcopy(reference)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    for name, options in variants.items():
        single = copy.deepcopy(reference)
        want = run(single, make(options, single), shard=False)
        # Both schedules: each matrix on its owner rank (the default), and gathered on every rank.
        for schedule in ("owner", "gather"):
            model = sharded_copy()
            got = run(model, make({**options, "sharded_schedule": schedule}, model), shard=True)
            key = name if schedule == "owner" else f"{name}/gather"
            results[key] = max((a - b).abs().max().item() for a, b in zip(want, got, strict=True))

    # Newton–Schulz on each rank's own rows (what "just run Muon on the shards" computes).
    import speedtronic.optim.muon as muon_module

    saved = muon_module._full, muon_module._my_rows
    muon_module._full = lambda t: t.to_local() if hasattr(t, "to_local") else t
    muon_module._my_rows = lambda p, update: update
    try:
        single = copy.deepcopy(reference)
        want = run(single, make({}, single), shard=False)
        model = sharded_copy()
        got = run(model, make({"sharded_schedule": "gather"}, model), shard=True)
    finally:
        muon_module._full, muon_module._my_rows = saved
    results["shard_local_newton_schulz"] = max(
        (a - b).abs().max().item() for a, b in zip(want, got, strict=True)
    )

    # The naive port: torch.optim.Muon steps the DTensor shards without complaint.
    single = copy.deepcopy(reference)
    want = run(single, torch.optim.Muon(single.parameters(), lr=0.02, weight_decay=0.1), shard=False)
    model = sharded_copy()
    got = run(model, torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.1), shard=True)
    results["torch_muon_shard_local"] = max(
        (a - b).abs().max().item() for a, b in zip(want, got, strict=True)
    )
    results["update_scale"] = max(
        (a - layer.weight).abs().max().item() for a, layer in zip(want, reference, strict=True)
    )
    return results


class RecordingSync:
    """A sync that installs known weights at attach, snapshots the weights it is handed at steps 2 and
    4, and at step 2 installs half of them: run under ddp and under fsdp, both must see and leave the
    same whole weights (fsdp: through rank 0's mirror, engine/parallel/fsdp_sync.py)."""

    def __init__(self) -> None:
        self.shapes: dict[str, list[int]] = {}
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.asked: list[int] = []
        self.steps: list[int] = []

    def attach(self, model: nn.Module, *, step: int, tokens: int, final_step: int) -> None:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                self.shapes[name] = list(p.shape)
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))

    def needs_weights(self, step: int) -> bool:
        self.asked.append(step)
        return step in (2, 4)

    def after_step(self, model: nn.Module, *, step: int, tokens: int) -> bool:
        self.steps.append(step)
        if step not in (2, 4):
            return False
        self.snapshots[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            return True
        return False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


def sync_through(strategy: str, out: str) -> dict:
    """Train 5 steps with RecordingSync on rank 0 under `strategy`; its snapshots go to OUT.pt."""
    from speedtronic.api import Trainer
    from speedtronic.config import load_config

    sets = [
        "run.max_steps=5",
        "run.seed=3",
        "run.log_every=1",
        "run.eval_every=0",
        "run.device=cpu",
        "model.n_layer=2",
        "model.n_head=2",
        "model.d_model=32",
        "model.dropout=0.0",
        "data.synthetic=true",
        "data.vocab_size=64",
        "data.num_tokens=20000",
        "data.block_size=16",
        "data.micro_batch_size=4",
        "data.target_batch_size=16",
        "precision.mode=fp32",
        "logging.hooks=[]",
        f"distributed.strategy={strategy}",
        f"run.output_dir={os.path.dirname(out)}/runs-{strategy}",
    ]
    recorder = RecordingSync() if dist.get_rank() == 0 else None
    result = Trainer(load_config(None, sets), sync=recorder, progress=False).train()
    if recorder is None:
        return {}
    torch.save(recorder.snapshots, out + ".pt")
    return {
        "shapes": recorder.shapes,
        "asked": recorder.asked,
        "steps": recorder.steps,
        "final_loss": result.final_loss,
        "val_loss": result.val_loss,
    }


SCENARIOS = {"muon_equivalence": muon_equivalence, "sync_through": sync_through}


if __name__ == "__main__":
    name, out, *extra = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = SCENARIOS[name](*extra, out) if extra else SCENARIOS[name]()
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        if dist.is_initialized():  # a Trainer tears the group down itself at the end of train()
            dist.barrier()  # both ranks done before either tears the group down (gloo aborts otherwise)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without interpreter finalization, as `speedtronic` does under torchrun (cli/__init__.py):
    # gloo threads still holding tensors then can abort a finished process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
