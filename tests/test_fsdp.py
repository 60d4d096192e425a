"""FSDP2 (`distributed.strategy: fsdp`) on two gloo ranks on CPU: Muon that is right when sharded,
loss curves equal to DDP's, a smaller per-rank state, and sharded (DCP) checkpoints that resume on
another number of ranks and read back in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_ddp import env

WORKERS = Path(__file__).with_name("fsdp_workers.py")


def torchrun_script(name: str, out: Path, *extra: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(WORKERS), name, str(out), *extra]
    result = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sharded_muon_is_the_unsharded_muon(tmp_path: Path) -> None:
    diffs = torchrun_script("muon_equivalence", tmp_path / "muon.json")
    for variant in ("plain", "no_nesterov", "cautious", "muon_plus", "polar_express"):
        assert diffs[variant] <= 1e-6, (variant, diffs)  # each matrix on its owner rank
        assert diffs[f"{variant}/gather"] <= 1e-6, (variant, diffs)  # gathered on every rank
    # Newton–Schulz on each rank's rows alone is another update altogether (here ~75% of its size),
    # and torch.optim.Muon on the shards is wrong as well.
    assert diffs["shard_local_newton_schulz"] > 1e-3, diffs
    assert diffs["torch_muon_shard_local"] > 1e-4, diffs
    assert diffs["update_scale"] > 1e-3  # the steps did move the weights


@pytest.mark.slow
def test_a_sync_on_an_fsdp_node_sees_and_installs_whole_weights(tmp_path: Path) -> None:
    """DiLoCo on an FSDP node: the sync on rank 0 is handed whole weights (rank 0's mirror, gathered
    at the steps it asks for) and what it installs reaches every rank's shards — the same weights, at
    the same steps, as on a DDP node with the same seed and batches."""

    runs = {s: torchrun_script("sync_through", tmp_path / f"{s}.json", s) for s in ("ddp", "fsdp")}
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert fsdp["shapes"] == ddp["shapes"]  # whole parameters, not shards
    assert fsdp["asked"] == [1, 2, 3, 4, 5] and fsdp["steps"] == ddp["steps"] == [1, 2, 3, 4, 5]
    seen = {s: torch.load(tmp_path / f"{s}.json.pt") for s in runs}
    assert sorted(seen["fsdp"]) == sorted(seen["ddp"]) == [2, 4]
    for step in (2, 4):  # step 4 holds only if the install at step 2 reached both ranks' shards
        for name, weight in seen["ddp"][step].items():
            torch.testing.assert_close(seen["fsdp"][step][name], weight, rtol=1e-5, atol=1e-6)
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)


def test_sharded_muon_owners_spread_the_work_and_chunks_follow_torch_chunk() -> None:
    from speedtronic.optim.sharded_muon import chunk_rows, owners

    shapes = [(96, 64), (97, 48), (40, 72), (96, 64), (8, 8)]
    assigned = owners(shapes, 2)
    assert assigned == owners(list(shapes), 2)  # the same on every rank
    load = [sum(r * c for (r, c), o in zip(shapes, assigned, strict=True) if o == rank) for rank in (0, 1)]
    assert abs(load[0] - load[1]) <= 96 * 64  # no rank does much more than another
    assert owners(shapes, 1) == [0] * 5
    # rank k holds rows [k·c, min((k+1)·c, rows)): the padded chunks end to end hold the matrix
    for rows, world in [(97, 2), (5, 4), (3, 8), (64, 3)]:
        c = chunk_rows(rows, world)
        held = [len(chunk) for chunk in torch.arange(rows).chunk(world)]
        held += [0] * (world - len(held))
        assert held == [max(0, min(c, rows - k * c)) for k in range(world)], (rows, world)


CONFIG = """
run: {name: fsdp, max_steps: 6, log_every: 1, eval_every: 3, seed: 3}
model: {n_layer: 2, n_head: 2, d_model: 32, dropout: 0.0}
data: {synthetic: true, vocab_size: 64, num_tokens: 40000, block_size: 16, micro_batch_size: 4,
       target_batch_size: 16, val_batches: 3}
