"""Test data and operators built independently of the library."""

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kdeq.maths.psf import parse_psf
from kdeq.models.repository import find_model, list_models
from kdeq.predictors.demosaic import cfa_mask
from kdeq.registry import TASKS
from kdeq.runtime import native
from kdeq.tasks.base import Request

#: the repository's models, as the service and the command line find them without KDEQ_MODELS_DIR
MODELS = Path(__file__).resolve().parents[1] / "models"


def served(name: str) -> str:
    """``NAME:VERSION`` of the version of model ``name`` that the service serves when no
    ``KDEQ_MODELS`` names one: the highest in the repository (``find_model``)."""
    return f"{name}:{find_model(MODELS, name).name}"


def served_models() -> set[str]:
    """``served`` of every model of the repository."""
    return {served(name) for name in {entry.name for entry in list_models(MODELS)}}


def require_native() -> None:
    """Skip the calling test, with the reason, where ``kdeq/runtime/native.c`` does not build."""
    if native.library() is None:
        pytest.skip(f"kdeq/runtime/native.c does not build here: {native.build_error()}")


def assert_refinement_alone_retrained(model, base) -> None:
    """``model`` (a ``Checkpoint``) has ``base``'s task, λ, mean, solver and tensor names, and only its
    refinement ``H_φ`` and mean mixing ``β`` differ from ``base``'s values (and some do)."""
    same = ("task", "lam", "mean", "mean_smoothing", "presmooth", "solver")
    assert all(getattr(model.config, field) == getattr(base.config, field) for field in same)
    assert model.tensors.keys() == base.tensors.keys()
    retrained = {name for name in model.tensors if not torch.equal(model.tensors[name], base.tensors[name])}
    assert retrained and all(name.startswith(("net_refine_", "net_mean_mix")) for name in retrained)


