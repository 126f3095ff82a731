"""Reference kGLM solvers that do not go through the DEQ, for checking it.

Both work on the representer coefficients ``α`` of ``f = k(·, X) α``, in the
dtype of their inputs (use float64), one sample at a time.
"""

from __future__ import annotations

import torch

from kdeq.maths.families import Family
from kdeq.maths.priors import Prior


def kernel_ridge(
    gram: torch.Tensor, y: torch.Tensor, lam: float, mean: torch.Tensor | None = None
) -> torch.Tensor:
    """Closed-form kernel ridge coefficients ``α = (K + λI)⁻¹ (Y − m)``.

    ``gram`` ``(n, n)``; ``y`` and ``mean`` ``(B, n)``; returns ``α`` ``(B, n)``.
    Predictions are ``k(X̃, X) α + m(X̃)``.
    """
    resid = y if mean is None else y - mean
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + lam * eye, resid.T).T


def objective(
    family: Family,
    prior: Prior,
    gram: torch.Tensor,
    y: torch.Tensor,
    lam: float,
    alpha: torch.Tensor,
    mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inner kGLM objective (eq. 5 with Appendix H's mean), per sample ``(B,)``:
    ``1ᵀA(η) + 1ᵀQ(η) − αᵀK T(Y) + λ/2 αᵀKα`` with ``η = Kα + m``."""
    ka = alpha @ gram
    eta = ka if mean is None else ka + mean
    t = family.T(y)
    return family.A(eta).sum(-1) + prior.Q(eta).sum(-1) - (ka * t).sum(-1) + 0.5 * lam * (alpha * ka).sum(-1)


def newton_kglm(
    family: Family,
    prior: Prior,
    gram: torch.Tensor,
    y: torch.Tensor,
    lam: float,
    mean: torch.Tensor | None = None,
    tol: float = 1e-13,
    max_iter: int = 100,
) -> torch.Tensor:
    """Minimise the kGLM objective by Newton's method (IRLS) with backtracking.

    Gradient ``K g`` with ``g = A'(η) + Q'(η) − T(Y) + λα``; Hessian
    ``K(DK + λI)`` with ``D = diag(A''(η) + Q''(η))``, so for ``K`` invertible
    the Newton step solves ``(DK + λI) Δ = −g``. Returns ``α`` ``(B, n)``.
    Raises ``RuntimeError`` if a sample has not converged (``‖Δ‖∞ ≤ tol·(1+‖α‖∞)``).
    """
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    t = family.T(y)
    alphas = []
    for b in range(y.shape[0]):
        m_b = None if mean is None else mean[b : b + 1]
        alpha = torch.zeros_like(y[b : b + 1])
        for _ in range(max_iter):
            eta = alpha @ gram if m_b is None else alpha @ gram + m_b
            g = family.sigma(eta) + prior.dQ(eta) - t[b : b + 1] + lam * alpha
            d = (family.A2(eta) + prior.d2Q(eta))[0]
            step = -torch.linalg.solve(d[:, None] * gram + lam * eye, g[0])[None]
            slope = ((g @ gram) * step).sum()
            f0 = objective(family, prior, gram, y[b : b + 1], lam, alpha, m_b)
            size = 1.0
            while size > 1e-10:
                trial = alpha + size * step
                f1 = objective(family, prior, gram, y[b : b + 1], lam, trial, m_b)
                if f1 <= f0 + 1e-4 * size * slope or (f1 - f0).abs() <= 1e-15 * f0.abs():
                    break
                size *= 0.5
            alpha = alpha + size * step
            if step.abs().max() * size <= tol * (1.0 + alpha.abs().max()):
                break
        else:
            raise RuntimeError(f"Newton did not converge for sample {b} in {max_iter} steps")
        alphas.append(alpha)
    return torch.cat(alphas)
