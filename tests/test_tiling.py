"""Tiled solves (``kdeq.serving.tiling``): the tiles' geometry, the denoiser's reach, and tiled against
untiled results."""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kdeq.cli import main
from kdeq.cli import test_image as piecewise_image
from kdeq.images.imageio import read_image, write_png
from kdeq.maths import collab
from kdeq.maths.families import Bernoulli, Gaussian
from kdeq.maths.filters import normalized_convolution
from kdeq.maths.guidenet import segment_mean
from kdeq.maths.operators import BlurSubsample, KernelMap
from kdeq.maths.psf import bicubic_taps
from kdeq.models.repository import default_models_dir, find_model, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.denoise import Denoiser
from kdeq.predictors.photon import RATE_FLOOR, PhotonDenoiser, WholeImage
from kdeq.predictors.robust import RobustDenoiser, patch_weights
from kdeq.predictors.super_resolve import degrade, upsample
from kdeq.registry import TASKS
from kdeq.runtime import backends
from kdeq.serving import tiling
from kdeq.serving.tiling import ALIGN, WINDOW_ALIGN, solve_tiled, spans, tiled, tiles
from kdeq.tasks.base import Request, Solved, solve_batch

DENOISE = TASKS["denoise"]


def shipped(name: str, version: int | None = None):
    return load_predictor(find_model(default_models_dir(), name, version))


@pytest.fixture(scope="module")
def default() -> Denoiser:
    return shipped("denoise-kglm", 2)


def noisy(height: int, width: int, colour: bool, sigma: float = 25.0, seed: int = 0) -> np.ndarray:
    """The CLI's piecewise test image at ``height × width`` (three channels made from it for colour)
    with Gaussian noise, ``(c, H, W)`` float32."""
    clean = piecewise_image(max(height, width))[0][:, :height, :width]
    clean = torch.cat([clean, clean.flip(-1), 1 - clean]) if colour else clean
    gen = torch.Generator().manual_seed(seed)
    return (clean + sigma / 255 * torch.randn(clean.shape, generator=gen)).numpy()


# ------------------------------------------------------------------------------------------- geometry


