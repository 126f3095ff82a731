"""Noise-level estimation (DESIGN §2.6: ``λ`` follows the noise level).

Grey images: Donoho and Johnstone's estimator, read where the image is flattest. The finest
diagonal Haar wavelet coefficients ``d = (x₀₀ − x₀₁ − x₁₀ + x₁₁)/2`` of an image are, away from
edges, pure noise with the noise's standard deviation (the Haar transform is orthonormal), and their
median absolute value over ``Φ⁻¹(3/4) ≈ 0.6745`` is a robust estimate of it (``haar_sigma``).
Texture leaks into ``d``: over the whole image it reads 1.0–1.6 grey levels high on average on
Set12 and BSD68 at σ = 15. ``flat_sigma`` takes the median over the flattest of the image's 8×8
tiles only, flattest by the gradient of the image at half resolution blurred (σ = 1 of its pixels),
which the noise in ``d`` barely moves (both keep the low frequencies; ``d`` is the highest): over
the flattest tenth, 0.2–0.4 high on average there at σ = 15. A tenth of the coefficients scatters
more than all of them, which costs where texture matters little against the noise (at σ = 50:
1.0–1.1 rms against the whole image's 0.5–1.0). So the kept share grows, through ``SHARES``, while
its estimate stays within ``GROW_WITHIN`` standard errors of the flattest tenth's: as long as no
texture shows against the sampling error (the median's standard error is
``σ/(4·q·φ(q)·√N) ≈ 1.17·σ/√N`` for ``N`` Gaussian coefficients, ``q = Φ⁻¹(3/4)``). Tiles mostly at
either end of the range are passed over: a clipped region is flat and noiseless, and clipped noise
is not the noise. (The colour estimate below does no better
on a grey image, 0.9 high on Set12: its texture reaches every direction of a grey patch.)

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
the Haar one is taken as that case, and the grey estimate is returned.
"""

from __future__ import annotations

import math

import torch

from kdeq.filters import gaussian_taps, separable_blur

MAD_TO_STD = 0.6744897501960817  # Φ⁻¹(3/4): the median of |N(0, 1)|
#: the side ``p`` of a colour image's patches: ``r = 3p² = 48`` pixel values each
PATCH = 4
#: at most about this many patches enter a colour image's covariance: beyond, they are taken on a
#: coarser grid (a 25-megapixel photo costs what a 256² image does)
PATCHES = 1 << 14
#: a colour image with fewer patches gets the grey estimate: on 32² crops of Kodak24 the patch
#: estimate reads 0.5 grey levels low at σ = 25 (its smallest eigenvalues spread with few samples), on
#: 48² crops 0.3, on 64² crops 0.06
MIN_PATCHES = 1 << 11
#: a colour estimate under this fraction of the Haar one is not the noise's (see the module docstring)
AGREEMENT = 1 / 8
#: ``flat_sigma``'s tiles: side in pixels, the blur's std, the shares of the flattest tried in turn
#: and the fewest kept
TILE = 8
TILE_BLUR = 2.0
SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
MIN_TILES = 64
#: a larger share is taken while its estimate exceeds the first's by at most this many of the first's
#: standard errors: 0.25 brings Set12's rms error at σ = 50 from 1.02 to 0.58 grey levels and BSD68's
#: from 1.13 to 0.90, and no other level's up (0.5 and 1 add 0.06 and 0.2 of bias at σ = 15-25; 0
#: scatters more at σ = 50: 0.67 on Set12)
GROW_WITHIN = 0.25
#: the standard error of ``median|d| / Φ⁻¹(3/4)`` over ``N`` coefficients of N(0, σ²), times ``√N/σ``
MAD_SE = 1 / (4 * MAD_TO_STD * math.exp(-(MAD_TO_STD**2) / 2) / math.sqrt(2 * math.pi))
#: a tile with this fraction of its pixels at or past either end of the range is saturated: a
#: clipped flat region would read as noiseless
SATURATED = 0.25


def estimate_sigma(images: torch.Tensor) -> torch.Tensor:
    """Noise standard deviation per image, ``(B,)``, for ``images`` ``(B, c, H, W)`` with ``H, W ≥ 2``,
    on the images' own scale (pixels in [0, 1] give ``σ̂`` in [0, 1] units): the flattest tiles' Haar
    estimate (``flat_sigma``) for grey images, the patch-covariance estimate (``patch_sigma``) for
    colour ones of at least ``MIN_PATCHES`` patches where it is at least ``AGREEMENT`` of the Haar
    estimate (``haar_sigma``)."""
    if images.dim() != 4 or images.shape[-1] < 2 or images.shape[-2] < 2:
        raise ValueError(f"need (B, c, H, W) images with H, W ≥ 2, got {tuple(images.shape)}")
    positions = max(0, images.shape[-2] - PATCH + 1) * max(0, images.shape[-1] - PATCH + 1)
    if images.shape[1] == 1 or positions < MIN_PATCHES:
        return torch.stack([flat_sigma(x) for x in images])
    haar = haar_sigma(images)
    # the grey estimate only where the colour one is refused: it blurs the image, the colour one does not
    colour = [patch_sigma(x) for x in images]
    out = [p if p >= AGREEMENT * h else flat_sigma(x) for p, h, x in zip(colour, haar, images, strict=True)]
    return torch.stack(out)


def blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four pixels ``(x₀₀, x₀₁, x₁₀, x₁₁)`` of each 2×2 block of ``x`` ``(…, H, W)`` with even
    ``H, W``, as views ``(…, H/2, W/2)``."""
    return x[..., 0::2, 0::2], x[..., 0::2, 1::2], x[..., 1::2, 0::2], x[..., 1::2, 1::2]


def haar_diagonal(corners: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The finest diagonal Haar coefficients ``d = (x₀₀ − x₀₁ − x₁₀ + x₁₁)/2`` of ``blocks``' four
    views: ``(…, H/2, W/2)``."""
    return (corners[0] - corners[1] - corners[2] + corners[3]) / 2


def haar_sigma(images: torch.Tensor) -> torch.Tensor:
    """``σ̂ = median|d| / Φ⁻¹(3/4)`` over the Haar diagonal band ``d`` of all channels of each image
    ``(B, c, H, W)``, ``H, W ≥ 2``: ``(B,)``."""
    h, w = images.shape[-2] // 2 * 2, images.shape[-1] // 2 * 2
    d = haar_diagonal(blocks(images[..., :h, :w].to(torch.float32)))
    return d.abs().reshape(images.shape[0], -1).median(dim=1).values / MAD_TO_STD


def flat_sigma(image: torch.Tensor) -> torch.Tensor:
    """``σ̂ = median|d| / Φ⁻¹(3/4)`` over the Haar diagonal coefficients ``d`` (all channels) of the
    flattest ``TILE × TILE`` tiles of ``image`` ``(c, H, W)``, ``H, W ≥ 2``: a scalar tensor. A tile's
    activity is the mean squared gradient of the Haar average band ``a = (x₀₀ + x₀₁ + x₁₀ + x₁₁)/4``
    (the image at half resolution) blurred by a Gaussian of std ``TILE_BLUR / 2``, summed over
    channels; tiles with at least ``SATURATED`` of their pixels at or past 0 or 1 come last. The
    ``max(f·n, min(n, MIN_TILES))`` least active of the ``n`` tiles are read for the shares ``f`` of
    ``SHARES`` in turn, each estimate ``σ̂_f`` over ``N_f`` coefficients; the last ``σ̂_f`` of the
    run that stays ``≤ σ̂_f₀·(1 + GROW_WITHIN·MAD_SE/√N_f₀)`` is returned (``f₀`` the first share).
    An image smaller than a tile gets ``haar_sigma``."""
    height, width = image.shape[-2] // TILE * TILE, image.shape[-1] // TILE * TILE
    if height == 0 or width == 0:
        return haar_sigma(image[None])[0]
    x = image[None, :, :height, :width].to(torch.float32)
    c, rows, cols, half = x.shape[1], height // TILE, width // TILE, TILE // 2
    corners = blocks(x)
    d = haar_diagonal(corners)
    # activity and saturation read at half resolution, a quarter of the memory: a 25-megapixel grey
    # scan's estimate peaks 225 MiB above its image (the whole-image Haar estimate's 100; at full
    # resolution, 580)
    smooth = separable_blur(sum(corners) / 4, gaussian_taps(TILE_BLUR / 2).to(x.device))
    gx = torch.diff(smooth, dim=-1, append=smooth[..., -1:])
    gy = torch.diff(smooth, dim=-2, append=smooth[..., -1:, :])
    energy = (gx**2 + gy**2).reshape(c, rows, half, cols, half).mean(dim=(0, 2, 4)).reshape(-1)
    ends = sum(((v <= 0) | (v >= 1)).to(torch.uint8) for v in corners).reshape(c, rows, half, cols, half)
    saturated = ends.sum(dim=(0, 2, 4), dtype=torch.int32).reshape(-1) >= SATURATED * c * TILE * TILE
    energy = energy + saturated.to(energy.dtype) * (1 + energy.max())
    n = energy.numel()
    per_tile = d.reshape(c, rows, half, cols, half).permute(1, 3, 0, 2, 4).reshape(n, -1)
    flattest = per_tile[torch.argsort(energy)].abs()
    counts = sorted({max(math.ceil(f * n), min(n, MIN_TILES)) for f in SHARES})
    first = flattest[: counts[0]].reshape(-1)
    best = first.median() / MAD_TO_STD
    bound = best * (1 + GROW_WITHIN * MAD_SE / math.sqrt(first.numel()))
    for count in counts[1:]:
        estimate = flattest[:count].reshape(-1).median() / MAD_TO_STD
        if estimate > bound:
            break
        best = estimate
    return best


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
