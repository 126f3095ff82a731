"""The kGLM deep equilibrium layer (Theorem 3 with the mean of Appendix H).

Equilibrium and readout, per sample, with ``M`` the observed-set mask (1 where observed):

    z  = σ(M⊙[W1(M⊙z) + W2(M⊙T(Y)) + W3(M⊙ρ(z))] + m)
    η̃ = V1(M⊙(z + ρ(z))) + V2(M⊙T(Y)) + m̃

``η̃`` is the canonical parameter ``f(X̃) + m(X̃)`` at the outer coordinates;
``σ(η̃)`` is the predictive mean. Masking the inputs of each map restricts the
kernel's columns to observed pixels and masking the equilibrium's pre-activation
restricts its rows (DESIGN §2.4): ``W1 = −MKM/λ`` and the readout is ``k(X̃, X_obs)``.
Without a mask every coordinate is observed.

The maps ``W·`` and ``V·`` are modules (dense matrices or convolutions), so a
kGLM-initialised layer (``kdeq.maths.kglm``) can be fine-tuned as a DEQ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdeq.maths.conv import Padding, Stationary, conv
from kdeq.maths.families import Family, Gaussian
from kdeq.maths.implicit import Backward, equilibrium
from kdeq.maths.linear import solve_affine
from kdeq.maths.priors import Prior, rho
from kdeq.maths.solvers import SolverConfig, SolverStats


class DenseMap(nn.Module):
    """``x ↦ W x`` for ``x`` ``(B, n_in)`` and trainable ``W`` ``(n_out, n_in)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class ConvMap(nn.Module):
    """``x ↦ C * x`` for ``x`` ``(B, c_in, H, W)`` and a trainable bank ``C`` ``(c_out, c_in, k, k)``."""

    def __init__(self, bank: torch.Tensor, padding: Padding = "zeros") -> None:
        super().__init__()
        self.weight = nn.Parameter(bank.clone())
        self.padding = padding

    def stationary(self) -> Stationary | None:
        """The map as one filter (``kdeq.maths.linear``) when the bank has one input and one
        output channel."""
        if self.weight.shape[:2] != (1, 1):
            return None
        return Stationary(self.weight[0, 0], torch.ones((), dtype=self.weight.dtype), self.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv(x, self.weight, self.padding)


@dataclass(frozen=True)
class DEQOutput:
    """``eta``: canonical parameter at ``X̃``; ``z``: equilibrium at ``X``; ``stats``: per sample."""

    eta: torch.Tensor
    z: torch.Tensor
    stats: SolverStats


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` are one tensor's values: the same object, or views of the same memory
    with the same shape, strides and dtype (two slices ``m[:, :1]`` of one mean). Decided from
    metadata, so it never reads the values (no device synchronisation)."""
    if a is b:
        return True
    if a is None or b is None:
        return False

    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device

    return key(a) == key(b)


class KGLMDEQ(nn.Module):
    """A DEQ whose fixed point is a kGLM embedding ``z = A'(Kα + m)``.

    Args:
        family: the exponential family (gives ``σ``, ``T``).
        prior: the prior factor (gives ``ρ``); a flat prior drops ``W3``.
        w1, w2, w3, v1, v2: the linear maps; ``w3`` is ``None`` for a flat prior.
        solver: default forward solver.
        backward: ``implicit`` or ``jacobian_free`` gradients.
        backward_solver: settings of the implicit adjoint solve (default: see
            ``kdeq.maths.implicit.equilibrium``).
        same_coordinates: ``X̃ = X`` (convolutional form, or dense without a
            separate ``k(X̃, X)``), so the readout's mean defaults to ``m``.
    """

    def __init__(
        self,
        family: Family,
        prior: Prior,
        w1: nn.Module,
        w2: nn.Module,
        w3: nn.Module | None,
        v1: nn.Module,
        v2: nn.Module,
        solver: SolverConfig | None = None,
        backward: Backward = "implicit",
        backward_solver: SolverConfig | None = None,
        same_coordinates: bool = True,
    ) -> None:
        super().__init__()
        if (w3 is None) != prior.flat:
            raise ValueError("W3 must be given exactly when the prior is not flat (ρ ≢ 0)")
        self.family = family
        self.prior = prior
        self.w1, self.w2, self.w3, self.v1, self.v2 = w1, w2, w3, v1, v2
        self.solver = solver or SolverConfig()
        self.backward = backward
        self.backward_solver = backward_solver
        self.same_coordinates = same_coordinates

    @property
    def readout_is_map(self) -> bool:
        """``V1 = W1`` and ``V2 = W2`` as modules: without a mask and with ``m̃ = m`` the readout is
        then the equilibrium map itself, ``η̃ = f(z)``."""
        return self.v1 is self.w1 and self.v2 is self.w2

    @property
    def affine(self) -> bool:
        """Whether the equilibrium map is affine in ``z`` (Gaussian family, flat prior): then a CG
        solve without autograd goes to ``kdeq.maths.linear``, which solves the same system faster."""
        return isinstance(self.family, Gaussian) and self.w3 is None

    def cell(
        self,
        z: torch.Tensor,
        t: torch.Tensor,
        mean: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One application of the equilibrium map ``z ↦ σ(M⊙[W1 M z + W2 M t + W3 M ρ(z)] + m)``,
        with ``t = T(Y)`` already computed; all tensors share ``z``'s shape (mask broadcasts)."""
        mz = z if mask is None else mask * z
        pre = self.w1(mz) + self.w2(t if mask is None else mask * t)
        if self.w3 is not None:
            r = rho(self.prior, self.family, z)
            pre = pre + self.w3(r if mask is None else mask * r)
        if mask is not None:
            pre = mask * pre
        if mean is not None:
            pre = pre + mean
        return self.family.sigma(pre)

    def readout(
        self,
        z: torch.Tensor,
        t: torch.Tensor,
        mean_out: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``η̃ = V1(M⊙(z + ρ(z))) + V2(M⊙t) + m̃``."""
        s = z + rho(self.prior, self.family, z) if self.w3 is not None else z
        if mask is not None:
            s, t = mask * s, mask * t
        eta = self.v1(s) + self.v2(t)
        return eta if mean_out is None else eta + mean_out

    def forward(
        self,
        y: torch.Tensor,
        mean: torch.Tensor | None = None,
        mean_out: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        z0: torch.Tensor | None = None,
        solver: SolverConfig | None = None,
    ) -> DEQOutput:
        """Solve for ``z`` given observations ``y`` (``(B, n)`` dense or ``(B, c, H, W)`` conv) and read out.

        ``mean``/``mean_out`` are ``m(X)`` and ``m(X̃)`` (default 0; ``mean_out``
        defaults to ``mean`` when ``X̃ = X`` and must be given otherwise),
        ``mask`` the observed set (default all), ``z0`` the start (default ``σ(m)``, or
        ``solve_affine``'s choice), ``solver`` an override of the layer's default. With the ``cg``
        method, an affine map and autograd off the solve is ``kdeq.maths.linear.solve_affine`` (a
        transform where one diagonalises the map, else preconditioned CG); otherwise
        ``kdeq.maths.implicit.equilibrium``.
        """
        if mean is not None and mean_out is None:
            if not self.same_coordinates:
                raise ValueError("a mean m(X) was given without m(X̃); pass mean_out for X̃ ≠ X")
            mean_out = mean
        t = self.family.T(y)
        cfg = solver or self.solver
        if cfg.method == "cg" and self.affine and not torch.is_grad_enabled():
            tied = self.readout_is_map and mask is None and _same_tensor(mean_out, mean)
            z, stats, fz = solve_affine(self.w1, self.w2, t, mean, mask, z0, cfg, with_map=tied)
            if fz is not None:
                return DEQOutput(fz, z, stats)
        else:
            if z0 is None:
                z0 = self.family.sigma(mean if mean is not None else torch.zeros_like(t))
            z, stats = equilibrium(
                lambda v: self.cell(v, t, mean, mask), z0, cfg, self.backward, self.backward_solver
            )
        return DEQOutput(self.readout(z, t, mean_out, mask), z, stats)
