"""Exponential families in canonical form, ``p(y | η) = h(y) exp(η T(y) − A(η))``.

Each family supplies the pieces the kGLM ⇄ DEQ mapping needs (DESIGN §2):
the log-partition ``A``, the activation ``σ = A'``, its inverse ``σ⁻¹`` (the
canonical link), the curvature ``A''`` with an upper bound ``sup A''`` over the
family's working domain, and the sufficient statistic ``T``. All functions act
elementwise on tensors of any shape.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F


def _clamp_open(mu: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Clamp ``mu`` into the open interval (low, high) at the dtype's resolution,
    so that the link ``σ⁻¹`` stays finite at saturated means."""
    eps = torch.finfo(mu.dtype).eps if mu.is_floating_point() else 1e-12
    span = high - low
    return mu.clamp(low + eps * span, high - eps * span)


class Family(Protocol):
    """The contract every exponential family satisfies."""

    name: str

    def A(self, eta: torch.Tensor) -> torch.Tensor:
        """Log-partition ``A(η)``, same shape as ``η``."""
        ...

    def sigma(self, eta: torch.Tensor) -> torch.Tensor:
        """Mean map ``σ(η) = A'(η) = E[T(y) | η]``."""
        ...

    def sigma_inv(self, mu: torch.Tensor) -> torch.Tensor:
        """Canonical link ``σ⁻¹(μ)``, the inverse of the mean map."""
        ...

    def A2(self, eta: torch.Tensor) -> torch.Tensor:
        """Curvature ``A''(η) = Var[T(y) | η]``."""
        ...

    def sup_A2(self) -> float:
        """An upper bound on ``A''`` over the family's working domain."""
        ...

    def T(self, y: torch.Tensor) -> torch.Tensor:
        """Sufficient statistic ``T(y)``."""
        ...


class Gaussian:
    """Unit-variance Gaussian: ``A(η) = η²/2``, ``σ = id``, ``A'' = 1``."""

    name = "gaussian"

    def A(self, eta: torch.Tensor) -> torch.Tensor:
        return 0.5 * eta * eta

    def sigma(self, eta: torch.Tensor) -> torch.Tensor:
        return eta

    def sigma_inv(self, mu: torch.Tensor) -> torch.Tensor:
        return mu

    def A2(self, eta: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(eta)

    def sup_A2(self) -> float:
        return 1.0

    def T(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Binomial:
    """Binomial with ``r`` trials, ``y ∈ {0, …, r}``: ``A(η) = r log(1 + eᶯ)``,
    ``σ(η) = r·logistic(η)``, ``A'' = r·logistic(η)(1 − logistic(η)) ≤ r/4``."""

    def __init__(self, trials: int = 1) -> None:
        if trials < 1:
            raise ValueError(f"Binomial needs trials >= 1, got {trials}")
        self.trials = trials
        self.name = "bernoulli" if trials == 1 else f"binomial{trials}"

    def A(self, eta: torch.Tensor) -> torch.Tensor:
        return self.trials * F.softplus(eta)

    def sigma(self, eta: torch.Tensor) -> torch.Tensor:
        return self.trials * torch.sigmoid(eta)

    def sigma_inv(self, mu: torch.Tensor) -> torch.Tensor:
        return torch.logit(_clamp_open(mu / self.trials, 0.0, 1.0))

    def A2(self, eta: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(eta)
        return self.trials * p * (1.0 - p)

    def sup_A2(self) -> float:
        return self.trials / 4.0

    def T(self, y: torch.Tensor) -> torch.Tensor:
        return y


def Bernoulli() -> Binomial:
    """Bernoulli, ``y ∈ {0, 1}``: the Binomial with one trial (kernel logistic regression)."""
    return Binomial(1)


class Spin:
    """Spins ``y ∈ {−1, +1}`` (Ising-style labels): ``A(η) = log(2 cosh η)``,
    ``σ = tanh``, ``A'' = 1 − tanh² ≤ 1``."""

    name = "spin"

    def A(self, eta: torch.Tensor) -> torch.Tensor:
        # log(2 cosh η) = |η| + log(1 + e^{−2|η|}), stable for large |η|
        a = eta.abs()
        return a + torch.log1p(torch.exp(-2.0 * a))

    def sigma(self, eta: torch.Tensor) -> torch.Tensor:
        return torch.tanh(eta)

    def sigma_inv(self, mu: torch.Tensor) -> torch.Tensor:
        return torch.atanh(_clamp_open(mu, -1.0, 1.0))

    def A2(self, eta: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(eta)
        return 1.0 - t * t

    def sup_A2(self) -> float:
        return 1.0

    def T(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Poisson:
    """Poisson counts with the curvature capped above ``η_max``.

    ``A(η) = eᶯ`` has unbounded curvature, so above ``η_max`` it continues along
    its second-order Taylor expansion: ``A(η) = e^{η_max}(1 + δ + δ²/2)`` with
    ``δ = η − η_max``. ``A`` stays strictly convex and C², ``σ`` strictly
    increasing (so ``σ⁻¹`` is exact everywhere, which the prior's ``ρ = Q'∘σ⁻¹``
    needs) and ``sup A'' = e^{η_max}``. Below ``η_max`` every quantity is the
    exact Poisson one; choose ``η_max`` above ``log`` of the largest expected count.
    """

    name = "poisson"

    def __init__(self, eta_max: float = 8.0) -> None:
        if not math.isfinite(eta_max):
            raise ValueError("Poisson needs a finite eta_max to bound A''")
        self.eta_max = eta_max
        self._top = math.exp(eta_max)

    def A(self, eta: torch.Tensor) -> torch.Tensor:
        d = eta - self.eta_max
        return torch.where(
            d <= 0, torch.exp(eta.clamp(max=self.eta_max)), self._top * (1.0 + d + 0.5 * d * d)
        )

    def sigma(self, eta: torch.Tensor) -> torch.Tensor:
        d = eta - self.eta_max
        return torch.where(d <= 0, torch.exp(eta.clamp(max=self.eta_max)), self._top * (1.0 + d))

    def sigma_inv(self, mu: torch.Tensor) -> torch.Tensor:
        tiny = torch.finfo(mu.dtype).tiny
        return torch.where(
            mu <= self._top,
            torch.log(mu.clamp(min=tiny)),
            self.eta_max + mu / self._top - 1.0,
        )

    def A2(self, eta: torch.Tensor) -> torch.Tensor:
        return torch.exp(eta.clamp(max=self.eta_max))

    def sup_A2(self) -> float:
        return self._top

    def T(self, y: torch.Tensor) -> torch.Tensor:
        return y


FAMILIES = {
    "gaussian": Gaussian,
    "bernoulli": Bernoulli,
    "binomial": Binomial,
    "spin": Spin,
    "poisson": Poisson,
}


def get_family(name: str, **params: float) -> Family:
    """Build a family from the registry by name, e.g. ``get_family("binomial", trials=4)``."""
    try:
        factory = FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown family {name!r}; known: {sorted(FAMILIES)}") from None
    return factory(**params)
