"""Optimisation-induced equilibrium layers: OptEq and KerDEQ (dense and patch form).

Each layer's equilibrium is a stationary point of an energy, per sample,

    G(z; x) = 1ᵀf(z) + ½‖z‖² − Φ(z; x),

with ``f`` convex and ``σ = prox_f`` the activation: ``0 ∈ ∂f(z) + z − ∇Φ(z)`` is
``z = σ(∇Φ(z))``, which is the DEQ map. With ``r = Ux + b − Wz``:

- ``OptEq``:  ``Φ = ½‖Wz‖² + ⟨Ux + b, z⟩``, so ``z = σ(WᵀWz + Ux + b)``.
- ``KerDEQ``: ``Φ = (1/2γ)·exp(−γ‖r‖²)`` (a Gaussian kernel between ``Ux + b`` and ``Wz``), so
  ``z = σ(exp(−γ‖r‖²)·Wᵀr)``. As ``γ → 0``, ``Φ = 1/2γ − ½‖r‖² + O(γ)``: the fixed point tends
  to that of ``z = σ(Wᵀ(Ux + b − Wz))``, the minimiser of ``1ᵀf(z) + ½‖z‖² + ½‖r‖²``.
- ``PatchKerDEQ``: KerDEQ on images with ``U``, ``W`` convolutions and the kernel summed over
  the patches ``r̃_j = x̃_j − z̃_j`` of ``r`` (one per pixel): ``Φ = (1/2γ)·Σ_j exp(−γ‖r̃_j W_h‖²)``,
  so ``z = σ(Wᵀm)`` with ``m = Σ_j P_jᵀ m̃_j``, ``m̃_j = exp(−γ‖r̃_j W_h‖²)·r̃_j W_h W_hᵀ``, ``P_j``
  the extraction of patch ``j`` and ``Σ_j P_jᵀ`` its adjoint (overlap-add).

Activations (``ACTIVATIONS``): ``relu``, the prox of the indicator of ``z ≥ 0``, and ``tanh``,
the prox of ``f(z) = ½[(1+z)ln(1+z) + (1−z)ln(1−z)] − z²/2`` on ``[−1, 1]`` (``f′(z) = artanh z − z``,
so ``v ∈ z + ∂f(z)`` is ``z = tanh v``; this equals ``z·artanh z + ½ln(1−z²) − z²/2`` inside).

Initialisation (seeded) makes the map a contraction, so the default Anderson solve converges:
``σ`` is 1-Lipschitz, and ``‖∂/∂r (e^{−γ‖r‖²} r)‖ ≤ 1`` (its eigenvalues are ``e^{−t}`` and
``e^{−t}(1 − 2t)``, ``t = γ‖r‖²``), so the map's Lipschitz constant is at most ``‖W‖²``, and
``‖A‖²`` for the patch form, ``A = z ↦ (r̃_j W_h)_j`` the linear part of ``z ↦ (s_j)_j`` (the
Jacobian is ``−AᵀDA`` with ``‖D‖ ≤ 1``). A dense ``W`` is drawn Gaussian and rescaled to
``‖W‖ = 0.7``; in the patch form ``W_h`` is rescaled to ``‖W_h‖ = 1/patch`` (so that
``‖r̃_j W_h‖² ≲ ‖r̃_j‖²/patch²``, about 1) and the conv ``W`` so that ``‖A‖² = 0.49``, ``‖A‖``
estimated by power iteration on a 32 × 32 image (larger images reach about 0.5): the map contracts
by about ``0.49`` at initialisation. ``U`` has variance ``1/fan_in`` (OptEq) or
``1/(fan_in·n_latent)`` (KerDEQ: ``‖Ux‖² ≈ 1`` for unit-variance inputs, so the kernel neither
saturates nor vanishes); ``b = 0``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kdeq.maths.implicit import Backward, equilibrium
from kdeq.maths.solvers import SolverConfig, SolverStats

#: ``‖W‖`` (``‖A‖`` in the patch form) at initialisation: the map contracts by ``0.7² = 0.49``
W_NORM = 0.7

_TensorFn = Callable[[torch.Tensor], torch.Tensor]


def _relu_penalty(z: torch.Tensor) -> torch.Tensor:
    """``1ᵀf(z)`` per sample ``(B,)`` for the indicator of ``z ≥ 0``: 0 or ``+∞``."""
    feasible = (z.reshape(z.shape[0], -1) >= 0).all(dim=1)
    return torch.where(feasible, 0.0, torch.inf).to(z.dtype)


def _tanh_penalty(z: torch.Tensor) -> torch.Tensor:
    """``1ᵀf(z)`` per sample ``(B,)`` for ``f(z) = ½[(1+z)ln(1+z) + (1−z)ln(1−z)] − z²/2``, ``+∞``
    outside ``[−1, 1]``."""
    flat = z.reshape(z.shape[0], -1)
    # clamped so that the unused branch stays finite (a NaN there would poison the gradient)
    c = flat.clamp(-1, 1)
    value = (0.5 * (torch.xlogy(1 + c, 1 + c) + torch.xlogy(1 - c, 1 - c)) - 0.5 * c**2).sum(dim=1)
    return torch.where((flat.abs() <= 1).all(dim=1), value, torch.inf)


#: activation name -> (σ = prox_f, z ↦ 1ᵀf(z) per sample)
ACTIVATIONS: dict[str, tuple[_TensorFn, _TensorFn]] = {
    "relu": (torch.relu, _relu_penalty),
    "tanh": (torch.tanh, _tanh_penalty),
}


def _spectral(shape: tuple[int, ...], norm: float, gen: torch.Generator) -> torch.Tensor:
    """A Gaussian tensor of ``shape`` rescaled so that its ``(shape[0], −1)`` matrix has spectral norm
    ``norm``."""
    w = torch.randn(shape, generator=gen)
    return w * (norm / torch.linalg.matrix_norm(w.reshape(shape[0], -1), ord=2))


def _per_sample(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).sum(dim=1)


class _EnergyDEQ(nn.Module):
    """The shared equilibrium ``z = σ(∇Φ(z; x))`` and energy ``G`` (module docstring); subclasses
    define the injection ``x ↦ Ux + b``, ``∇Φ``, ``Φ`` and the state's shape.

    ``phantom_steps`` and ``phantom_damping`` (``k``, ``τ``) set the ``phantom`` backward."""

    def __init__(self, activation: str, solver: SolverConfig | None, backward: Backward) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.solver = solver or SolverConfig(method="anderson")
        self.backward: Backward = backward
        self.phantom_steps = 5
        self.phantom_damping = 0.5

    def _inject(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _grad_phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _hidden_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
        """The equilibrium ``z* = σ(∇Φ(z*; x))`` solved from ``z = 0``, with its per-sample stats;
        gradients per ``backward`` (``kdeq.maths.implicit``)."""
        sigma = ACTIVATIONS[self.activation][0]
        # computed once, outside the solver's loop; the map keeps its graph for the backward
        inj = self._inject(x)
        z0 = torch.zeros(self._hidden_shape(x), dtype=x.dtype, device=x.device)
        return equilibrium(
            lambda z: sigma(self._grad_phi(z, inj)),
            z0,
            self.solver,
            self.backward,
            phantom_steps=self.phantom_steps,
            phantom_damping=self.phantom_damping,
        )

    def energy(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``G(z; x) = 1ᵀf(z) + ½‖z‖² − Φ(z; x)`` per sample ``(B,)`` (``+∞`` outside ``dom f``; the
        inference output of ``forward`` is an Anderson iterate, whose ReLU zeros may be off by
        rounding, so evaluate a ReLU layer's energy at ``z.clamp(min=0)``)."""
        penalty = ACTIVATIONS[self.activation][1]
        return penalty(z) + 0.5 * _per_sample(z**2) - self._phi(z, self._inject(x))


