"""The noise-level estimators (``kdeq.noise``): the colour estimate from the patch covariance's noise
eigenvalues against numpy on explicit patches, its accuracy where texture fools the Haar estimate, and
the cases that fall back to the Haar estimate. Every test makes its own images."""

import math

import numpy as np
import pytest
import torch

from kdeq.noise import AGREEMENT, MIN_PATCHES, PATCH, PATCHES, estimate_sigma, haar_sigma, patch_sigma


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


def test_a_grey_image_stored_as_colour_gets_the_haar_estimate() -> None:
    """Identical channels: no noise in the colour differences, so the smallest eigenvalues are zero;
    an estimate under ``AGREEMENT`` of the Haar one gives way to it."""
    gen = torch.Generator().manual_seed(7)
    grey = textured(64, 64)[1:2] + 15 / 255 * torch.randn(1, 64, 64, generator=gen)
    as_colour = grey.expand(3, 64, 64)[None]
    assert float(patch_sigma(as_colour[0])) < AGREEMENT * float(haar_sigma(as_colour))
    assert torch.equal(estimate_sigma(as_colour), haar_sigma(as_colour))


def test_grey_and_tiny_images_get_the_haar_estimate_and_each_image_its_own() -> None:
    gen = torch.Generator().manual_seed(8)
    grey = torch.rand(2, 1, 30, 30, generator=gen)
    assert torch.equal(estimate_sigma(grey), haar_sigma(grey))
    for height, width in [(PATCH - 1, 9), (40, 52)]:  # no patch; fewer than MIN_PATCHES
        small = torch.rand(1, 3, height, width, generator=gen)
        assert max(0, height - PATCH + 1) * (width - PATCH + 1) < MIN_PATCHES
        assert torch.equal(estimate_sigma(small), haar_sigma(small))
    clean = textured(64, 80)[None].expand(2, 3, 64, 80)
    noisy = clean + torch.tensor([5.0, 40.0]).reshape(2, 1, 1, 1) / 255 * torch.randn(
        2, 3, 64, 80, generator=gen
    )
    both = estimate_sigma(noisy)
    assert torch.allclose(both, torch.stack([estimate_sigma(noisy[k : k + 1])[0] for k in range(2)]))
    assert both[0] * 255 == pytest.approx(5, rel=0.05) and both[1] * 255 == pytest.approx(40, rel=0.05)
