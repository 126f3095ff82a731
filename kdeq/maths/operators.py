"""Forward operators ``A`` of the Gaussian tasks, ``y = A f + ε``, and the kGLM-DEQ observed through them.

An operator maps images ``(B, c, H, W)`` to observations ``(B, c, H', W')``, applying the same
single-channel map to every channel, and has an exact adjoint ``Aᵀ`` (DESIGN §2 fact 8):

- ``Identity``: denoising, ``A = I``.
- ``Diagonal``: ``A = diag(d)``, a weight per pixel (the segmenter's Laplace approximation,
  ``kdeq.predictors.uncertainty``); ``Restriction``: inpainting, ``A = M = diag(mask)`` kept on the full grid
  (as ``kdeq.predictors.inpaint``).
- ``Blur``: deblurring, ``A = H`` the convolution with a PSF (``kdeq.maths.psf``) under a border rule.
- ``BlurSubsample``: super-resolution, ``A = S H`` the separable bicubic degradation of
  ``kdeq.maths.psf.bicubic_taps`` (MATLAB's ``imresize(f, 1/s, 'bicubic')``).

With a kernel ``K`` on the full grid the kGLM on the observations has Gram matrix ``A K Aᵀ``;
``solve_observed`` solves its DEQ (Theorem 3 with ``K → A K Aᵀ``) and reads out at every pixel.

Borders: ``zeros`` extends the image by zeros; ``symmetric`` mirrors it with the edge pixel
repeated (``f[−1] = f[0]``, ``kdeq.maths.conv.symmetric_pad``), continued periodically with period
``2N`` where the filter reaches further than the image is wide (as MATLAB and ``numpy.pad`` do).
Each operator is written as (extend the border) then (valid correlation, with a stride), so its
adjoint is (transposed correlation) then (the extension's adjoint: crop for zeros; for
symmetric, every padded sample folded back onto the pixel it copies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kdeq.maths.conv import ScaledConv, Stationary
from kdeq.maths.implicit import warn_unconverged
from kdeq.maths.linear import Negated, solve_affine
from kdeq.maths.precision import ieee_float32
from kdeq.maths.solvers import SolverConfig, SolverStats
from kdeq.maths.transforms import dct2, dct_symbol, idct2, is_axis_even

Border = Literal["zeros", "symmetric"]


def _per_channel(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` on single-channel images ``(B·c, 1, H, W) → (B·c, 1, H', W')``, applied to every
    channel of ``x`` ``(B, c, H, W)`` alike; returns ``(B, c, H', W')``."""
    b, c, h, w = x.shape
    out = fn(x.reshape(b * c, 1, h, w))
    return out.reshape(b, c, *out.shape[-2:])


def mirror(j: torch.Tensor, n: int) -> torch.Tensor:
    """The pixel of a length-``n`` axis that sample ``j`` (any integer) of its symmetric extension
    copies: ``j mod 2n``, folded back as ``2n − 1 − j`` past the end."""
    j = j.remainder(2 * n)
    return torch.where(j >= n, 2 * n - 1 - j, j)


def _extend(x: torch.Tensor, dim: int, start: int, stop: int, border: Border) -> torch.Tensor:
    """``x`` along ``dim`` (length ``n``) re-indexed to the samples ``start … stop−1`` of its border
    extension (``start`` may be negative, ``stop`` beyond ``n``)."""
    n = x.shape[dim]
    if border == "symmetric":
        return x.index_select(dim, mirror(torch.arange(start, stop, device=x.device), n))
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [-start, stop - n]
    return F.pad(x, pad)


def _extend_adjoint(u: torch.Tensor, dim: int, n: int, start: int, stop: int, border: Border) -> torch.Tensor:
    """The adjoint of ``_extend`` for an axis of length ``n``: each sample of ``u`` (``start … stop−1``
    along ``dim``) added onto the pixel it was copied from (zeros: the samples inside, cropped)."""
    if border == "symmetric":
        shape = list(u.shape)
        shape[dim] = n
        return u.new_zeros(shape).index_add(dim, mirror(torch.arange(start, stop, device=u.device), n), u)
    pad = [0, 0] * (u.dim() - 1 - dim % u.dim()) + [start, n - stop]
    return F.pad(u, pad)


