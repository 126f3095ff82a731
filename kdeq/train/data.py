"""Training data: image folders, random patches, and the draws the tasks' corruptions are made of.

Every sample is a pure function of ``(seed, epoch, index)``: its generator is
seeded from those three numbers, so a run is reproducible whatever the number
of data workers or ranks, and ``--resume`` continues with exactly the samples
an uninterrupted run would have drawn.

Each task corrupts a clean patch its own way (``kdeq.train.tasks.base.Training.corrupt``, e.g.
the denoiser's ``y = x + σn``), within the run's settings of its knobs; this module holds the
pieces they draw: uniform numbers, inpainting masks of the kinds ``pixels`` (each pixel missing
with a probability), ``blocks`` (random rectangles) and ``strokes`` (brush strokes: thick random
walks), and the segmenter's binary target.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from kdeq.images.imageio import read_image
from kdeq.predictors.segment import luminance, otsu_threshold

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff"}
MaskKind = Literal["pixels", "blocks", "strokes"]
MASK_KINDS: tuple[MaskKind, ...] = ("pixels", "blocks", "strokes")


def image_files(directories: Sequence[str | Path]) -> list[Path]:
    """The PNG/JPEG/TIFF files directly in ``directories``, sorted; ``ValueError`` when there are none."""
    files: list[Path] = []
    for d in map(Path, directories):
        if not d.is_dir():
            raise ValueError(f"{d}: not a directory")
        files += sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"no PNG, JPEG or TIFF images in {', '.join(map(str, directories))}")
    return files


def centre_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size × size`` centre of ``x`` ``(…, H, W)`` (each side at most the image's); ``x`` itself
    for ``size`` ≤ 0."""
    if size <= 0:
        return x
    h, w = x.shape[-2:]
    i, j = max(0, (h - size) // 2), max(0, (w - size) // 2)
    return x[..., i : i + size, j : j + size]


def load_images(files: Sequence[Path], channels: int) -> list[torch.Tensor]:
    """Each file as ``(channels, H, W)`` float32 in [0, 1]: colour to luminance for 1, grey repeated for 3."""
    out = []
    for path in files:
        try:
            x = read_image(path)[0]
        except (OSError, ValueError) as err:  # PIL: unreadable, truncated, not an image
            raise ValueError(f"{path}: cannot be read as an image ({err})") from None
        if channels == 1 and x.shape[0] == 3:
            x = luminance(x)
        elif channels == 3 and x.shape[0] == 1:
            x = x.expand(3, -1, -1)
        out.append(x.contiguous())
    return out


def check_patch_size(files: Sequence[Path], images: Sequence[torch.Tensor], size: int) -> None:
    """``ValueError`` naming the first image too small for ``size × size`` patches: a smaller image
    is mirrored up to the patch, which needs each side above ``size/2``."""
    for path, image in zip(files, images, strict=True):
        h, w = image.shape[-2:]
        if 2 * min(h, w) <= size:
            raise ValueError(
                f"{path}: {w}×{h} is too small for patches of {size}² (sides must exceed {size // 2})"
            )


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator seeded from ``(seed, epoch, index)`` (a hash, so neighbouring triples are unrelated)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def step_generator(seed: int, epoch: int, step: int) -> torch.Generator:
    """The generator of the draws every sample of one step shares (``sample_generator``'s hash, on a
    key no sample's can equal)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/step/{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    """A number drawn uniformly from ``[lo, hi]`` (one draw from ``gen``, also when ``lo == hi``)."""
    return lo + (hi - lo) * torch.rand((), generator=gen).item()


def log_uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    """A number whose logarithm is drawn uniformly from ``[log lo, log hi]`` (``0 < lo ≤ hi``; one
    draw from ``gen``): as many draws per factor of two at a few photons as at hundreds."""
    return lo * (hi / lo) ** torch.rand((), generator=gen).item()


def random_patch(image: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """A ``size × size`` crop of ``image`` ``(c, H, W)`` at a random place, randomly flipped and rotated
    by a multiple of 90° (the eight symmetries of the square); images smaller than ``size`` are mirrored."""
    _, h, w = image.shape
    if h < size or w < size:
        image = F.pad(image[None], (0, max(0, size - w), 0, max(0, size - h)), mode="reflect")[0]
        _, h, w = image.shape
    i = int(torch.randint(h - size + 1, (), generator=gen))
    j = int(torch.randint(w - size + 1, (), generator=gen))
    patch = image[:, i : i + size, j : j + size]
    k = int(torch.randint(8, (), generator=gen))
    if k >= 4:
        patch = patch.flip(-1)
    return torch.rot90(patch, k % 4, dims=(-2, -1)).contiguous()


def pixel_mask(shape: tuple[int, int], fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``(H, W)`` bool, each pixel missing with probability ``fraction``."""
    return torch.rand(shape, generator=gen) < fraction


def block_mask(shape: tuple[int, int], gen: torch.Generator, count: int = 3) -> torch.Tensor:
    """``(H, W)`` bool: ``count`` rectangles with sides between 1/8 and 1/3 of the image's."""
    h, w = shape
    miss = torch.zeros(shape, dtype=torch.bool)
    for _ in range(count):
        bh = max(1, int(uniform(gen, h / 8, h / 3)))
        bw = max(1, int(uniform(gen, w / 8, w / 3)))
        i = int(torch.randint(h - bh + 1, (), generator=gen))
        j = int(torch.randint(w - bw + 1, (), generator=gen))
        miss[i : i + bh, j : j + bw] = True
    return miss


def stroke_mask(shape: tuple[int, int], gen: torch.Generator, strokes: int = 3) -> torch.Tensor:
    """``(H, W)`` bool: ``strokes`` brush strokes, each a random walk of straight segments swept by a
    disc of radius 1 to ``min(H, W)/16``."""
    h, w = shape
    ii = torch.arange(h, dtype=torch.float32)[:, None]
    jj = torch.arange(w, dtype=torch.float32)[None, :]
    miss = torch.zeros(shape, dtype=torch.bool)
    for _ in range(strokes):
        radius = uniform(gen, 1.0, max(1.5, min(h, w) / 16))
        y, x = uniform(gen, 0, h - 1), uniform(gen, 0, w - 1)
        for _ in range(int(torch.randint(2, 6, (), generator=gen))):
            angle = uniform(gen, 0, 2 * torch.pi)
            length = uniform(gen, min(h, w) / 8, min(h, w) / 3)
            y2 = min(max(y + length * torch.sin(torch.tensor(angle)).item(), 0.0), h - 1.0)
            x2 = min(max(x + length * torch.cos(torch.tensor(angle)).item(), 0.0), w - 1.0)
            # distance from every pixel to the segment (y, x)–(y2, x2)
            dy, dx = y2 - y, x2 - x
            t = (((ii - y) * dy + (jj - x) * dx) / max(dy * dy + dx * dx, 1e-9)).clamp(0, 1)
            miss |= (ii - y - t * dy).square() + (jj - x - t * dx).square() <= radius * radius
            y, x = y2, x2
    return miss


def make_mask(kind: MaskKind, shape: tuple[int, int], fraction: tuple[float, float], gen) -> torch.Tensor:
    """A mask of ``kind``; ``fraction`` is the range of the missing probability for ``pixels``."""
    if kind == "pixels":
        return pixel_mask(shape, uniform(gen, *fraction), gen)
    if kind == "blocks":
        return block_mask(shape, gen)
    return stroke_mask(shape, gen)


def binary_target(x: torch.Tensor) -> torch.Tensor:
    """``[x̄ > τ]`` ``(1, H, W)`` float for ``x`` ``(c, H, W)``: luminance above its Otsu threshold."""
    grey = luminance(x)
    tau = otsu_threshold(grey[None])
    return (grey > tau.reshape(1, 1, 1)).to(torch.float32)


class Corrupts(Protocol):
    """What draws examples from clean images: a training (``kdeq.train.tasks.base.Training``)."""

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: Any,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]: ...


