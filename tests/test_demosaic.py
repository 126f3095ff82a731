"""The demosaicker (``kdeq.predictors.demosaic``) and its task: the kernel-ridge solve against a dense
float64 one, the Bayer patterns, the refusals, a request through ``solve_batch``, and its gain over
bilinear interpolation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kdeq.images.samples import sample_images
from kdeq.maths.filters import normalized_convolution
from kdeq.maths.kernels import Coregional, Kernel, grid_coordinates
from kdeq.models.checkpoint import ConvArchitecture, FixedLambda, ModelSpec, NoiseLambda
from kdeq.models.repository import load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.demosaic import Demosaicker, cfa_mask
from kdeq.registry import TASKS
from kdeq.tasks.base import InputError, solve_batch
from kdeq.train.trainings import TRAININGS
from tests.helpers import bilinear
from tests.tolerances import assert_within, dense_solve_error, gamma, norm2, stopped_solve_error

MODEL = Path(__file__).resolve().parents[1] / "models" / "demosaic-kglm" / "1"
PATTERNS = ("RGGB", "BGGR", "GRBG", "GBRG")
TASK = TASKS["demosaic"]
TIGHT = SolverOverride(tol=1e-5)


@pytest.fixture(scope="module")
def model() -> Demosaicker:
    return load_predictor(MODEL)


def smooth_colour(h: int, w: int, seed: int) -> torch.Tensor:
    """A smooth random colour image ``(3, h, w)`` float32 in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, (h + 3) // 4, (w + 3) // 4, generator=gen)
    return F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]


def mosaic_of(image: torch.Tensor, pattern: str) -> torch.Tensor:
    """The Bayer mosaic ``(1, H, W)`` of ``image`` ``(3, H, W)``: each pixel's own colour."""
    return (image * cfa_mask(pattern, *image.shape[-2:])).sum(dim=0, keepdim=True)


def dense_reference(model: Demosaicker, image: torch.Tensor, pattern: str, pad_to: int) -> tuple:
    """The exact ``f* = m + K Aᵀ(A K Aᵀ + λI)⁻¹(y − A m)`` ``(3, H, W)`` in float64 from the dense
    coregional Gram ``K`` ``(3n, 3n)`` (``Coregional.gram``: the zero-border convolution is this
    matrix, Corollary 11) and ``A`` the rows of the observed (channel, pixel) pairs, with ``m`` the
    model's mean computed as the model computes it (an input of the solve, not under test); and a
    bound on the model's distance from it, solved in float32 to ``TIGHT.tol`` on a grid of
    ``pad_to`` entries per sample.

    The bound is ``tolerances.observed_solve_error``'s argument with the float32 rounding unit: the
    stopped solve misses ``z* = A f*`` by the residual ``‖r‖ ≤ tol·‖f(z)‖`` (the masked equilibrium's
    ``f(z)`` is ``z*`` on the observed pairs and ``m`` on the others, which it keeps exactly), plus the
    rounding of the residual's ``W₁ = A K Aᵀ/λ`` applied to ``y − z``; the read-out multiplies that
    by ``‖K Aᵀ‖₂/λ`` and rounds on its own; the float64 reference errs by ``dense_solve_error``."""
    h, w = image.shape[-2:]
    observed = cfa_mask(pattern, h, w)[None].float()
    x = image[None]
    mean = normalized_convolution(x * observed, observed, model.mean_taps)[0].double().reshape(-1)
    kernel: Coregional = model.config.architecture.kernel
    k = kernel.gram(grid_coordinates(h, w)).numpy()
    rows = observed.reshape(-1).bool().numpy()
    a = np.eye(3 * h * w)[rows]
    lam = model.config.lam.value
    y = image.double().reshape(-1).numpy()[rows]
    m = mean.numpy()
    system = a @ k @ a.T + lam * np.eye(a.shape[0])
    alpha = np.linalg.solve(system, y - a @ m)
    ka = k @ a.T
    exact = m + ka @ alpha
    z_full = np.where(rows, exact, m)
    apart = float(np.linalg.norm(y - exact[rows]))
    # a restriction has one term per row, the kernel at most its taps over the three channels
    rounds = gamma(2 + int((k != 0).sum(axis=1).max()) + 4, np.float32)
    gain = norm2(ka) / lam
    scale = max(float(np.linalg.norm(z_full)) / (1 - TIGHT.tol), model.config.solver.atol * pad_to**0.5)
    residual = TIGHT.tol * scale + rounds * norm2(a @ ka) / lam * apart
    readout = rounds * (float(np.linalg.norm(m)) + gain * apart)
    reference = norm2(ka) * dense_solve_error(system, alpha)
    bound = stopped_solve_error(1.0, residual, gain) + readout + reference
    return torch.from_numpy(exact.reshape(3, h, w)), bound


@pytest.mark.parametrize("pattern", ["RGGB", "GBRG"])
def test_the_solve_is_the_dense_kernel_ridge_regression_and_keeps_the_samples(model, pattern) -> None:
    image = smooth_colour(8, 10, seed=1)
    out = model.predict(image[None], pattern=pattern, solver=TIGHT)
    assert bool(out.stats.converged.all())
    exact, bound = dense_reference(model, image, pattern, image.numel())
    assert_within(out.output[0], exact, bound)
    observed = cfa_mask(pattern, 8, 10)
    assert torch.equal(out.output[0][observed], image[observed])