class Operator:
    """A linear map ``A``: images ``(B, c, H, W)`` → observations ``(B, c, H', W')``, the same
    single-channel map on every channel.

    Attributes:
        batch: the batch size an operator that differs per sample was built for (``Restriction``'s
            masks); ``None`` when it is the same for every sample.
    """

    batch: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``A x``: ``(B, c, H, W) → (B, c, H', W')``."""
        raise NotImplementedError

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        """``Aᵀ y``: ``(B, c, H', W') → (B, c, H, W)``."""
        raise NotImplementedError

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        """``(H', W')``, the observation grid of an ``h×w`` image."""
        return h, w

    def dense(self, h: int, w: int, sample: int = 0, adjoint: bool = False) -> torch.Tensor:
        """The float64 matrix of the single-channel operator on an ``h×w`` image, ``(H'W', hw)``
        (``Aᵀ``'s, ``(hw, H'W')``, with ``adjoint``), row-major pixels; built by applying the map
        to every basis image at once (as channels), so only for small sizes. ``sample`` picks the
        sample of an operator that differs per sample."""
        rows, cols = self.out_size(h, w) if adjoint else (h, w)
        n = rows * cols
        basis = torch.eye(n, dtype=torch.float64).reshape(1, n, rows, cols)
        basis = basis.expand(self.batch or 1, n, rows, cols)
        out = (self.adjoint if adjoint else self.forward)(basis)[sample]
        return out.reshape(n, -1).T.contiguous()


class Identity(Operator):
    """``A = I`` (denoising)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Diagonal(Operator):
    """``A = diag(d)`` on the full grid: ``A x = d ⊙ x``, self-adjoint.

    Args:
        weights: ``d`` ``(B, 1, H, W)``, shared by the channels.
    """

    def __init__(self, weights: torch.Tensor) -> None:
        if weights.dim() != 4 or weights.shape[1] != 1:
            raise ValueError(f"the weights must be (B, 1, H, W), got {tuple(weights.shape)}")
        self.weights = weights
        self.batch = weights.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights.to(x)

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        return self.forward(y)


class Restriction(Diagonal):
    """``A = M = diag(mask)`` on the full grid (inpainting): ``A x = mask ⊙ x``.

    Args:
        observed: ``(B, 1, H, W)``, 1 on observed pixels and 0 elsewhere, shared by the channels.
    """

    def __init__(self, observed: torch.Tensor) -> None:
        super().__init__(observed)
        self.observed = observed


#: filters with more taps than this are applied by FFT (on the CPU a one-channel conv2d of a 15×15
#: PSF over 256² pixels takes ~50 ms, its FFT product ~3 ms)
FFT_TAPS = 49


def _correlate(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The valid correlation ``y[i] = Σ_a t[a] x[i + a]`` of ``x`` ``(N, 1, P, Q)`` with ``taps``
    ``(kh, kw)``: ``(N, 1, P − kh + 1, Q − kw + 1)``. Large filters go through the FFT, where the
    circular correlation ``F⁻¹(X · conj T)`` equals the valid one on the indices that do not wrap."""
    kh, kw = taps.shape
    if taps.numel() <= FFT_TAPS:
        return F.conv2d(x, taps.to(x)[None, None])
    size = tuple(x.shape[-2:])
    spectrum = torch.fft.rfft2(x) * torch.fft.rfft2(taps.to(x), s=size).conj()
    return torch.fft.irfft2(spectrum, s=size)[..., : size[0] - kh + 1, : size[1] - kw + 1]


def _check_psf_shape(psf: torch.Tensor) -> None:
    if psf.dim() != 2 or psf.shape[0] % 2 == 0 or psf.shape[1] % 2 == 0:
        raise ValueError(f"a PSF is 2-D with odd sides, got shape {tuple(psf.shape)}")


class Blur(Operator):
    """``A = H``: ``(H f)[i] = Σ_a h[a] f̃[i − a]``, the true convolution with the PSF ``h``
    ``(kh, kw)`` (odd sides, centred) of the border-extended image ``f̃``; output ``H×W``.

    As a correlation it is ``ȟ ⋆ f̃`` with the flipped PSF ``ȟ[a] = h[−a]``, so a PSF that is not
    point-symmetric (motion blur) is applied the right way round; ``Aᵀ`` is the correlation with
    ``h`` of the ``(H + kh − 1)×(W + kw − 1)`` transposed ("full") result, folded back by the
    border's adjoint. With ``symmetric`` borders ``A`` is not self-adjoint in general.
    """

    def __init__(self, psf: torch.Tensor, border: Border = "zeros") -> None:
        psf = torch.as_tensor(psf)
        _check_psf_shape(psf)
        if border not in ("zeros", "symmetric"):
            raise ValueError(f"border must be zeros or symmetric, got {border!r}")
        self.psf = psf
        self.border: Border = border

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rh, rw = self.psf.shape[0] // 2, self.psf.shape[1] // 2

        def one(v: torch.Tensor) -> torch.Tensor:
            h, w = v.shape[-2:]
            v = _extend(_extend(v, -1, -rw, w + rw, self.border), -2, -rh, h + rh, self.border)
            return _correlate(v, self.psf.flip(-2, -1))

        return _per_channel(one, x)

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        rh, rw = self.psf.shape[0] // 2, self.psf.shape[1] // 2

        def one(v: torch.Tensor) -> torch.Tensor:
            h, w = v.shape[-2:]
            # the transposed correlation with ȟ is the "full" correlation with h (on the CPU
            # conv_transpose2d runs several times slower than a correlation)
            u = _correlate(F.pad(v, (2 * rw, 2 * rw, 2 * rh, 2 * rh)), self.psf)
            u = _extend_adjoint(u, -2, h, -rh, h + rh, self.border)
            return _extend_adjoint(u, -1, w, -rw, w + rw, self.border)

        return _per_channel(one, y)


class BlurSubsample(Operator):
    """``A = S H``, separable: along each axis ``(A f)[i] = Σ_t w[t] f̃[s·i + offset + t]`` for
    ``i < N/s`` (``f̃`` the border extension), rows and columns alike; output ``(H/s, W/s)``.

    With ``(w, offset) = kdeq.maths.psf.bicubic_taps(s)`` and ``symmetric`` borders this is the
    project's super-resolution degradation, MATLAB's ``imresize(f, 1/s, 'bicubic')`` (``kdeq.maths.psf``).
    ``H`` and ``W`` must be multiples of ``s``: crop the high-resolution image first.

    Args:
        taps_1d: ``(n,)`` filter ``w``.
        offset: where tap 0 lands relative to ``s·i``.
        scale: the subsampling factor ``s ≥ 1``.
        border: ``symmetric`` or ``zeros``.
    """

    def __init__(self, taps_1d: torch.Tensor, offset: int, scale: int, border: Border = "symmetric") -> None:
        taps_1d = torch.as_tensor(taps_1d)
        if taps_1d.dim() != 1 or taps_1d.numel() == 0:
            raise ValueError(f"taps_1d must be a non-empty 1-D filter, got shape {tuple(taps_1d.shape)}")
        if int(scale) != scale or scale < 1:
            raise ValueError(f"scale must be a positive integer, got {scale}")
        if border not in ("zeros", "symmetric"):
            raise ValueError(f"border must be zeros or symmetric, got {border!r}")
        self.taps = taps_1d
        self.offset = int(offset)
        self.scale = int(scale)
        self.border: Border = border
        self._matrices: dict[tuple, torch.Tensor] = {}

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        if h % self.scale or w % self.scale:
            raise ValueError(f"a {h}×{w} image is not a multiple of the scale {self.scale}; crop it first")
        return h // self.scale, w // self.scale

    def matrix(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The 1-D map ``(n/s, n)`` along one axis: row ``i`` holds ``w[t]`` at the pixel that sample
        ``s·i + offset + t`` of the border extension copies (dropped outside for ``zeros``)."""
        key = (n, dtype, device)
        if key not in self._matrices:
            s, k = self.scale, self.taps.numel()
            rows = torch.arange(n // s, device=device).repeat_interleave(k)
            j = (
                torch.arange(n // s, device=device)[:, None] * s
                + self.offset
                + torch.arange(k, device=device)
            )
            j = j.reshape(-1)
            weights = self.taps.to(dtype=dtype, device=device).repeat(n // s)
            if self.border == "symmetric":
                j = mirror(j, n)
            else:
                inside = (j >= 0) & (j < n)
                rows, j, weights = rows[inside], j[inside], weights[inside]
            m = torch.zeros(n // s, n, dtype=dtype, device=device)
            self._matrices[key] = m.index_put_((rows, j), weights, accumulate=True)
        return self._matrices[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.out_size(*x.shape[-2:])
        # separable, as two banded matrix products: one BLAS call per axis
        rows = self.matrix(x.shape[-2], x.dtype, x.device)
        cols = self.matrix(x.shape[-1], x.dtype, x.device)
        return rows @ x @ cols.T

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        s = self.scale
        rows = self.matrix(y.shape[-2] * s, y.dtype, y.device)
        cols = self.matrix(y.shape[-1] * s, y.dtype, y.device)
        return rows.T @ y @ cols


class KernelMap(ScaledConv):
    """The model's kernel ``x ↦ s_b·(k ⋆ x)`` at any image size: ``kdeq.maths.conv.ScaledConv`` where its
    border rule fits, and for a ``symmetric`` border on an image narrower than the filter's radius (which
    ``kdeq.maths.conv.symmetric_pad`` refuses) the same mirror continued periodically with period ``2N``, as
    ``kdeq.maths.operators`` extends borders — the same matrix where both apply, and still a kernel (the
    DCT-II diagonalises it, its eigenvalues the filter's symbol at the transform's frequencies). Without it a
    model refuses images (and warm-up sizes) smaller than its kernel's radius."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rh, rw = self.bank.shape[-2] // 2, self.bank.shape[-1] // 2
        if self.padding != "symmetric" or (rh <= x.shape[-2] and rw <= x.shape[-1]):
            return super().forward(x)
        if self.bank.shape[:2] != (1, 1):
            raise ValueError("a multi-channel kernel needs images at least as large as its radius")
        # Blur convolves with its PSF, i.e. correlates with the flipped one: flip it back
        return self.scale.to(x) * Blur(self.bank[0, 0].flip(-2, -1), "symmetric").forward(x)


def _full_conv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The full 2-D convolution of two axis-even filters (where it equals correlation)."""
    ph, pw = b.shape[0] - 1, b.shape[1] - 1
    return F.conv2d(F.pad(a, (pw, pw, ph, ph))[None, None], b[None, None])[0, 0]


def _square(taps: torch.Tensor) -> torch.Tensor:
    """Centred taps zero-padded to a square (the transform symbols take square filters)."""
    kh, kw = taps.shape
    k = max(kh, kw)
    return F.pad(taps, ((k - kw) // 2, (k - kw) // 2, (k - kh) // 2, (k - kh) // 2))


class Sandwich(nn.Module):
    """``x ↦ s_b · A K Aᵀ x`` on the observation grid ``(B, c, H', W')``: the kernel map ``K`` (a module
    on the full grid, e.g. ``kdeq.maths.conv.ScaledConv`` with scale 1) seen through the operator ``A``,
    with a per-sample scale ``s`` ``(B,)`` (``−1/λ_b`` for Theorem 3's ``W1``)."""

    def __init__(self, op: Operator, kernel_map: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.op = op
        self.kernel_map = kernel_map
        self.scale = torch.as_tensor(scale).reshape(-1, 1, 1, 1)
        self._symbols: dict[tuple, torch.Tensor] = {}

    def stationary(self) -> Stationary | None:
        """The map as one filter on the observation grid where it is one, so that
        ``kdeq.maths.linear.solve_affine`` solves it by a transform: ``A = I`` with a stationary ``K``; and
        a symmetric-border ``Blur`` whose PSF ``h`` is even in each axis with a symmetric-border,
        axis-even ``K`` — each is then diagonal in the DCT-II, ``H`` self-adjoint, and
        ``H K H`` is the filter ``h * k * h`` (its symbol the product of the three)."""
        describe = getattr(self.kernel_map, "stationary", None)
        inner = describe() if callable(describe) else None
        if inner is None:
            return None
        scale = self.scale.to(inner.taps) * inner.scale
        if isinstance(self.op, Identity):
            return Stationary(inner.taps, scale, inner.padding)
        if not (
            isinstance(self.op, Blur)
            and self.op.border == "symmetric"
            and inner.padding == "symmetric"
            and is_axis_even(self.op.psf)
            and is_axis_even(inner.taps)
        ):
            return None
        psf = self.op.psf.to(inner.taps)
        taps = _full_conv(_full_conv(inner.taps, psf), psf)
        # the composition of axis-even filters is axis-even; the rounding of the sums above is not,
        # and the transform path tests evenness exactly: average over the flips (exactly even)
        taps = taps + taps.flip(-1)
        taps = 0.25 * (taps + taps.flip(-2))
        return Stationary(_square(taps), scale, "symmetric")

    def preconditioner(self, size: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        """``r ↦ F⁻¹[F r/(1 − s_b ĉ)]`` on the observation grid ``size``: the inverse of ``I − s A K Aᵀ``
        with ``A K Aᵀ`` replaced by the circulant of its response ``c`` to a unit impulse at the grid's
        centre (``ĉ`` its DFT, real since ``c`` is point-symmetric). Blur and subsampled blur are
        shift-invariant on the observation grid, so this is exact away from the border; it is SPD
        (``ĉ ≥ 0`` after clamping rounding, ``s < 0``), as CG needs."""
        if isinstance(self.op, Diagonal):
            return lambda r: r  # a per-pixel mask or weight is not shift-invariant
        h, w = size
        impulse = torch.zeros(1, 1, h, w, dtype=self.scale.dtype, device=self.scale.device)
        impulse[..., h // 2, w // 2] = 1.0
        unit = Sandwich(self.op, self.kernel_map, torch.ones(1, dtype=impulse.dtype, device=impulse.device))
        response = unit(impulse).roll((-(h // 2), -(w // 2)), dims=(-2, -1))
        symbol = torch.fft.rfft2(response).real.clamp(min=0.0)
        denom = 1.0 - self.scale.to(symbol) * symbol
        return lambda r: torch.fft.irfft2(torch.fft.rfft2(r) / denom, s=size)

    def kernel(self, u: torch.Tensor) -> torch.Tensor:
        """``K u`` on the full grid ``(B, c, H, W)``: by the DCT-II when ``K`` is a symmetric-border
        filter even in each axis (its exact eigenbasis; a 25×25 convolution costs ~20× more), else
        the kernel map itself."""
        describe = getattr(self.kernel_map, "stationary", None)
        inner = describe() if callable(describe) else None
        size = tuple(u.shape[-2:])
        if (
            inner is None
            or inner.padding != "symmetric"
            or not is_axis_even(inner.taps)
            or inner.taps.shape[-1] // 2 > min(size)
        ):
            return self.kernel_map(u)
        # a symbol computed without autograd must not serve a pass that differentiates the taps
        key = (size, u.dtype, u.device, torch.is_grad_enabled())
        if key not in self._symbols:
            self._symbols[key] = dct_symbol(inner.taps, size).to(u)
        return inner.scale.to(u) * idct2(dct2(u) * self._symbols[key])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale.to(x) * self.op.forward(self.kernel(self.op.adjoint(x)))


def solve_observed(
    op: Operator,
    kernel_map: nn.Module,
    y: torch.Tensor,
    lam: torch.Tensor,
    mean: torch.Tensor | None,
    config: SolverConfig,
) -> tuple[torch.Tensor, SolverStats]:
    """The Gaussian kGLM-DEQ observed through ``A`` (DESIGN §2 fact 8) and its readout at every pixel.

    On the observation grid the equilibrium is Theorem 3 with ``K → A K Aᵀ`` and mean ``A m``:

        z = −(A K Aᵀ/λ) z + (A K Aᵀ/λ) y + A m,

    solved by ``kdeq.maths.linear.solve_affine`` (``W1`` the ``Sandwich`` with scale ``−1/λ``, ``W2 = −W1``;
    a transform where ``Sandwich.stationary`` finds one, else CG; ``config``'s ``tol``, ``max_iter``
    and ``atol`` apply, its ``method`` does not). The readout is

        f = m + K Aᵀ (y − z)/λ = m + K Aᵀ (A K Aᵀ + λI)⁻¹ (y − A m).

    Args:
        op: the forward operator ``A``.
        kernel_map: ``x ↦ K x`` on the full grid ``(B, c, H, W)``.
        y: observations ``(B, c, H', W')``.
        lam: ``λ`` per sample ``(B,)``, positive.
        mean: ``m`` ``(B, c, H, W)``, or ``None`` for 0.
        config: the solver's settings.

    With autograd on, ``f`` is differentiable in the kernel map's parameters, ``λ`` and ``m``: ``z``
    is solved without tracking and re-attached by ``_attach`` (implicit differentiation).

    Returns:
        ``f`` ``(B, c, H, W)`` and the equilibrium solve's per-sample statistics.
    """
    lam = torch.as_tensor(lam, dtype=y.dtype, device=y.device).reshape(-1)
    if lam.shape[0] != y.shape[0]:
        raise ValueError(f"λ has {lam.shape[0]} values for a batch of {y.shape[0]}")
    w1 = Sandwich(op, kernel_map, -1.0 / lam)
    observed_mean = None if mean is None else op.forward(mean)
    with torch.no_grad():
        z, stats, _ = solve_affine(w1, Negated(w1), y, observed_mean, None, None, config)
    if torch.is_grad_enabled():
        z = _attach(w1, z, y, observed_mean, config)
    f = w1.kernel(op.adjoint(y - z)) / lam.reshape(-1, 1, 1, 1)
    return (f if mean is None else f + mean), stats


def _attach(
    w1: Sandwich, z: torch.Tensor, y: torch.Tensor, observed_mean: torch.Tensor | None, config: SolverConfig
) -> torch.Tensor:
    """The equilibrium ``z*`` ``(B, c, H', W')`` of ``g(z) = W1 (z − y) + A m`` re-attached to the
    autograd graph: ``g(z*)`` (equal to ``z*``) with its gradient corrected by the implicit function
    theorem, ``∂ℓ/∂θ = uᵀ ∂g/∂θ`` for ``(I − W1)ᵀ u = ∂ℓ/∂z*``. ``W1 = −A K Aᵀ/λ`` is symmetric, so
    the adjoint system is the forward one, ``u = W1 u + ∂ℓ/∂z*``, and ``solve_affine`` solves it by
    the same exact method (a transform, or preconditioned CG)."""
    z = w1(z.detach() - y) + (0.0 if observed_mean is None else observed_mean)
    if not z.requires_grad:
        return z

    def correct(grad: torch.Tensor) -> torch.Tensor:
        # the autograd engine runs this hook outside the forward's IEEE section (kdeq.maths.precision)
        with torch.no_grad(), ieee_float32():
            u, stats, _ = solve_affine(w1, Negated(w1), torch.zeros_like(grad), grad, None, None, config)
        warn_unconverged(stats, config)
        return u

    z.register_hook(correct)
    return z
