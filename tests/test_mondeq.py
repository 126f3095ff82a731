"""The monotone DEQ (kdeq.research.mondeq): its parameterisation, forward–backward's contraction, the fixed
point and its implicit gradients."""

from __future__ import annotations

import pytest
import torch

from kdeq.maths.solvers import SolverConfig, SplitMap, solve
from kdeq.research.mondeq import MonotoneDEQ, contraction_bound, monotone_step, symmetric_step
from tests.tolerances import assert_within, gamma, stopped_fixed_point_gap

TIGHT = SolverConfig(method="forward_backward", tol=1e-12, max_iter=5000, atol=1e-30)


def _net(seed: int, std: float | None = None, m: float = 1.0, solver: SolverConfig = TIGHT) -> MonotoneDEQ:
    return MonotoneDEQ(4, 12, m=m, init_std=std, solver=solver, seed=seed).double()


def _inputs(seed: int, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("std", [None, 0.05, 0.5, 2.0])
@pytest.mark.parametrize("m", [0.1, 1.0])
def test_parameterisation_is_strongly_monotone(seed: int, std: float | None, m: float) -> None:
    net = _net(seed, std, m)
    with torch.no_grad():
        gap = torch.eye(12, dtype=torch.float64) - net.weight()
        smallest = torch.linalg.eigvalsh(0.5 * (gap + gap.T))[0]
        lipschitz = net.lipschitz()
    assert smallest >= m - 1e-10 * max(1.0, float(lipschitz))
    assert float(lipschitz) >= m - 1e-12
    assert lipschitz == pytest.approx(torch.linalg.svdvals(gap)[0].item(), rel=1e-12)


def test_step_and_bound() -> None:
    assert monotone_step(1.0, 2.0) == pytest.approx(0.25)
    assert contraction_bound(0.25, 1.0, 2.0) == pytest.approx((1 - 0.5 + 0.25) ** 0.5)
    # the bound is below 1 exactly on (0, 2m/L²) and smallest at m/L²
    assert contraction_bound(0.5 - 1e-9, 1.0, 2.0) < 1.0 <= contraction_bound(0.5 + 1e-9, 1.0, 2.0)
    best = contraction_bound(monotone_step(0.3, 1.7), 0.3, 1.7)
    assert all(best <= contraction_bound(a, 0.3, 1.7) + 1e-15 for a in torch.linspace(0.01, 0.2, 39).tolist())
    assert symmetric_step(1.0, 3.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        monotone_step(0.0, 1.0)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("std", [None, 0.4])
def test_each_step_contracts_within_the_bound(seed: int, std: float | None) -> None:
    net = _net(seed, std)
    x = _inputs(seed)
    with torch.no_grad():
        split = net.split(x)
        z_star, stats = solve(split, torch.zeros(3, 12, dtype=torch.float64), TIGHT)
        assert bool(stats.converged.all())
        bound = contraction_bound(split.step, net.m, float(net.lipschitz()))
        assert bound < 1.0
        z = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        previous = None
        for _ in range(40):
            nxt = split.prox((1 - split.step) * z + split.step * split.pre(z), split.step)
            to_star = (nxt - z_star).norm(dim=1) / (z - z_star).norm(dim=1)
            assert bool((to_star <= bound + 1e-9).all())
            if previous is not None:
                steps = (nxt - z).norm(dim=1) / (z - previous).norm(dim=1)
                assert bool((steps <= bound + 1e-9).all())
            previous, z = z, nxt


@pytest.mark.parametrize("seed", [0, 1])
def test_fixed_point_against_a_dense_computation(seed: int) -> None:
    """z = ReLU(Wz + Ux + b) with W built independently from A, B; the ReLU's active set then makes
    the equation a linear system, solved densely."""
    net = _net(seed, 0.3)
    x = _inputs(seed)
    with torch.no_grad():
        z, stats = net(x)
        a, b_skew, u, b = net.A, net.B, net.U, net.b
        w = (1 - net.m) * torch.eye(12, dtype=torch.float64) - a.T @ a + b_skew - b_skew.T
        assert torch.allclose(w, net.weight(), atol=1e-14)
        assert torch.allclose(z, torch.relu(z @ w.T + x @ u.T + b), atol=1e-10)
        for k in range(x.shape[0]):
            act = torch.diag((z[k] > 1e-9).double())
            dense = torch.linalg.solve(torch.eye(12, dtype=torch.float64) - act @ w, act @ (u @ x[k] + b))
            assert torch.allclose(z[k], dense, atol=1e-9)
    assert bool(stats.converged.all())


def test_implicit_gradients_against_central_differences() -> None:
    net = _net(4, 0.15)
    x = _inputs(4)
    probe = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def loss() -> torch.Tensor:
        z, _ = net(x)
        return (probe * z).sum() + 0.5 * z.square().sum()

    loss().backward()
    eps = 1e-6
    for param in (net.A, net.B, net.U, net.b):
        flat = param.data.view(-1)
        for i in torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))[:4].tolist():
            keep = flat[i].item()
            with torch.no_grad():
                flat[i] = keep + eps
                up = loss().item()
                flat[i] = keep - eps
                down = loss().item()
                flat[i] = keep
            assert param.grad.view(-1)[i].item() == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-7)


def test_forward_backward_and_anderson_agree() -> None:
    net = _net(5)
    x = _inputs(5, batch=4)
    with torch.no_grad():
        split = net.split(x)
        z0 = torch.zeros(4, 12, dtype=torch.float64)
        z_fb, st_fb = solve(split, z0, TIGHT)
        z_aa, st_aa = solve(split, z0, SolverConfig(method="anderson", tol=1e-12, max_iter=500, atol=1e-30))
    assert bool(st_fb.converged.all()) and bool(st_aa.converged.all())
    assert torch.allclose(z_fb, z_aa, atol=1e-10)


def test_default_solve_converges_in_float32() -> None:
    net = MonotoneDEQ(6, 40, seed=7)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    z, stats = net(x)
    assert z.shape == (5, 40) and isinstance(net.split(x), SplitMap)
    assert bool(stats.converged.all())
    # the solver's own stopping rule, per sample, not a fixed atol: ‖f(z) − z‖ ≤ tol·‖f(z)‖ up to the
    # float32 rounding of the test's evaluation of f against the solver's (tolerances.py)
    with torch.no_grad():
        w, u, b = net.weight(), net.U, net.b
        fz = torch.relu(z @ w.T + x @ u.T + b)
        # one evaluation of W z + U x + b, entrywise within γ_{k+2}·(|W||z| + |U||x| + |b|) (ReLU is exact)
        magnitude = z.abs() @ w.abs().T + x.abs() @ u.abs().T + b.abs()
    terms, n = w.shape[1] + u.shape[1] + 2, fz.shape[1]
    tol, atol = net.solver.tol, net.solver.atol
    for i in range(z.shape[0]):
        evaluation = gamma(terms, torch.float32) * float(magnitude[i].double().norm())
        bound = stopped_fixed_point_gap(tol, float(fz[i].norm()), atol, n, evaluation, torch.float32)
        assert_within(fz[i], z[i], bound)
