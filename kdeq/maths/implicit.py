"""Equilibrium points with gradients: implicit differentiation, Jacobian-free or phantom backward.

For ``z* = f(z*; θ)`` and a loss ``ℓ(z*)``, the implicit function theorem gives
``dℓ/dθ = uᵀ ∂f/∂θ`` with ``u = (I − ∂f/∂z)⁻ᵀ ∂ℓ/∂z*``, i.e. ``u`` solves the
linear fixed point ``u = (∂f/∂z)ᵀ u + ∂ℓ/∂z*``. ``implicit`` solves it with
the configured solver; ``jacobian_free`` takes ``u = ∂ℓ/∂z*`` (Fung et al.,
"JFB", 2022), cheaper and only a descent direction. ``phantom`` (Geng et al.,
"phantom gradients", 2021) back-propagates through ``k`` damped steps
``z ← (1−τ)z + τf(z)`` unrolled from the detached ``z*``: with ``J = ∂f/∂z`` it
replaces ``(I − J)⁻¹`` by ``τ Σ_{i<k} ((1−τ)I + τJ)^i``, which tends to it as
``k → ∞`` when ``f`` contracts, at the cost of ``k`` backward passes through ``f``.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from kdeq.maths.precision import ieee_float32
from kdeq.maths.solvers import Map, SolverConfig, SolverStats, solve

Backward = Literal["implicit", "jacobian_free", "phantom"]


def equilibrium(
    f: Map,
    z0: torch.Tensor,
    forward: SolverConfig,
    backward: Backward = "implicit",
    backward_solver: SolverConfig | None = None,
    *,
    phantom_steps: int = 5,
    phantom_damping: float = 0.5,
) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``z* = f(z*)`` from ``z0`` ``(B, ...)`` without tracking the iterations, then
    re-attach ``z*`` to the autograd graph by one application of ``f``.

    Returns ``(z*, stats)``. When autograd is off (inference), ``z*`` is the
    solver's best iterate. When on, the returned tensor is ``f(z*)`` — equal to
    ``z*`` at the fixed point; ``stats`` describe ``z*`` — and its gradient is
    corrected per ``backward``. The adjoint solve uses ``backward_solver``,
    by default the forward settings with CG kept for a CG forward (the adjoint
    of a symmetric linear DEQ is the same SPD system) and Anderson otherwise;
    a backward solve that does not converge raises a ``RuntimeWarning``.
    Higher-order gradients (``create_graph=True``) are not supported and raise.
    With ``backward="phantom"`` the returned tensor is instead the last of
    ``phantom_steps`` (``k``) damped steps ``z ← (1−τ)z + τf(z)``, ``τ = phantom_damping``,
    from ``z*`` — again ``z*`` at the fixed point — and autograd runs through them.
    """
    if backward == "phantom" and not (phantom_steps >= 1 and 0 < phantom_damping <= 1):
        raise ValueError(
            f"phantom gradient needs steps >= 1 and 0 < damping <= 1, got {phantom_steps}, {phantom_damping}"
        )
    with torch.no_grad():
        z_star, stats = solve(f, z0, forward)
    if not torch.is_grad_enabled():
        return z_star, stats
    z_star = z_star.detach()
    if backward == "phantom":
        z = z_star
        for _ in range(phantom_steps):
            z = (1 - phantom_damping) * z + phantom_damping * f(z)
        return z, stats
    z = f(z_star)
    if backward == "jacobian_free" or not z.requires_grad:
        return z, stats

    adjoint_cfg = backward_solver or forward.model_copy(
        update={"method": "cg" if forward.method == "cg" else "anderson"}
    )
    z_in = z_star.clone().requires_grad_(True)
    f_in = f(z_in)

    def correct(grad: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("higher-order gradients through an implicit equilibrium are not supported")

        def adjoint(u: torch.Tensor) -> torch.Tensor:
            (jtu,) = torch.autograd.grad(f_in, z_in, u, retain_graph=True)
            return jtu + grad

        # the autograd engine runs this hook outside the forward's IEEE section (kdeq.maths.precision)
        with torch.enable_grad(), ieee_float32():
            u, adj_stats = solve(adjoint, grad, adjoint_cfg)
        warn_unconverged(adj_stats, adjoint_cfg)
        return u.detach()

    z.register_hook(correct)
    return z, stats


def warn_unconverged(stats: SolverStats, config: SolverConfig) -> None:
    """A ``RuntimeWarning`` (the trainer counts them) when an adjoint solve left a sample above
    ``config``'s tolerance."""
    if not bool(stats.converged.all()):
        warnings.warn(
            f"implicit backward solve did not converge: residual {stats.residual.max().item():.2e} "
            f"> tol {config.tol:g} after {stats.iterations.max().item()} iterations",
            RuntimeWarning,
            stacklevel=3,
        )
