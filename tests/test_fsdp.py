"""FSDP2 (`distributed.strategy: fsdp`) on two gloo ranks on CPU: Muon that is right when sharded,
loss curves equal to DDP's, a smaller per-rank state, and sharded (DCP) checkpoints that resume on
another number of ranks and read back in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_ddp import env

WORKERS = Path(__file__).with_name("fsdp_workers.py")


def torchrun_script(name: str, out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(WORKERS), name, str(out)]
    result = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sharded_muon_is_the_unsharded_muon(tmp_path: Path) -> None:
    diffs = torchrun_script("muon_equivalence", tmp_path / "muon.json")
    for variant in ("plain", "no_nesterov", "cautious", "muon_plus", "polar_express"):
        assert diffs[variant] <= 1e-6, (variant, diffs)
    # Newton–Schulz on each rank's rows alone is another update altogether (here ~75% of its size),
    # and torch.optim.Muon on the shards is wrong as well.
    assert diffs["shard_local_newton_schulz"] > 1e-3, diffs
    assert diffs["torch_muon_shard_local"] > 1e-4, diffs
    assert diffs["update_scale"] > 1e-3  # the steps did move the weights