def test_the_patterns_tile_the_sensor_as_named() -> None:
    for pattern in PATTERNS:
        mask = cfa_mask(pattern, 4, 6)
        assert bool((mask.sum(dim=0) == 1).all())  # one colour per pixel
        assert int(mask[1].sum()) == 12 and int(mask[0].sum()) == int(mask[2].sum()) == 6
        tile = "".join("RGB"[int(mask[:, i, j].nonzero())] for i in (0, 1) for j in (0, 1))
        assert tile == pattern
        assert torch.equal(mask[:, 2:4, 2:4], mask[:, :2, :2])  # the 2×2 tile repeats
    with pytest.raises(ValueError, match="Bayer pattern"):
        cfa_mask("RGBG", 4, 4)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_mosaic_and_its_colour_source_are_demosaicked_alike(model, pattern) -> None:
    """A colour image is read at each pixel's own colour only: its mosaic gives the same system, and
    the result keeps each sample where the pattern puts it."""
    image = smooth_colour(12, 14, seed=2)
    mosaic = mosaic_of(image, pattern)
    from_colour = model.predict(image[None], pattern=pattern).output[0]
    from_mosaic = model.predict(mosaic[None], pattern=pattern).output[0]
    assert torch.equal(from_colour, from_mosaic)
    observed = cfa_mask(pattern, 12, 14)
    assert torch.equal((from_mosaic * observed).sum(dim=0, keepdim=True), mosaic)
    # another pattern reads other samples: the result differs where the colours differ
    other = PATTERNS[(PATTERNS.index(pattern) + 1) % 4]
    assert not torch.equal(model.predict(mosaic[None], pattern=other).output[0], from_mosaic)


def test_the_task_refuses_what_is_not_a_mosaic() -> None:
    options = TASK.options()
    for channels in (2, 4):
        with pytest.raises(InputError) as err:
            TASK.prepare(np.zeros((channels, 8, 8), np.float32), None, options, {})
        assert err.value.code == "not_a_mosaic"
    with pytest.raises(InputError) as err:
        TASK.prepare(np.zeros((1, 1, 8), np.float32), None, options, {})
    assert err.value.code == "too_small"
    with pytest.raises(ValueError):
        TASK.options(pattern="RGBG")
    assert "demosaic" not in TRAININGS  # no training declared: `kdeq train` refuses the task


def test_the_task_takes_only_coregional_colour_kernels_with_a_fixed_lambda() -> None:
    kernel = Kernel(profile="matern52", lengthscale=1.0, radius=3)
    ok = {"name": "d", "task": "demosaic", "mean": "normalized_convolution"}
    ModelSpec(
        **ok, architecture=ConvArchitecture(kernel=Coregional.single(kernel, 3)), lam=FixedLambda(value=1e-3)
    )
    with pytest.raises(ValueError, match="3 colour channels"):
        ModelSpec(
            **ok, architecture=ConvArchitecture(kernel=Coregional.single(kernel)), lam=FixedLambda(value=1e-3)
        )
    with pytest.raises(ValueError):
        ModelSpec(
            **ok,
            architecture=ConvArchitecture(kernel=Coregional.single(kernel, 3)),
            lam=NoiseLambda(signal_variance=1.0),
        )


def test_requests_of_both_kinds_and_sizes_solve_in_one_batch(model) -> None:
    """A grey mosaic and a colour image of another size, padded into one batch by ``solve_batch``: each
    is its own dense solution, in colour (``output_mode``), its samples kept."""
    colour, grey_source = smooth_colour(8, 10, seed=3), smooth_colour(6, 8, seed=4)
    options = TASK.options(pattern="GRBG")
    requests = [
        TASK.prepare(mosaic_of(grey_source, "GRBG").numpy(), None, options, {}, TIGHT),
        TASK.prepare(colour.numpy(), None, options, {}, TIGHT),
    ]
    assert TASK.batch_key(requests[0]) == TASK.batch_key(requests[1])
    solved = solve_batch(TASK, model, requests)
    for result, image in zip(solved, (grey_source, colour), strict=True):
        assert result.converged and result.output.shape == image.shape
        exact, bound = dense_reference(model, image, "GRBG", 3 * 8 * 10)
        assert_within(torch.from_numpy(result.output), exact, bound)
        observed = cfa_mask("GRBG", *image.shape[-2:]).numpy()
        assert np.array_equal(result.output[observed], image.numpy()[observed])
    assert [TASK.output_mode(m) for m in ("L", "LA", "I;16", "RGB", "RGBA")] == [
        "RGB",
        "RGBA",
        "RGB",
        "RGB",
        "RGBA",
    ]


def test_demosaicking_halves_bilinear_interpolations_error_where_colour_varies_slowly(model) -> None:
    """On a generated image with the statistic the prior encodes, that of natural photographs (the
    spec's CBSD432 measurement): sharp edges shared by the channels (the sample photo's luminance) and
    colour differences that vary over ~16 pixels. (On the sample photo itself, saturated discs whose
    colour jumps at their edges, bilinear interpolation does better: the colour-difference prior's
    limit.)"""
    luminance = sample_images(size=(64, 80))["photo"].mean(dim=0, keepdim=True)
    coarse = torch.rand(1, 3, 5, 6, generator=torch.Generator().manual_seed(5))
    chroma = F.interpolate(coarse, size=(64, 80), mode="bicubic", align_corners=True)[0]
    image = (luminance + 0.5 * (chroma - chroma.mean(dim=0, keepdim=True))).clamp(0, 1)
    mosaic = mosaic_of(image, "RGGB")[None]
    ours = model.predict(mosaic).output.clamp(0, 1)
    baseline = bilinear(mosaic, "RGGB")
    error = float((ours - image).square().mean())
    assert error <= 0.5 * float((baseline - image).square().mean())  # at least 3 dB more PSNR
