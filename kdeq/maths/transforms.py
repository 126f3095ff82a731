"""Orthonormal 2-D transforms that diagonalise stationary kernel operators, and their symbols.

For a filter ``h`` of radius ``R`` (``(2R+1, 2R+1)``, centred) on an ``H×W`` grid:

- **circular** border: ``C x = F⁻¹(ĥ ⊙ F x)`` with ``F`` the 2-D DFT and
  ``ĥ(u, v) = Σ_{a,b} h(a, b) e^{−2πi(ua/H + vb/W)}``; exact for any ``h``.
- **symmetric** border (the image mirrored with its edge pixel repeated,
  ``x[−1] = x[0]``): ``C x = D⁻¹(ĥ ⊙ D x)`` with ``D`` the orthonormal 2-D
  DCT-II and ``ĥ(u, v) = Σ_{a,b} h(a, b) cos(πua/H) cos(πvb/W)``; exact when
  ``h`` is even in each axis (``h(a, b) = h(−a, b) = h(a, −b)``) and ``R ≤ H, W``.

Both are orthonormal, so ``‖x‖ = ‖D x‖`` (residuals may be measured in either domain).
The DCT is computed from one real 2-D FFT (Makhoul's reordering applied to both axes).
"""

from __future__ import annotations

import functools
import math

import torch


def _blocks(h: int, w: int) -> list[tuple[tuple[slice, slice], tuple[slice, slice], tuple[int, ...]]]:
    """Makhoul's reordering ``v = (x₀, x₂, x₄, …, x₅, x₃, x₁)`` along both of the last two axes of an
    ``h×w`` grid as four blocks ``(block of v, strided block of x, axes flipped between them)``: even
    entries ascending, then odd ones descending."""
    hv, wv = (h + 1) // 2, (w + 1) // 2
    even, odd = slice(0, None, 2), slice(1, None, 2)
    return [
        ((slice(None, hv), slice(None, wv)), (even, even), ()),
        ((slice(None, hv), slice(wv, None)), (even, odd), (-1,)),
        ((slice(hv, None), slice(None, wv)), (odd, even), (-2,)),
        ((slice(hv, None), slice(wv, None)), (odd, odd), (-2, -1)),
    ]


def _reorder(x: torch.Tensor) -> torch.Tensor:
    """``v`` from ``x`` (``_blocks``): four block copies instead of a gather."""
    v = torch.empty_like(x)
    for dst, src, axes in _blocks(*x.shape[-2:]):
        block = x[(..., *src)]
        v[(..., *dst)] = block.flip(axes) if axes else block
    return v


def _unreorder(v: torch.Tensor) -> torch.Tensor:
    """``x`` from ``v``, the inverse of ``_reorder``."""
    x = torch.empty_like(v)
    for dst, src, axes in _blocks(*v.shape[-2:]):
        block = v[(..., *dst)]
        x[(..., *src)] = block.flip(axes) if axes else block
    return x


@functools.lru_cache(maxsize=64)
def _twiddle(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``w_k = √(2/N) e^{−iπk/2N}`` for ``k < N``, ``w_0`` scaled by ``1/√2`` (orthonormality)."""
    with torch.inference_mode(False):  # cached: it must also serve calls that autograd records
        k = torch.arange(n, dtype=torch.float64, device=device)
        w = torch.polar(torch.full_like(k, math.sqrt(2.0 / n)), -math.pi * k / (2 * n))
        w[0] = w[0] / math.sqrt(2.0)
        return w.to(torch.complex128 if dtype == torch.float64 else torch.complex64)


def _mirror(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x[(−k) mod N]`` along ``dim``: entry 0 stays, the rest reversed."""
    return torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 1, x.shape[dim] - 1).flip(dim)], dim=dim)


def _shift_mirror(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x[N − k]`` along ``dim`` with ``x[N] = 0``: a zero, then entries ``N−1 … 1``."""
    zero = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat([zero, x.narrow(dim, 1, x.shape[dim] - 1).flip(dim)], dim=dim)


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II ``(n, n)``: row ``k`` is ``c_k·cos(π(2j + 1)k/2n)``, ``c_0 = √(1/n)``,
    ``c_k = √(2/n)``."""
    j = torch.arange(n, dtype=torch.float64)
    k = j[:, None]
    out = torch.cos(math.pi * (2 * j[None, :] + 1) * k / (2 * n)) * math.sqrt(2 / n)
    out[0] /= math.sqrt(2)
    return out


def dct2(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal 2-D DCT-II over the last two axes: ``(…, H, W) → (…, H, W)``, from one real 2-D FFT.

    With ``v`` the input reordered along both axes (``_reorder``) and ``V = F v`` its 2-D DFT,
    ``X[k, l] = ½ Re(w_k (w_l V[k, l] + w̄_l V[k, −l]))`` (Makhoul's 1-D identity applied per
    axis; ``V[k, −l] = conj V[−k, l]`` since ``v`` is real, so the half spectrum of ``rfft2``
    suffices: columns ``l > W/2`` are read through ``−l``).
    """
    height, width = x.shape[-2:]
    half = torch.fft.rfft2(_reorder(x))  # V[k, l] for 0 ≤ l ≤ W/2
    conj_neg = _mirror(half, -2).conj()  # V[k, −l] for the same l
    wk = _twiddle(height, x.dtype, x.device)[:, None]
    wl = _twiddle(width, x.dtype, x.device)
    m = half.shape[-1]
    low = (wk * (wl[:m] * half + wl[:m].conj() * conj_neg)).real
    # columns l = W − j (j = 1 … ⌈W/2⌉ − 1): V[k, l] = conj V[−k, j] and V[k, −l] = V[k, j]
    j = (width + 1) // 2 - 1
    wh = wl[width - j :].flip(-1)  # w_{W−j} for j = 1 … j
    high = (wk * (wh * conj_neg[..., 1 : j + 1] + wh.conj() * half[..., 1 : j + 1])).real.flip(-1)
    return 0.5 * torch.cat([low, high], dim=-1)


def idct2(y: torch.Tensor) -> torch.Tensor:
    """Inverse of ``dct2`` (orthonormal 2-D DCT-III), from one inverse real 2-D FFT.

    Per axis ``V_k = (X_k − i X_{N−k})/w_k`` (``X_N = 0``); over both axes
    ``V[k, l] = (X[k, l] − X[−k, −l] − i(X[−k, l] + X[k, −l]))/(w_k w_l)`` with ``X[−k] = X[N−k]``,
    needed for ``l ≤ W/2`` only, then ``v = F⁻¹V`` and the reordering undone.
    """
    height, width = y.shape[-2:]
    m = width // 2 + 1
    rows = _shift_mirror(y, -2)  # X[−k, l]
    cols = _shift_mirror(y, -1)[..., :m]  # X[k, −l]
    both = _shift_mirror(rows, -1)[..., :m]  # X[−k, −l]
    wk = _twiddle(height, y.dtype, y.device)[:, None]
    wl = _twiddle(width, y.dtype, y.device)[:m]
    spec = torch.complex(y[..., :m] - both, -(rows[..., :m] + cols)) / (wk * wl)
    return _unreorder(torch.fft.irfft2(spec, s=(height, width)))


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