@pytest.mark.parametrize(("length", "size", "halo"), [(100, 32, 7), (97, 32, 0), (64, 64, 10), (31, 64, 5)])
def test_cores_cover_every_pixel_once_and_windows_hold_their_halo(length, size, halo) -> None:
    parts = spans(length, size, halo)
    covered = np.zeros(length, dtype=int)
    for window, core in parts:
        covered[core] += 1
        assert window.start % WINDOW_ALIGN == 0 and core.start % ALIGN == 0
        assert window.start <= max(0, core.start - halo) and window.stop == min(length, core.stop + halo)
        assert window.start > core.start - halo - WINDOW_ALIGN
        assert core.stop - core.start <= size + ALIGN
    assert (covered == 1).all()
    assert len(parts) == -(-length // size)
    lengths = [c.stop - c.start for _, c in parts]
    assert max(lengths) - min(lengths) <= 2 * ALIGN  # near-equal parts


def test_tiles_are_the_grid_of_both_axes_and_bad_sizes_are_refused() -> None:
    grid = tiles(70, 100, 32, 4)
    assert len(grid) == 3 * 4
    seen = np.zeros((70, 100), dtype=int)
    for tile in grid:
        seen[tile.core] += 1
        rows, _cols = tile.crop
        assert rows.stop - rows.start == tile.core[0].stop - tile.core[0].start
        assert tile.shape == (
            tile.window[0].stop - tile.window[0].start,
            tile.window[1].stop - tile.window[1].start,
        )
    assert (seen == 1).all()
    for size, halo in [(7, 0), (33, 0), (32, -1)]:
        with pytest.raises(ValueError, match="tile"):
            spans(100, size, halo)


# ------------------------------------------------------------------------------------------ the reach


def equations(model: Denoiser, y: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
    """What pixel ``at``'s equation ``z = (K/λ)(y − z) + m`` reads of ``y`` ``(1, c, H, W)`` at σ = 25,
    with the channel means fixed: ``m`` there, and the operator ``K`` (which the guided kernel builds
    from ``y``) applied to a fixed probe and to ``y``, ``(3c,)`` or ``(2c,)`` without a mean."""
    s = torch.tensor([25 / 255])
    level = torch.full(y.shape[:2], 0.5)
    with torch.inference_mode():
        if model.config.architecture.kind == "guided":
            layer, mean, _ = model._guided(y, s, model.lam(s), None, None, level)
        else:
            layer, mean = model.conv_layer(Gaussian(), model.lam(s)), model._mean(y, None, None, level)
        probe = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        parts = [layer.w1(probe), layer.w1(y)] + ([] if mean is None else [mean])
        return torch.cat([p[0, :, at[0], at[1]] for p in parts])


def shifted(x: torch.Tensor, pixel: tuple[int, int], by: float) -> torch.Tensor:
    """A copy of ``x`` ``(…, H, W)`` with ``by`` added at ``pixel`` in every channel."""
    moved = x.clone()
    moved[..., pixel[0], pixel[1]] += by
    return moved


def added(by: float) -> Callable[[tuple, tuple[int, int]], list[tuple]]:
    """The perturbation (``assert_reach``) that adds ``by`` at the pixel to the first input."""

    def perturbed(inputs: tuple, pixel: tuple[int, int]) -> list[tuple]:
        return [(shifted(inputs[0], pixel, by), *inputs[1:])]

    return perturbed


def assert_reach(
    equation: Callable[..., torch.Tensor],
    inputs: tuple,
    rho: int,
    at: tuple[int, int],
    perturbed: Callable[[tuple, tuple[int, int]], Iterable[tuple]],
    near: tuple[int, ...] = (1,),
) -> None:
    """``equation(*inputs)``, what the pixel ``at`` reads, is bit for bit unchanged by each perturbation
    ``perturbed(inputs, pixel)`` yields at ∞-distance ``ρ + 1`` and ``ρ + 7`` from ``at`` (to its right
    and above it), and changed by each at the distances ``near``. A direct convolution throughout: the
    reach is the operator's, and the fft backend (which conv_zeros may time fastest for a large filter
    on a loaded machine) rounds every output with every input."""
    with backends.force_backend("prepadded"):
        base = equation(*inputs)
        for distance, unchanged in [(rho + 1, True), (rho + 7, True), *((d, False) for d in near)]:
            for dr, dc in ((0, distance), (-distance, 0)):
                for moved in perturbed(inputs, (at[0] + dr, at[1] + dc)):
                    assert torch.equal(equation(*moved), base) == unchanged, (dr, dc)


@pytest.mark.usefixtures("guided_backend")
@pytest.mark.parametrize("name", ["denoise-kglm", "denoise-kglm-x8", "denoise-stationary-kglm"])
def test_a_pixel_s_equation_reads_nothing_beyond_the_reach(name) -> None:
    """Perturb one pixel at ∞-distance ``ρ + 1`` or more from ``x``: ``x``'s equation is bit for bit
    unchanged; within ``ρ`` it changes. (How far the equation's float32 bits can feel a pixel is less
    than ``ρ``: far contributions fall below its rounding, so ``ρ``'s tightness is not measurable here.)"""
    model = shipped(name)
    rho = model.reach
    y = torch.from_numpy(noisy(2 * rho + 12, 2 * rho + 12, colour=True))[None]
    at = (rho + 4, 3)
    assert_reach(
        lambda v: equations(model, v, at),
        (y,),
        rho,
        at,
        added(0.5),
        near=(rho // 2, 1),
    )


# ---------------------------------------------------------------------------- tiled against untiled


def solve(model, image: np.ndarray, sigma: float | None, tol: float = 1e-4, **tiling) -> object:
    request = DENOISE.prepare(image, None, DENOISE.options(sigma=sigma), {}, SolverOverride(tol=tol))
    if not tiling:
        return solve_batch(DENOISE, model, [request])[0]
    return solve_tiled(DENOISE, model, request, **tiling)


@pytest.mark.parametrize(("colour", "sigma"), [(False, 25.0), (True, None)])
def test_the_default_denoiser_tiled_matches_the_untiled_solve(default, colour, sigma) -> None:
    """Halo = reach: the tiles pose the whole image's equations, so the outputs differ only by where
    each solver stopped (tol 10⁻⁶ here): ≤ 10⁻³, and 0.001 dB of PSNR; with no halo they differ ≫."""
    image = noisy(150, 206, colour, seed=1)
    clean = noisy(150, 206, colour, sigma=0.0)
    whole = solve(default, image, sigma, tol=1e-6)
    cut = solve(default, image, sigma, tol=1e-6, size=64)
    bare = solve(default, image, sigma, tol=1e-6, size=64, halo=0)
    assert cut.output.shape == whole.output.shape
    assert np.abs(cut.output - whole.output).max() < 1e-3
    assert np.abs(bare.output - whole.output).max() > 3e-2
    psnr = [-10 * np.log10(((r.output.clip(0, 1) - clean) ** 2).mean()) for r in (whole, cut)]
    assert abs(psnr[1] - psnr[0]) < 1e-3
    # the estimated σ is the whole image's, not each tile's
    assert cut.fields["sigma"] == pytest.approx(whole.fields["sigma"], rel=1e-6)
    assert cut.converged and cut.finite and cut.lam == pytest.approx(whole.lam, rel=1e-6)


def test_the_ensemble_denoiser_tiled_matches_the_untiled_solve_on_odd_sides() -> None:
    """``denoise-kglm-x8`` turns and mirrors each tile: its odd-sized tiles still see the whole
    image's 2×2 blocks, so tiled matches untiled as the default denoiser's does."""
    model = shipped("denoise-kglm-x8")
    image = noisy(97, 133, False, seed=2)
    whole = solve(model, image, 25.0, tol=1e-6)
    cut = solve(model, image, 25.0, tol=1e-6, size=64)
    assert np.abs(cut.output - whole.output).max() < 1e-3


@pytest.mark.usefixtures("guided_backend")
def test_the_collaborative_denoiser_reads_a_grey_image_within_its_reach() -> None:
    """``denoise-kglm-collab:1`` filters a grey image collaboratively (``kdeq.maths.collab``) for its mean:
    the filter reads up to ``collab.reach()`` pixels away, within the model's reach."""
    model = shipped("denoise-kglm-collab", 1)
    rho = model.reach
    assert rho >= collab.reach() + 2 * model.config.architecture.net.refine.depth + 1
    y = torch.from_numpy(noisy(2 * rho + 12, 2 * rho + 12, colour=False))[None]
    at = (rho + 4, 3)
    assert_reach(lambda v: equations(model, v, at), (y,), rho, at, added(0.5), near=(rho // 2, 1))


def test_the_collaborative_denoiser_tiled_matches_the_untiled_solve() -> None:
    """Its tiles' windows start on multiples of ``WINDOW_ALIGN``, on the filter's reference grid: tiled
    matches untiled on a grey image, odd sides included."""
    model = shipped("denoise-kglm-collab", 1)
    image = noisy(97, 133, False, seed=2)
    whole = solve(model, image, 25.0, tol=1e-6)
    cut = solve(model, image, 25.0, tol=1e-6, size=64)
    assert np.abs(cut.output - whole.output).max() < 1e-3


def test_a_wider_search_and_larger_patches_widen_the_collaborative_denoisers_reach() -> None:
    """``denoise-kglm-collab:3`` matches patches in 25×25 windows: its reach covers the filter's
    ``reach(12)``, wider than version 1's; version 4's 9×9 patches, ``reach(12, 4)``, wider still;
    version 5's wavelet patches lie within those, and its reach is version 4's."""
    narrow, wide, larger, both = (shipped("denoise-kglm-collab", v) for v in (1, 3, 4, 5))
    depth = wide.config.architecture.net.refine.depth
    assert wide.reach >= collab.reach(12) + 2 * depth + 1 > narrow.reach
    assert larger.reach >= collab.reach(12, 4) + 2 * depth + 1 > wide.reach
    assert both.reach == larger.reach


def test_the_blended_collaborative_denoiser_tiled_blends_each_tile_by_its_own_weight() -> None:
    """``denoise-kglm-collab:2`` moves toward the filter by one weight per image (``kdeq.maths.sure``), so a
    tile blends by its own: not the whole image's equations, but within 0.01 dB of the untiled PSNR on
    a piecewise-smooth image and on stripes (where the blend is worth ~5 dB over version 1)."""
    from tests.test_collab import stripes

    model = shipped("denoise-kglm-collab", 2)
    piecewise = noisy(150, 206, False, sigma=0.0)
    texture = stripes(150, 206).numpy()
    gen = np.random.default_rng(2)
    for clean in (piecewise, texture):
        image = clean + (25 / 255 * gen.standard_normal(clean.shape)).astype(np.float32)
        whole = solve(model, image, 25.0, tol=1e-6)
        cut = solve(model, image, 25.0, tol=1e-6, size=96)
        psnr = [-10 * np.log10(((r.output.clip(0, 1) - clean) ** 2).mean()) for r in (whole, cut)]
        assert abs(psnr[1] - psnr[0]) < 0.01


@pytest.mark.parametrize("sigma", [5.0, 20.0, 50.0])
def test_the_stationary_denoiser_tiled_at_its_default_halo_matches_the_untiled_solve(sigma) -> None:
    """Its resolvent carries a pixel's influence past its reach (5): at the default halo
    (``solve_reach``) the tiles still match the whole image to 10⁻³; with the reach alone they do not."""
    model = shipped("denoise-stationary-kglm")
    image = noisy(120, 130, colour=False, sigma=sigma, seed=2)
    whole = solve(model, image, sigma, tol=1e-6)
    cut = solve(model, image, sigma, tol=1e-6, size=48)
    near = solve(model, image, sigma, tol=1e-6, size=48, halo=model.reach)
    assert np.abs(cut.output - whole.output).max() < 1e-3
    assert np.abs(near.output - whole.output).max() > 2e-3


def test_a_nan_residual_is_not_hidden_by_the_other_tiles(default, monkeypatch) -> None:
    import kdeq.serving.tiling as tiling

    calls = iter(range(100))

    def solve_batch(task, predictor, requests):
        out = []
        for r in requests:
            k = next(calls)
            out.append(
                Solved(np.zeros_like(r.image), 1, float("nan") if k == 1 else 0.5, k != 1, 1.0, {}, True)
            )
        return out

    monkeypatch.setattr(tiling, "solve_batch", solve_batch)
    request = DENOISE.prepare(noisy(64, 64, colour=False), None, DENOISE.options(sigma=25), {})
    result = solve_tiled(DENOISE, default, request, 32)
    assert np.isnan(result.residual) and not result.converged


def test_an_estimated_level_above_255_is_given_to_the_tiles_as_255(default) -> None:
    # a one-pixel checkerboard: every Haar diagonal coefficient is ±1, so σ̂ = 1/0.6745 → 378
    board = (np.indices((64, 64)).sum(axis=0) % 2).astype(np.float32)[None]
    request = DENOISE.prepare(board, None, DENOISE.options(), {})
    assert DENOISE.whole_image(default, request).options.sigma == 255.0
    result = solve_tiled(DENOISE, default, request, 32)
    assert result.fields["sigma"] == pytest.approx(255.0) and np.isfinite(result.output).all()


def test_tiles_per_call_keep_within_the_pixel_budget(default, monkeypatch) -> None:
    import kdeq.serving.tiling as tiling

    sizes: list[int] = []
    real = tiling.solve_batch
    monkeypatch.setattr(tiling, "solve_batch", lambda t, p, rs: sizes.append(len(rs)) or real(t, p, rs))
    request = DENOISE.prepare(noisy(96, 96, colour=False), None, DENOISE.options(sigma=25), {})
    solve_tiled(DENOISE, default, request, 24, halo=6, batch=8, batch_pixels=2 * 36 * 36)
    # interior windows are 36×36: two per call; the border ones (30×36, 36×30, 30×30) two as well
    assert sum(sizes) == 16 and max(sizes) == 2


def test_batched_tiles_equal_single_tiles_and_progress_counts_them(default) -> None:
    image = noisy(100, 100, colour=False, seed=3)
    counted: list[int] = []
    one = solve(default, image, 25.0, size=32, progress=counted.append)
    four = solve(default, image, 25.0, size=32, batch=4)
    assert sum(counted) == len(tiles(100, 100, 32, 0)) == 16
    assert np.abs(one.output - four.output).max() < 1e-3


def test_tasks_without_a_tiled_solve_refuse_it() -> None:
    task = TASKS["deblur"]
    request = Request(np.zeros((1, 64, 64), np.float32), task.options())
    with pytest.raises(ValueError, match="whole images only"):
        solve_tiled(task, shipped("deblur-kglm"), request, 32)


def test_the_cli_tiles_a_large_image_and_writes_what_the_untiled_solve_writes(
    tmp_path, capsys, monkeypatch
) -> None:
    source = tmp_path / "big.png"
    write_png(source, torch.from_numpy(noisy(96, 140, colour=True, seed=4)).clamp(0, 1))
    common = ["--sigma", "25", "--tol", "1e-6"]
    counted: list[int] = []
    real = tiling.solve_tiled
    monkeypatch.setattr(tiling, "solve_tiled", lambda *a, **k: counted.append(1) or real(*a, **k))
    assert main(["denoise", str(source), "-o", str(tmp_path / "tiled.png"), "--tile", "48", *common]) == 0
    assert counted == [1]
    assert main(["denoise", str(source), "-o", str(tmp_path / "whole.png"), "--tile", "0", *common]) == 0
    assert counted == [1]
    tiled, whole = (read_image(tmp_path / f"{n}.png")[0] for n in ("tiled", "whole"))
    assert (tiled - whole).abs().max() <= 1 / 255 + 1e-6  # at most one grey level
    for bad in ("-1", "7", "33", "x"):
        with pytest.raises(SystemExit):
            main(["denoise", str(source), "-o", str(tmp_path / "x.png"), "--tile", bad])
        assert "--tile" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_the_tile_s_request_carries_the_whole_image_s_statistics(default) -> None:
    image = noisy(64, 80, colour=True, seed=5)
    request = DENOISE.prepare(image, None, DENOISE.options(), {})
    whole = DENOISE.whole_image(default, request)
    expected = default.noise_level(torch.from_numpy(image)[None], None) * 255
    assert whole.options.sigma == pytest.approx(float(expected))
    np.testing.assert_allclose(whole.inputs["level"], image.mean(axis=(1, 2)), rtol=1e-6)
    tile = DENOISE.cut(whole, slice(8, 40), slice(0, 32))
    assert tile.image.shape == (3, 32, 32) and tile.image.flags.c_contiguous
    np.testing.assert_array_equal(tile.image, image[:, 8:40, :32])
    assert tile.options == whole.options and tile.inputs["level"] is whole.inputs["level"]


def test_cut_slices_per_pixel_inputs_and_shares_the_rest() -> None:
    task = TASKS["inpaint"]
    missing = np.zeros((1, 20, 30), bool)
    missing[0, 5, 7] = True
    request = Request(
        np.ones((1, 20, 30), np.float32), task.options(), {"missing": missing, "psf": np.ones((3, 3))}
    )
    part = task.cut(request, slice(4, 10), slice(6, 12))
    assert part.inputs["missing"].shape == (1, 6, 6) and part.inputs["missing"][0, 1, 1]
    assert part.inputs["psf"] is request.inputs["psf"]


def test_only_images_larger_than_a_tile_of_tasks_that_tile_are_cut(default) -> None:
    request = Request(np.zeros((1, 32, 32), np.float32), DENOISE.options())
    assert not tiled(DENOISE, default, request, 32) and tiled(DENOISE, default, request, 30)
    assert not tiled(DENOISE, default, request, 0)
    deblur = TASKS["deblur"]
    assert not tiled(deblur, shipped("deblur-kglm"), Request(request.image, deblur.options()), 30)


# -------------------------------------------------------------------------------------- inpainting

INPAINT = TASKS["inpaint"]


def holes(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A mask ``(1, H, W)`` (True = missing): 30 % of the pixels at random and a block of 60 % of each
    side in the middle, larger than the tests' tiles with their halos."""
    miss = np.random.default_rng(seed).random((1, height, width)) < 0.3
    miss[:, height // 5 : height * 4 // 5, width // 5 : width * 4 // 5] = True
    return miss


def inpaint_equation(model, y: torch.Tensor, missing: torch.Tensor, level: torch.Tensor, at) -> torch.Tensor:
    """What pixel ``at``'s equation ``z = M⊙[W1(M z) + W2(M y)] + m`` reads of ``y`` ``(1, c, H, W)``
    and ``missing`` ``(1, 1, H, W)``, the observed means ``level`` ``(1, c)`` fixed: ``W1`` applied to a
    fixed probe on the observed pixels, ``W2`` to ``y`` there, ``m``, and ``M`` at ``at``."""
    with torch.inference_mode():
        x, observed = model._observed(y, missing, None, empty=True)
        mean = normalized_convolution(x * observed, observed, model.mean_taps, level)
        if model.config.architecture.net is not None:
            mean = model._pilot(x * observed, observed, mean, None, level)
        layer = model.conv_layer(Gaussian(), model.lam(torch.zeros(1)))
        probe = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        parts = [layer.w1(observed * probe), layer.w2(observed * x), mean, observed.expand_as(x)]
        return torch.cat([p[0, :, at[0], at[1]] for p in parts])


@pytest.mark.parametrize("version", [1, 3])
def test_an_inpainted_pixel_s_equation_reads_nothing_beyond_the_reach(version) -> None:
    """Perturb one pixel, its value and whether it is observed, at ∞-distance ``ρ + 1`` or more from
    ``x``: ``x``'s equation is bit for bit unchanged; within ``ρ`` it changes."""
    model = shipped("inpaint-kglm", version)
    rho = model.reach
    y = torch.from_numpy(noisy(2 * rho + 12, 2 * rho + 12, colour=True, sigma=0.0))[None]
    missing = torch.from_numpy(holes(2 * rho + 12, 2 * rho + 12)[None] & False)
    missing[..., ::3, ::2] = True
    level = torch.full((1, 3), 0.5)
    at = (rho + 4, 3)

    def perturbed(inputs: tuple, pixel: tuple[int, int]) -> list[tuple]:
        flipped = inputs[1].clone()
        flipped[..., pixel[0], pixel[1]] = ~flipped[..., pixel[0], pixel[1]]
        return [(shifted(inputs[0], pixel, 0.5), flipped)]

    assert_reach(lambda v, m: inpaint_equation(model, v, m, level, at), (y, missing), rho, at, perturbed)


@pytest.mark.parametrize("version", [1, 3])
def test_the_inpainters_tiled_match_the_untiled_solve(version) -> None:
    """At the default halo (``solve_reach``) the tiles match the whole image to 10⁻³ and 0.001 dB (tol
    10⁻⁶), tiles inside the hole with no observed pixel included; with no halo they differ ≫."""
    model = shipped("inpaint-kglm", version)
    clean = noisy(150, 170, colour=True, sigma=0.0)
    miss = holes(150, 170)
    request = INPAINT.prepare(clean, None, INPAINT.options(), {"mask": miss}, SolverOverride(tol=1e-6))
    empty = [t for t in tiles(150, 170, 24, model.solve_reach) if miss[0][t.window].all()]
    assert empty or version == 3  # version 3's halo (37) takes every window past the hole
    whole = solve_batch(INPAINT, model, [request])[0]
    cut = solve_tiled(INPAINT, model, request, 24)
    bare = solve_tiled(INPAINT, model, request, 24, halo=0)
    assert np.abs(cut.output - whole.output).max() < 1e-3
    assert np.abs(bare.output - whole.output).max() > 3e-2
    psnr = [-10 * np.log10(((r.output.clip(0, 1) - clean) ** 2).mean()) for r in (whole, cut)]
    assert abs(psnr[1] - psnr[0]) < 1e-3
    assert cut.converged and cut.finite
    np.testing.assert_array_equal(cut.output[:, ~miss[0]], clean[:, ~miss[0]])  # known pixels kept


def test_the_inpainting_tile_s_request_carries_the_whole_image_s_observed_means() -> None:
    image = noisy(40, 50, colour=True, seed=6)
    miss = holes(40, 50)
    request = INPAINT.prepare(image, None, INPAINT.options(), {"mask": miss})
    whole = INPAINT.whole_image(shipped("inpaint-kglm", 1), request)
    expected = [image[k][~miss[0]].astype(np.float64).mean() for k in range(3)]
    np.testing.assert_allclose(whole.inputs["level"], expected, rtol=1e-6)
    tile = INPAINT.cut(whole, slice(10, 30), slice(10, 40))  # inside the hole: nothing observed
    assert tile.inputs["missing"].all() and tile.inputs["level"] is whole.inputs["level"]
    solved = solve_batch(INPAINT, shipped("inpaint-kglm", 1), [tile])[0]
    # no observed pixel within the mean's reach: the whole image's observed means
    np.testing.assert_allclose(
        solved.output[:, 8:12, 8:22],
        np.broadcast_to(whole.inputs["level"][:, None, None], (3, 4, 14)),
        rtol=1e-5,
    )


# ------------------------------------------------------------------------------------- segmentation

SEGMENT = TASKS["segment"]


def segment_equation(model, y: torch.Tensor, at) -> torch.Tensor:
    """What pixel ``at``'s equation ``z = logistic(W1 z + W2 t + m)`` reads of ``y`` ``(1, c, H, W)`` at
    the threshold 0.5: ``W1`` applied to a fixed probe, ``W2`` to the labels ``t``, and the network's
    mean ``m`` where there is one."""
    with torch.inference_mode():
        grey, tau, labels = model._labels(y, 0.5)
        layer = model.conv_layer(Bernoulli(), model.lam(torch.zeros(1)))
        probe = torch.linspace(-1, 1, labels.numel()).reshape(labels.shape)
        parts = [layer.w1(probe), layer.w2(labels)]
        if model.config.architecture.net is not None:
            parts.append(segment_mean(grey, tau, labels, model.tensors, model.config.architecture.net))
        return torch.cat([p[0, :, at[0], at[1]] for p in parts])


@pytest.mark.parametrize("version", [1, 2])
def test_a_segmented_pixel_s_equation_reads_nothing_beyond_the_reach(version) -> None:
    """Perturb one pixel at ∞-distance ``ρ + 1`` or more from ``x``: ``x``'s equation is bit for bit
    unchanged; within ``ρ`` it changes. The perturbation is far out of range, so that it flips the
    labels around it however the smoothing weighs it."""
    model = shipped("segment-kglm", version)
    rho = model.reach
    y = torch.from_numpy(noisy(2 * rho + 12, 2 * rho + 12, colour=True, sigma=60.0))[None]
    at = (rho + 4, 3)
    assert_reach(lambda v: segment_equation(model, v, at), (y,), rho, at, added(100.0))


@pytest.mark.parametrize("version", [1, 2])
def test_the_segmenters_tiled_match_the_untiled_solve_at_the_whole_image_s_threshold(version) -> None:
    """The tiles take the whole image's Otsu threshold; at the default halo (``solve_reach``) their
    probabilities match the whole image's to 10⁻⁴ (tol 10⁻⁶) and no mask pixel flips; with no halo
    hundreds do."""
    model = shipped("segment-kglm", version)
    image = np.clip(
        noisy(150, 170, colour=True, sigma=0.0)
        + 0.3 * np.random.default_rng(0).standard_normal((3, 150, 170)),
        0,
        1,
    ).astype(np.float32)
    options = SEGMENT.options(output="probability")
    request = SEGMENT.prepare(image, None, options, {}, SolverOverride(tol=1e-6))
    whole = solve_batch(SEGMENT, model, [request])[0]
    cut = solve_tiled(SEGMENT, model, request, 40)
    bare = solve_tiled(SEGMENT, model, request, 40, halo=0)
    assert cut.fields["threshold"] == whole.fields["threshold"]
    assert np.abs(cut.output - whole.output).max() < 1e-4
    assert ((cut.output > 0.5) != (whole.output > 0.5)).sum() == 0
    assert ((bare.output > 0.5) != (whole.output > 0.5)).sum() > 100
    assert cut.converged and cut.finite


# ------------------------------------------------------------------------------ impulse denoising

IMPULSE = TASKS["denoise-impulse"]


def salted(image: np.ndarray, rate: float, seed: int) -> np.ndarray:
    """``image`` ``(c, H, W)`` clipped to [0, 1] with a fraction ``rate`` of its pixels set to 0 or 1
    in every channel (salt and pepper), float32."""
    rng = np.random.default_rng(seed)
    out = np.clip(image, 0, 1)
    hit = rng.random(image.shape[-2:]) < rate
    out[:, hit] = rng.integers(0, 2, int(hit.sum()))
    return out.astype(np.float32)


def impulse_equation(robust: RobustDenoiser, y: torch.Tensor, at) -> torch.Tensor:
    """What pixel ``at``'s stationarity condition reads of ``y`` ``(1, c, H, W)`` at σ = 25, the level
    fixed: ``K̃`` applied to a fixed probe ``z`` and to ``y``, ``m``, and ``λ(z − m) + K̃ W(z)(z − y)``
    at ``at`` (``kdeq.predictors.robust``: ``K̃∇E``)."""
    with torch.inference_mode():
        problem = robust.problem(y, 25.0, torch.full(y.shape[:2], 0.5))
        probe = torch.linspace(0, 1, y.numel()).reshape(y.shape)
        w = patch_weights(y - probe, problem.sigma, robust.gamma, robust.patch, problem.observed)
        grad = problem.lam * (probe - problem.mean) + problem.operator(w * (probe - y))
        parts = [problem.operator(probe), problem.operator(y), problem.mean, grad]
        return torch.cat([p[0, :, at[0], at[1]] for p in parts])


def test_an_impulse_denoised_pixel_s_equation_reads_nothing_beyond_the_reach() -> None:
    """Put an impulse (a pixel at black or white) or move a pixel at ∞-distance ``ρ + 1`` or more from
    ``x``: ``x``'s equation is bit for bit unchanged; within ``ρ`` it changes."""
    model = shipped("denoise-impulse-kglm")
    robust = RobustDenoiser(model)
    rho = model.reach
    assert rho == robust.reach > shipped("denoise-kglm", 2).reach
    y = torch.from_numpy(salted(noisy(2 * rho + 12, 2 * rho + 12, colour=True), 0.1, 0))[None]
    at = (rho + 4, 3)

    def perturbed(inputs: tuple, pixel: tuple[int, int]) -> Iterator[tuple]:
        for value in (0.0, 1.0, 0.37):
            moved = inputs[0].clone()
            moved[..., pixel[0], pixel[1]] = value
            if not torch.equal(moved, inputs[0]):  # a pixel already at that value is no perturbation
                yield (moved,)

    assert_reach(lambda v: impulse_equation(robust, v, at), (y,), rho, at, perturbed)


@pytest.mark.parametrize(("sigma", "rate"), [(25.0, 0.1), (None, 0.1), (25.0, 0.5)])
def test_the_impulse_denoiser_tiled_matches_the_untiled_solve(sigma, rate) -> None:
    """The tiles take the whole image's σ estimate and level; at the default halo (the reach) they
    match the whole image to 10⁻⁵ and 0.001 dB (outer tol 10⁻⁶), with half the pixels impulses too;
    with no halo they differ ≫."""
    model = shipped("denoise-impulse-kglm")
    assert IMPULSE.tile_halo(model) == model.reach
    clean = noisy(150, 206, colour=True, sigma=0.0)
    image = salted(noisy(150, 206, colour=True, seed=2), rate, 1)
    request = IMPULSE.prepare(image, None, IMPULSE.options(sigma=sigma), {}, SolverOverride(tol=1e-6))
    whole = solve_batch(IMPULSE, model, [request])[0]
    cut = solve_tiled(IMPULSE, model, request, 64)
    bare = solve_tiled(IMPULSE, model, request, 64, halo=0)
    assert cut.fields["sigma"] == pytest.approx(whole.fields["sigma"], rel=1e-6)
    assert np.abs(cut.output - whole.output).max() < 1e-5
    assert np.abs(bare.output - whole.output).max() > 3e-2
    psnr = [-10 * np.log10(((r.output.clip(0, 1) - clean) ** 2).mean()) for r in (whole, cut)]
    assert abs(psnr[1] - psnr[0]) < 1e-3
    assert cut.converged and cut.finite


def test_the_impulse_tile_s_request_carries_the_whole_image_s_level_and_sigma() -> None:
    image = salted(noisy(40, 50, colour=True, seed=6), 0.2, 3)
    request = IMPULSE.prepare(image, None, IMPULSE.options(), {})
    whole = IMPULSE.whole_image(shipped("denoise-impulse-kglm"), request)
    off = ~((image <= 0.5 / 255) | (image >= 1 - 0.5 / 255)).any(axis=0)
    expected = [image[k][off].astype(np.float64).mean() for k in range(3)]
    np.testing.assert_allclose(whole.inputs["level"], expected, rtol=1e-5)
    # σ from the blocks free of impulses: about the noise's 25, not the impulses' spread
    assert 20 < whole.options.sigma < 30
    tile = IMPULSE.cut(whole, slice(10, 30), slice(10, 40))
    assert tile.inputs["level"] is whole.inputs["level"] and tile.options.sigma == whole.options.sigma


# ----------------------------------------------------------------------------------- photon counts

PHOTON = TASKS["denoise-poisson"]


def counts(height: int, width: int, peak: float, seed: int) -> np.ndarray:
    """Poisson counts ``(1, H, W)`` float32 of the CLI's piecewise image at ``peak`` photons for white."""
    rate = peak * noisy(height, width, colour=False, sigma=0.0)
    return np.random.default_rng(seed).poisson(rate).astype(np.float32)


def photon_equation(model: PhotonDenoiser, y: torch.Tensor, whole: WholeImage, at) -> torch.Tensor:
    """What pixel ``at``'s equation ``z = exp((K/λ)(y − z) + m)`` reads of the counts ``y``
    ``(1, 1, H, W)``, the whole image's statistics fixed: ``K`` applied to a fixed probe and to ``y``,
    and ``m``, at ``at``."""
    with torch.inference_mode():
        u, s_u, span = model.stabilised(y, whole.bright)
        op, pilot_u = model.guided_operator(u, s_u, level=whole.level, mean_of=y)
        beta = model.tensors["net_mean_mix"]
        rate = beta * model.pilot_rate(pilot_u, span) + (1 - beta) * op.local_mean
        probe = torch.linspace(0, 5, y.numel()).reshape(y.shape)
        parts = [op(probe), op(y), torch.log(rate.clamp(min=RATE_FLOOR))]
        return torch.cat([p[0, :, at[0], at[1]] for p in parts])


def test_a_photon_count_s_equation_reads_nothing_beyond_the_reach() -> None:
    """Move one count at ∞-distance ``ρ + 1`` or more from ``x``: ``x``'s equation is bit for bit
    unchanged; within ``ρ`` it changes."""
    model = shipped("denoise-poisson-kglm")
    rho = model.reach
    y = torch.from_numpy(counts(2 * rho + 12, 2 * rho + 12, 20.0, 0))[None]
    whole = WholeImage.of(y)
    at = (rho + 4, 3)
    assert_reach(lambda v: photon_equation(model, v, whole, at), (y,), rho, at, added(7.0))


@pytest.mark.parametrize("peak", [None, 30.0])
def test_the_photon_denoiser_tiled_matches_the_untiled_solve(peak) -> None:
    """The tiles take the whole image's guide scale, level and largest count, and without a given
    peak the whole output's; at the default halo (the reach) they match the whole image to 10⁻⁴ of
    full scale and 0.001 dB (tol 10⁻⁶), with the same peak; with no halo they differ ≫."""
    model = shipped("denoise-poisson-kglm")
    assert PHOTON.tile_halo(model) == model.reach
    y = counts(150, 206, 10.0, 4)
    request = PHOTON.prepare(y, None, PHOTON.options(peak=peak), {}, SolverOverride(tol=1e-6))
    whole = solve_batch(PHOTON, model, [request])[0]
    cut = solve_tiled(PHOTON, model, request, 64)
    bare = solve_tiled(PHOTON, model, request, 64, halo=0)
    assert cut.fields["peak"] == pytest.approx(whole.fields["peak"], rel=1e-4)
    if peak is not None:
        assert cut.fields["peak"] == peak
    assert np.abs(cut.output - whole.output).max() < 1e-4
    assert np.abs(bare.output - whole.output).max() > 1e-2
    clean = noisy(150, 206, colour=False, sigma=0.0) * 10.0 / whole.fields["peak"]
    psnr = [-10 * np.log10(((r.output - clean) ** 2).mean()) for r in (whole, cut)]
    assert abs(psnr[1] - psnr[0]) < 1e-3
    assert cut.converged and cut.finite


def test_photon_tiles_uncertainty_is_the_whole_image_s_scale() -> None:
    """A tiled request's uncertainty map is its tiles' on the whole output's scale: where the tiles
    match, within 2 % of the untiled map (each tile probes its own pixels)."""
    model = shipped("denoise-poisson-kglm")
    y = counts(96, 128, 10.0, 5)
    request = PHOTON.prepare(y, None, PHOTON.options(), {}, SolverOverride(tol=1e-6))
    request = replace(request, uncertainty=True)
    whole = solve_batch(PHOTON, model, [request])[0]
    cut = solve_tiled(PHOTON, model, request, 48)
    ratio = cut.uncertainty.std / whole.uncertainty.std
    assert np.median(ratio) == pytest.approx(1.0, abs=0.02)


# ---------------------------------------------------------------------------------- super-resolution

SUPER = TASKS["super-resolve"]


def sr_equation(model, y: torch.Tensor, scale: int, at) -> torch.Tensor:
    """What low-resolution pixel ``at``'s equation ``(A K Aᵀ + λI)α = y − A m`` reads of ``y``
    ``(1, c, h, w)``, the network's level fixed: ``A K Aᵀ`` applied to a fixed probe, and ``A m``."""
    with torch.inference_mode():
        taps, offset = bicubic_taps(scale)
        op = BlurSubsample(taps, offset, scale, "symmetric")
        kernel = KernelMap(model.tensors["w1"], torch.ones(1), model.config.architecture.padding)
        mean = model._pilot(y, scale, torch.full(y.shape[:2], 0.5))
        probe = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        parts = [op.forward(kernel(op.adjoint(probe))), op.forward(mean)]
        return torch.cat([p[0, :, at[0], at[1]] for p in parts])


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_a_low_resolution_pixel_s_equation_reads_nothing_beyond_the_reach(scale) -> None:
    """Move one low-resolution pixel at ∞-distance ``ρ(s) + 1`` or more from ``x``: ``x``'s equation is
    bit for bit unchanged; within ``ρ(s)`` it changes."""
    model = shipped("super-resolve-kglm")
    rho = model.reach(scale)
    y = torch.from_numpy(noisy(2 * rho + 12, 2 * rho + 12, colour=True, sigma=5.0))[None]
    at = (rho + 4, 3)
    assert_reach(lambda v: sr_equation(model, v, scale, at), (y,), rho, at, added(0.5))


@pytest.mark.parametrize("scale", [2, 3])
def test_the_super_resolver_tiled_matches_the_untiled_solve(scale) -> None:
    """Tiles of 96 output pixels on a side (``96/s`` input pixels), each writing its core's ``s × s``
    output pixels, with the whole image's interpolation means: at the default halo they match the
    whole image to 10⁻⁴ and 0.001 dB (tol 10⁻⁶); with no halo they differ ≫."""
    model = shipped("super-resolve-kglm")
    hr = noisy(60 * scale, 75 * scale, colour=True, sigma=0.0)
    y = degrade(torch.from_numpy(hr)[None], scale)[0].numpy()
    request = SUPER.prepare(y, None, SUPER.options(scale=scale), {}, SolverOverride(tol=1e-6))
    whole = solve_batch(SUPER, model, [request])[0]
    tiles_seen: list[int] = []
    cut = solve_tiled(SUPER, model, request, 96, progress=tiles_seen.append)
    bare = solve_tiled(SUPER, model, request, 96, halo=0)
    assert cut.output.shape == whole.output.shape == hr.shape
    assert sum(tiles_seen) == len(tiles(60, 75, 96 // scale // 2 * 2, 0)) > 1
    assert np.abs(cut.output - whole.output).max() < 1e-4
    assert np.abs(bare.output - whole.output).max() > 1e-2
    psnr = [-10 * np.log10(((r.output.clip(0, 1) - hr) ** 2).mean()) for r in (whole, cut)]
    assert abs(psnr[1] - psnr[0]) < 1e-3


def test_the_super_resolution_tile_s_request_carries_the_interpolation_s_means() -> None:
    image = noisy(30, 41, colour=True, seed=7)
    request = SUPER.prepare(image, None, SUPER.options(scale=3), {})
    whole = SUPER.whole_image(shipped("super-resolve-kglm"), request)
    expected = upsample(torch.from_numpy(image).double()[None], 3)[0].mean(dim=(1, 2)).numpy()
    np.testing.assert_allclose(whole.inputs["level"], expected, rtol=1e-6)
    assert tiled(SUPER, shipped("super-resolve-kglm"), request, 64)  # its output, 90 × 123, is larger
    assert not tiled(SUPER, shipped("super-resolve-kglm"), request, 128)
