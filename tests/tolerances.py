"""Test tolerances derived from the arithmetic, not chosen: each helper bounds the difference between
two computations of one quantity from the rounding unit of the dtype, the size of the computation,
the conditioning of the problem (computed from the test's own matrices) or a solver's stopping
tolerance. A bound holds on any CPU (another BLAS or oneDNN kernel, AVX2 or AVX-512, FMA contraction,
another thread count changes the rounding, never these bounds), and it stays tight enough that a
wrong term, adjoint or sign in the code under test exceeds it by orders of magnitude.

The rounding model is the standard one (Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., §2.2, §3.1): every operation's result is the exact one times ``1 + δ``, ``|δ| ≤ u``, the
unit roundoff; a sum or inner product of ``n`` terms, in any order or blocking, is then off by at
most ``γ_n = n·u/(1 − n·u)`` times the sum of the terms' magnitudes.
"""

from __future__ import annotations

import numpy as np
import torch


def unit_roundoff(dtype: torch.dtype | np.dtype | type) -> float:
    """``u = ε/2`` of a floating dtype (torch or numpy): the largest relative error of one rounding
    to nearest (``2⁻⁵³`` for float64, ``2⁻²⁴`` for float32)."""
    if isinstance(dtype, torch.dtype):
        return torch.finfo(dtype).eps / 2
    return float(np.finfo(dtype).eps) / 2


