"""Point-spread functions for deblurring, and the project's super-resolution degradation.

A PSF is a ``(k, k)`` array with odd ``k`` (centred at ``(k//2, k//2)``), non-negative, summing
to 1; ``kdeq.maths.operators.Blur`` applies it as a convolution (``y = h * f``). The constructors
compute in float64 and return float32 unless given another ``dtype``. Anti-aliased shapes are
the fraction of each pixel's area inside the shape, estimated on ``SUPERSAMPLE × SUPERSAMPLE``
points per pixel placed symmetrically about the pixel centre, so a shape symmetric about the
origin gives a PSF with exactly the same symmetry.

**Super-resolution degradation model** (``bicubic_taps``): the low-resolution image is MATLAB's
``imresize(f, 1/s, 'bicubic')`` of the high-resolution ``f``, the standard SR benchmark protocol.
Along each axis, LR pixel ``i`` is centred at HR coordinate ``u_i = s·i + (s−1)/2`` (pixel
centres at integers, both grids starting at their pixel edge 0) and is

    y[i] = Σ_j w(j − u_i) f[j],    w(d) ∝ κ(d/s)/s over |d| < 2s,  Σ w = 1,

with ``κ`` Keys' cubic for ``a = −0.5`` (support [−2, 2]) stretched by ``s`` for anti-aliasing,
the two axes applied separably and the border extended symmetrically (edge pixel repeated),
as MATLAB does. ``kdeq.maths.operators.BlurSubsample`` implements it with its exact adjoint.
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: the largest PSF side accepted (constructed or uploaded)
MAX_PSF_SIDE = 63
#: sub-pixel samples per pixel side for anti-aliased shapes
SUPERSAMPLE = 8
#: super-resolution factors of the degradation model
SR_SCALES = (2, 3, 4)

_F64 = torch.float64


def _radius_for(extent: float) -> int:
    """The PSF radius ``R`` (side ``2R+1``, at least 3) covering every pixel that a shape reaching
    ``extent`` pixels from the centre overlaps: pixel ``i`` spans ``[i − ½, i + ½]``, so ``R`` is the
    largest integer with ``R − ½ < extent``."""
    return max(1, math.ceil(extent + 0.5) - 1)


def _check_side(radius: int, what: str) -> None:
    side = 2 * radius + 1
    if side > MAX_PSF_SIDE:
        raise ValueError(f"{what} needs a {side}×{side} PSF; the largest allowed side is {MAX_PSF_SIDE}")


def _positive(value: float, name: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value}")


def _subpixel_grid(radius: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample coordinates ``(rows, cols)`` ``(n, n)``, ``n = (2R+1)·SUPERSAMPLE``, relative to the
    centre pixel: ``SUPERSAMPLE`` points per pixel side at offsets ``(q + ½)/SUPERSAMPLE − ½``,
    so the set is symmetric under negation."""
    q = (torch.arange(SUPERSAMPLE, dtype=_F64) + 0.5) / SUPERSAMPLE - 0.5
    pix = torch.arange(-radius, radius + 1, dtype=_F64)
    line = (pix[:, None] + q[None, :]).reshape(-1)
    return torch.meshgrid(line, line, indexing="ij")


def _pixel_coverage(inside: torch.Tensor, radius: int, dtype: torch.dtype) -> torch.Tensor:
    """The fraction of samples inside the shape per pixel, normalised to sum 1, without the outer
    rings that no sample reached (``_radius_for`` also counts pixels the shape only grazes):
    ``(2r+1, 2r+1)``, ``1 ≤ r ≤ R``."""
    side = 2 * radius + 1
    cover = inside.to(_F64).reshape(side, SUPERSAMPLE, side, SUPERSAMPLE).mean(dim=(1, 3))
    offs = torch.arange(-radius, radius + 1).abs()
    used = torch.maximum(offs[:, None], offs[None, :])[cover > 0]
    r = max(1, int(used.max()))
    cover = cover[radius - r : radius + r + 1, radius - r : radius + r + 1]
    return (cover / cover.sum()).to(dtype)


