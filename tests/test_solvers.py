"""The solver contract (DESIGN §4): typed configs, per-sample statistics, best iterates."""

import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from kdeq import SOLVERS, Kernel, SolverConfig, dense_spectral_norm, grid_coordinates, solve
from kdeq.maths import solvers

F64 = torch.float64
METHODS = sorted(SOLVERS)


def _diagonal_affine(slopes: torch.Tensor, n: int = 50):
    """``f(z) = a_b·z + c`` per sample ``b``: fixed point ``c/(1−a_b)``, Jacobian ``a_b I`` (symmetric)."""
    c = torch.linspace(0.5, 1.5, n, dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return slopes[:, None] * z + c

    return f, c[None] / (1 - slopes[:, None])


def _kernel_matrix(side: int, norm: float) -> torch.Tensor:
    """A ``side²×side²`` kernel Gram matrix scaled to spectral norm ``norm``: ``f(z) = (b − z)K``
    is then a linear Gaussian kGLM-DEQ at ``‖K/λ‖ = norm``."""
    gram = Kernel(lengthscale=2.0, radius=5).gram(grid_coordinates(side, side))
    return gram * norm / dense_spectral_norm(gram)


def _for(method: str, f):
    """``f`` as ``method`` takes it: a solver of ``solvers.SPLIT_ONLY`` gets the split form of ``f``
    with the identity as prox (``φ = 0``) and step 1, i.e. ``z ← pre(z) = f(z)``."""
    if method not in solvers.SPLIT_ONLY:
        return f
    return solvers.SplitMap(pre=f, prox=lambda x, _alpha: x, step=1.0)


def _rel(f, z: torch.Tensor) -> torch.Tensor:
    fz = f(z)
    return (fz - z).norm(dim=1) / fz.norm(dim=1)


def test_config_rejects_unknown_keys_and_is_frozen() -> None:
    with pytest.raises(ValidationError):
        SolverConfig(method="anderson", tolerance=1e-5)
    with pytest.raises(ValidationError):
        SolverConfig(method="broyden")
    with pytest.raises(ValidationError):
        SolverConfig(tol=-1.0)
    cfg = SolverConfig()
    with pytest.raises(ValidationError):
        cfg.tol = 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_stats_are_per_sample_and_describe_the_returned_iterate(method: str) -> None:
    f, exact = _diagonal_affine(torch.tensor([0.1, 0.5, -0.8], dtype=F64))
    cfg = SolverConfig(method=method, tol=1e-9, max_iter=500, damping=1.0)
    z, stats = solve(_for(method, f), torch.zeros(3, 50, dtype=F64), cfg)
    assert stats.iterations.shape == stats.residual.shape == stats.converged.shape == (3,)
    assert stats.iterations.dtype == torch.int64 and stats.converged.dtype == torch.bool
    assert stats.converged.all()
    assert torch.allclose(stats.residual, _rel(f, z), rtol=1e-6, atol=1e-15)
    assert torch.allclose(z, exact, rtol=1e-7)


@pytest.mark.parametrize("method", ["fixed_point", "anderson"])
def test_converged_samples_stop_counting_and_checks_do_not_change_results(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CPU checks every step; treat it as an asynchronous device so that check_every applies
    monkeypatch.setattr(solvers, "SYNC_FREE_DEVICES", frozenset())
    slopes = torch.tensor([0.1, 0.9], dtype=F64)
    f, _ = _diagonal_affine(slopes)
    z0 = torch.zeros(2, 50, dtype=F64)
    base = dict(method=method, tol=1e-8, max_iter=400, damping=1.0)
    z1, s1 = solve(f, z0, SolverConfig(**base, check_every=1))
    z7, s7 = solve(f, z0, SolverConfig(**base, check_every=7))
    assert torch.equal(s1.iterations, s7.iterations) and torch.equal(z1, z7)
    easy_alone, s_easy = solve(_diagonal_affine(slopes[:1])[0], z0[:1], SolverConfig(**base, check_every=7))
    assert s7.iterations[0] == s_easy.iterations[0] < s7.iterations[1]
    assert torch.equal(z7[:1], easy_alone)


@pytest.mark.parametrize("method", METHODS)
def test_on_the_cpu_a_solve_stops_the_step_it_converges(method: str) -> None:
    """No host sync to save on the CPU: a check period of 50 must not cost map evaluations."""
    f, _ = _diagonal_affine(torch.tensor([0.5, 0.6], dtype=F64))
    calls = 0

    def counted(z: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return f(z)

    cfg = SolverConfig(method=method, tol=1e-6, max_iter=400, damping=1.0, check_every=50)
    _, stats = solve(_for(method, counted), torch.zeros(2, 50, dtype=F64), cfg)
    assert stats.converged.all() and int(stats.iterations.max()) < 50
    # one evaluation per step, plus the start's (and CG's f(0) and closing true residual)
    assert calls <= int(stats.iterations.max()) + 3


def test_plain_iteration_counts_match_the_contraction_rate() -> None:
    f, _ = _diagonal_affine(torch.tensor([0.5], dtype=F64))
    _, stats = solve(
        f, torch.zeros(1, 50, dtype=F64), SolverConfig(method="fixed_point", tol=1e-6, damping=1.0)
    )
    # residual of z_k is 0.5^k · ‖c‖ against ‖f(z_k)‖ ≈ ‖z*‖ = 2‖c‖
    k = stats.iterations.item()
    assert 0.5**k / (2 - 0.5**k) <= 1e-6 < 0.5 ** (k - 1) / (2 - 0.5 ** (k - 1))


def test_divergent_iteration_returns_best_finite_iterate() -> None:
    f, _ = _diagonal_affine(torch.tensor([-3.0], dtype=F64))
    z0 = torch.zeros(1, 50, dtype=F64)
    z, stats = solve(f, z0, SolverConfig(method="fixed_point", tol=1e-8, max_iter=2000, damping=1.0))
    assert not stats.converged.item()
    assert torch.isfinite(z).all()
    assert stats.residual.item() == pytest.approx(_rel(f, z).item())
    assert stats.residual.item() <= _rel(f, z0).item()


@pytest.mark.parametrize("method", ["fixed_point", "anderson"])
def test_non_finite_values_stop_the_sample_and_keep_its_best(method: str) -> None:
    """Sample 0 has no fixed point and runs into NaN; sample 1 converges undisturbed."""
    slopes = torch.tensor([[1.0], [0.5]], dtype=F64)
    shifts = torch.tensor([[3.0], [1.0]], dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.where(z.abs() > 10, torch.full_like(z, torch.nan), slopes * z + shifts)

    cfg = SolverConfig(method=method, max_iter=50, damping=1.0, tol=1e-8)
    z, stats = solve(f, torch.zeros(2, 4, dtype=F64), cfg)
    assert torch.isfinite(z).all() and torch.isfinite(stats.residual).all()
    assert stats.converged.tolist() == [False, True]
    assert stats.iterations[0] < 50
    assert torch.allclose(z[1], torch.full((4,), 2.0, dtype=F64))
    assert stats.residual[0].item() == pytest.approx(_rel(f, z)[0].item())


def test_anderson_falls_back_when_its_system_is_singular() -> None:
    def f(z: torch.Tensor) -> torch.Tensor:
        return z + 1.0  # no fixed point: every residual is the same vector, G Gᵀ has rank one

    cfg = SolverConfig(method="anderson", regularization=0.0, max_iter=20, damping=0.5)
    z, stats = solve(f, torch.zeros(2, 8, dtype=F64), cfg)
    assert not stats.converged.any()
    assert (stats.iterations == 20).all()
    # the fallback is a damped step from the latest iterate: z_k = z_{k−1} + β
    assert torch.allclose(z, torch.full_like(z, 10.0))


def test_cg_solves_spd_system_exactly_within_dimension() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=F64))[0]
    a = q @ torch.diag(torch.linspace(1.0, 50.0, 30, dtype=F64)) @ q.T
    b = torch.randn(2, 30, generator=gen, dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return z - z @ a + b  # z = f(z)  ⇔  A z = b

    z, stats = solve(f, torch.zeros(2, 30, dtype=F64), SolverConfig(method="cg", tol=1e-12, max_iter=60))
    assert stats.converged.all() and (stats.iterations <= 30).all()
    assert torch.allclose(z, torch.linalg.solve(a, b.T).T, atol=1e-10)


def test_anderson_needs_fewer_iterations_than_plain_iteration() -> None:
    f, _ = _diagonal_affine(torch.tensor([0.95], dtype=F64))
    z0 = torch.zeros(1, 50, dtype=F64)
    _, plain = solve(f, z0, SolverConfig(method="fixed_point", tol=1e-8, max_iter=1000, damping=1.0))
    _, acc = solve(f, z0, SolverConfig(method="anderson", tol=1e-8, max_iter=1000))
    assert acc.converged.all() and plain.converged.all()
    assert acc.iterations.item() * 5 < plain.iterations.item()


def test_residual_floor_lets_a_zero_fixed_point_converge() -> None:
    z, stats = solve(
        lambda z: 0.5 * z, torch.ones(2, 5, dtype=F64), SolverConfig(method="fixed_point", damping=1.0)
    )
    assert stats.converged.all()
    assert z.abs().max() < 1e-8


def test_anderson_returns_its_best_iterate() -> None:
    """On a problem where Anderson does not converge, its residual is not monotone; the returned
    iterate is the best so far, so a larger cap never gives a worse answer."""
    a = _kernel_matrix(16, 100.0)
    b = torch.rand(1, 256, dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return (b - z) @ a

    best = []
    for cap in range(5, 80, 5):
        z, stats = solve(
            f, torch.zeros(1, 256, dtype=F64), SolverConfig(method="anderson", memory=4, max_iter=cap)
        )
        assert stats.residual.item() == pytest.approx(_rel(f, z).item(), rel=1e-9)
        best.append(stats.residual.item())
    assert all(later <= earlier for earlier, later in itertools.pairwise(best))
    assert not stats.converged.any()


def test_cg_reports_the_true_residual_in_float32() -> None:
    """At ‖K/λ‖ = 300 in float32 the recursive CG residual drifts below the true one."""
    a = _kernel_matrix(20, 300.0).float()
    b = torch.rand(2, 400)

    def f(z: torch.Tensor) -> torch.Tensor:
        return (b - z) @ a

    z, stats = solve(f, torch.zeros(2, 400), SolverConfig(method="cg", tol=1e-6, max_iter=300))
    fz = f(z)
    true = (fz - z).norm(dim=1) / fz.norm(dim=1)
    assert torch.allclose(stats.residual, true, rtol=1e-4)
    assert torch.equal(stats.converged, true <= 1e-6)


def _counting(f):
    calls = 0

    def counted(z: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return f(z)

    return counted, lambda: calls


@pytest.mark.parametrize("method", ["fixed_point", "anderson"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["cpu", "simulated-async"])
def test_map_evaluations_are_the_iterations_plus_at_most_one_look_ahead(
    method: str, asynchronous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step applies ``f`` once; on an asynchronous device the host reads the batch's flag one
    step late, so a converged batch takes exactly one more evaluation, not ``check_every`` more."""
    if asynchronous:
        monkeypatch.setattr(solvers, "SYNC_FREE_DEVICES", frozenset())
    slopes = torch.tensor([0.3, 0.6], dtype=F64)
    f, _ = _diagonal_affine(slopes)
    counted, calls = _counting(f)
    cfg = SolverConfig(method=method, tol=1e-8, max_iter=400, damping=1.0)
    _, stats = solve(_for(method, counted), torch.zeros(2, 50, dtype=F64), cfg)
    assert stats.converged.all()
    # f(z0), then one per step the slowest sample took, then the look-ahead step's
    assert calls() == 1 + int(stats.iterations.max()) + int(asynchronous)


def test_cg_on_a_simulated_asynchronous_device_stops_one_step_after_convergence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CG applies ``A`` once a step; past convergence the look-ahead costs one application, and
    the closing true residual one more, whatever ``check_every`` the checkpoints carried."""
    a = _kernel_matrix(12, 30.0)
    b = torch.rand(2, 144, dtype=F64, generator=torch.Generator().manual_seed(0))
    z0 = torch.zeros(2, 144, dtype=F64)
    counts = {}
    for asynchronous in (False, True):
        if asynchronous:
            monkeypatch.setattr(solvers, "SYNC_FREE_DEVICES", frozenset())
        applied = 0

        def apply_a(p: torch.Tensor) -> torch.Tensor:
            nonlocal applied
            applied += 1
            return p + p @ a

        _, stats, _ = solvers.linear_cg(apply_a, b - apply_a(z0), z0, SolverConfig(method="cg", tol=1e-8))
        assert stats.converged.all()
        counts[asynchronous] = (applied, int(stats.iterations.max()))
    (sync_applied, sync_iters), (async_applied, async_iters) = counts[False], counts[True]
    assert sync_iters == async_iters
    # r0, one per step, the closing true residual; the asynchronous run adds the look-ahead step
    assert sync_applied == 1 + sync_iters + 1
    assert async_applied == sync_applied + 1


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_cg_converged_at_its_first_step_reports_that_steps_residual_without_applying_a_again(
    dtype: torch.dtype,
) -> None:
    """A denoiser's usual solve: ``A = I + K/λ`` near the identity, one CG step to ``tol``. The
    residual of ``d = αr0`` is the step's ``r0 − α·Ar0``, so ``A`` is applied once in all; that
    residual agrees with ``r0 − A d`` computed here in float64 to the dtype's rounding."""
    a = _kernel_matrix(12, 1e-5)
    b = torch.rand(2, 144, dtype=F64, generator=torch.Generator().manual_seed(0))
    z0 = torch.zeros(2, 144, dtype=dtype)
    r0 = b.to(dtype)
    applied = 0

    def apply_a(p: torch.Tensor) -> torch.Tensor:
        nonlocal applied
        applied += 1
        return p + p @ a.to(dtype)

    z, stats, r = solvers.linear_cg(apply_a, r0, z0, SolverConfig(method="cg", tol=1e-4))
    assert stats.converged.all() and stats.iterations.tolist() == [1, 1]
    assert applied == 1
    true = b - (z.double() + z.double() @ a)
    eps = torch.finfo(dtype).eps
    assert (r.double() - true).norm(dim=1).max() <= 4 * eps * b.norm(dim=1).max()
    assert torch.allclose(
        stats.residual.double(), true.norm(dim=1) / (z.double() + true).norm(dim=1), rtol=1e-3
    )


def test_cg_reaches_its_tolerance_in_float32_far_past_float32s_floor_for_the_iterate() -> None:
    """At ``‖K/λ‖ = 10⁵`` rounding ``z*`` itself to float32 leaves a residual of ~``2⁻²⁴·10⁵``, above
    ``tol = 10⁻⁴`` (3·10⁻⁴); CG on the correction ``d = z − z0`` from a close start reaches ``tol``."""
    a = _kernel_matrix(16, 1e5)
    gen = torch.Generator().manual_seed(1)
    clean = torch.rand(1, 256, dtype=F64, generator=gen)
    t = clean + 1e-3 * torch.randn(1, 256, dtype=F64, generator=gen)
    exact = torch.linalg.solve(torch.eye(256, dtype=F64) + a, (t @ a).T).T  # z = (t − z)K
    rounded = exact.float().double()
    floor = ((t - rounded) @ a - rounded).norm() / ((t - rounded) @ a).norm()
    assert floor > 2e-4
    a32, t32 = a.float(), t.float()
    # the residual of the start t (z0 = t, r0 = (t − z0)K − z0 + 0 = −t) is exact in float32
    z, stats, _ = solvers.linear_cg(lambda p: p + p @ a32, -t32, t32, SolverConfig(method="cg", tol=1e-4))
    assert stats.converged.all() and float(stats.residual) <= 1e-4
    assert torch.allclose(z.double(), exact, atol=1e-5)


def test_the_history_is_the_residual_of_each_plain_iterate_until_each_sample_stops() -> None:
    """``history=True`` against the residuals of ``z_k = f(z_{k−1})`` computed here: equal at every
    step a sample is still iterating, NaN after; without it, no history."""
    f, _ = _diagonal_affine(torch.tensor([0.1, 0.5, -0.8], dtype=F64))
    cfg = SolverConfig(method="fixed_point", tol=1e-9, max_iter=500, damping=1.0)
    _, plain = solve(f, torch.zeros(3, 50, dtype=F64), cfg)
    assert plain.history is None
    _, stats = solve(f, torch.zeros(3, 50, dtype=F64), cfg.model_copy(update={"history": True}))
    steps = stats.history.shape[1]
    assert stats.history.shape == (3, int(stats.iterations.max()))
    z, expected = torch.zeros(3, 50, dtype=F64), []
    for _ in range(steps):
        z = f(z)
        expected.append(_rel(f, z))
    expected = torch.stack(expected, dim=1)
    for b in range(3):
        n = int(stats.iterations[b])
        torch.testing.assert_close(stats.history[b, :n], expected[b, :n], rtol=1e-12, atol=0)
        assert bool(stats.history[b, n:].isnan().all())
        assert stats.history[b, n - 1] == stats.residual[b] <= cfg.tol
    assert "history" not in cfg.model_copy(update={"history": True}).model_dump()  # never saved


@pytest.mark.parametrize("method", METHODS)
def test_every_solver_records_one_residual_per_iteration(method: str) -> None:
    f, _ = _diagonal_affine(torch.tensor([0.1, 0.5, -0.8], dtype=F64))
    cfg = SolverConfig(method=method, tol=1e-9, max_iter=500, damping=1.0, history=True)
    _, stats = solve(_for(method, f), torch.zeros(3, 50, dtype=F64), cfg)
    for b in range(3):
        recorded = stats.history[b][~stats.history[b].isnan()]
        assert len(recorded) == int(stats.iterations[b]) and bool((recorded > 0).all())
        if method != "cg":  # CG reports the true residual of its answer, recomputed at the end
            assert recorded.min() == stats.residual[b]  # the returned iterate is the best recorded one


def test_chained_solves_join_their_histories_and_sum_their_steps() -> None:
    f, _ = _diagonal_affine(torch.tensor([0.1, 0.5], dtype=F64))
    cfg = SolverConfig(method="anderson", tol=1e-9, max_iter=500, history=True)
    z, first = solve(f, torch.zeros(2, 50, dtype=F64), cfg)
    _, second = solve(f, z + 1.0, cfg)
    both = solvers.chained([first, second])
    assert torch.equal(both.iterations, first.iterations + second.iterations)
    assert torch.equal(both.residual, torch.maximum(first.residual, second.residual))
    joined = torch.cat([first.history, second.history], dim=1)
    torch.testing.assert_close(both.history, joined, equal_nan=True)
    plain = solve(f, z, cfg.model_copy(update={"history": False}))[1]
    assert solvers.chained([first, plain]).history is None


def test_anderson_undoes_a_step_whose_residual_grows_and_still_reaches_the_fixed_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stiff, decoupled exponential map ``zᵢ = exp((yᵢ − zᵢ)/λ + mᵢ)``, the photon denoiser's with
    ``K = I`` (counts up to 1000, λ = 25, damped at ``2/(1 + max y/λ)``): with the safeguard no
    recorded residual exceeds twice its predecessor, and the solve converges to each component's
    root (bisection on the increasing ``z − exp((y − z)/λ + m)``), each within its own residual
    ``|f(z) − z|`` (the map's slope is in ``[−z/λ, 0]``, so the error is at most the residual); without
    it (``SAFEGUARD = ∞``) Anderson's extrapolations keep overshooting and the solve has not
    converged in 150 steps."""
    gen = torch.Generator().manual_seed(0)
    y = torch.exp(torch.rand(1, 1024, generator=gen, dtype=F64) * math.log(1000.0))
    m = torch.log(y) + 0.05 * torch.randn(1, 1024, generator=gen, dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.exp((y - z) / 25.0 + m)

    cfg = SolverConfig(method="anderson", damping=2 / (1 + float(y.max()) / 25.0), max_iter=150, tol=1e-6)
    z, stats = solve(f, torch.exp(m), cfg.model_copy(update={"history": True}))
    assert bool(stats.converged[0]) and int(stats.iterations[0]) < 100
    steps = stats.history[0]
    assert bool((steps[1:] <= solvers.SAFEGUARD * steps[:-1]).all())
    lo, hi = torch.zeros_like(y), torch.maximum(y, torch.exp(m)) * 4
    for _ in range(200):
        mid = (lo + hi) / 2
        above = mid > f(mid)
        lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
    root = (lo + hi) / 2
    assert bool(((z - root).abs() <= (f(z) - z).abs() + 1e-9 * root).all())
    assert float((z - root).abs().max()) < 1e-2
    monkeypatch.setattr(solvers, "SAFEGUARD", math.inf)
    _, unguarded = solve(f, torch.exp(m), cfg)
    assert not bool(unguarded.converged[0])
