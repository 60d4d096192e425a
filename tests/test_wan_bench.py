"""bench/wan.py and its --simulate model: the command line, the refusal without root/tc, and the
calibrated model on a synthetic measurement (no link is shaped here and nothing is timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import wan_model  # noqa: E402


def run_bench(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "wan.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_help_names_the_link_options_and_the_json_keys() -> None:
    done = run_bench("--help")
    assert done.returncode == 0, done.stderr
    for word in ("--mbit", "--workers", "--simulate", "--json", "tbf", "netem"):
        assert word in done.stdout, word


def test_without_root_or_tc_it_says_so_and_exits_2() -> None:
    done = run_bench("--mbit", "10", SPEEDTRONIC_WAN_NO_ROOT="1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "cannot shape a link here" in done.stderr and "root" in done.stderr
    assert done.stdout == ""


C_DDP, DDP_BYTES, EVAL_EVERY = 0.1, 1_000_000, 10  # 0.8 s on the wire at 10 Mbit/s, 0.08 s at 100
ROUND_S, ROUND_BYTES, H = 2.0, 4_000_000, 25  # 3.2 s on the wire at 10 Mbit/s: link-bound there


def synthetic(mbit: float, skew: float = 1.0) -> dict[str, Any]:
    """What bench/wan.py --json would print for a link obeying the model exactly: a DDP step the longer
    of compute and bytes / rate, a DiLoCo round their smooth maximum (`skew` scales the measured times,
    to make a run the model cannot reproduce)."""
    step = max(C_DDP, DDP_BYTES * 8 / (mbit * 1e6)) * skew
    rnd = wan_model.smooth_max(ROUND_S, ROUND_BYTES * 8 / (mbit * 1e6)) * skew
    steps, rounds = 100, 12
    evals = [[5.0 + step * EVAL_EVERY * i, 4.0 - 0.1 * i] for i in range(1, steps // EVAL_EVERY + 1)]
    round_times = [10.0 + rnd * i for i in range(rounds)]
    return {
        "link_mbit": mbit,
        "workers": 4,
        "eval_every": EVAL_EVERY,
        "arms": {
            "ddp": {"steps": steps, "link_bytes": DDP_BYTES * steps, "val_losses": evals},
            "diloco": {
                "rounds": rounds,
                "inner_steps": H,
                "round_times_s": round_times,
                "link_bytes": ROUND_BYTES * rounds,
                "s_to_target": round_times[7],  # reached at round 8: 200 worker steps for DDP's 100
            },
        },
    }


def write(tmp_path: Path, runs: list[dict[str, Any]]) -> list[str]:
    paths = []
    for i, run in enumerate(runs):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run))
        paths.append(str(path))
    return paths


def test_the_model_recovers_the_constants_and_passes_its_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write(tmp_path, [synthetic(10), synthetic(30), synthetic(100)])
    model = wan_model.Model.fit([wan_model.read(p) for p in paths])
    assert model.c_ddp == pytest.approx(C_DDP) and model.b_ddp == pytest.approx(DDP_BYTES)
    assert model.r_comp == pytest.approx(ROUND_S) and model.b_round == pytest.approx(ROUND_BYTES)
    assert model.efficiency == pytest.approx(100 / (8 * H))
    assert wan_model.main(paths) == 0
    out = capsys.readouterr().out
    assert "OFF BY" not in out and "IN-SAMPLE" not in out
    assert "nodes" in out and "1000" in out and "10 Gbit/s" in out
    # The model's own shape: DDP's goodput falls as the ring grows on a slow link; DiLoCo's does not.
    g8, _ = wan_model.goodput_ddp(model, 8, 10.0, 0.0)
    g1000, _ = wan_model.goodput_ddp(model, 1000, 10.0, 0.0)
    d10, _ = wan_model.goodput_diloco(model, 10.0, 0.0)
    assert g1000 < g8 < d10
    # Failures cost DDP more than DiLoCo (everyone stops vs one node's round).
    assert (
        wan_model.goodput_ddp(model, 128, 1000.0, 1.0)[0] < wan_model.goodput_ddp(model, 128, 1000.0, 0.0)[0]
    )
    assert wan_model.goodput_diloco(model, 1000.0, 1.0)[0] > wan_model.goodput_ddp(model, 128, 1000.0, 1.0)[0]


def test_a_run_the_model_cannot_reproduce_fails_the_check_and_prints_no_extrapolation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The 10 Mbit/s run took 30% longer than its bytes allow: a link term the model does not have.
    paths = write(tmp_path, [synthetic(10, skew=1.3), synthetic(100)])
    assert wan_model.main(paths) == 1
    out = capsys.readouterr().out
    assert "OFF BY MORE THAN 15%" in out and "no extrapolation printed" in out and "nodes" not in out


def test_one_link_rate_is_a_fit_not_a_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert wan_model.main(write(tmp_path, [synthetic(30)])) == 0
    assert "IN-SAMPLE" in capsys.readouterr().out


def test_plot_draws_the_extrapolation_only_when_the_check_passes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    good = write(tmp_path, [synthetic(10), synthetic(30), synthetic(100)])
    figure = tmp_path / "goodput.png"
    done = run_bench("--simulate", *good, "--plot", str(figure))
    assert done.returncode == 0, done.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {figure}" in done.stdout
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    refused = bad_dir / "goodput.png"
    bad = write(bad_dir, [synthetic(10, skew=1.3), synthetic(100)])
    assert run_bench("--simulate", *bad, "--plot", str(refused)).returncode == 1
    assert not refused.exists()  # a model that fails its check is not drawn either


RESULTS = BENCH / "results"


@pytest.mark.parametrize("runs", ["poll", "mu08-all", "overlap1", "amd"])
def test_the_model_reproduces_the_measured_runs_of_both_machines(
    runs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The committed WAN runs with the shipped overlap (a 2-core Xeon: poll, mu08-all, overlap1; a 2-core
    AMD EPYC: amd) pass the check. The AMD's 10 Mbit/s round (compute 1.59 s, link 1.57 s, measured
    1.96 s) is why the round is a smooth maximum: the plain max predicted 1.60 s."""
    paths = [str(RESULTS / f"wan-{mbit}-{runs}.json") for mbit in (10, 30, 100)]
    assert wan_model.main(paths) == 0, capsys.readouterr().out
    if runs == "amd":
        # The plain model, fitted its own way (compute = the measured round where the link did not limit).
        runs_read = [wan_model.read(p) for p in paths]
        points = [(r.round_s, wan_model.link_s(r.round_bytes, r.mbit), r.mbit) for r in runs_read]
        plain_compute = wan_model.compute_term(points)  # type: ignore[arg-type]
        slow = runs_read[0]
        plain_max = max(plain_compute, wan_model.link_s(slow.round_bytes, slow.mbit))  # type: ignore[arg-type]
        assert not wan_model.ok(slow.round_s, plain_max), (slow.round_s, plain_max)  # type: ignore[arg-type]


