"""JPEG inputs to the noise estimate (``kdeq.maths.noise``): the quantisation signature told from the pixels
alone, against the same 8-bit image not compressed; the estimate on noisy images saved as JPEGs by
Pillow, which the patch estimate reads far low (4:2:0 colour removes the colour differences' noise) and
the luminance's reads near the noise that denoises best; and non-JPEG images' estimates unchanged.
Every test makes its own images."""

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kdeq.maths.noise import (
    JPEG_MARGIN,
    LUMA,
    estimate_noise,
    estimate_sigma,
    flat_sigma,
    jpeg_sigma,
    looks_jpeg,
    luminance,
    plain_sigma,
    quantised_frequencies,
)

DENOISER = Path(__file__).resolve().parent.parent / "models" / "denoise-kglm" / "8"


def scene(height: int, width: int, colour: bool = True) -> torch.Tensor:
    """A clean piecewise-smooth image ``(3, H, W)`` (``(1, H, W)`` grey) in [0.15, 0.85]: a smooth colour
    field, a disc and a square of other colours, and a band of fine grey stripes."""
    u = torch.linspace(0, 1, height)[:, None].expand(height, width)
    v = torch.linspace(0, 1, width)[None, :].expand(height, width)
    image = torch.stack(
        [
            0.3 + 0.3 * v + 0.1 * torch.sin(5 * u),
            0.5 + 0.2 * torch.cos(4 * v) * u,
            0.6 - 0.3 * u * v,
        ]
    )
    disc = (u - 0.35) ** 2 + (v - 0.4) ** 2 < 0.04
    image = torch.where(disc, torch.tensor([0.8, 0.3, 0.2])[:, None, None], image)
    square = ((u - 0.7).abs() < 0.1) & ((v - 0.75).abs() < 0.1)
    image = torch.where(square, torch.tensor([0.2, 0.25, 0.7])[:, None, None], image)
    stripes = (u > 0.85) & (v < 0.5)
    image = image + 0.1 * stripes * torch.sin(2.2 * torch.arange(width))[None, None, :]
    image = image.clamp(0.15, 0.85)
    return luminance(image) if not colour else image


def eight_bit(image: torch.Tensor) -> np.ndarray:
    """``image`` ``(c, H, W)`` in [0, 1] clipped and rounded to 8 bits, ``H×W`` or ``H×W×3`` (a PNG's)."""
    pixels = (255 * image.clamp(0, 1)).round().to(torch.uint8)
    return (pixels[0] if pixels.shape[0] == 1 else pixels.permute(1, 2, 0)).numpy()


def decoded(pixels: np.ndarray, quality: int | None) -> torch.Tensor:
    """The 8-bit ``pixels`` saved by Pillow as a JPEG of ``quality`` (its defaults: 4:2:0 colour) and
    decoded (``None``: as they are), as ``(c, H, W)`` float in [0, 1]."""
    if quality is not None:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
        pixels = np.asarray(Image.open(io.BytesIO(buffer.getvalue())))
    x = torch.from_numpy(pixels.astype(np.float32) / 255)
    return x[None] if x.dim() == 2 else x.permute(2, 0, 1).contiguous()


