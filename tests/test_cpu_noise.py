"""What a user sees on a CPU machine (issue 37 item 5): `torch.compile` logs "No CUDA runtime is found,
using CUDA_HOME=..." (torch.utils.cpp_extension) on a CPU machine whose torch is a CUDA build and which
has a CUDA toolkit; `speedtronic` keeps that line out of the terminal (engine/quiet.py) and says what it
meant once, at debug level.

The CPU build of torch that CI installs never logs it (it does not look for a toolkit), so the child
process makes torch's own function log it where it would: a `sitecustomize` on the child's path calls
`torch.utils.cpp_extension._find_cuda_home()` — the real function, with CUDA_HOME pointing at a real
folder and no CUDA runtime — each time `torch.compile` is called. Without the filter the line reaches
stderr (the test's own control run checks that it really is emitted).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import speedtronic

SRC = Path(speedtronic.__file__).resolve().parents[1]
LINE = "No CUDA runtime is found"

CONFIG = """
run: {name: cpu, max_steps: 2, log_every: 1, eval_every: 0}
model: {n_layer: 1, n_head: 2, d_model: 32}
data: {synthetic: true, vocab_size: 256, num_tokens: 20000, block_size: 16, micro_batch_size: 4, val_batches: 1}
checkpoint: {every_steps: 100}
compile: true
logging: {hooks: [], level: LEVEL}
"""

SITECUSTOMIZE = """
import torch
import torch.utils.cpp_extension as cpp_extension

_compile = torch.compile


def compile(*args, **kwargs):
    cpp_extension._find_cuda_home()  # logs the line when a toolkit is found and no CUDA runtime is
    return _compile(*args, **kwargs)


torch.compile = compile
"""


def run(tmp_path: Path, *args: str, level: str = "info") -> subprocess.CompletedProcess[str]:
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "cuda").mkdir(exist_ok=True)  # a CUDA_HOME that exists
    (tmp_path / "run.yaml").write_text(CONFIG.replace("LEVEL", level))
    path = os.pathsep.join([str(tmp_path / "site"), str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "CUDA_HOME": str(tmp_path / "cuda")}
    env.pop("HF_TOKEN", None)
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_cpu_compiled_train_keeps_torchs_cuda_home_line_out_of_stderr(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA runtime is here: torch does not log the line")
    # Control: in this environment torch's function does log the line to stderr.
    control = run(tmp_path, "-c", "import torch; torch.compile(lambda x: x)")
    assert LINE in control.stderr, control.stderr
    result = run(tmp_path, "-m", "speedtronic", "train", "run.yaml", "--json", level="debug")
    assert result.returncode == 0, result.stderr
    assert "torch.compile on (requested)" in result.stderr  # it did compile
    assert LINE not in result.stderr, result.stderr
    # Said once, in our words (debug level: not on the terminal of a run at the default level).
    assert result.stderr.count("no CUDA runtime on this machine") == 1, result.stderr
