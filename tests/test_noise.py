"""The noise-level estimators (``kdeq.maths.noise``): the colour estimate from the patch covariance's noise
eigenvalues against numpy on explicit patches, its accuracy where texture fools the Haar estimate, and
the cases that fall back to the grey one; the grey estimate from the flattest tiles against numpy
tile by tile, where texture and clipping would fool it. Every test makes its own images."""

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from kdeq.maths.noise import (
    AGREEMENT,
    GROW_WITHIN,
    MIN_PATCHES,
    MIN_TILES,
    PATCH,
    PATCHES,
    SATURATED,
    SHARES,
    TILE,
    TILE_BLUR,
    estimate_sigma,
    flat_sigma,
    haar_sigma,
    patch_sigma,
)


def textured(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """A clean colour image ``(3, H, W)`` whose luminance is fine texture (each pixel's grey level
    drawn anew in 0.3–0.7) and whose colour is a smooth tint: the Haar band sees the texture."""
    gen = torch.Generator().manual_seed(seed)
    grey = 0.3 + 0.4 * torch.rand(height, width, generator=gen)
    ramp = torch.linspace(0, 0.1, height)[:, None]
    return torch.stack([grey + ramp, grey, grey - ramp])


def numpy_patch_sigma(image: np.ndarray, step: int) -> float:
    """The estimate by numpy: every ``PATCH × PATCH`` patch on the grid of ``step`` as one row of
    ``c·PATCH²`` values, their covariance's eigenvalues ascending, and the largest ``m`` whose first
    ``m`` eigenvalues have their mean as a median (as many strictly above as strictly below)."""
    _, height, width = image.shape
    rows = [
        image[:, i : i + PATCH, j : j + PATCH].reshape(-1)
        for i in range(0, height - PATCH + 1, step)
        for j in range(0, width - PATCH + 1, step)
    ]
    eigen = np.linalg.eigvalsh(np.cov(np.array(rows, dtype=np.float64), rowvar=False, bias=True))
    best = eigen[0]
    for m in range(1, len(eigen) + 1):
        mean = eigen[:m].mean()
        if np.sum(eigen[:m] > mean) == np.sum(eigen[:m] < mean):
            best = mean
    return math.sqrt(max(best, 0.0))


@pytest.mark.parametrize(("height", "width", "sigma"), [(40, 52, 10.0), (96, 64, 30.0), (150, 140, 20.0)])
def test_the_patch_estimate_is_numpys_on_explicit_patches(height, width, sigma) -> None:
    gen = torch.Generator().manual_seed(2)
    noisy = textured(height, width) + sigma / 255 * torch.randn(3, height, width, generator=gen)
    positions = (height - PATCH + 1) * (width - PATCH + 1)
    step = max(1, math.ceil(math.sqrt(positions / PATCHES)))
    want = numpy_patch_sigma(noisy.double().numpy(), step)
    assert float(patch_sigma(noisy)) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("sigma", [5.0, 15.0, 50.0])
def test_texture_fools_the_haar_estimate_not_the_colour_one(sigma) -> None:
    """On fine grey texture with a colour tint the Haar band holds texture, so its estimate reads
    high; the patch estimate finds the noise in the colour differences, within 3 %."""
    clean = textured(128, 160, seed=3)[None]
    gen = torch.Generator().manual_seed(4)
    noisy = clean + sigma / 255 * torch.randn(clean.shape, generator=gen)
    assert float(haar_sigma(noisy)) * 255 > 1.1 * sigma
    assert float(estimate_sigma(noisy)) * 255 == pytest.approx(sigma, rel=0.03)


def test_a_large_image_reads_a_coarser_grid_and_keeps_its_accuracy() -> None:
    gen = torch.Generator().manual_seed(5)
    clean = textured(600, 700, seed=6)
    noisy = clean + 20 / 255 * torch.randn(clean.shape, generator=gen)
    positions = (600 - PATCH + 1) * (700 - PATCH + 1)
    step = max(1, math.ceil(math.sqrt(positions / PATCHES)))
    assert step > 1 and positions / step**2 <= 1.1 * PATCHES
    assert float(patch_sigma(noisy)) * 255 == pytest.approx(20, rel=0.03)


def test_a_grey_image_stored_as_colour_gets_the_grey_estimate() -> None:
    """Identical channels: no noise in the colour differences, so the smallest eigenvalues are zero;
    an estimate under ``AGREEMENT`` of the Haar one gives way to the grey estimate (``flat_sigma``)."""
    gen = torch.Generator().manual_seed(7)
    grey = textured(64, 64)[1:2] + 15 / 255 * torch.randn(1, 64, 64, generator=gen)
    as_colour = grey.expand(3, 64, 64)[None]
    assert float(patch_sigma(as_colour[0])) < AGREEMENT * float(haar_sigma(as_colour))
    assert torch.equal(estimate_sigma(as_colour), flat_sigma(as_colour[0])[None])


def test_grey_and_small_images_get_the_grey_estimate_and_each_image_its_own() -> None:
    gen = torch.Generator().manual_seed(8)
    grey = torch.rand(2, 1, 30, 30, generator=gen)
    assert torch.equal(estimate_sigma(grey), torch.stack([flat_sigma(x) for x in grey]))
    for height, width in [(PATCH - 1, 9), (40, 52)]:  # no patch; fewer than MIN_PATCHES
        small = torch.rand(1, 3, height, width, generator=gen)
        assert max(0, height - PATCH + 1) * (width - PATCH + 1) < MIN_PATCHES
        assert torch.equal(estimate_sigma(small), flat_sigma(small[0])[None])
    clean = textured(64, 80)[None].expand(2, 3, 64, 80)
    noisy = clean + torch.tensor([5.0, 40.0]).reshape(2, 1, 1, 1) / 255 * torch.randn(
        2, 3, 64, 80, generator=gen
    )
    both = estimate_sigma(noisy)
    assert torch.allclose(both, torch.stack([estimate_sigma(noisy[k : k + 1])[0] for k in range(2)]))
    assert both[0] * 255 == pytest.approx(5, rel=0.05) and both[1] * 255 == pytest.approx(40, rel=0.05)


def half_textured(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """A clean grey image ``(1, H, W)``: a gentle ramp on the left half, fine texture (each pixel's
    grey level drawn anew in 0.3–0.7) on the right half."""
    gen = torch.Generator().manual_seed(seed)
    image = torch.linspace(0.3, 0.6, height)[:, None].expand(height, width).clone()
    image[:, width // 2 :] = 0.3 + 0.4 * torch.rand(height, width - width // 2, generator=gen)
    return image[None]


def numpy_flat_sigma(image: np.ndarray, shares: tuple[float, ...] = SHARES) -> float:
    """``flat_sigma`` by numpy, tile by tile: the 2×2 block means blurred by explicit taps with
    mirrored borders, forward differences (0 at the last row and column), each tile's mean squared
    gradient over its 4×4 block means, the tiles mostly at or past 0 or 1 last; the lower median of
    the kept tiles' Haar diagonal coefficients for each share of the flattest tiles in turn, while
    it stays within ``GROW_WITHIN`` standard errors of the first share's (the median's standard error
    from the normal density, ``σ/(4·q·φ(q)·√N)``)."""
    _, height, width = image.shape
    height, width = height // TILE * TILE, width // TILE * TILE
    x = image[:, :height, :width].astype(np.float64)
    means = (x[:, 0::2, 0::2] + x[:, 0::2, 1::2] + x[:, 1::2, 0::2] + x[:, 1::2, 1::2]) / 4
    std = TILE_BLUR / 2
    r = math.ceil(3 * std)
    taps = np.exp(-(np.arange(-r, r + 1) ** 2) / (2 * std**2))
    taps /= taps.sum()
    h2, w2 = means.shape[1:]
    padded = np.pad(means, ((0, 0), (r, r), (r, r)), mode="reflect")
    rows = sum(t * padded[:, :, k : k + w2] for k, t in enumerate(taps))
    smooth = sum(t * rows[:, k : k + h2, :] for k, t in enumerate(taps))
    gx = np.diff(smooth, axis=2, append=smooth[:, :, -1:])
    gy = np.diff(smooth, axis=1, append=smooth[:, -1:, :])
    half = TILE // 2
    tiles = []
    for i in range(0, height, TILE):
        for j in range(0, width, TILE):
            block = x[:, i : i + TILE, j : j + TILE]
            a, b = i // 2, j // 2
            energy = (gx[:, a : a + half, b : b + half] ** 2 + gy[:, a : a + half, b : b + half] ** 2).mean()
            saturated = ((block <= 0) | (block >= 1)).mean() >= SATURATED
            d = (
                block[:, 0::2, 0::2] - block[:, 0::2, 1::2] - block[:, 1::2, 0::2] + block[:, 1::2, 1::2]
            ) / 2
            tiles.append((saturated, energy, d.reshape(-1)))
    tiles.sort(key=lambda t: (t[0], t[1]))
    normal = NormalDist()
    q = normal.inv_cdf(0.75)

    def estimate(share: float) -> tuple[float, int]:
        kept = tiles[: max(math.ceil(share * len(tiles)), min(len(tiles), MIN_TILES))]
        values = np.sort(np.abs(np.concatenate([d for _, _, d in kept])))
        return float(values[(len(values) - 1) // 2]) / q, len(values)  # the lower median, as torch's

    first, count = estimate(shares[0])
    bound = first * (1 + GROW_WITHIN / (4 * q * normal.pdf(q) * math.sqrt(count)))
    best = first
    for share in shares[1:]:
        value, _ = estimate(share)
        if value > bound:
            break
        best = value
    return best


@pytest.mark.parametrize(("shape", "sigma"), [((1, 96, 120), 10.0), ((3, 130, 97), 30.0)])
def test_the_flat_estimate_is_numpys_tile_by_tile(shape, sigma) -> None:
    gen = torch.Generator().manual_seed(9)
    clean = half_textured(shape[1], shape[2]).expand(shape)
    noisy = clean + sigma / 255 * torch.randn(shape, generator=gen)
    assert float(flat_sigma(noisy)) == pytest.approx(numpy_flat_sigma(noisy.numpy()), rel=1e-5)


def test_more_tiles_are_read_where_texture_does_not_show_against_the_noise() -> None:
    """A fine texture of 3 grey levels (std) everywhere is small against σ = 50: over 24 noise draws
    the grown share's estimate scatters less around the truth than the flattest tenth's alone, and
    reads more coefficients than the tenth on most draws. Against σ = 2, ``half_textured``'s texture
    (29 grey levels, half the tiles) shows: the share stops short of it, where 70 % of the tiles
    would read more than 1.5σ."""
    errors, tenth, grown = [], [], 0
    for seed in range(24):
        gen = torch.Generator().manual_seed(100 + seed)
        texture = 0.5 + 3 / 255 * math.sqrt(3) * (2 * torch.rand(1, 160, 192, generator=gen) - 1)
        noisy = texture + 50 / 255 * torch.randn(1, 160, 192, generator=gen)
        value = float(flat_sigma(noisy))
        first = numpy_flat_sigma(noisy.numpy(), shares=SHARES[:1])
        errors.append(value * 255 - 50)
        tenth.append(first * 255 - 50)
        grown += value != pytest.approx(first, rel=1e-6)
    assert np.sqrt(np.mean(np.square(errors))) < 0.8 * np.sqrt(np.mean(np.square(tenth)))
    assert grown >= 12
    gen = torch.Generator().manual_seed(7)
    noisy = half_textured(160, 192) + 2 / 255 * torch.randn(1, 160, 192, generator=gen)
    assert float(flat_sigma(noisy)) * 255 == pytest.approx(2, rel=0.05)
    assert numpy_flat_sigma(noisy.numpy(), shares=(0.7,)) * 255 > 3


@pytest.mark.parametrize("sigma", [5.0, 15.0, 50.0])
def test_grey_noise_is_read_where_the_image_is_flat(sigma) -> None:
    """Half the image is fine texture: the whole image's Haar estimate reads it as noise, the flattest
    tiles' estimate does not (within 5 %)."""
    gen = torch.Generator().manual_seed(10)
    noisy = half_textured(160, 192)[None] + sigma / 255 * torch.randn(1, 1, 160, 192, generator=gen)
    assert float(haar_sigma(noisy)) * 255 > sigma + 3
    assert float(estimate_sigma(noisy)) * 255 == pytest.approx(sigma, rel=0.05)


def test_a_clipped_flat_region_is_not_read_as_noiseless() -> None:
    """Three eighths of the image are blown out to white (exactly 1 after clipping): flatter than
    anything, but passed over, so the estimate is the noise's (without the rule it would be 0)."""
    gen = torch.Generator().manual_seed(11)
    clean = half_textured(256, 256)[None].clone()
    clean[..., :96, :] = 1.5
    noisy = (clean + 15 / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
    assert float(estimate_sigma(noisy)) * 255 == pytest.approx(15, rel=0.05)
