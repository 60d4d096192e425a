"""Muon and its parts: Newton–Schulz, agreement with torch.optim.Muon, Muon+, cautious masking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedtronic.optim.cautious import Cautious, CautiousAdamW, cautious_
from speedtronic.optim.muon import Muon, adjusted_lr, normalize_plus, resolve_plus_mode
from speedtronic.optim.newton_schulz import coefficient_schedule, orthogonalize

SHAPES = [(48, 48), (64, 24), (24, 64)]


def params_like(shapes: list[tuple[int, int]], seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def run_steps(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], steps: int, seed: int = 1
) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


# ------------------------------------------------------------------------------------ Newton–Schulz


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("schedule", ["keller", "polar_express"])
def test_newton_schulz_output_is_near_orthogonal(shape: tuple[int, int], schedule: str) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    out = orthogonalize(x, steps=5, schedule=schedule)
    assert out.shape == x.shape and out.dtype == torch.float32
    singular = torch.linalg.svdvals(out)
    # Keller's coefficients aim for ~[0.7, 1.2] rather than exactly 1; Polar Express lands closer.
    low, high = (0.6, 1.25) if schedule == "keller" else (0.8, 1.2)
    assert singular.min() > low and singular.max() < high, singular
    # Same singular vectors as the exact polar factor U·Vᵀ: the product with it is positive definite.
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    polar = u @ vh
    assert torch.nn.functional.cosine_similarity(out.flatten(), polar.flatten(), dim=0) > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_leaves_its_input_untouched(dtype: torch.dtype) -> None:
    x = torch.randn(40, 24).to(dtype)
    before = x.clone()
    orthogonalize(x, dtype=dtype)
    orthogonalize(x.T, dtype=dtype)
    assert torch.equal(x, before)


def test_batched_newton_schulz_equals_one_at_a_time() -> None:
    stack = torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(5))
    batched = orthogonalize(stack)
    for i in range(3):
        torch.testing.assert_close(batched[i], orthogonalize(stack[i]), rtol=1e-5, atol=1e-5)


def test_newton_schulz_of_zero_is_zero_and_bad_input_is_refused() -> None:
    assert torch.equal(orthogonalize(torch.zeros(8, 4)), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.zeros(8))
    with pytest.raises(ValueError, match="three numbers"):
        coefficient_schedule((1.0, 2.0), 5)
    with pytest.raises(ValueError, match="unknown Newton-Schulz schedule"):
        coefficient_schedule("fast", 5)
    # More steps than Polar Express has coefficients repeat its last polynomial.
    assert coefficient_schedule("polar_express", 7)[5:] == [coefficient_schedule("polar_express", 5)[-1]] * 2


# ------------------------------------------------------------------------------ torch.optim.Muon


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_muon_matches_torch_muon(nesterov: bool, adjust: str) -> None:
    ours, theirs = params_like(SHAPES), params_like(SHAPES)
    options = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov, "ns_steps": 5}
    # torch.optim.Muon always iterates in bf16; ask ours for the same to compare like with like.
    run_steps(Muon(ours, **options, adjust_lr=adjust, ns_dtype=torch.bfloat16), ours, 4)
    run_steps(torch.optim.Muon(theirs, **options, adjust_lr_fn=adjust), theirs, 4)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_muon_in_float32_stays_close_to_torch_muon_in_bf16() -> None:
    ours, theirs = params_like(SHAPES), params_like(SHAPES)
    run_steps(Muon(ours, lr=0.02, ns_dtype=torch.float32), ours, 3)
    run_steps(torch.optim.Muon(theirs, lr=0.02), theirs, 3)
    for a, b, start in zip(ours, theirs, params_like(SHAPES), strict=True):
        step_a, step_b = a.detach() - start, b.detach() - start
        assert torch.nn.functional.cosine_similarity(step_a.flatten(), step_b.flatten(), dim=0) > 0.99


def test_batched_muon_equals_the_loop() -> None:
    shapes = [(32, 16)] * 3 + [(16, 16)]
    looped, batched = params_like(shapes), params_like(shapes)
    run_steps(Muon(looped, lr=0.02, batched=False), looped, 3)
    run_steps(Muon(batched, lr=0.02, batched=True), batched, 3)
    for a, b in zip(looped, batched, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_muon_refuses_vectors_and_sparse_gradients() -> None:
    with pytest.raises(ValueError, match="2-D matrices"):
        Muon([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([nn.Parameter(torch.zeros(4, 4))], adjust_lr="sqrt")  # type: ignore[arg-type]
    p = nn.Parameter(torch.zeros(4, 4))
    optimizer = Muon([p])
    p.grad = torch.eye(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()


def test_adjusted_lr_follows_the_two_conventions() -> None:
    assert adjusted_lr(0.1, "original", (64, 16)) == pytest.approx(0.1 * 2)
    assert adjusted_lr(0.1, "original", (16, 64)) == pytest.approx(0.1)
    assert adjusted_lr(0.1, "match_rms_adamw", (16, 64)) == pytest.approx(0.1 * 0.2 * 8)


def test_match_rms_adamw_gives_an_update_rms_near_point_two_times_lr() -> None:
    (p,) = params_like([(64, 256)])
    start = p.detach().clone()
    run_steps(
        Muon([p], lr=1.0, weight_decay=0.0, adjust_lr="match_rms_adamw", ns_schedule="polar_express"), [p], 1
    )
    rms = (p.detach() - start).pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.25


# ---------------------------------------------------------------------------------------------- Muon+


@pytest.mark.parametrize(("mode", "unit_dim"), [("row", -1), ("col", -2), ("col_row", -1), ("row_col", -2)])
def test_muon_plus_gives_unit_rows_or_columns(mode: str, unit_dim: int) -> None:
    update = orthogonalize(torch.randn(24, 40))
    out = normalize_plus(update, mode)
    torch.testing.assert_close(
        torch.linalg.vector_norm(out, dim=unit_dim),
        torch.ones(out.size(unit_dim - 1 if unit_dim == -1 else -1)),
    )
    zero_row = torch.zeros(3, 5)
    zero_row[0] = 1.0
    assert torch.isfinite(normalize_plus(zero_row, mode)).all()


def test_muon_plus_is_applied_in_the_optimizer_step() -> None:
    (p,) = params_like([(32, 48)])
    start = p.detach().clone()
    # fp32 Newton-Schulz: unit norms to fp32 tolerance (auto iterates in bf16 on native-bf16 CPUs).
    muon = Muon([p], lr=1.0, weight_decay=0.0, muon_plus="col", adjust_lr="original", ns_dtype=torch.float32)
    run_steps(muon, [p], 1)
    column_norms = torch.linalg.vector_norm(p.detach() - start, dim=0)
    torch.testing.assert_close(column_norms, torch.ones(48))
    assert resolve_plus_mode(True) == "col" and resolve_plus_mode(False) is None
    with pytest.raises(ValueError, match="muon_plus"):
        resolve_plus_mode("diagonal")


# ------------------------------------------------------------------------------------------- cautious

HOSTILE_GRADS = {
    "zero": torch.zeros(16, 8),
    "huge": torch.full((16, 8), 1e30),
    "tiny": torch.full((16, 8), 1e-30),
    "mixed": torch.randn(16, 8, generator=torch.Generator().manual_seed(9)) * 1e20,
}


def test_cautious_mask_zeroes_disagreeing_entries_and_rescales() -> None:
    update = torch.tensor([1.0, -2.0, 3.0, 4.0])
    grad = torch.tensor([1.0, 1.0, -1.0, 2.0])
    cautious_(update, grad)
    assert update.tolist() == [2.0, 0.0, 0.0, 8.0]  # half the entries agree: scaled by 1 / 0.5
    nothing = torch.tensor([1.0, 2.0])
    cautious_(nothing, torch.tensor([-1.0, -1.0]))
    assert nothing.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("name", sorted(HOSTILE_GRADS))
@pytest.mark.parametrize("kind", ["adamw", "muon", "wrapper"])
def test_cautious_optimizers_stay_finite(name: str, kind: str) -> None:
    (p,) = params_like([(16, 8)])
    if kind == "adamw":
        optimizer: torch.optim.Optimizer = CautiousAdamW([p], lr=1e-3)
    elif kind == "muon":
        optimizer = Muon([p], lr=1e-3, cautious=True)
    else:
        optimizer = Cautious(torch.optim.SGD([p], lr=1e-3, momentum=0.9))
    for _ in range(3):
        p.grad = HOSTILE_GRADS[name].clone()
        optimizer.step()
    assert torch.isfinite(p).all()


def test_cautious_adamw_first_step_equals_adamw() -> None:
    # On the first step Adam's direction is g/(|g|+eps): it always agrees with g, so nothing is masked.
    ours, theirs = params_like([(8, 8), (4, 4)]), params_like([(8, 8), (4, 4)])
    run_steps(CautiousAdamW(ours, lr=1e-2, weight_decay=0.1), ours, 1)
    run_steps(torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1), theirs, 1)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_cautious_adamw_state_loads_into_adamw() -> None:
    ours = params_like([(8, 8)])
    cautious = CautiousAdamW(ours, lr=1e-2)
    run_steps(cautious, ours, 2)
    plain = torch.optim.AdamW(ours, lr=1e-2)
    plain.load_state_dict(cautious.state_dict())
    assert torch.equal(plain.state[ours[0]]["exp_avg"], cautious.state[ours[0]]["exp_avg"])


def test_cautious_wrapper_never_moves_uphill() -> None:
    p = nn.Parameter(torch.zeros(6))
    optimizer = Cautious(torch.optim.SGD([p], lr=1.0, momentum=0.9))
    p.grad = torch.ones(6)
    optimizer.step()  # momentum is now +1 everywhere
    before = p.detach().clone()
    p.grad = torch.tensor([-0.5, -0.5, -0.5, 0.5, 0.5, 0.5])
    optimizer.step()  # SGD steps by -(0.9·1 + g) everywhere: uphill where g = -0.5
    moved = p.detach() - before
    assert torch.equal(moved[:3], torch.zeros(3))  # uphill for the new gradient: masked
    assert (moved[3:] < 0).all()  # downhill: kept, and rescaled by 1 / 0.5
    torch.testing.assert_close(moved[3:], torch.full((3,), -1.4 * 2))


def test_cautious_wrapper_shares_groups_and_state_with_the_inner_optimizer() -> None:
    (p,) = params_like([(4, 4)])
    inner = torch.optim.Adam([p], lr=1e-2)
    wrapped = Cautious(inner)
    scheduler = torch.optim.lr_scheduler.LambdaLR(wrapped, lambda step: 0.5)
    assert inner.param_groups[0]["lr"] == pytest.approx(5e-3)
    run_steps(wrapped, [p], 2)
    scheduler.step()
    assert "exp_avg" in wrapped.state_dict()["state"][0]
    with pytest.raises(ValueError, match="already cautious"):
        Cautious(wrapped)