def noisy(clean: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return clean + sigma / 255 * torch.randn(clean.shape, generator=gen)


@pytest.mark.parametrize("colour", [False, True], ids=["grey", "colour"])
@pytest.mark.parametrize("sigma", [5.0, 25.0])
def test_a_jpeg_is_told_from_the_same_image_not_compressed(colour, sigma) -> None:
    """At qualities 75–95 the decoded JPEG's coefficients lie on their steps' lattices; the same 8-bit
    image as a PNG has no quantised frequency. Quality 100 quantises nothing: no signature."""
    pixels = eight_bit(noisy(scene(160, 192, colour), sigma, seed=1))
    png = decoded(pixels, None)
    assert not bool(quantised_frequencies(png).any())
    assert not looks_jpeg(png)
    for quality in (75, 90, 95):
        assert looks_jpeg(decoded(pixels, quality)), quality
    assert not looks_jpeg(decoded(pixels, 100))


def test_noise_after_the_jpeg_or_a_shifted_grid_hides_it() -> None:
    """Noise of std 2 grey levels added to the decoded JPEG moves its coefficients off the lattices
    (the rounding to 8 bits after it too);
    a crop off the 8×8 grid reads blocks that straddle JPEG's; other channel counts are not JPEGs."""
    jpeg = decoded(eight_bit(noisy(scene(160, 192), 15.0, seed=2)), 90)
    assert looks_jpeg(jpeg)
    renoised = decoded(eight_bit(noisy(jpeg, 2.0, seed=3)), None)
    assert not looks_jpeg(renoised)
    assert not looks_jpeg(jpeg[:, 3:, 5:])
    assert not looks_jpeg(torch.cat([jpeg, jpeg[:1]]))


@pytest.mark.parametrize(("sigma", "quality"), [(15.0, 90), (15.0, 95), (25.0, 75), (25.0, 95), (50.0, 75)])
def test_a_colour_jpegs_estimate_is_its_luminance_noise(sigma, quality) -> None:
    """4:2:0 colour halves the colour differences' resolution and quantises them coarsely: the patch
    estimate, which reads the smallest eigenvalues (the colour differences), falls below 80 % of σ.
    JPEG keeps the luminance's noise (std ``σ·‖LUMA‖``, where the noise is alike in R, G, B):
    ``estimate_sigma`` reads it within 15 % of σ (the quantisation's share at these qualities, and
    the clipping at σ = 50) and flags the image. (At quality 75 and σ = 15 the quantisation removes
    much of the luminance's noise too: bench/noise.py --jpeg.)"""
    jpeg = decoded(eight_bit(noisy(scene(192, 224), sigma, seed=4)), quality)
    assert float(plain_sigma(jpeg)) * 255 < 0.8 * sigma
    estimate = estimate_noise(jpeg[None])
    assert bool(estimate.jpeg[0])
    assert float(estimate.sigma[0]) * 255 == pytest.approx(sigma, rel=0.15)
    assert torch.equal(estimate.sigma[0], flat_sigma(luminance(jpeg), JPEG_MARGIN) / math.hypot(*LUMA))


def test_the_estimate_denoises_a_colour_jpeg_as_sigma_given_does() -> None:
    """The default denoiser on a σ = 25 colour image saved at quality 95: with the plain estimate it
    leaves the noise in (several dB below σ given); with ``estimate_sigma``'s it is within 0.5 dB of
    σ given (the estimate's error, within 15 %, costs a few tenths of a dB)."""
    from kdeq.models.repository import load_predictor

    model = load_predictor(DENOISER)
    clean = scene(96, 96)
    jpeg = decoded(eight_bit(noisy(clean, 25.0, seed=5)), 95)[None]

    def psnr(sigma: float) -> float:
        out = model.predict(jpeg, sigma=sigma).output.clamp(0, 1)
        return -10 * math.log10(float((out - clean).square().mean()))

    given = psnr(25.0)
    plain = psnr(float(plain_sigma(jpeg[0])) * 255)
    now = psnr(float(estimate_sigma(jpeg)[0]) * 255)
    assert plain < given - 1.5
    assert now > given - 0.5


@pytest.mark.parametrize("quality", [90, 95])
def test_a_jpegs_clipped_region_is_passed_over(quality) -> None:
    """A third of a grey image is near black (5 grey levels), its noise clipped at 0: JPEG's ringing
    lifts the clipped pixels off 0, so the saturation rule at 0 misses them and the flattest tiles
    read the clipped noise (under 85 % of σ); within ``JPEG_MARGIN`` of 0 they are passed over, and
    the estimate is the PNG's, within 5 % of σ."""
    clean = scene(192, 192, colour=False).clone()
    clean[:, :64] = 5 / 255
    jpeg = decoded(eight_bit(noisy(clean, 25.0, seed=6)), quality)
    assert looks_jpeg(jpeg)
    assert float(flat_sigma(jpeg)) * 255 < 0.85 * 25
    assert float(jpeg_sigma(jpeg)) * 255 == pytest.approx(25, rel=0.05)
    assert torch.equal(estimate_sigma(jpeg[None])[0], jpeg_sigma(jpeg))


@pytest.mark.parametrize("colour", [False, True], ids=["grey", "colour"])
def test_other_images_keep_their_estimate_bit_for_bit(colour) -> None:
    """Noisy images in float and in 8 bits, clean 8-bit ones, and a batch with a JPEG among them: every
    non-JPEG's estimate is ``plain_sigma``'s (the estimate before JPEGs were told apart), exactly."""
    clean = scene(128, 144, colour)
    images = [noisy(clean, s, seed=7 + k) for k, s in enumerate((2.0, 10.0, 30.0))]
    images += [decoded(eight_bit(x), None) for x in images] + [decoded(eight_bit(clean), None)]
    batch = torch.stack(images)
    estimate = estimate_noise(batch)
    assert not bool(estimate.jpeg.any())
    assert torch.equal(estimate.sigma, torch.stack([plain_sigma(x) for x in images]))
    jpeg = decoded(eight_bit(images[1]), 90)
    mixed = estimate_noise(torch.stack([images[3], jpeg]))
    assert mixed.jpeg.tolist() == [False, True]
    assert torch.equal(mixed.sigma, torch.stack([plain_sigma(images[3]), jpeg_sigma(jpeg)]))


def test_images_without_a_whole_block_or_of_other_channels_are_not_jpegs() -> None:
    """No 8×8 block: no frequency to read; two channels: no JPEG (and no JPEG luminance)."""
    gen = torch.Generator().manual_seed(8)
    for shape in [(1, 7, 40), (3, 40, 5), (3, 3, 9)]:
        small = torch.rand(1, *shape, generator=gen)
        assert not bool(quantised_frequencies(small[0]).any())
        estimate = estimate_noise(small)
        assert not bool(estimate.jpeg[0]) and torch.equal(estimate.sigma[0], plain_sigma(small[0]))
    two = torch.rand(2, 32, 32, generator=gen)
    assert not looks_jpeg(two)
    with pytest.raises(ValueError, match="grey or RGB"):
        luminance(two)