def gaussian_psf(sigma: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``h(a, b) ∝ exp(−(a² + b²)/2σ²)`` sampled at pixel offsets, ``(k, k)`` with
    ``k = 2⌈3σ⌉ + 1`` (at least 3), summing to 1."""
    _positive(sigma, "gaussian sigma")
    radius = max(1, math.ceil(3.0 * sigma))
    _check_side(radius, f"a gaussian of sigma {sigma}")
    offs = torch.arange(-radius, radius + 1, dtype=_F64)
    g = torch.exp(-0.5 * (offs / sigma) ** 2)
    h = g[:, None] * g[None, :]
    return (h / h.sum()).to(dtype)


def disk_psf(radius: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The uniform disk ``a² + b² ≤ r²`` (out-of-focus blur): each pixel weighted by the share of its
    area inside the disk (supersampled), ``(k, k)`` with odd ``k``, summing to 1.

    A radius of at most ½ fits inside the centre pixel and gives the identity (a 3×3 delta);
    radii too small for any sub-pixel sample (below ``√2/(2·SUPERSAMPLE)``) are refused.
    """
    _positive(radius, "disk radius")
    r = _radius_for(radius)
    _check_side(r, f"a disk of radius {radius}")
    rows, cols = _subpixel_grid(r)
    inside = rows**2 + cols**2 <= radius**2
    if not bool(inside.any()):
        raise ValueError(
            f"disk radius {radius} is below the sampling resolution (any radius up to 0.5 is the identity)"
        )
    return _pixel_coverage(inside, r, dtype)


def motion_psf(length: float, angle_degrees: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Linear motion blur: a segment of ``length`` pixels through the centre at ``angle_degrees``
    (0 horizontal, counter-clockwise positive with rows pointing down), drawn one pixel wide and
    anti-aliased by supersampling (each pixel weighted by the share of its area inside the
    ``length × 1`` rectangle), ``(k, k)`` with odd ``k``, summing to 1, symmetric about the centre.
    At 0° with an odd integer length it is ``1/length`` on ``length`` pixels of the centre row.
    """
    _positive(length, "motion length")
    if length < 1.0:
        raise ValueError(f"motion length must be at least 1 pixel, got {length}")
    if not math.isfinite(angle_degrees):
        raise ValueError(f"motion angle must be a finite number of degrees, got {angle_degrees}")
    theta = math.radians(angle_degrees)
    c, s = math.cos(theta), math.sin(theta)
    half = 0.5 * length
    # half-extents of the rotated rectangle along the columns and the rows
    extent = max(half * abs(c) + 0.5 * abs(s), half * abs(s) + 0.5 * abs(c))
    r = _radius_for(extent)
    _check_side(r, f"a motion of length {length}")
    rows, cols = _subpixel_grid(r)
    # coordinates along and across the segment; "up" (counter-clockwise) is the negative row axis
    along = cols * c - rows * s
    across = cols * s + rows * c
    inside = (along.abs() <= half) & (across.abs() <= 0.5)
    return _pixel_coverage(inside, r, dtype)


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text.strip()!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {text.strip()!r}")
    return value


_PSF_SYNTAX = "gaussian:SIGMA, disk:RADIUS or motion:LENGTH[,ANGLE_DEGREES]"


def parse_psf(text: str) -> torch.Tensor:
    """The float32 PSF named by ``gaussian:SIGMA``, ``disk:RADIUS`` or ``motion:LENGTH[,ANGLE_DEGREES]``
    (e.g. ``motion:9,30``). Raises ``ValueError`` saying what is wrong for an unknown name, a bad
    or missing number, a non-positive size or one whose PSF would exceed ``MAX_PSF_SIDE``."""
    name, sep, args = text.strip().partition(":")
    name = name.strip().lower()
    if not sep or not args.strip():
        raise ValueError(f"PSF {text!r} has no parameters; use {_PSF_SYNTAX}")
    parts = args.split(",")
    if name == "gaussian" and len(parts) == 1:
        return gaussian_psf(_number(parts[0], "gaussian sigma"))
    if name == "disk" and len(parts) == 1:
        return disk_psf(_number(parts[0], "disk radius"))
    if name == "motion" and len(parts) in (1, 2):
        angle = _number(parts[1], "motion angle") if len(parts) == 2 else 0.0
        return motion_psf(_number(parts[0], "motion length"), angle)
    if name in ("gaussian", "disk", "motion"):
        raise ValueError(f"PSF {text!r} has the wrong number of parameters; use {_PSF_SYNTAX}")
    raise ValueError(f"unknown PSF {name!r}; use {_PSF_SYNTAX}")


def check_psf(array: object) -> torch.Tensor:
    """An uploaded PSF (a 2-D array of numbers: numpy, tensor or nested lists) validated and
    normalised to sum 1, as float32 ``(kh, kw)``. Raises ``ValueError`` unless it is 2-D with odd
    sides of at most ``MAX_PSF_SIDE``, finite, non-negative and of positive sum."""
    try:
        h = torch.as_tensor(np.asarray(array, dtype=np.float64))
    except (TypeError, ValueError):
        raise ValueError("the PSF must be a 2-D array of numbers") from None
    if h.dim() != 2:
        raise ValueError(f"the PSF must be 2-D, got {h.dim()} dimensions (shape {tuple(h.shape)})")
    if h.shape[0] % 2 == 0 or h.shape[1] % 2 == 0:
        raise ValueError(f"the PSF's sides must be odd (centred on a pixel), got {tuple(h.shape)}")
    if max(h.shape) > MAX_PSF_SIDE:
        raise ValueError(f"the PSF is {tuple(h.shape)}; the largest allowed side is {MAX_PSF_SIDE}")
    if not bool(torch.isfinite(h).all()):
        raise ValueError("the PSF has non-finite values (NaN or infinity)")
    if bool((h < 0).any()):
        raise ValueError(f"the PSF has negative values (smallest {h.min().item():.3g})")
    total = h.sum()
    if not total > 0:
        raise ValueError("the PSF sums to zero")
    return (h / total).to(torch.float32)


def keys_cubic(x: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    """Keys' cubic convolution kernel ``κ(x)`` (support [−2, 2], ``κ(0) = 1``, ``κ(±1) = κ(±2) = 0``)."""
    t = x.abs()
    near = ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
    far = ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a
    return torch.where(t <= 1.0, near, torch.where(t < 2.0, far, torch.zeros_like(t)))


def bicubic_taps(scale: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    """The 1-D filter of the super-resolution degradation (module docstring) for ``scale`` ``s`` in
    ``SR_SCALES``: ``(w, offset)`` with ``w`` ``(n,)`` summing to 1 such that

        y[i] = Σ_{t<n} w[t] · f[s·i + offset + t]        (f extended beyond the border),

    ``w[t] ∝ κ((offset + t − (s−1)/2)/s)``. The taps are every HR pixel within ``2s`` of the LR
    centre ``s·i + (s−1)/2``: ``n = 4s − 1`` for odd ``s`` (centred on pixel ``s·i + (s−1)/2``),
    ``n = 4s`` for even ``s`` (the centre falls between two pixels), and ``offset = −⌊3s/2⌋``
    (−3, −4, −6 for s = 2, 3, 4).
    """
    if scale not in SR_SCALES:
        raise ValueError(f"super-resolution scale must be one of {SR_SCALES}, got {scale}")
    offset = -((3 * scale) // 2)
    n = 4 * scale - scale % 2
    d = torch.arange(n, dtype=_F64) + offset - (scale - 1) / 2
    w = keys_cubic(d / scale)
    return (w / w.sum()).to(dtype), offset
