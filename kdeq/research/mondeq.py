"""Monotone deep equilibrium models (Winston and Kolter, "Monotone operator equilibrium networks",
NeurIPS 2020), and the kGLM-DEQ seen as one.

A monotone DEQ is ``z = σ(Wz + Ux + b)`` with ``σ = prox_φ`` for a convex ``φ`` (ReLU: the indicator
of the non-negative orthant) and

    W = (1 − m)I − AᵀA + B − Bᵀ,

so that the symmetric part of ``I − W = mI + AᵀA + (Bᵀ − B)`` is ``mI + AᵀA ⪰ mI`` (the skew part
``Bᵀ − B`` adds nothing to ``vᵀ(I − W)v``): ``I − W`` is strongly monotone with constant ``m`` for
every ``A``, ``B``. The fixed point is unique and forward–backward splitting

    z ← prox_{αφ}((1 − α)z + α(Wz + Ux + b)) = prox_{αφ}(z − α((I − W)z − (Ux + b)))

(``kdeq.maths.solvers.forward_backward``) contracts for ``α ∈ (0, 2m/L²)``, ``L = ‖I − W‖₂``: ``prox`` is
non-expansive and ``‖(I − αG)v‖² = ‖v‖² − 2α vᵀGv + α²‖Gv‖² ≤ (1 − 2αm + α²L²)‖v‖²`` for
``G = I − W``, so the factor is at most ``√(1 − 2αm + α²L²)``, smallest at ``α = m/L²``.

The link to kdeq (DESIGN §2 fact 11): a flat-prior kGLM-DEQ has ``W1 = −K/λ`` with ``K`` PSD, so
``I − W1 = I + K/λ ⪰ I``: a monotone DEQ with ``m = 1`` whenever ``σ = A'`` is a proximal map, i.e.
(Moreau) the gradient of a convex function that is 1-Lipschitz: ``sup A'' ≤ 1``. That holds for the
Gaussian (identity), Bernoulli (logistic, ``1/4``), spin (tanh, ``1``) and Binomial with ``r ≤ 4``
trials (``r/4``), not for the Poisson's ``exp``. Since ``I − W1`` is then symmetric, the sharper
``‖I − αG‖₂ = max(|1 − αm|, |1 − αL|)`` applies, smallest at ``α = 2/(m + L)`` (``symmetric_step``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kdeq.maths.families import Family, Gaussian
from kdeq.maths.implicit import Backward, equilibrium
from kdeq.maths.solvers import Map, SolverConfig, SolverStats, SplitMap

Prox = Callable[[torch.Tensor, float], torch.Tensor]

#: the monotone DEQ's default solve: forward–backward at ``α = m/L²`` (the bound's factor is then
#: ``√(1 − m²/L²)``; the measured one is usually well below it)
DEFAULT_SOLVER = SolverConfig(method="forward_backward", tol=1e-5, max_iter=1000)


def monotone_step(m: float, lipschitz: float) -> float:
    """``α = m/L²``, the minimiser of the contraction bound ``√(1 − 2αm + α²L²)`` over ``α``."""
    if not (m > 0.0 and lipschitz > 0.0):
        raise ValueError(f"need m > 0 and L > 0, got m = {m}, L = {lipschitz}")
    return m / lipschitz**2


def contraction_bound(alpha: float, m: float, lipschitz: float) -> float:
    """``√(1 − 2αm + α²L²)``: forward–backward's contraction factor for step ``α`` on ``I − W ⪰ mI``,
    ``‖I − W‖₂ ≤ L`` (below 1 exactly when ``0 < α < 2m/L²``)."""
    return math.sqrt(max(0.0, 1.0 - 2.0 * alpha * m + alpha**2 * lipschitz**2))


def symmetric_step(m: float, lipschitz: float) -> float:
    """``α = 2/(m + L)``: forward–backward's best step when ``I − W`` is symmetric with spectrum in
    ``[m, L]`` (the kGLM's ``I + K/λ``), contracting by ``(L − m)/(L + m)``."""
    if not (m > 0.0 and lipschitz > 0.0):
        raise ValueError(f"need m > 0 and L > 0, got m = {m}, L = {lipschitz}")
    return 2.0 / (m + lipschitz)


def relu_prox(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``prox_{αφ}(x) = max(x, 0)`` for ``φ`` the indicator of ``[0, ∞)``, the same for every ``α``."""
    return torch.relu(x)


def family_prox(family: Family, iterations: int = 100) -> Prox:
    """``(x, α) ↦ prox_{αφ}(x) = (I + α(σ⁻¹ − I))⁻¹(x)`` elementwise for ``σ = A' = prox_φ`` of
    ``family``; ``α = 1`` gives ``σ``.

    The identity for the Gaussian (``φ = 0``). Otherwise ``v = prox_{αφ}(x)`` solves the scalar
    equation ``h(v) = (1 − α)v + α σ⁻¹(v) = x`` on ``σ``'s range, with ``h' = 1 − α + α/A''(σ⁻¹(v)) ≥ 1``
    (since ``A'' ≤ 1``): strictly increasing, so Newton's method from ``σ(x)`` is safeguarded by the
    bracket that the sign of ``h(v) − x`` maintains (a step leaving it bisects), in float64, for at
    most ``iterations`` steps. Raises ``ValueError`` for a family whose ``σ`` is no proximal map
    (``sup A'' > 1``: the Poisson's ``exp``, a Binomial with more than 4 trials).
    """
    if family.sup_A2() > 1.0:
        raise ValueError(
            f"σ of the {family.name} family is no proximal map: its slope reaches sup A'' = "
            f"{family.sup_A2():g} > 1"
        )
    if isinstance(family, Gaussian):
        return lambda x, alpha: x
    ends = family.sigma(torch.tensor([-math.inf, math.inf], dtype=torch.float64))
    low, high = float(ends[0]), float(ends[1])
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"family_prox needs σ of bounded range, {family.name}'s is ({low}, {high})")
    span = high - low

    def prox(x: torch.Tensor, alpha: float) -> torch.Tensor:
        if alpha == 1.0:
            return family.sigma(x)
        target = x.double()
        lo = torch.full_like(target, low)
        hi = torch.full_like(target, high)
        v = family.sigma(target).clamp(low + 1e-3 * span, high - 1e-3 * span)
        for _ in range(iterations):
            eta = family.sigma_inv(v)
            gap = (1.0 - alpha) * v + alpha * eta - target
            lo = torch.where(gap < 0, v, lo)
            hi = torch.where(gap > 0, v, hi)
            newton = v - gap / ((1.0 - alpha) + alpha / family.A2(eta))
            inside = (newton > lo) & (newton < hi)
            nxt = torch.where(inside, newton, 0.5 * (lo + hi))
            moved = (nxt - v).abs().max()
            v = nxt
            if moved <= 4 * torch.finfo(torch.float64).eps * span:
                break
        return v.to(x.dtype)

    return prox


def kglm_split(pre: Map, family: Family, norm: float, floor: float = 0.0) -> SplitMap:
    """The flat-prior kGLM-DEQ ``z = σ(pre(z))``, ``pre(z) = −(K/λ)z + (K/λ)T(y) + m`` (masked, or
    through an operator as ``AKAᵀ/λ``, as the layer has it), as a monotone DEQ: with the spectrum of
    ``K/λ`` in ``[floor, norm]`` (``floor = 0`` always holds, ``norm ≥ ‖K/λ‖₂``) that of ``I − W1`` is
    in ``[m, L] = [1 + floor, 1 + norm]`` and the step is ``symmetric_step(m, L)``."""
    return SplitMap(pre, family_prox(family), symmetric_step(1.0 + floor, 1.0 + norm))


class MonotoneDEQ(nn.Module):
    """``z = ReLU(Wz + Ux + b)`` with ``W = (1 − m)I − AᵀA + B − Bᵀ`` (module docstring), solved by
    forward–backward splitting at ``α = m/L²`` and differentiated implicitly (``kdeq.maths.implicit``).

    Parameters ``A``, ``B`` ``(n_hidden, n_hidden)``, ``U`` ``(n_hidden, n_in)``, ``b`` ``(n_hidden,)``,
    drawn from a seeded ``torch.Generator``: with ``init_std`` every entry is ``N(0, init_std²)``;
    with ``None``, ``A`` and ``B`` have entries ``N(0, 1/(4·n_hidden))`` (so ``‖AᵀA‖₂ ≈ 1`` and
    ``‖B − Bᵀ‖₂ ≈ 1.4``: ``L`` stays near ``m + 2.5``), ``U`` ``N(0, 1/n_in)`` and ``b = 0``.
    """

    def __init__(
        self,
        n_in: int,
        n_hidden: int,
        *,
        m: float = 1.0,
        init_std: float | None = None,
        solver: SolverConfig | None = None,
        backward: Backward = "implicit",
        seed: int = 0,
    ) -> None:
        super().__init__()
        if m <= 0:
            raise ValueError(f"the monotonicity m must be positive, got {m}")
        gen = torch.Generator().manual_seed(seed)
        square = init_std if init_std is not None else 0.5 / math.sqrt(n_hidden)
        inputs = init_std if init_std is not None else 1.0 / math.sqrt(n_in)
        bias = init_std if init_std is not None else 0.0
        self.m = m
        self.A = nn.Parameter(square * torch.randn(n_hidden, n_hidden, generator=gen))
        self.B = nn.Parameter(square * torch.randn(n_hidden, n_hidden, generator=gen))
        self.U = nn.Parameter(inputs * torch.randn(n_hidden, n_in, generator=gen))
        self.b = nn.Parameter(bias * torch.randn(n_hidden, generator=gen))
        self.solver = solver or DEFAULT_SOLVER
        self.backward: Backward = backward

    def weight(self) -> torch.Tensor:
        """``W = (1 − m)I − AᵀA + B − Bᵀ`` ``(n_hidden, n_hidden)``."""
        eye = torch.eye(self.A.shape[0], dtype=self.A.dtype, device=self.A.device)
        return (1.0 - self.m) * eye - self.A.T @ self.A + self.B - self.B.T

    def lipschitz(self) -> torch.Tensor:
        """``L = ‖I − W‖₂`` (the largest singular value, exact), a scalar tensor."""
        eye = torch.eye(self.A.shape[0], dtype=self.A.dtype, device=self.A.device)
        return torch.linalg.matrix_norm(eye - self.weight(), ord=2)

    def split(self, x: torch.Tensor) -> SplitMap:
        """The layer on inputs ``x`` ``(B, n_in)`` in split form: ``pre(z) = zWᵀ + xUᵀ + b`` for ``z``
        ``(B, n_hidden)``, ``prox`` the ReLU, ``step = monotone_step(m, L)``."""
        weight = self.weight()
        injected = x @ self.U.T + self.b
        step = monotone_step(self.m, float(self.lipschitz().detach()))
        return SplitMap(lambda z: z @ weight.T + injected, relu_prox, step)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
        """The equilibrium ``z`` ``(B, n_hidden)`` of inputs ``x`` ``(B, n_in)`` from ``z₀ = 0``, with the
        solve's statistics; gradients by ``self.backward`` (``kdeq.maths.implicit.equilibrium``)."""
        z0 = torch.zeros(x.shape[0], self.A.shape[0], dtype=x.dtype, device=x.device)
        return equilibrium(self.split(x), z0, self.solver, self.backward)


__all__ = [
    "DEFAULT_SOLVER",
    "MonotoneDEQ",
    "contraction_bound",
    "family_prox",
    "kglm_split",
    "monotone_step",
    "relu_prox",
    "symmetric_step",
]
