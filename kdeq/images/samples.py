"""Generated sample images for trying the models without data of one's own (``kdeq samples DIR``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kdeq.images.imageio import write_png
from kdeq.maths.operators import Blur
from kdeq.maths.psf import parse_psf

#: the blur ``blurred.png`` is made with, as ``deblur`` takes it (``--psf``, the ``psf`` field)
BLUR_PSF = "gaussian:1.6"

#: every file ``kdeq samples`` writes, in the order written, with what it holds and what to try it on
SAMPLE_FILES: dict[str, str] = {
    "photo.png": "a clean colour scene: inpaint it with holes.png, super-resolve it",
    "noisy.png": "the photo with σ = 25 Gaussian noise: denoise it",
    "holes.png": "a grey mask, white where pixels are missing: the photo's holes to inpaint",
    "scan.png": "noisy grey shapes: segment them",
    "blurred.png": f"the photo blurred by the PSF {BLUR_PSF} with σ = 2 noise: deblur it with that PSF",
    "counts.png": "photon counts of the photo's grey at a peak of 10 (pixel value = count): denoise-poisson",
    "impulses.png": "the photo with σ = 15 noise and 10 % salt-and-pepper pixels: denoise-impulse",
}


def _scene(height: int, width: int) -> torch.Tensor:
    """A colour ``(3, H, W)`` scene in [0, 1]: a shaded background, three discs and a square."""
    ii, jj = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    img = torch.stack([0.25 + 0.4 * jj, 0.3 + 0.3 * ii, 0.35 + 0.1 * torch.sin(5 * math.pi * ii)])
    for (ci, cj, r), colour in zip(
        [(0.45, 0.3, 0.18), (0.55, 0.45, 0.18), (0.4, 0.55, 0.15)],
        [(0.9, 0.3, 0.3), (0.3, 0.8, 0.4), (0.3, 0.4, 0.9)],
        strict=True,
    ):
        disc = (ii - ci) ** 2 + (jj - cj) ** 2 < r * r
        img = torch.where(disc, torch.tensor(colour)[:, None, None], img)
    square = ((ii - 0.2).abs() < 0.08) & ((jj - 0.8).abs() < 0.08)
    return torch.where(square, torch.tensor(0.1), img).clamp(0, 1)


def sample_images(seed: int = 0, size: tuple[int, int] = (192, 256)) -> dict[str, torch.Tensor]:
    """Generated images ``(c, H, W)`` in [0, 1], by name: ``photo`` (a clean colour scene), ``noisy``
    (it with σ = 25 Gaussian noise), ``holes`` (a grey mask, 1 = missing), ``holey`` (the photo with
    an alpha channel, 0 where ``holes`` is 1), ``scan`` (noisy grey shapes to segment), ``blurred``
    (the photo blurred by ``BLUR_PSF``, a Gaussian PSF of width 1.6, σ = 2 noise), ``small`` (the
    photo at half the size, averaged 2×2), ``counts`` (photon counts of the photo's grey at a peak of
    10 as an 8-bit image: pixel value = count, so ``count/255`` here) and ``impulses`` (the photo
    with σ = 15 noise and 10 % of its pixels salt or pepper, black or white in every channel)."""
    gen = torch.Generator().manual_seed(seed)
    h, w = size
    photo = _scene(h, w)
    noisy = (photo + 25 / 255 * torch.randn(photo.shape, generator=gen)).clamp(0, 1)
    holes = torch.zeros(1, h, w)
    holes[:, h // 3 : h // 3 + 12, w // 4 : 3 * w // 4] = 1.0
    holes[:, h // 2 : 3 * h // 4, w // 2 : w // 2 + 10] = 1.0
    shapes = (photo.mean(dim=0, keepdim=True) > 0.5).float()
    scan = (0.25 + 0.5 * shapes + 0.2 * torch.randn(shapes.shape, generator=gen)).clamp(0, 1)
    blur = Blur(parse_psf(BLUR_PSF), "symmetric")
    blurred = (blur.forward(photo[None])[0] + 2 / 255 * torch.randn(photo.shape, generator=gen)).clamp(0, 1)
    counts = torch.poisson(10.0 * photo.mean(dim=0, keepdim=True), generator=gen) / 255.0
    impulses = (photo + 15 / 255 * torch.randn(photo.shape, generator=gen)).clamp(0, 1)
    hit = torch.rand(photo.shape[-2:], generator=gen) < 0.1
    salt = (torch.rand(photo.shape[-2:], generator=gen) < 0.5).to(photo.dtype)
    impulses = torch.where(hit, salt, impulses)
    return {
        "photo": photo,
        "noisy": noisy,
        "holes": holes,
        "holey": torch.cat([photo, 1 - holes]),
        "scan": scan,
        "blurred": blurred,
        "small": F.avg_pool2d(photo[None], 2)[0],
        "counts": counts,
        "impulses": impulses,
    }


def write_samples(directory: str | Path, seed: int = 0, size: tuple[int, int] = (192, 256)) -> list[Path]:
    """Write the files of ``SAMPLE_FILES`` (``sample_images`` by name, as PNG) into ``directory``; their
    paths, in that order."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    images = sample_images(seed, size)
    paths = [out / name for name in SAMPLE_FILES]
    for path in paths:
        write_png(path, images[path.stem])
    return paths
