"""bench/scale.py: a CI-sized run (2 and 3 workers on the loopback S3 server, a minute each) and its fit.

Asserted of the run: every delta id sent is applied exactly once (none lost, none twice), the server
counted the master's and each worker's requests under their own access keys (the master's per round
are list, get and put requests: not zero, and spent on polling mostly), the master's CPU per round was
read, and the check of the simulator was printed. The pure fit is checked on made-up rows: a master
whose CPU grows with N becomes the round's bottleneck where a + b·N passes the measured round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import bench_env

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_scale_ci_size_counts_requests_and_keeps_every_delta_exactly_once(tmp_path: Path) -> None:
    env = bench_env()
    args = ["--nodes", "2,3", "--minutes", "1", "--step-s", "0.3", "--inner-steps", "5"]
    done = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), *args, "--json", "--out", str(tmp_path / "scale")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = result["sizes"]
    assert [r["nodes"] for r in rows] == [2, 3], rows
    for row in rows:
        listed = {k: row[k] for k in ("deltas_sent", "deltas_applied", "lost_ids", "applied_twice_ids")}
        assert row["deltas_lost"] == 0 and row["deltas_applied_twice"] == 0, listed
        assert (
            row["deltas_sent"] > 0 and row["deltas_applied"] + row["deltas_left_on_bus"] >= row["deltas_sent"]
        ), listed
        assert row["steady_outer_steps"] >= 1, row
        methods = row["master_requests_by_method_per_round"]
        assert methods.get("GET", 0) > 0 and methods.get("PUT", 0) > 0, row  # polls, deltas read; globals put
        touched = row["master_requests_by_target_per_round"]  # the same requests, by what they touched
        assert touched.get("LIST deltas", 0) > 0 and touched.get("PUT head.json", 0) > 0, touched
        assert sum(touched.values()) == pytest.approx(sum(methods.values()), abs=0.1), (touched, methods)
        assert row["worker_requests_by_target_per_round"].get("PUT deltas", 0) > 0, row
        assert row["worker_requests_per_round"] > 0 and row["master_cpu_s_per_round"] > 0, row
    check = result["simulator_check"]
    assert set(check["goodput_at"]) == {"8", "32", "128", "1000"}, check
    assert json.loads((tmp_path / "scale" / "scale.json").read_text())["sizes"] == rows


def test_the_fit_finds_where_the_master_becomes_the_bottleneck() -> None:
    sys.path.insert(0, str(BENCH))
    from scale import TABLE_GOODPUT, fit

    rows = [{"nodes": n, "round_s": 4.0, "master_cpu_s_per_round": 0.1 + 0.01 * n} for n in (4, 8, 16, 32)]
    check = fit(rows)
    assert check["master_cpu_s_per_round"] == {"a": 0.1, "b_per_node": 0.01}
    assert check["master_bound_from_nodes"] == pytest.approx(390.0)  # 0.1 + 0.01·N = 4.0
    assert check["goodput_at"]["128"]["goodput"] == TABLE_GOODPUT  # 1.38 s < 4 s: not the bottleneck
    assert check["goodput_at"]["1000"]["master_s_per_round"] == pytest.approx(10.1)
    assert check["goodput_at"]["1000"]["goodput"] == pytest.approx(round(TABLE_GOODPUT * 4.0 / 10.1, 4))
    flat = fit([{"nodes": n, "round_s": 4.0, "master_cpu_s_per_round": 0.2} for n in (4, 8)])
    assert flat["master_bound_from_nodes"] is None and flat["goodput_at"]["1000"]["goodput"] == TABLE_GOODPUT


def test_the_server_names_what_each_request_touched() -> None:
    sys.path.insert(0, str(BENCH))
    from _servers import request_target

    def target(method: str, path: str, query: str = "") -> str:
        return request_target({"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query})

    assert target("GET", "/chaos", "list-type=2&prefix=run%2Fdeltas%2Fw0%2F") == "LIST deltas"
    assert target("GET", "/chaos", "prefix=run/leases/") == "LIST leases"  # ListObjects (v1)
    assert target("GET", "/chaos", "list-type=2&prefix=run%2F") == "LIST (run)"
    assert target("GET", "/chaos/run/deltas/w0/w0--00000001.safetensors") == "GET deltas"
    assert target("PUT", "/chaos/run/head.json") == "PUT head.json"
    assert target("HEAD", "/chaos/run/globals/g.safetensors") == "HEAD globals"
    assert target("POST", "/chaos", "delete") == "POST delete"


def test_the_figures_are_the_active_masters_even_after_a_takeover() -> None:
    """At 32 nodes on 2 cores the first master stopped idle before the first delta and the standby ran
    every round: the figures follow whichever master spent the requests, and its CPU counts every life
    of its slot ("mb", then "mb.2" restarted; one started after the first mark counts from 0)."""
    sys.path.insert(0, str(BENCH))
    from scale import Steady, cpu_spent

    assert cpu_spent({"mb": 2.0}, {"mb": 12.0, "mb.2": 3.0, "ma": 50.0}, "mb") == 13.0
    steady = Steady.__new__(Steady)
    steady.marks = [
        {"t": 0.0, "step": 1, "requests": {"ma": {"GET": 5}, "mb": {"GET": 1}, "w0": {"PUT": 1}},
         "targets": {}, "cpu": {"ma": 4.0, "mb": 1.0}},
        {"t": 60.0, "step": 11, "requests": {"ma": {"GET": 6}, "mb": {"GET": 401, "PUT": 20}, "w0": {"PUT": 121}},
         "targets": {}, "cpu": {"ma": 4.0, "mb": 21.0}},
    ]  # fmt: skip
    figures = steady.figures(["w0"])
    assert figures["active_master"] == "mb"
    assert figures["master_requests_per_round"] == 42.0 and figures["standby_requests_per_round"] == 0.1
    assert figures["master_cpu_s_per_round"] == 2.0 and figures["worker_requests_per_round"] == 12.0
