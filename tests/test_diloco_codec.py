"""The DiLoCo wire format and outer optimizer: codecs, validation, tied weights, error feedback, Nesterov."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.manifest import build_manifest, check_manifest
from speedtronic.diloco.master.norms import norm_outliers
from speedtronic.diloco.outer import (
    OuterOptimizer,
    is_sync_step,
    momentum_at,
    planned_outer,
    staleness_weight,
    sync_steps,
    weighted_mean,
)
from speedtronic.engine.build import build_model
from speedtronic.errors import SpeedtronicError

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "data.block_size=16"]


def tiny_model(*extra: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(load_config(None, [*TINY, *extra]), 256)


def delta_like(model: torch.nn.Module, scale: float = 1e-3, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=g) * scale for n, s in codec.param_specs(model).items()}


META = {
    "kind": "delta",
    "node": "w1",
    "seq": "0",
    "local_step": "10",
    "base_outer_step": "0",
    "tokens": "640",
}


def test_tied_weights_travel_once_and_safetensors_accepts_them() -> None:
    model = tiny_model()
    assert model.lm_head.weight is model.tok_emb.weight
    names = list(codec.unique_params(model))
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    data = codec.encode(codec.snapshot(model), "fp32", {"kind": "global", "outer_step": "0"})
    decoded = codec.decode(data, codec.param_specs(model), kind="global")
    assert torch.equal(decoded.tensors["tok_emb.weight"], model.tok_emb.weight.detach())


@pytest.mark.parametrize(
    ("wire", "tolerance"), [("fp32", 0.0), ("bf16", 4e-3), ("int8", 1e-2), ("int4", 0.08)]
)
def test_codecs_roundtrip_with_metadata(wire: str, tolerance: float) -> None:
    model = tiny_model()
    delta = delta_like(model)
    decoded = codec.decode(codec.encode(delta, wire, META), codec.param_specs(model), kind="delta")
    assert decoded.meta["codec"] == wire and decoded.meta["node"] == "w1" and decoded.int("tokens") == 640
    assert decoded.meta["base_outer_step"] == "0" and decoded.meta["local_step"] == "10"
    assert decoded.meta["checksum"].startswith("sha256:")
    for name, t in delta.items():
        err = (decoded.tensors[name] - t).abs().max().item()
        assert err <= tolerance * t.abs().max().item() + 1e-12, (name, err)


def test_int8_is_about_four_times_smaller_than_fp32() -> None:
    model = tiny_model()
    delta = delta_like(model)
    fp32, bf16, int8, int4 = (len(codec.encode(delta, w, META)) for w in codec.CODECS)
    assert 1.9 < fp32 / bf16 < 2.1
    assert 3.2 < fp32 / int8 < 4.0
    assert 5.5 < fp32 / int4 < 7.2


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_error_feedback_delivers_the_sum_of_deltas(wire: str) -> None:
    model = tiny_model()
    true_sum = {n: torch.zeros(s.shape) for n, s in codec.param_specs(model).items()}
    received_sum = {n: torch.zeros_like(t) for n, t in true_sum.items()}
    residual = {n: torch.zeros_like(t) for n, t in true_sum.items()}
    no_feedback_sum = {n: torch.zeros_like(t) for n, t in true_sum.items()}
    for seed in range(30):
        delta = delta_like(model, seed=seed)
        y = {n: delta[n] + residual[n] for n in delta}
        received = codec.roundtrip(y, wire)
        residual = {n: y[n] - received[n] for n in y}
        plain = codec.roundtrip(delta, wire)
        for n in delta:
            true_sum[n] += delta[n]
            received_sum[n] += received[n]
            no_feedback_sum[n] += plain[n]
    # With feedback the error stays one rounding step; without it, it grows with the number of rounds.
    with_fb = max((received_sum[n] - true_sum[n]).abs().max().item() for n in true_sum)
    without = max((no_feedback_sum[n] - true_sum[n]).abs().max().item() for n in true_sum)
    assert with_fb < without / 2


def _corrupt_variants(model: torch.nn.Module) -> dict[str, bytes]:
    specs = codec.param_specs(model)
    good = codec.encode(delta_like(model), "int8", META)
    nan = delta_like(model)
    first = next(iter(nan))
    nan[first][0] = float("nan")
    wrong_shape = delta_like(tiny_model("model.d_model=64"))
    header_len = int.from_bytes(good[:8], "little")
    flipped = bytearray(good)
    flipped[8 + header_len + 5] ^= 0xFF  # one payload byte: the checksum catches it
    assert specs
    return {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x00" * 3 + b"not safetensors at all" * 10,
        "checksum": bytes(flipped),
        "nan": codec.encode(nan, "fp32", META),
        "shape": codec.encode(wrong_shape, "fp32", META),
        "pickle": pickle.dumps({"x": 1}),
    }


@pytest.mark.parametrize("variant", ["truncated", "garbage", "checksum", "nan", "shape", "pickle"])
def test_bad_files_are_rejected_with_a_reason(variant: str) -> None:
    model = tiny_model()
    data = _corrupt_variants(model)[variant]
    with pytest.raises(codec.Rejected) as info:
        codec.decode(data, codec.param_specs(model), kind="delta")
    expected = {
        "truncated": "not a valid safetensors file|truncated",
        "garbage": "not a valid safetensors file|truncated",
        "checksum": "checksum mismatch",
        "nan": "non-finite values in",
        "shape": "has shape",
        "pickle": "not a valid safetensors file|truncated",
    }[variant]
    assert re.search(expected, str(info.value)), str(info.value)


def test_size_limit_and_kind_are_enforced() -> None:
    model = tiny_model()
    data = codec.encode(delta_like(model), "fp32", META)
    with pytest.raises(codec.Rejected, match="size limit"):
        codec.decode(data, codec.param_specs(model), kind="delta", max_bytes=len(data) - 1)
    with pytest.raises(codec.Rejected, match="kind"):
        codec.decode(data, codec.param_specs(model), kind="global")


@pytest.mark.parametrize(
    "name",
    [
        "../w1--00000001.safetensors",
        "w1/../../x",
        "w1--1.safetensors",
        "w1--00000001.pt",
        ".hidden",
        "a b--00000001.safetensors",
    ],
)
def test_file_names_must_be_plain_delta_names(name: str) -> None:
    with pytest.raises(codec.Rejected, match="bad file name"):
        codec.parse_delta_name(name)
    assert codec.parse_delta_name("w-1.a_b--00000042.safetensors") == ("w-1.a_b", 42)


def test_fingerprint_mismatch_is_refused_with_the_first_difference() -> None:
    cfg = load_config(None, TINY)
    manifest = build_manifest(cfg, codec.param_specs(tiny_model()))
    check_manifest(manifest, codec.param_specs(tiny_model()), "file://run")
    with pytest.raises(
        SpeedtronicError,
        match=r"does not match the run.s model fingerprint \(blocks.0.attn.k_proj.weight is \[64, 64\] float32 here but \[32, 32\]",
    ):
        check_manifest(manifest, codec.param_specs(tiny_model("model.d_model=64")), "file://run")


def test_nesterov_outer_step_matches_torch_sgd_and_averaging_is_lr1_mu0() -> None:
    torch.manual_seed(0)
    w0 = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    deltas = [{n: torch.randn_like(t) for n, t in w0.items()} for _ in range(3)]
    outer = OuterOptimizer(w0, lr=0.7, momentum=0.9)
    params = [torch.nn.Parameter(t.clone()) for t in w0.values()]
    sgd = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for d in deltas:
        outer.step(d)
        for p, g in zip(params, d.values(), strict=True):
            p.grad = g.clone()
        sgd.step()
    for p, t in zip(params, outer.weights.values(), strict=True):
        assert torch.allclose(p.detach(), t, atol=1e-6)
    # plain averaging: θ_new = mean of the workers' θ = θ − mean(Δ)
    avg = OuterOptimizer(w0, lr=1.0, momentum=0.0)
    workers = [{n: w0[n] - d[n] for n in w0} for d in deltas]
    avg.step(weighted_mean((d, 1.0) for d in deltas))
    for n in w0:
        assert torch.allclose(avg.weights[n], sum(w[n] for w in workers) / 3, atol=1e-6)


def test_outer_momentum_warmup_follows_the_round_not_the_process() -> None:
    """Round r uses momentum 0.9·min(1, (r+1)/warmup), equal to torch's Nesterov SGD with that
    momentum; a master restarted at round 2 (state reloaded) continues exactly (the round is passed in)."""
    torch.manual_seed(1)
    w0 = {"a": torch.randn(4, 3)}
    deltas = [{"a": torch.randn(4, 3)} for _ in range(4)]
    warm = OuterOptimizer(w0, lr=0.7, momentum=0.9, warmup=4)
    param = torch.nn.Parameter(w0["a"].clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for r, d in enumerate(deltas):
        warm.step(d, r)
        sgd.param_groups[0]["momentum"] = momentum_at(0.9, 4, r)
        param.grad = d["a"].clone()
        sgd.step()
        assert torch.allclose(warm.weights["a"], param.detach(), atol=1e-6), r
    restarted = OuterOptimizer(w0, lr=0.7, momentum=0.9, warmup=4)
    for r, d in enumerate(deltas[:2]):
        restarted.step(d, r)
    resumed = OuterOptimizer(restarted.weights, lr=0.7, momentum=0.9, warmup=4)  # a new process
    resumed.momentum_buffers = {n: t.clone() for n, t in restarted.momentum_buffers.items()}
    for r, d in enumerate(deltas[2:], start=2):
        resumed.step(d, r)
    assert torch.allclose(resumed.weights["a"], warm.weights["a"], atol=1e-6)


def test_round_rules() -> None:
    assert staleness_weight(0, 4) == 1.0 and staleness_weight(2, 4) == pytest.approx(1 / 3)
    assert staleness_weight(5, 4) is None
    history = [["a", 1.1], ["b", 0.9], ["c", 1.0]]
    assert set(norm_outliers(history, {"x": ("a", 1.0), "p": ("p", 100.0)}, 10, 100.0, 1e-3)) == {"p"}
    assert norm_outliers([], {"x": ("a", 1.0), "y": ("b", 1.3)}, 10, 100.0, 1e-3) == {}
    # One node has one vote however much of the history it fills; the floor keeps tiny ones harmless.
    tiny = [["t", 1e-6]] * 50
    assert norm_outliers(tiny, {"x": ("a", 1.0)}, 10, 100.0, 1e-2) == {}
    assert planned_outer(0.5, 0.3, 3) == (0.5, 0.3)
    assert planned_outer(None, None, 1000) == (0.7, 0.8)
    assert planned_outer(None, None, 12) == (0.7, 0.8)
    assert [momentum_at(0.9, 3, r) for r in range(4)] == pytest.approx([0.3, 0.6, 0.9, 0.9])
    assert momentum_at(0.9, 0, 0) == 0.9
    assert sync_steps(60, 25, ramp=False) == [25, 50]
    assert sync_steps(60, 8, ramp=True) == [1, 3, 7, 15, 23, 31, 39, 47, 55]
    assert [s for s in range(1, 61) if is_sync_step(s, 8, True)] == sync_steps(60, 8, True)
    assert [s for s in range(1, 61) if is_sync_step(s, 25, False)] == [25, 50]


def test_int4_roundtrip_is_exact_on_its_grid_and_rejects_bad_payloads() -> None:
    # Values that are multiples of absmax/7 (per 64-value block) survive exactly, odd lengths included.
    x = torch.tensor([7.0, -7.0, 3.0, 0.0, -1.0, 5.0, 2.0]).repeat(10)[:67]
    back = codec.roundtrip({"w": x}, "int4")["w"]
    assert torch.equal(back, x)
    wire = codec.compress({"w": x}, "int4")
    assert wire["w:q4"].dtype == torch.uint8 and wire["w:q4"].numel() == 64  # 2 blocks x 64 / 2
    specs = {"w": codec.ParamSpec((67,), "float32")}
    with pytest.raises(codec.Rejected):
        codec.decompress({"w:q4": wire["w:q4"][:10], "w:scale": wire["w:scale"]}, "int4", specs)
    with pytest.raises(codec.Rejected):
        codec.decompress({"w:q": wire["w:q4"], "w:scale": wire["w:scale"]}, "int4", specs)
    assert codec.wire_bytes(specs, "int4") == 64 + 8