def gamma(n: float, dtype: torch.dtype | np.dtype | type = np.float64) -> float:
    """Higham's ``γ_n = n·u/(1 − n·u)``: the relative bound, against the sum of the terms'
    magnitudes, on the error of a sum or inner product of ``n`` terms in ``dtype`` (recursive
    summation; pairwise, blocked and FMA-contracted kernels do no worse)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"γ_{n} is unbounded in {dtype}: n·u = {nu} ≥ 1")
    return nu / (1 - nu)


def norm2(matrix: np.ndarray) -> float:
    """The spectral norm ``‖M‖₂`` (largest singular value)."""
    return float(np.linalg.norm(matrix, 2))


def condition(matrix: np.ndarray) -> float:
    """The spectral condition number ``κ₂(M) = σ_max/σ_min`` of a square matrix."""
    s = np.linalg.svd(matrix, compute_uv=False)
    return float(s[0] / s[-1])


def dense_solve_error(matrix: np.ndarray, solution: np.ndarray) -> float:
    """A bound on ``‖x̂ − x‖₂`` for ``x̂ = np.linalg.solve(M, b)`` in float64 (LU with partial pivoting).

    The computed solution solves ``(M + ΔM) x̂ = b`` with ``‖ΔM‖ ≤ γ_{3n}·g·‖M‖`` (Higham Thm 9.4,
    ``g`` the growth factor), so ``‖x̂ − x‖ ≤ κ·γ_{3n}·g·‖x̂‖/(1 − κ·γ_{3n}·g)`` (Thm 7.2). The
    tests' matrices are symmetric positive definite (normal equations, ``I + K/λ``), where pivoting
    keeps ``g ≤ 2``; forming ``M`` and ``b`` by float64 products adds an error of the same order,
    for which the bound keeps another factor 2.
    """
    n = matrix.shape[0]
    relative = condition(matrix) * 4 * gamma(3 * n, matrix.dtype)
    if relative >= 0.5:
        raise ValueError(f"M is too ill-conditioned for a float64 solve to bound: κ·γ = {relative}")
    return relative * float(np.linalg.norm(solution)) / (1 - relative)


def stopped_solve_error(tol: float, scale: float, gain: float) -> float:
    """A bound on the error of a quantity read from an iterative solve stopped at relative residual
    ``tol``: ``gain·tol·scale``.

    The solve stops once ``‖r‖ ≤ tol·scale`` for its residual ``r = b − A ẑ`` (``scale`` is the norm
    the residual is relative to, ``kdeq.maths.solvers``' ``‖f(z)‖``), so ``ẑ`` misses the solution by
    ``A⁻¹r``; a read-out ``R ẑ`` then misses by at most ``‖R A⁻¹‖₂·‖r‖``. ``gain`` bounds that
    operator norm (for ``A ⪰ I``, ``‖A⁻¹‖ ≤ 1`` and ``gain = ‖R‖₂`` serves, whether the read-out uses
    ``ẑ`` or the map's value ``f(ẑ) = ẑ + r``).
    """
    return gain * tol * scale


def sum_gap(n: int, magnitude: float, dtype: torch.dtype | np.dtype | type = np.float64) -> float:
    """A bound on the difference between two computations of one sum of ``n`` terms whose magnitudes
    add to at most ``magnitude``, in any two orders or blockings: ``2·γ_n·magnitude`` (each is within
    ``γ_n·magnitude`` of the exact sum)."""
    return 2 * gamma(n, dtype) * magnitude


def _taps(matrix: np.ndarray) -> int:
    """The most non-zero entries in any row or column: the terms of one output of a sparse product."""
    nonzero = matrix != 0
    return int(max(nonzero.sum(axis=0).max(), nonzero.sum(axis=1).max()))


def observed_solve_error(
    A: np.ndarray, K: np.ndarray, y: np.ndarray, m: np.ndarray, lam: float, tol: float, atol: float
) -> float:
    """A bound on ``‖f − f*‖₂`` over one sample's channels for ``kdeq.maths.operators.solve_observed``'s
    ``f``, solved to relative residual ``tol`` (floor ``atol``), against the exact
    ``f* = m + K Aᵀ(A K Aᵀ + λI)⁻¹(y − A m)``, from the dense ``A`` ``(n', n)``, ``K`` ``(n, n)``,
    observations ``y`` ``(c, n')`` and mean ``m`` ``(c, n)``.

    The solve finds ``z`` with ``B z = W₁ y + A m``, ``W₁ = A K Aᵀ/λ``, ``B = I + W₁ ⪰ I``, and reads
    out ``f = m + K Aᵀ(y − z)/λ``. Stopped at ``‖r‖ ≤ tol·‖f(z)‖`` (``kdeq.maths.solvers``: ``f(z) = z + r``,
    at most ``‖z*‖/(1 − tol)`` for ``z* = A f*``, floored at ``atol·√(c n')``), the ``z`` it reads out
    from, ``z`` itself or ``f(z)``, misses ``z*`` by at most ``‖r‖`` (``‖B⁻¹‖, ‖I − B⁻¹‖ ≤ 1``); the
    read-out multiplies that by ``‖K Aᵀ‖₂/λ`` (``stopped_solve_error``). The residual the solver
    tests is computed too: ``W₁`` applied to the difference ``z − y`` (``k`` taps of each factor, DCTs
    of ``log₂ n`` butterflies) adds ``γ·‖W₁‖₂·‖y − z*‖`` to it; the read-out's own rounding is
    ``γ·(‖m‖ + ‖K Aᵀ‖₂‖y − z*‖/λ)``.
    """
    ka = K @ A.T
    exact = m + np.linalg.solve(A @ ka + lam * np.eye(A.shape[0]), (y - m @ A.T).T).T @ ka.T
    z_star = exact @ A.T
    apart = float(np.linalg.norm(y - z_star))
    rounds = gamma(2 * _taps(A) + _taps(K) + 4 * np.ceil(np.log2(A.shape[1])) + 4)
    gain = norm2(ka) / lam
    scale = max(float(np.linalg.norm(z_star)) / (1 - tol), atol * y.size**0.5)
    residual = tol * scale + rounds * norm2(A @ ka) / lam * apart
    readout = rounds * (float(np.linalg.norm(m)) + gain * apart)
    return stopped_solve_error(1.0, residual, gain) + readout


def assert_within(
    actual: np.ndarray | torch.Tensor, expected: np.ndarray | torch.Tensor, bound: float
) -> None:
    """Assert ``‖actual − expected‖₂ ≤ bound`` (the 2-norm over every entry, the norm the helpers
    above bound), with the ratio in the message."""
    a = torch.as_tensor(actual).detach().cpu().double()
    e = torch.as_tensor(expected).detach().cpu().double()
    error = float((a - e).norm())
    assert error <= bound, (
        f"‖actual − expected‖₂ = {error:.3e} exceeds the bound {bound:.3e} ({error / bound:.3g}×)"
    )


def stopped_fixed_point_gap(
    tol: float, fz_norm: float, atol: float, n: int, evaluation: float, dtype: torch.dtype | np.dtype | type
) -> float:
    """A bound on ``‖f(z) − z‖₂`` for one sample's iterate ``z`` that a ``kdeq.maths.solvers`` solve accepted
    at relative residual ``tol`` (floor ``atol``), with ``f(z)`` evaluated again by the test (other
    kernels, other summation order) to norm ``fz_norm``.

    The solver accepted once its own ``f̂(z)`` met ``‖f̂(z) − z‖ ≤ tol·max(‖f̂(z)‖, atol·√n)``, up to
    the rounding of its two norms and the subtraction (relative ``γ_{n+2}`` each, in ``dtype``).
    ``evaluation`` bounds one evaluation's error ``‖f̂(z) − f(z)‖₂``; the test's and the solver's
    evaluations then differ by at most ``2·evaluation``, in the residual and in ``‖f(z)‖`` alike.
    """
    slack = (1 + gamma(n + 2, dtype)) ** 2
    floor = atol * n**0.5
    return slack * tol * max(fz_norm + 2 * evaluation, floor) + 2 * evaluation


def column_gap(dense: torch.Tensor, dtype: torch.dtype, terms: int, negative_mass: float = 1.0) -> float:
    """A bound on ``‖ĉ − c‖₂`` between two ``dtype`` computations (any kernels, orders, blockings) of one
    column ``c = D e_j`` of a linear map whose dense matrix ``dense`` is given.

    A map composed of stages (``s·A K Aᵀ``: three sums of products, each over at most its input's
    pixels, or a fast transform of length ``L``, ``4⌈log₂ L⌉`` roundings deep, Higham §24.1) is
    computed within ``γ_m`` of the magnitudes ``|A||K||Aᵀ||v|``, ``m`` the ``terms`` summed over the
    stages (Higham §3.5); normwise, within ``γ_m·negative_mass·‖|D|‖₂·‖v‖₂``, where ``negative_mass``
    bounds ``‖|A||K||Aᵀ|‖₂/‖|D|‖₂`` (1 for non-negative filters; ``‖h‖₁/|Σh|`` per application of a
    filter ``h`` with negative lobes). Two computations differ by twice that.
    """
    d = dense.detach().double()
    return 2 * gamma(terms, dtype) * negative_mass * float(torch.linalg.matrix_norm(d.abs(), ord=2))