def binary_shapes(count: int, size: int, seed: int) -> torch.Tensor:
    """``count`` binary images ``(count, 1, size, size)`` of random discs and rectangles, float64."""
    gen = torch.Generator().manual_seed(seed)
    ii, jj = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    out = torch.zeros(count, 1, size, size, dtype=torch.float64)
    for b in range(count):
        for _ in range(3):
            ci, cj = torch.randint(2, size - 2, (2,), generator=gen).tolist()
            r = torch.randint(2, size // 3, (1,), generator=gen).item()
            if torch.rand(1, generator=gen).item() < 0.5:
                shape = (ii - ci) ** 2 + (jj - cj) ** 2 <= r * r
            else:
                shape = ((ii - ci).abs() <= r) & ((jj - cj).abs() <= r // 2 + 1)
            out[b, 0][shape] = 1.0
    return out


def flip(images: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """Flip a ``fraction`` of the pixels of binary ``images``, chosen independently."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(images.shape, generator=gen, dtype=images.dtype) < fraction
    return torch.where(noise, 1.0 - images, images)


def central_difference(
    loss: Callable[[], torch.Tensor], steps: list[tuple[torch.Tensor, torch.Tensor]], eps: float = 1e-3
) -> float:
    """``(L(θ + εd) − L(θ − εd))/2ε`` for ``L = loss()``, evaluated without autograd: each tensor of
    ``steps`` is moved by ``±ε`` times its direction ``d``, then restored."""

    def move(scale: float) -> None:
        for t, d in steps:
            t.add_(scale * eps * d)

    with torch.no_grad():
        move(1.0)
        up = loss().item()
        move(-2.0)
        down = loss().item()
        move(1.0)
    return (up - down) / (2 * eps)


def dense_operator(op, shape: tuple[int, ...]) -> torch.Tensor:
    """The matrix of a linear operator on ``shape``, built column by column from basis vectors."""
    n = math.prod(shape)
    basis = torch.eye(n, dtype=torch.float64).reshape(n, *shape)
    return op(basis).reshape(n, -1).T


def mirror(i: int, n: int) -> int:
    """The pixel of a length-``n`` axis that sample ``i`` of its symmetric extension (edge repeated,
    period ``2n``) copies."""
    i %= 2 * n
    return 2 * n - 1 - i if i >= n else i


def symmetric_correlation_matrix(taps: np.ndarray, h: int, w: int) -> np.ndarray:
    """The ``(hw, hw)`` matrix of the correlation with centred ``taps`` on an ``h×w`` image whose border
    is extended symmetrically, row-major pixels: written entry by entry, sharing no code with the library."""
    rh, rw = taps.shape[0] // 2, taps.shape[1] // 2
    out = np.zeros((h * w, h * w))
    for r in range(h):
        for c in range(w):
            for a in range(-rh, rh + 1):
                for b in range(-rw, rw + 1):
                    out[r * w + c, mirror(r + a, h) * w + mirror(c + b, w)] += taps[a + rh, b + rw]
    return out


def denoise_batch(
    gen: torch.Generator, height: int, width: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two clean images ``(2, 1, H, W)`` uniform in [0, 1] and the trainer's batch of them with noise
    of standard deviation 0.1, labelled σ = 25 (0–255 scale), drawn from ``gen``."""
    clean = torch.rand(2, 1, height, width, generator=gen)
    noisy = clean + 0.1 * torch.randn(clean.shape, generator=gen)
    return clean, {"noisy": noisy, "sigma": torch.tensor([25.0, 25.0])}


def predict_arguments(
    task: str, images: torch.Tensor, sigma: float, gen: torch.Generator
) -> tuple[tuple, dict]:
    """``predict``'s arguments for a task's model on ``images`` ``(B, c, H, W)`` that carry noise of
    ``sigma`` (0–255 scale): the denoiser is told ``sigma``, the inpainter gets half the pixels missing
    (drawn from ``gen``), the segmenter the images alone, the deblurrer a Gaussian PSF and ``sigma``,
    the super-resolver a scale of 2, the photon denoiser counts drawn at a peak of 20 photons, the
    impulse denoiser the images with a tenth of their pixels salt or pepper and ``sigma``. A task
    without a line here is asked as a request of each image with its default options and no other
    input is (``Task.arguments``: the demosaicker reads the images as RGGB mosaics)."""
    shape = (images.shape[0], 1, *images.shape[-2:])
    arguments = {
        "denoise": lambda: ((images,), {"sigma": sigma}),
        "inpaint": lambda: ((images, (torch.rand(shape, generator=gen) < 0.5).float()), {}),
        "segment": lambda: ((images,), {}),
        "deblur": lambda: ((images, parse_psf("gaussian:1.6")), {"sigma": sigma}),
        "super-resolve": lambda: ((images,), {"scale": 2}),
        "denoise-poisson": lambda: (
            (torch.poisson(20.0 * images.clamp(min=0), generator=gen),),
            {"peak": 20.0},
        ),
        "denoise-impulse": lambda: (
            (
                torch.where(
                    torch.rand(shape, generator=gen) < 0.1,
                    (torch.rand(shape, generator=gen) < 0.5).to(images.dtype),
                    images,
                ),
            ),
            {"sigma": sigma},
        ),
    }
    if task in arguments:
        return arguments[task]()
    own = TASKS[task]
    requests = [Request(image.cpu().numpy(), own.options()) for image in images]
    return own.arguments(images, requests, None)


def bilinear(mosaic: torch.Tensor, pattern: str) -> torch.Tensor:
    """Bilinear demosaicking ``(B, 3, H, W)`` of mosaics ``(B, 1, H, W)``: each missing sample the mean
    of its colour's nearest samples (the tent ``[½, 1, ½]⊗[½, 1, ½]`` normalised over them)."""
    observed = cfa_mask(pattern, *mosaic.shape[-2:])[None].float()
    tent = torch.tensor([0.5, 1.0, 0.5])
    taps = (tent[:, None] * tent[None]).expand(3, 1, 3, 3)
    num = F.conv2d(mosaic * observed, taps, padding=1, groups=3)
    den = F.conv2d(observed.expand(mosaic.shape[0], 3, -1, -1), taps, padding=1, groups=3)
    return torch.where(observed > 0, mosaic.expand_as(num), num / den)