class OptEq(_EnergyDEQ):
    """OptEq: ``z = σ(WᵀWz + Ux + b)``, the minimiser of ``1ᵀf(z) + ½‖z‖² − ½‖Wz‖² − ⟨Ux + b, z⟩``
    (convex while ``‖W‖ ≤ 1``).

    Shapes: ``x`` ``(B, n_in)``, ``z`` ``(B, n_hidden)``; parameters ``w`` ``(n_latent, n_hidden)``,
    ``u`` ``(n_hidden, n_in)``, ``b`` ``(n_hidden,)``.
    """

    def __init__(
        self,
        n_in: int,
        n_hidden: int,
        n_latent: int,
        *,
        activation: str = "relu",
        solver: SolverConfig | None = None,
        backward: Backward = "implicit",
        seed: int = 0,
    ) -> None:
        super().__init__(activation, solver, backward)
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(_spectral((n_latent, n_hidden), W_NORM, gen))
        self.u = nn.Parameter(torch.randn((n_hidden, n_in), generator=gen) / n_in**0.5)
        self.b = nn.Parameter(torch.zeros(n_hidden))

    def _inject(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.u.T + self.b

    def _grad_phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        return (z @ self.w.T) @ self.w + inj

    def _phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((z @ self.w.T) ** 2).sum(dim=1) + (inj * z).sum(dim=1)

    def _hidden_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (x.shape[0], self.w.shape[1])


class _GaussianKernelDEQ(_EnergyDEQ):
    """An ``_EnergyDEQ`` whose ``Φ`` is a Gaussian kernel ``(1/2γ)·exp(−γ‖·‖²)``: its fixed ``γ > 0``."""

    def __init__(
        self, gamma: float, activation: str, solver: SolverConfig | None, backward: Backward
    ) -> None:
        super().__init__(activation, solver, backward)
        if not gamma > 0:
            raise ValueError(f"gamma must be positive, got {gamma}")
        self._gamma = float(gamma)

    @property
    def gamma(self) -> float:
        """The kernel's ``γ``."""
        return self._gamma


class KerDEQ(_GaussianKernelDEQ):
    """KerDEQ: ``z = σ(exp(−γ‖r‖²)·Wᵀr)``, ``r = Ux + b − Wz``, a stationary point of
    ``1ᵀf(z) + ½‖z‖² − (1/2γ)·exp(−γ‖r‖²)``.

    Shapes: ``x`` ``(B, n_in)``, ``z`` ``(B, n_hidden)``; parameters ``w`` ``(n_latent, n_hidden)``,
    ``u`` ``(n_latent, n_in)``, ``b`` ``(n_latent,)``; ``gamma`` ``γ > 0`` is fixed.
    """

    def __init__(
        self,
        n_in: int,
        n_hidden: int,
        n_latent: int,
        *,
        gamma: float = 0.5,
        activation: str = "relu",
        solver: SolverConfig | None = None,
        backward: Backward = "implicit",
        seed: int = 0,
    ) -> None:
        super().__init__(gamma, activation, solver, backward)
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(_spectral((n_latent, n_hidden), W_NORM, gen))
        self.u = nn.Parameter(torch.randn((n_latent, n_in), generator=gen) / (n_in * n_latent) ** 0.5)
        self.b = nn.Parameter(torch.zeros(n_latent))

    def _inject(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.u.T + self.b

    def _grad_phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        r = inj - z @ self.w.T
        return torch.exp(-self._gamma * (r**2).sum(dim=1, keepdim=True)) * (r @ self.w)

    def _phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        r = inj - z @ self.w.T
        return torch.exp(-self._gamma * (r**2).sum(dim=1)) / (2 * self._gamma)

    def _hidden_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (x.shape[0], self.w.shape[1])


class PatchKerDEQ(_GaussianKernelDEQ):
    """KerDEQ on images (Algorithm 1): ``z = σ(Wᵀm)``, ``m = Σ_j P_jᵀ m̃_j``,
    ``m̃_j = exp(−γ‖r̃_j W_h‖²)·r̃_j W_h W_hᵀ`` over the ``patch × patch`` patches ``r̃_j`` of
    ``r = Ux + b − Wz`` — a stationary point of ``1ᵀf(z) + ½‖z‖² − (1/2γ)·Σ_j exp(−γ‖r̃_j W_h‖²)``.

    ``U`` ``(c_latent, c_in, k, k)`` and ``W`` ``(c_latent, c_hidden, k, k)`` are zero-padded
    "same" convolutions (parameters ``u``, ``w``; ``b`` ``(c_latent,)`` per channel) and ``Wᵀ`` is
    ``W``'s adjoint (the transposed convolution). There is one patch per pixel, zero-padded at the
    border, flattened as ``(channel, row offset, column offset)`` into a row of length
    ``p = c_latent·patch²``; ``w_h`` ``(p, q)``, ``q = projection`` (default ``p``).
    Shapes: ``x`` ``(B, c_in, H, W)``, ``z`` ``(B, c_hidden, H, W)``.
    """

    def __init__(
        self,
        c_in: int,
        c_hidden: int,
        c_latent: int,
        *,
        kernel_size: int = 3,
        patch: int = 3,
        projection: int | None = None,
        gamma: float = 0.5,
        activation: str = "relu",
        solver: SolverConfig | None = None,
        backward: Backward = "implicit",
        seed: int = 0,
    ) -> None:
        super().__init__(gamma, activation, solver, backward)
        if kernel_size < 1 or kernel_size % 2 == 0 or patch < 1 or patch % 2 == 0:
            raise ValueError(f"kernel_size and patch must be odd and positive, got {kernel_size}, {patch}")
        self.kernel_size = kernel_size
        self.patch = patch
        p = c_latent * patch**2
        gen = torch.Generator().manual_seed(seed)
        fan_in = c_in * kernel_size**2
        self.u = nn.Parameter(
            torch.randn((c_latent, c_in, kernel_size, kernel_size), generator=gen)
            / (fan_in * c_latent) ** 0.5
        )
        self.b = nn.Parameter(torch.zeros(c_latent))
        self.w_h = nn.Parameter(_spectral((p, projection or p), 1 / patch, gen))
        w = torch.randn((c_latent, c_hidden, kernel_size, kernel_size), generator=gen)
        self.w = nn.Parameter(w)
        with torch.no_grad():
            # ‖A‖² is quadratic in W
            self.w.mul_(W_NORM / self._bound(gen).sqrt())

    def _inject(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.u, self.b, padding=self.kernel_size // 2)

    def _project(self, r: torch.Tensor) -> torch.Tensor:
        """``s_j = r̃_j W_h`` for every patch of ``r`` ``(B, c_latent, H, W)``, as columns ``(B, q, H·W)``."""
        patches = F.unfold(r, self.patch, padding=self.patch // 2)  # (B, p, H·W)
        return torch.einsum("pq,bpl->bql", self.w_h, patches)

    def _back(self, t: torch.Tensor, size: torch.Size) -> torch.Tensor:
        """``Wᵀ Σ_j P_jᵀ W_h t_j`` for columns ``t`` ``(B, q, H·W)`` on ``size = (H, W)`` images: the
        adjoint of ``z ↦ _project(Wz)``."""
        # fold is unfold's adjoint: it adds each patch back where it was taken (overlap-add)
        m = F.fold(torch.einsum("pq,bql->bpl", self.w_h, t), size, self.patch, padding=self.patch // 2)
        return F.conv_transpose2d(m, self.w, padding=self.kernel_size // 2)

    def _bound(self, gen: torch.Generator, size: int = 32, steps: int = 30) -> torch.Tensor:
        """``‖A‖²`` for ``A = z ↦ _project(Wz)`` on ``size × size`` images, by power iteration on
        ``AᵀA``: the map's Jacobian is ``−Aᵀ D A`` with ``‖D‖ ≤ 1`` (module docstring), so this bounds
        its Lipschitz constant (zero padding: larger images approach it from below)."""
        v = torch.randn((1, self.w.shape[1], size, size), generator=gen)
        for _ in range(steps):
            v = v / v.norm()
            v = self._back(self._project(F.conv2d(v, self.w, padding=self.kernel_size // 2)), v.shape[-2:])
        return v.norm()

    def _projected(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        return self._project(inj - F.conv2d(z, self.w, padding=self.kernel_size // 2))

    def _grad_phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        s = self._projected(z, inj)
        return self._back(torch.exp(-self._gamma * (s**2).sum(1, keepdim=True)) * s, z.shape[-2:])

    def _phi(self, z: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
        s = self._projected(z, inj)
        return torch.exp(-self._gamma * (s**2).sum(dim=1)).sum(dim=1) / (2 * self._gamma)

    def _hidden_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (x.shape[0], self.w.shape[1], *x.shape[-2:])
