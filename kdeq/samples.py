"""Generated sample images for trying the models without data of one's own (``kdeq samples DIR``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kdeq.imageio import write_png


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


def write_samples(directory: str | Path, seed: int = 0, size: tuple[int, int] = (192, 256)) -> list[Path]:
    """Write ``photo.png`` (clean colour), ``noisy.png`` (σ = 25 Gaussian noise), ``holes.png`` (a
    mask, white = missing) and ``scan.png`` (noisy grey shapes to segment) into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, w = size
    photo = _scene(h, w)
    noisy = (photo + 25 / 255 * torch.randn(photo.shape, generator=gen)).clamp(0, 1)
    holes = torch.zeros(1, h, w)
    holes[:, h // 3 : h // 3 + 12, w // 4 : 3 * w // 4] = 1.0
    holes[:, h // 2 : 3 * h // 4, w // 2 : w // 2 + 10] = 1.0
    shapes = (photo.mean(dim=0, keepdim=True) > 0.5).float()
    scan = (0.25 + 0.5 * shapes + 0.2 * torch.randn(shapes.shape, generator=gen)).clamp(0, 1)
    files = {"photo.png": photo, "noisy.png": noisy, "holes.png": holes, "scan.png": scan}
    for name, image in files.items():
        write_png(out / name, image)
    return [out / name for name in files]
