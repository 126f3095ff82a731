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

JPEG inputs: a JPEG's colour differences are stored at half resolution (4:2:0, libjpeg's default at
every quality) and quantised coarsely, which removes most of their noise. The patch estimate then
reads the noise left in the colour differences, not the noise in the luminance that the denoiser
solves: on 192² crops of the first four CBSD68 images at σ = 25 saved as quality 75–95 JPEGs it read
10–17 grey levels on average, and the blind denoiser lost 2.2–4.0 dB to σ given, where the σ that
denoises best was σ or a little above (the luminance keeps its noise; ``bench/noise.py --jpeg``).
And JPEG's ringing moves a clipped region off 0 and 1, so that ``flat_sigma``'s saturation rule
misses it and reads its reduced, clipped noise (Set12 ``01.png``: 20 at σ = 25). A JPEG is told from
the pixels alone (``looks_jpeg``: it may arrive re-saved as PNG): the DCT coefficients of its 8×8
blocks lie on the multiples of each frequency's quantisation step, off them by the decoder's
rounding to 8 bits alone. Its noise is read from JPEG's own luminance ``Y = 0.299R + 0.587G +
0.114B`` (for a grey image, the image), which JPEG keeps at full resolution, by ``flat_sigma`` with
tiles within ``JPEG_MARGIN`` of either end taken as clipped, and scaled by ``1/‖(0.299, 0.587,
0.114)‖`` to the noise of each channel that gives ``Y`` that noise. Any other image's estimate is
what it was (no step of it changes). On JPEGs the blind denoiser comes within 0.3 dB of σ given (CBSD68
crops, quality 90–95, σ = 15–50; 1.1–7 dB above the patch estimate's). The estimate is what JPEG
left in the luminance: where the quantisation removed much of it (quality 75 at σ = 15) it reads low
(10 for 15, 1.4 dB under σ given).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kdeq.maths.filters import gaussian_taps, separable_blur
from kdeq.maths.transforms import dct_matrix

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
#: JPEG's luminance ``Y`` from RGB (ITU-R BT.601, as libjpeg converts)
LUMA = (0.299, 0.587, 0.114)
#: the side of a JPEG's blocks (its DCT's)
JPEG_BLOCK = 8
#: at most this many blocks, spread evenly over the image, are read for its JPEG signature
JPEG_BLOCKS = 256
#: the quantisation steps tried (on the 0–255 scale of an orthonormal 8×8 DCT); libjpeg's are ≥ 2 for
#: most of the 63 AC frequencies at quality ≤ 95, and a coefficient on a step's lattice is on its
#: divisors' too: a larger step is seen through its divisors (a prime one, not at all)
JPEG_STEPS = range(2, 17)
#: a coefficient is on its step's lattice within this distance: the decoder's rounding of 64 pixels
#: to integers moves an orthonormal DCT's coefficient by ``1/√12 ≈ 0.29`` (std), so a decoded JPEG's
#: lie within it but for clipped pixels; a quarter of the step at most, so that coefficients lying
#: anywhere fall within it at most half the time
JPEG_TOLERANCE = 1.0
#: a frequency is quantised where at least this share of its coefficients off the zero bin (at least
#: ``JPEG_MIN_COUNT`` of them) lie on one step's lattice: where its coefficients lie anywhere, the share
#: is ``2·tolerance/step ≤ 1/2``; noise of std 1.5 added after the JPEG leaves a share of 0.5 at any step
JPEG_SHARE = 0.8
JPEG_MIN_COUNT = 64
#: an image is a JPEG where at least this many of the 63 AC frequencies are quantised
JPEG_MIN_FREQUENCIES = 4
#: a JPEG's tile with ``SATURATED`` of its pixels within this of 0 or 1 is clipped: JPEG's ringing
#: lifts a clipped region by a few grey levels (Set12 ``01.png``'s dark third, σ = 25, quality 95:
#: 20.0 read without, 24.5 with; σ = 50: 39 and 43)
JPEG_MARGIN = 4 / 255


class NoiseEstimate(NamedTuple):
    """``estimate_noise``'s answer for a batch: ``sigma`` ``(B,)`` on the images' scale, and ``jpeg``
    ``(B,)`` bool, whether the image bears a JPEG's quantisation (``looks_jpeg``), whose estimate is the
    noise JPEG left in the luminance (the module docstring)."""

    sigma: torch.Tensor
    jpeg: torch.Tensor


def estimate_sigma(images: torch.Tensor) -> torch.Tensor:
    """Noise standard deviation per image, ``(B,)``: ``estimate_noise(images).sigma``."""
    return estimate_noise(images).sigma


def estimate_noise(images: torch.Tensor) -> NoiseEstimate:
    """Noise standard deviation per image for ``images`` ``(B, c, H, W)`` with ``H, W ≥ 2``, on the
    images' own scale (pixels in [0, 1] give ``σ̂`` in [0, 1] units), and whether each ``looks_jpeg``:
    a JPEG's ``jpeg_sigma``, any other image's ``plain_sigma``."""
    if images.dim() != 4 or images.shape[-1] < 2 or images.shape[-2] < 2:
        raise ValueError(f"need (B, c, H, W) images with H, W ≥ 2, got {tuple(images.shape)}")
    jpeg = [looks_jpeg(x) for x in images]
    out = [jpeg_sigma(x) if is_jpeg else plain_sigma(x) for x, is_jpeg in zip(images, jpeg, strict=True)]
    return NoiseEstimate(torch.stack(out), torch.tensor(jpeg, device=images.device))


def plain_sigma(image: torch.Tensor) -> torch.Tensor:
    """``σ̂`` of ``image`` ``(c, H, W)``, ``H, W ≥ 2``, taken to hold noise alike and independent in every
    pixel and channel: the flattest tiles' Haar estimate (``flat_sigma``) for a grey image, the
    patch-covariance estimate (``patch_sigma``) for a colour one of at least ``MIN_PATCHES`` patches
    where it is at least ``AGREEMENT`` of the Haar estimate (``haar_sigma``): a scalar tensor."""
    positions = max(0, image.shape[-2] - PATCH + 1) * max(0, image.shape[-1] - PATCH + 1)
    if image.shape[0] == 1 or positions < MIN_PATCHES:
        return flat_sigma(image)
    # the grey estimate only where the colour one is refused: it blurs the image, the colour one does not
    colour = patch_sigma(image)
    return colour if colour >= AGREEMENT * haar_sigma(image[None])[0] else flat_sigma(image)


def luminance(image: torch.Tensor) -> torch.Tensor:
    """JPEG's luminance ``Y = Σ LUMA_k·x_k`` ``(1, H, W)`` of a colour ``image`` ``(3, H, W)``; a grey
    one ``(1, H, W)`` as it is, in float32."""
    x = image.to(torch.float32)
    if x.shape[0] == 1:
        return x
    if x.shape[0] != len(LUMA):
        raise ValueError(f"need a grey or RGB image, got {x.shape[0]} channels")
    return (torch.tensor(LUMA, device=x.device)[:, None, None] * x).sum(dim=0, keepdim=True)


def jpeg_sigma(image: torch.Tensor) -> torch.Tensor:
    """``σ̂`` of a JPEG ``image`` ``(c, H, W)``, ``c`` 1 or 3: ``flat_sigma`` of its ``luminance`` with
    ``JPEG_MARGIN``, over ``‖LUMA‖`` for a colour one (the noise ``σ`` in each of R, G, B, alike and
    independent, gives ``Y`` the noise ``σ·‖LUMA‖``): a scalar tensor."""
    sigma = flat_sigma(luminance(image), margin=JPEG_MARGIN)
    return sigma if image.shape[0] == 1 else sigma / math.hypot(*LUMA)


def quantised_frequencies(image: torch.Tensor) -> torch.Tensor:
    """Which of the 63 AC frequencies of the 8×8 block DCT of the ``luminance`` of ``image`` ``(c, H, W)``
    (in [0, 1]; the blocks on the grid from the top left) are quantised, ``(63,)`` bool: those for
    which some step ``q`` of ``JPEG_STEPS`` has at least ``JPEG_MIN_COUNT`` coefficients ``|c| ≥ q/2``
    (on the 0–255 scale), of which at least ``JPEG_SHARE`` lie within ``min(JPEG_TOLERANCE, q/4)`` of a
    multiple of ``q``. Blocks with a pixel at or past 0 or 1 in any channel are passed over (the
    decoder's clipping moves their coefficients off the lattice); at most ``JPEG_BLOCKS`` are read,
    on an even grid of them. ``image`` has 1 or 3 channels."""
    rows, cols = image.shape[-2] // JPEG_BLOCK, image.shape[-1] // JPEG_BLOCK
    if rows == 0 or cols == 0:
        return torch.zeros(JPEG_BLOCK**2 - 1, dtype=torch.bool, device=image.device)
    # candidates on an even grid of at most 4·JPEG_BLOCKS blocks, read alone (a pass over a large
    # image would cost more than the test), of which the unclipped ones are thinned to JPEG_BLOCKS
    stride = max(1, math.floor(math.sqrt(rows * cols / (4 * JPEG_BLOCKS))))
    c, side = image.shape[0], JPEG_BLOCK
    x = image[:, : rows * side, : cols * side].reshape(c, rows, side, cols, side)[:, ::stride, :, ::stride]
    tiles = x.permute(1, 3, 0, 2, 4).reshape(-1, c, side, side).to(torch.float32)
    values = tiles.reshape(tiles.shape[0], -1)
    tiles = tiles[(values.amin(dim=1) > 0) & (values.amax(dim=1) < 1)]
    tiles = tiles[:: max(1, math.ceil(tiles.shape[0] / JPEG_BLOCKS))]
    weights = (
        torch.tensor(LUMA, device=image.device) if c == len(LUMA) else torch.ones(1, device=image.device)
    )
    tiles = 255 * (weights[:, None, None] * tiles).sum(dim=1)
    basis = dct_matrix(JPEG_BLOCK).to(image.device, torch.float32)
    coef = (basis @ tiles @ basis.T).reshape(-1, side * side)[:, 1:]
    steps = torch.tensor(list(JPEG_STEPS), dtype=torch.float32, device=image.device)[:, None, None]
    tolerance = torch.clamp(steps / 4, max=JPEG_TOLERANCE)
    off_zero = coef.abs() >= steps / 2  # (steps, blocks, 63): the zero bin holds any small coefficient
    on_lattice = off_zero & ((coef - steps * torch.round(coef / steps)).abs() <= tolerance)
    count = off_zero.sum(dim=1)
    share = on_lattice.sum(dim=1) / count.clamp(min=1)
    return ((count >= JPEG_MIN_COUNT) & (share >= JPEG_SHARE)).any(dim=0)


def looks_jpeg(image: torch.Tensor) -> bool:
    """Whether ``image`` ``(c, H, W)`` bears a JPEG's quantisation: at least ``JPEG_MIN_FREQUENCIES``
    of its ``quantised_frequencies``. A JPEG cropped off its 8×8 grid, resized, or with noise of std
    1.5 grey levels or more added after it does not (a smooth one too: its coefficients are small, in
    the zero bin); nor does an image of other than 1 or 3 channels (a JPEG holds grey or colour)."""
    if image.shape[0] not in (1, len(LUMA)):
        return False
    return int(quantised_frequencies(image).sum()) >= JPEG_MIN_FREQUENCIES


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


def flat_sigma(image: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """``σ̂ = median|d| / Φ⁻¹(3/4)`` over the Haar diagonal coefficients ``d`` (all channels) of the
    flattest ``TILE × TILE`` tiles of ``image`` ``(c, H, W)``, ``H, W ≥ 2``: a scalar tensor. A tile's
    activity is the mean squared gradient of the Haar average band ``a = (x₀₀ + x₀₁ + x₁₀ + x₁₁)/4``
    (the image at half resolution) blurred by a Gaussian of std ``TILE_BLUR / 2``, summed over
    channels; tiles with at least ``SATURATED`` of their pixels within ``margin`` of 0 or 1 (or past)
    come last. The ``max(f·n, min(n, MIN_TILES))`` least active of the ``n`` tiles are read for the
    shares ``f`` of ``SHARES`` in turn, each estimate ``σ̂_f`` over ``N_f`` coefficients; the last
    ``σ̂_f`` of the run that stays ``≤ σ̂_f₀·(1 + GROW_WITHIN·MAD_SE/√N_f₀)`` is returned (``f₀`` the
    first share).
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
    ends = sum(((v <= margin) | (v >= 1 - margin)).to(torch.uint8) for v in corners)
    ends = ends.reshape(c, rows, half, cols, half)
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
