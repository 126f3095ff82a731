"""Noise-level estimation (DESIGN §2.6: ``λ`` follows the noise level).

Grey images: Donoho and Johnstone's estimator. The finest diagonal Haar wavelet coefficients
``d = (x₀₀ − x₀₁ − x₁₀ + x₁₁)/2`` of an image are, away from edges, pure noise with the noise's
standard deviation (the Haar transform is orthonormal), and their median absolute value over
``Φ⁻¹(3/4) ≈ 0.6745`` is a robust estimate of it. Texture leaks into ``d``: on Set12 and BSD68 at
σ = 15 it reads 1.0–1.6 grey levels high on average (the colour estimate below does no better
on a grey image, 0.9 high on Set12: its texture reaches every direction of a grey patch).

Colour images: the noise eigenvalues of the patches' covariance (Chen, Zhu and Heng, "An efficient
statistical method for image noise level estimation", ICCV 2015). With i.i.d. noise of variance
``σ²`` in every channel, the covariance of the ``r`` pixel values of ``p×p×c`` patches is the
signal's plus ``σ²I``; natural images' signal fills few of its ``r`` directions (their colour
differences carry little), so its smallest eigenvalues are ``σ²`` each, up to sampling. Of the
eigenvalues ``λ₁ ≤ … ≤ λ_r``, the first ``m`` that are noise have a mean that is also their
median; ``σ̂² = (1/m)·Σ_{i≤m} λ_i`` for the largest ``m`` whose eigenvalues lie as many above
their mean as below it. On CBSD68 and Kodak24 at σ = 5 to 50 it is off by 0.06–0.31 grey levels
(rms), where the Haar estimate reads 0.4–2.3 high on average (docs/BENCHMARKS.md). Where the
channels' noise is not alike (a grey image stored as colour: identical channels, whose differences
hold no noise at all), the smallest eigenvalues are not the noise's; an estimate under an eighth of
the Haar one is taken as that case, and the Haar one is returned.
"""

from __future__ import annotations

import math

import torch

MAD_TO_STD = 0.6744897501960817  # Φ⁻¹(3/4): the median of |N(0, 1)|
#: the side ``p`` of a colour image's patches: ``r = 3p² = 48`` pixel values each
PATCH = 4
#: at most about this many patches enter a colour image's covariance: beyond, they are taken on a
#: coarser grid (a 25-megapixel photo costs what a 256² image does)
PATCHES = 1 << 14
#: a colour image with fewer patches gets the Haar estimate: on 32² crops of Kodak24 the patch
#: estimate reads 0.5 grey levels low at σ = 25 (its smallest eigenvalues spread with few samples), on
#: 48² crops 0.3, on 64² crops 0.06
MIN_PATCHES = 1 << 11
#: a colour estimate under this fraction of the Haar one is not the noise's (see the module docstring)
AGREEMENT = 1 / 8


def estimate_sigma(images: torch.Tensor) -> torch.Tensor:
    """Noise standard deviation per image, ``(B,)``, for ``images`` ``(B, c, H, W)`` with ``H, W ≥ 2``,
    on the images' own scale (pixels in [0, 1] give ``σ̂`` in [0, 1] units): the Haar estimate
    (``haar_sigma``) for grey images, the patch-covariance estimate (``patch_sigma``) for colour ones
    of at least ``MIN_PATCHES`` patches where it is at least ``AGREEMENT`` of the Haar one."""
    if images.dim() != 4 or images.shape[-1] < 2 or images.shape[-2] < 2:
        raise ValueError(f"need (B, c, H, W) images with H, W ≥ 2, got {tuple(images.shape)}")
    haar = haar_sigma(images)
    positions = max(0, images.shape[-2] - PATCH + 1) * max(0, images.shape[-1] - PATCH + 1)
    if images.shape[1] == 1 or positions < MIN_PATCHES:
        return haar
    patches = torch.stack([patch_sigma(x) for x in images])
    return torch.where(patches >= AGREEMENT * haar, patches, haar)


def haar_sigma(images: torch.Tensor) -> torch.Tensor:
    """``σ̂ = median|d| / Φ⁻¹(3/4)`` over the Haar diagonal band ``d`` of all channels of each image
    ``(B, c, H, W)``, ``H, W ≥ 2``: ``(B,)``."""
    h, w = images.shape[-2] // 2 * 2, images.shape[-1] // 2 * 2
    x = images[..., :h, :w].to(torch.float32)
    d = (x[..., 0::2, 0::2] - x[..., 0::2, 1::2] - x[..., 1::2, 0::2] + x[..., 1::2, 1::2]) / 2
    return d.abs().reshape(images.shape[0], -1).median(dim=1).values / MAD_TO_STD


def patch_sigma(image: torch.Tensor) -> torch.Tensor:
    """``σ̂`` from the noise eigenvalues of the covariance of ``image``'s ``PATCH × PATCH`` patches
    (all its channels: ``r = c·PATCH²`` values each), ``image`` ``(c, H, W)`` with ``H, W ≥ PATCH``:
    a scalar tensor. The patches sit on a grid of step ``s ≥ 1``, so that at most about ``PATCHES``
    are read."""
    positions = (image.shape[-2] - PATCH + 1) * (image.shape[-1] - PATCH + 1)
    step = max(1, math.ceil(math.sqrt(positions / PATCHES)))
    cols = torch.nn.functional.unfold(image[None].to(torch.float32), PATCH, stride=step)[0]
    cols = cols - cols.mean(dim=1, keepdim=True)
    eigen = torch.linalg.eigvalsh(cols @ cols.T / cols.shape[1]).to("cpu", torch.float64)
    # the largest m whose m smallest eigenvalues lie as many above their mean as below it; m = 1
    # always does, so the loop ends
    for m in range(eigen.numel(), 0, -1):
        tail = eigen[:m]
        mean = tail.mean()
        if int((tail > mean).sum()) == int((tail < mean).sum()):
            break
    return mean.clamp(min=0).sqrt().to(image.device, torch.float32)