class PatchDataset(Dataset):
    """``length`` random patches per epoch from ``images``, corrupted by ``training`` within the run's
    ``settings`` of its knobs; sample ``i`` of epoch ``e`` depends only on ``(seed, e, i mod length)``
    (call ``set_epoch``), and the draws its step shares (``Training.corrupt``'s ``shared``) on
    ``(seed, e, ⌊i/group⌋)``: ``group``
    is the samples of one optimiser step over every rank, and a step's indices ``i`` run on past
    ``length`` where the epoch's steps need more samples than it."""

    def __init__(
        self,
        images: Sequence[torch.Tensor],
        size: int,
        training: Corrupts,
        settings: Any,
        length: int,
        seed: int,
        group: int = 1,
    ) -> None:
        self.images, self.size, self.training, self.settings = list(images), size, training, settings
        self.length, self.seed, self.epoch, self.group = length, seed, 0, group

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # an epoch's last step may wrap past ``length``: its samples repeat the first ones', its
        # shared draws are its own
        gen = sample_generator(self.seed, self.epoch, index % self.length)
        image = self.images[int(torch.randint(len(self.images), (), generator=gen))]
        shared = step_generator(self.seed, self.epoch, index // self.group)
        return self.training.corrupt(random_patch(image, self.size, gen), gen, self.settings, shared=shared)


def validation_set(
    images: Sequence[torch.Tensor],
    training: Corrupts,
    settings: Any,
    levels: Sequence[float],
    seed: int,
) -> list[dict[str, torch.Tensor]]:
    """Fixed validation examples: every image at every level (``training.corrupt`` within the run's
    ``settings`` at ``level``, e.g. a noise σ for denoise), plus the ``level`` itself, seeded by
    position so every epoch (and every run with the same seed) sees the same inputs."""
    out = []
    for i, image in enumerate(images):
        for j, level in enumerate(levels):
            gen = sample_generator(seed, -1, i * len(levels) + j)
            example = training.corrupt(image, gen, settings, level)
            example["level"] = torch.tensor(float(level))
            out.append(example)
    return out
