"""Spectral norms ``‖K‖₂`` of kernel operators, and ``λ`` from a norm ratio.

The Assumption-2 constant is ``C = ‖K/λ‖·sup A''``; ``λ = ‖K‖·sup A''/C`` sets it.
"""

from __future__ import annotations

import torch

from kdeq.maths.conv import Padding, conv
from kdeq.maths.kernels import filter_symbol


def dense_spectral_norm(matrix: torch.Tensor) -> float:
    """``‖W‖₂``, the largest singular value of a dense ``(m, n)`` matrix."""
    return torch.linalg.matrix_norm(matrix.to(torch.float64), ord=2).item()


def circular_spectral_norm(bank: torch.Tensor, size: tuple[int, int]) -> float:
    """Exact ``‖C‖₂`` of circular convolution with ``bank`` ``(c_out, c_in, k, k)`` on an ``N₁×N₂`` grid.

    The operator is block-diagonalised by the 2-D DFT, so its singular values
    are those of the ``c_out×c_in`` symbol matrices ``Ĉ(ω)`` (Sedghi et al.).
    """
    sym = filter_symbol(bank.to(torch.float64), size)
    return torch.linalg.svdvals(sym).max().item()


def conv_spectral_norm(
    bank: torch.Tensor,
    size: tuple[int, int],
    padding: Padding = "zeros",
    iters: int = 500,
    rtol: float = 1e-9,
    seed: int = 0,
) -> float:
    """``‖C‖₂`` of the actual padded convolution on an ``N₁×N₂`` image, by power iteration on ``CᵀC``.

    The adjoint ``Cᵀ`` is the vector-Jacobian product of the operator, so
    borders that break symmetry (``reflect``) are handled exactly. Stops when
    the estimate changes by less than ``rtol`` relatively, or after ``iters`` steps.
    """
    gen = torch.Generator().manual_seed(seed)
    bank = bank.to(torch.float64)
    v = torch.randn(1, bank.shape[1], *size, generator=gen, dtype=torch.float64)
    v /= v.norm()
    estimate = 0.0
    for _ in range(iters):
        x = v.clone().requires_grad_(True)
        y = conv(x, bank, padding)
        (w,) = torch.autograd.grad(y, x, y.detach())
        norm_w = w.norm()
        new = norm_w.sqrt().item()
        if norm_w == 0:
            return 0.0
        v = (w / norm_w).detach()
        if abs(new - estimate) <= rtol * new:
            return new
        estimate = new
    return estimate


def lambda_from_ratio(kernel_norm: float, ratio: float, curvature: float = 1.0) -> float:
    """``λ = ‖K‖·sup A''/C``: the regulariser that puts Assumption 2's constant
    ``‖K/λ‖·sup A''`` at ``C`` (``curvature`` is the family's ``sup A''``; 1 gives ``‖K/λ‖ = C``).
    ``C < 1`` makes plain iteration a contraction."""
    if ratio <= 0 or kernel_norm <= 0 or curvature <= 0:
        raise ValueError("need ‖K‖ > 0, C > 0 and sup A'' > 0")
    return kernel_norm * curvature / ratio
