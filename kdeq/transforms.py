"""Orthonormal 2-D transforms that diagonalise stationary kernel operators, and their symbols.

For a filter ``h`` of radius ``R`` (``(2R+1, 2R+1)``, centred) on an ``H×W`` grid:

- **circular** border: ``C x = F⁻¹(ĥ ⊙ F x)`` with ``F`` the 2-D DFT and
  ``ĥ(u, v) = Σ_{a,b} h(a, b) e^{−2πi(ua/H + vb/W)}``; exact for any ``h``.
- **symmetric** border (the image mirrored with its edge pixel repeated,
  ``x[−1] = x[0]``): ``C x = D⁻¹(ĥ ⊙ D x)`` with ``D`` the orthonormal 2-D
  DCT-II and ``ĥ(u, v) = Σ_{a,b} h(a, b) cos(πua/H) cos(πvb/W)``; exact when
  ``h`` is even in each axis (``h(a, b) = h(−a, b) = h(a, −b)``) and ``R ≤ H, W``.

Both are orthonormal, so ``‖x‖ = ‖D x‖`` (residuals may be measured in either domain).
The DCT is computed from one real FFT per axis (Makhoul's reordering).
"""

from __future__ import annotations

import math

import torch


def _reorder(n: int, device: torch.device) -> torch.Tensor:
    """Indices ``v = (x₀, x₂, x₄, …, x₅, x₃, x₁)``: even entries ascending, then odd descending."""
    idx = torch.arange(n, device=device)
    return torch.cat([idx[0::2], idx[1::2].flip(0)])


def _twiddle(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``√(2/N) e^{−iπk/2N}`` for ``k < N``, with the ``k = 0`` entry scaled by ``1/√2`` (orthonormality)."""
    k = torch.arange(n, dtype=torch.float64, device=device)
    w = torch.polar(torch.full_like(k, math.sqrt(2.0 / n)), -math.pi * k / (2 * n))
    w[0] = w[0] / math.sqrt(2.0)
    return w.to(torch.complex128 if dtype == torch.float64 else torch.complex64)


def _dct_last(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II along the last axis of a real tensor."""
    n = x.shape[-1]
    v = x.index_select(-1, _reorder(n, x.device))
    half = torch.fft.rfft(v, dim=-1)
    full = torch.cat([half, half[..., 1 : (n + 1) // 2].flip(-1).conj()], dim=-1)
    return (full * _twiddle(n, x.dtype, x.device)).real


def _idct_last(y: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_dct_last`` (orthonormal DCT-III) along the last axis."""
    n = y.shape[-1]
    w = _twiddle(n, y.dtype, y.device)
    m = n // 2 + 1
    # V_k = (Y_k − i Y_{N−k}) / w_k with Y_N = 0, needed for k ≤ N/2 only (v is real)
    mirrored = torch.cat([torch.zeros_like(y[..., :1]), y[..., n - m + 1 :].flip(-1)], dim=-1)
    spec = torch.complex(y[..., :m], -mirrored) / w[:m]
    v = torch.fft.irfft(spec, n=n, dim=-1)
    out = torch.empty_like(v)
    out.index_copy_(-1, _reorder(n, y.device), v)
    return out


def dct2(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal 2-D DCT-II over the last two axes: ``(…, H, W) → (…, H, W)``."""
    return _dct_last(_dct_last(x).transpose(-1, -2)).transpose(-1, -2)


def idct2(y: torch.Tensor) -> torch.Tensor:
    """Inverse of ``dct2`` (orthonormal 2-D DCT-III)."""
    return _idct_last(_idct_last(y).transpose(-1, -2)).transpose(-1, -2)


def is_axis_even(bank: torch.Tensor, atol: float = 0.0) -> bool:
    """Whether every filter of ``bank`` ``(…, k, k)`` is even in each axis separately."""
    return bool(
        torch.allclose(bank, bank.flip(-1), rtol=0, atol=atol)
        and torch.allclose(bank, bank.flip(-2), rtol=0, atol=atol)
    )


def dct_symbol(taps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``ĥ(u, v) = Σ_{a,b} h(a, b) cos(πua/H) cos(πvb/W)`` ``(H, W)`` for centred taps ``(2R+1, 2R+1)``:
    the eigenvalues of the symmetric-border convolution (exact for axis-even ``h``, ``R ≤ H, W``)."""
    height, width = size
    r = taps.shape[-1] // 2
    if r > min(height, width):
        raise ValueError(f"a {2 * r + 1}-tap filter needs images of at least {r}×{r} pixels")
    offs = torch.arange(-r, r + 1, dtype=torch.float64, device=taps.device)
    cu = torch.cos(
        math.pi * torch.arange(height, dtype=torch.float64, device=taps.device)[:, None] * offs / height
    )
    cv = torch.cos(
        math.pi * torch.arange(width, dtype=torch.float64, device=taps.device)[:, None] * offs / width
    )
    return (cu @ taps.to(torch.float64) @ cv.T).to(taps.dtype)


def dft_symbol(taps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``ĥ(u, v)`` ``(H, W//2+1)`` of centred taps ``(2R+1, 2R+1)`` on the ``rfft2`` grid: the eigenvalues
    of the circular convolution (real for point-symmetric ``h``, the only ones kernels give)."""
    height, width = size
    k = taps.shape[-1]
    if k > min(height, width):
        raise ValueError(f"a {k}-tap filter needs images of at least {k}×{k} pixels for circular borders")
    padded = torch.zeros(height, width, dtype=torch.float64, device=taps.device)
    padded[:k, :k] = taps.to(torch.float64)
    padded = torch.roll(padded, shifts=(-(k // 2), -(k // 2)), dims=(0, 1))
    return torch.fft.rfft2(padded).real.to(taps.dtype)