precision: {mode: fp32}
optimizer: {name: OPTIMIZER, lr: 3.0e-3}
checkpoint: {every_steps: 3}
logging: {hooks: [jsonl]}
distributed: {strategy: STRATEGY}
"""


def make_run(tmp_path: Path, name: str, strategy: str, optimizer: str = "muon") -> Path:
    cwd = tmp_path / name
    cwd.mkdir()
    text = CONFIG.replace("STRATEGY", strategy).replace("OPTIMIZER", optimizer)
    (cwd / "run.yaml").write_text(text)
    return cwd


def train(cwd: Path, *extra: str, ranks: int = 2) -> dict:
    args = ["-m", "speedtronic", "train", str(cwd / "run.yaml"), "--json", *extra]
    if ranks > 1:
        args += ["--nproc", str(ranks)]
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, result.stdout  # only rank 0 reports
    return json.loads(reports[0])


def step_losses(cwd: Path) -> dict[int, float]:
    lines = (cwd / "runs" / "fsdp" / "metrics.jsonl").read_text().splitlines()
    return {e["step"]: e["loss"] for e in map(json.loads, lines) if e["event"] == "step"}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_matches_ddp_and_holds_less(tmp_path: Path, optimizer: str) -> None:
    ddp = make_run(tmp_path, "ddp", "ddp", optimizer)
    fsdp = make_run(tmp_path, "fsdp", "fsdp", optimizer)
    # With AdamW the fsdp run also recomputes activations: checkpointing composes with sharding.
    extra = ["--set", "gradient_checkpointing=true"] if optimizer == "adamw" else []
    a, b = train(ddp), train(fsdp, *extra)
    assert b["plan"]["gradient_checkpointing"] is (optimizer == "adamw")
    assert a["strategy"] == "ddp" and b["strategy"] == "fsdp"
    losses_ddp, losses_fsdp = step_losses(ddp), step_losses(fsdp)
    assert sorted(losses_ddp) == sorted(losses_fsdp) == list(range(1, 7))
    for step in losses_ddp:  # the same global batches; only reduction order differs
        assert losses_fsdp[step] == pytest.approx(losses_ddp[step], rel=1e-5), step
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    # Parameters, gradients and optimizer state held by rank 0: about half under fsdp on 2 ranks.
    assert b["rank0_state_bytes"] <= 0.6 * a["rank0_state_bytes"], (a["state_bytes"], b["state_bytes"])
    assert b["state_bytes"]["optimizer"] > 0 and b["peak_memory_bytes"] > 0


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_one_rank_and_reads_back(tmp_path: Path) -> None:
    whole = make_run(tmp_path, "whole", "fsdp")
    train(whole)
    moved = make_run(tmp_path, "moved", "fsdp")
    half = train(moved, "--max-steps", "3")
    assert half["steps"] == 3 and half["checkpoint"].endswith("step_00000003.dcp")
    shards = sorted(p.name for p in Path(moved / half["checkpoint"]).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "run.pt"]  # every rank wrote
    rest = train(moved, ranks=1)  # 2 → 1: the shards are resharded onto one process
    assert rest["resumed_from"] and rest["steps"] == 6
    want, got = step_losses(whole), step_losses(moved)
    for step in range(4, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step

    # One process reads a sharded checkpoint through load_run: inspect, sample, export.
    from speedtronic.engine.checkpoint.load_run import inspect, load_run

    summary = inspect(moved / half["checkpoint"])
    assert summary["sharded"] and summary["step"] == 3
    assert summary["parameter_count"] == rest["parameters"]
    loaded = load_run(moved / half["checkpoint"])
    assert loaded.checkpoint.sharded is not None and loaded.model is not None
    # The consolidated weights are the run's: the 1-rank resume started from them, and the tie held.
    assert loaded.model.lm_head.weight is loaded.model.tok_emb.weight

    transformers = pytest.importorskip("transformers")

    from speedtronic.interop.hf_export import export_hf

    export_hf(moved / half["checkpoint"], tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (loaded.model(ids)["logits"] - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.slow
def test_one_process_checkpoints_resume_sharded_on_two_ranks(tmp_path: Path) -> None:
    """1 → 2: a one-process fsdp run writes the same sharded layout, and a whole (ddp) checkpoint
    is sharded on load; both continue the 2-rank curve."""
    whole = make_run(tmp_path, "whole", "fsdp")
    train(whole)
    want = step_losses(whole)
    for name, strategy in (("from_fsdp", "fsdp"), ("from_ddp", "ddp")):
        run = make_run(tmp_path, name, strategy)
        first = train(run, "--max-steps", "3", ranks=1)
        assert first["checkpoint"].endswith(".dcp" if strategy == "fsdp" else ".pt")
        (run / "run.yaml").write_text(
            (run / "run.yaml").read_text().replace("strategy: ddp", "strategy: fsdp")
        )
        rest = train(run)
        assert rest["resumed_from"] and rest["steps"] == 6 and rest["strategy"] == "fsdp"
        got = step_losses(run)
        for step in range(4, 7):  # one process summed 4 micro-batches where two ranks sum 2 each
            assert got[step] == pytest.approx(want[step], rel=1e-4), (name, step)


def test_memory_plan_shards_state_but_not_activations() -> None:
    from speedtronic.config import load_config
    from speedtronic.engine.preflight.memory_plan import memory_plan

    config = load_config(
        {
            "model": {"n_layer": 4, "n_head": 4, "d_model": 128},
            "data": {"synthetic": True, "vocab_size": 256, "block_size": 64, "micro_batch_size": 4},
            "optimizer": {"name": "muon"},
            "precision": {"mode": "fp32"},
        }
    )
    plan = memory_plan(config, nproc=4)
    ddp, fsdp = plan["strategies"]["ddp"], plan["strategies"]["fsdp"]
    assert ddp["params"] == plan["parameters"] * 4 and fsdp["params"] == ddp["params"] // 4
    assert fsdp["optimizer"] == ddp["optimizer"] // 4 and ddp["optimizer"] > ddp["params"]  # muon + adamw
    assert fsdp["activations"] == ddp["activations"] > 0 and ddp["gathered"] == 0 < fsdp["gathered"]
    assert fsdp["state"] < 0.3 * ddp["state"]
    one = memory_plan(config, nproc=1)["strategies"]
    assert one["fsdp"]["state"] == one["ddp"]["state"]


def test_fsdp_units_default_to_the_block_list_and_a_model_can_name_its_own() -> None:
    from torch import nn

    from speedtronic.engine.parallel.fsdp import fsdp_units

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2)])
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            self.head = nn.Linear(8, 2)

    model = Blocks()
    assert fsdp_units(model) == list(model.layers)

    class Chosen(Blocks):
        def fsdp_units(self) -> list[nn.Module]:
            return [self.head]

    chosen = Chosen()
    assert fsdp_units(chosen) == [chosen.head]
    assert fsdp_units(nn.Linear(2, 2)) == []
