"""Log-concave prior factors ``q`` on the canonical parameters ``η = f(X) + m(X)``.

With ``Q = −log q`` convex, the kGLM objective gains ``1ᵀQ(η)`` and the DEQ
gains the activation ``ρ = Q' ∘ σ⁻¹`` (Theorem 3; Appendix H for the mean).
``ρ`` is non-decreasing because both ``Q'`` and ``σ⁻¹`` are.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kdeq.maths.families import Family


class Prior(Protocol):
    """``Q = −log q`` and its first two derivatives, elementwise."""

    name: str
    #: True when ``q`` is constant (``ρ ≡ 0``): the DEQ then has no ``W3`` term.
    flat: bool

    def Q(self, eta: torch.Tensor) -> torch.Tensor: ...

    def dQ(self, eta: torch.Tensor) -> torch.Tensor: ...

    def d2Q(self, eta: torch.Tensor) -> torch.Tensor: ...


class GaussianPrior:
    """The Gaussian-process prior alone: ``q`` constant, ``Q ≡ 0``, ``ρ ≡ 0``."""

    name = "gaussian"
    flat = True

    def Q(self, eta: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(eta)

    def dQ(self, eta: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(eta)

    def d2Q(self, eta: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(eta)


class LogCoshPrior:
    """A smoothed Laplace prior: ``Q(η) = β s log cosh(η/s)``.

    Heavy-tailed like a Laplace prior for ``|η| ≫ s`` and Gaussian near 0;
    ``Q' = β tanh(η/s)`` and ``Q'' = (β/s) sech²(η/s) ≥ 0``, so ``q`` is log-concave.
    """

    name = "logcosh"
    flat = False

    def __init__(self, strength: float = 0.1, scale: float = 1.0) -> None:
        if strength <= 0 or scale <= 0:
            raise ValueError("LogCoshPrior needs strength > 0 and scale > 0")
        self.strength = strength
        self.scale = scale

    def Q(self, eta: torch.Tensor) -> torch.Tensor:
        u = (eta / self.scale).abs()
        log_cosh = u + torch.log1p(torch.exp(-2.0 * u)) - math.log(2.0)
        return self.strength * self.scale * log_cosh

    def dQ(self, eta: torch.Tensor) -> torch.Tensor:
        return self.strength * torch.tanh(eta / self.scale)

    def d2Q(self, eta: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(eta / self.scale)
        return (self.strength / self.scale) * (1.0 - t * t)


def rho(prior: Prior, family: Family, z: torch.Tensor) -> torch.Tensor:
    """``ρ(z) = Q'(σ⁻¹(z))``, elementwise; zeros for a flat prior."""
    if prior.flat:
        return torch.zeros_like(z)
    return prior.dQ(family.sigma_inv(z))


PRIORS = {"gaussian": GaussianPrior, "logcosh": LogCoshPrior}


def get_prior(name: str, **params: float) -> Prior:
    """Build a prior from the registry by name."""
    try:
        factory = PRIORS[name]
    except KeyError:
        raise ValueError(f"unknown prior {name!r}; known: {sorted(PRIORS)}") from None
    return factory(**params)