def test_steady_state_figures_leave_out_start_up_and_agree_with_the_times_from_start() -> None:
    import wan

    results = {
        "ddp": {"first_step_seen": [4.0, 1], "s_to_target": 30.0},
        "diloco": {"first_step_seen": [11.0, 1], "s_to_target": 19.0},
        "single": {"first_step_seen": [3.0, 1], "s_to_target": None},
    }
    got = wan.steady_figures(results)
    assert got["ddp_steady_s_to_target"] == pytest.approx(26.0)
    assert got["diloco_steady_s_to_target"] == pytest.approx(8.0)
    assert got["ddp_startup_s"] == 4.0 and got["diloco_startup_s"] == 11.0
    assert got["diloco_startup_fraction"] == pytest.approx(11.0 / 19.0)
    assert got["single_steady_s_to_target"] is None and got["streaming_startup_s"] is None
    for arm in ("ddp", "diloco"):
        assert 0.0 <= got[f"{arm}_steady_s_to_target"] <= results[arm]["s_to_target"]
        assert got[f"{arm}_startup_s"] >= 0.0


@pytest.mark.parametrize(
    "name", ["wan-30-steady.json", "wan-10-1500.json", "wan-30-1500.json", "wan-100-1500.json"]
)
def test_a_stored_run_has_the_steady_keys_consistent_with_the_times_from_start(name: str) -> None:
    path = BENCH / "results" / name
    if not path.exists():
        pytest.skip(f"{name} not measured yet")
    run = json.loads(path.read_text())
    for arm in ("ddp", "diloco"):
        steady, total, startup = (
            run[f"{arm}_steady_s_to_target"],
            run[f"{arm}_s_to_target"],
            run[f"{arm}_startup_s"],
        )
        assert startup >= 0.0 and 0.0 <= steady <= total
        assert steady == pytest.approx(total - startup, abs=1e-6)
    assert run["diloco_startup_fraction"] == pytest.approx(
        run["diloco_startup_s"] / run["diloco_s_to_target"]
    )
    # The simulator reads the same file: its round and step times are steady-state figures already.
    measured = wan_model.read(path)
    assert measured.mbit == run["link_mbit"]


def test_the_simulator_sets_its_time_to_target_beside_both_measured_times(tmp_path: Path) -> None:
    runs = [synthetic(10), synthetic(100)]
    for run in runs:  # DDP's 100 steps and DiLoCo's 8 rounds from the first step, 3 s and 5 s of start-up
        run.update(ddp_startup_s=3.0, diloco_startup_s=5.0)
        step = wan_model.Model.fit(
            [wan_model.read(p) for p in write(tmp_path, [synthetic(10), synthetic(100)])]
        )
        run["ddp_steady_s_to_target"] = 100 * step.shared_ddp_step(run["link_mbit"])
        run["diloco_steady_s_to_target"] = 8 * step.shared_round(run["link_mbit"])
    measured = [wan_model.read(p) for p in write(tmp_path, runs)]
    model = wan_model.Model.fit(measured)
    rows = wan_model.to_target(model, measured[0])
    assert [r[0].split(",")[0] for r in rows] == ["DDP s to target"] * 2 + ["DiLoCo s to target"] * 2
    assert all(good for *_, good in rows)
    steady, start = rows[2], rows[3]
    assert start[1] == pytest.approx(steady[1] + 5.0) and start[2] == pytest.approx(steady[2] + 5.0)
    # An older run without the keys: no rows, and the check itself is unchanged.
    assert wan_model.to_target(model, wan_model.read(write(tmp_path, [synthetic(30)])[0])) == []
