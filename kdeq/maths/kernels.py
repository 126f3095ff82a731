"""Positive-definite kernels on pixel coordinates, their Gram matrices and filter banks.

A kernel here is ``k(x, x') = s² · g(‖x − x'‖/ℓ) · τ(x − x')``: a stationary
profile ``g`` (squared exponential, Matérn 3/2 or 5/2) times a compactly
supported positive-definite taper ``τ`` of radius ``R`` pixels. A product of
PSD kernels is PSD (Schur), so the tapered kernel is PSD and vanishes beyond
``R``: on the pixel grid it is a ``(2R+1)×(2R+1)`` convolution (Corollary 11).

The ``box`` taper (an indicator of ``‖x − x'‖∞ ≤ R``, as in the paper's
reference code) is *not* positive definite — its Fourier symbol goes negative
once the lengthscale passes about 1.2 pixels — and exists so that the PSD
checks below can be shown to reject it (DESIGN §2.2).

Multi-channel kernels are coregionalised: ``k((x,i),(x',j)) = Σ_q B_q[i,j] k_q(x,x')``
with every ``B_q`` PSD; their filter banks have shape ``(c, c, 2R+1, 2R+1)``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

Profile = Literal["se", "matern32", "matern52"]
Taper = Literal["triangular", "wendland", "box"]


class Kernel(BaseModel):
    """A tapered stationary kernel on ``d``-dimensional coordinates (pixel units).

    Attributes:
        profile: ``se`` ``exp(−r²/2ℓ²)``; ``matern32`` ``(1+√3r/ℓ)e^{−√3r/ℓ}``;
            ``matern52`` ``(1+√5r/ℓ+5r²/3ℓ²)e^{−√5r/ℓ}``.
        lengthscale: ``ℓ > 0``.
        variance: ``s² > 0``.
        taper: ``triangular`` ``Π_d (1 − |δ_d|/(R+1))₊`` (PD on ℝ^d: its Fourier
            transform is a product of sinc², and on ℤ^d a product of Fejér kernels);
            ``wendland`` ``(1 − t)₊⁴(4t + 1)`` with ``t = ‖δ‖/(R+1)`` (PD for d ≤ 3);
            ``box`` the non-PSD indicator of the reference code.
        radius: ``R``, the largest offset (in pixels) at which ``k`` is non-zero.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: Profile = "se"
    lengthscale: float = Field(2.0, gt=0)
    variance: float = Field(1.0, gt=0)
    taper: Taper = "triangular"
    radius: int = Field(6, ge=0)

    def profile_value(self, r: torch.Tensor) -> torch.Tensor:
        """``s² g(r/ℓ)`` for distances ``r ≥ 0`` of any shape."""
        u = r / self.lengthscale
        if self.profile == "se":
            g = torch.exp(-0.5 * u * u)
        elif self.profile == "matern32":
            a = math.sqrt(3.0) * u
            g = (1.0 + a) * torch.exp(-a)
        else:
            a = math.sqrt(5.0) * u
            g = (1.0 + a + a * a / 3.0) * torch.exp(-a)
        return self.variance * g

    def taper_value(self, delta: torch.Tensor) -> torch.Tensor:
        """``τ(δ)`` for offsets ``δ`` of shape ``(..., d)``; returns shape ``(...)``."""
        support = self.radius + 1.0
        if self.taper == "triangular":
            return (1.0 - delta.abs() / support).clamp(min=0.0).prod(dim=-1)
        if self.taper == "wendland":
            t = (delta.norm(dim=-1) / support).clamp(max=1.0)
            return (1.0 - t) ** 4 * (4.0 * t + 1.0)
        return (delta.abs().amax(dim=-1) <= self.radius).to(delta.dtype)

    def __call__(self, delta: torch.Tensor) -> torch.Tensor:
        """``k`` at offsets ``δ = x − x'`` of shape ``(..., d)``; returns ``(...)``."""
        return self.profile_value(delta.norm(dim=-1)) * self.taper_value(delta)

    def gram(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """Dense ``k(X₁, X₂)`` for coordinates ``x1`` ``(n₁, d)`` and ``x2`` ``(n₂, d)``: ``(n₁, n₂)``."""
        x2 = x1 if x2 is None else x2
        return self(x1[:, None, :] - x2[None, :, :])

    def filter(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The 2-D filter ``C[a, b] = k((a − R, b − R))``, shape ``(2R+1, 2R+1)``."""
        r = self.radius
        offsets = torch.arange(-r, r + 1, dtype=dtype)
        delta = torch.stack(torch.meshgrid(offsets, offsets, indexing="ij"), dim=-1)
        return self(delta)


class Coregional(BaseModel):
    """``k((x,i),(x',j)) = Σ_q B_q[i,j] k_q(x,x')`` over ``c`` channels, each ``B_q`` PSD.

    With one term and ``B = [[1]]`` this is the single-channel kernel itself.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kernels: tuple[Kernel, ...]
    mixing: tuple[tuple[tuple[float, ...], ...], ...]

    @model_validator(mode="after")
    def _check(self) -> Coregional:
        if len(self.kernels) != len(self.mixing) or not self.kernels:
            raise ValueError("need one mixing matrix B_q per kernel k_q, at least one")
        c = len(self.mixing[0])
        for q, b in enumerate(self.mixing):
            mat = torch.tensor(b, dtype=torch.float64)
            if mat.shape != (c, c):
                raise ValueError(f"mixing matrix {q} has shape {tuple(mat.shape)}, expected ({c}, {c})")
            if not torch.allclose(mat, mat.T):
                raise ValueError(f"mixing matrix {q} is not symmetric")
            lo = torch.linalg.eigvalsh(mat).min().item()
            if lo < -1e-12 * max(1.0, mat.abs().max().item()):
                raise ValueError(f"mixing matrix {q} is not PSD (smallest eigenvalue {lo:.3g})")
        return self

    @classmethod
    def single(cls, kernel: Kernel, channels: int = 1) -> Coregional:
        """The same kernel on each of ``channels`` independent channels (``B = I``)."""
        eye = tuple(tuple(float(i == j) for j in range(channels)) for i in range(channels))
        return cls(kernels=(kernel,), mixing=(eye,))

    @property
    def channels(self) -> int:
        return len(self.mixing[0])

    @property
    def radius(self) -> int:
        return max(k.radius for k in self.kernels)

    def gram(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """Dense Gram over (channel, coordinate) pairs, channel-major: ``(c·n₁, c·n₂)``.

        Row ``i·n₁ + p`` is channel ``i`` at coordinate ``x1[p]``, matching the
        flattening of a ``(c, H, W)`` image.
        """
        out = None
        for kern, b in zip(self.kernels, self.mixing, strict=True):
            g = kern.gram(x1, x2)
            term = torch.kron(torch.tensor(b, dtype=g.dtype), g)
            out = term if out is None else out + term
        return out

    def filter_bank(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Convolution weights ``Σ_q B_q ⊗ C_q``, shape ``(c, c, 2R+1, 2R+1)``, ``R`` the largest radius."""
        r = self.radius
        bank = torch.zeros(self.channels, self.channels, 2 * r + 1, 2 * r + 1, dtype=dtype)
        for kern, b in zip(self.kernels, self.mixing, strict=True):
            pad = r - kern.radius
            f = torch.nn.functional.pad(kern.filter(dtype), (pad, pad, pad, pad))
            bank += torch.tensor(b, dtype=dtype)[:, :, None, None] * f
        return bank


def grid_coordinates(height: int, width: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Pixel coordinates ``(i, j)`` of an ``H×W`` grid in row-major order: ``(H·W, 2)``."""
    ii, jj = torch.meshgrid(
        torch.arange(height, dtype=dtype), torch.arange(width, dtype=dtype), indexing="ij"
    )
    return torch.stack([ii.reshape(-1), jj.reshape(-1)], dim=-1)


def filter_symbol(bank: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Per-frequency matrices of a filter bank (Sedghi et al., 2019).

    For ``bank`` ``(c_out, c_in, kh, kw)`` centred at ``(kh//2, kw//2)``, returns
    ``Ĉ(ω)[o, i] = Σ_n C[o, i, n] e^{−i ω·n}`` at ``ω = 2π(u/N₁, v/N₂)``, shape
    ``(N₁, N₂, c_out, c_in)``, complex. These are exactly the blocks that
    diagonalise the circular convolution on an ``N₁×N₂`` grid.
    """
    n1, n2 = size
    kh, kw = bank.shape[-2:]
    if kh > n1 or kw > n2:
        raise ValueError(f"grid {size} is smaller than the filter ({kh}, {kw})")
    padded = torch.zeros(*bank.shape[:2], n1, n2, dtype=bank.dtype)
    padded[..., :kh, :kw] = bank
    padded = torch.roll(padded, shifts=(-(kh // 2), -(kw // 2)), dims=(-2, -1))
    return torch.fft.fft2(padded).permute(2, 3, 0, 1)


def gram_min_eigenvalue(gram: torch.Tensor) -> float:
    """Smallest eigenvalue of a symmetric Gram matrix ``(n, n)``."""
    return torch.linalg.eigvalsh(gram.to(torch.float64)).min().item()


def symbol_min_eigenvalue(bank: torch.Tensor, size: tuple[int, int] | None = None) -> float:
    """Smallest eigenvalue of ``Ĉ(ω)`` over a frequency grid, for a symmetric bank ``(c, c, k, k)``.

    Negative means the convolution is not PSD on a large enough grid. The
    default grid is ``max(64, 8k)`` per side, fine enough to resolve the
    symbol of a ``k``-tap filter; pass ``size`` for an exact circular grid.
    """
    if size is None:
        n = max(64, 8 * max(bank.shape[-2:]))
        size = (n, n)
    sym = filter_symbol(bank.to(torch.float64), size)
    sym = 0.5 * (sym + sym.conj().transpose(-2, -1))
    return torch.linalg.eigvalsh(sym).min().item()


class NotPSDError(ValueError):
    """A kernel's Gram matrix or filter symbol has a negative eigenvalue."""


def require_psd(min_eig: float, scale: float, what: str, rtol: float = 1e-10) -> None:
    """Raise ``NotPSDError`` when ``min_eig < −rtol·scale`` (``scale``: e.g. the largest eigenvalue)."""
    if min_eig < -rtol * scale:
        raise NotPSDError(f"{what} is not positive semi-definite: smallest eigenvalue {min_eig:.3g}")


def require_psd_filter(bank: torch.Tensor, what: str, rtol: float = 1e-10) -> None:
    """``require_psd`` for a convolution: a bank ``(c, c, k, k)`` or one filter ``(k, k)``, judged by
    its symbol's smallest eigenvalue against ``Σ|C|`` (a bound on the symbol's magnitude)."""
    bank = bank if bank.dim() == 4 else bank[None, None]
    require_psd(symbol_min_eigenvalue(bank), float(bank.abs().sum()), what, rtol)
