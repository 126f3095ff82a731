"""Per-pixel posterior uncertainty (``kdeq.predictors.uncertainty``) against dense float64 linear algebra.

The reference is DESIGN §2 fact 9 computed densely on small images: ``K`` (the kernel applied to
every unit image, or built from the taps directly), ``A`` (``Operator.dense``) and
``Σ = s²(K − K Aᵀ (A K Aᵀ + λI)⁻¹ A K)`` by ``torch.linalg``. Exact paths must agree to the float32
rounding of the returned map; probed ones within 5 % mean relative error at the default probes.
"""

import math
from pathlib import Path

import pytest
import torch

from kdeq.maths.adaptive import guided_gram
from kdeq.maths.psf import parse_psf
from kdeq.models.checkpoint import Checkpoint, load_checkpoint
from kdeq.models.repository import find_model, load_predictor
from kdeq.predictors.denoise import Denoiser
from kdeq.predictors.uncertainty import (
    MAX_SPACING,
    gaussian_posterior,
    posterior,
    posterior_std,
    probe_spacing,
)

MODELS = Path(__file__).resolve().parents[1] / "models"
SIZE = 12


def latest(name: str, version: int | None = None):
    """The shipped model ``name`` (its highest version: the one the service serves by default)."""
    return load_predictor(find_model(MODELS, name, version))


def variant(name: str, version: int, **update) -> Denoiser:
    """The shipped stationary denoiser with ``update`` applied to its config (``padding`` goes to the
    architecture)."""
    ck = load_checkpoint(MODELS / name / str(version))
    config = ck.config
    if "padding" in update:
        arch = config.architecture.model_copy(update={"padding": update.pop("padding")})
        config = config.model_copy(update={"architecture": arch})
    return Denoiser(Checkpoint(config.model_copy(update=update), ck.tensors, ck.path))


def scene(size: int = SIZE, sigma: float = 0.0, seed: int = 0) -> torch.Tensor:
    """A ``(1, 1, size, size)`` image with an edge (a disc) and a gradient, plus noise ``σ`` (0–1)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    disc = ((rows - size / 2) ** 2 + (cols - size / 2.5) ** 2 < (size / 3) ** 2).float()
    image = 0.2 + 0.5 * disc + 0.2 * cols / size
    return (image + sigma * torch.randn(size, size, generator=gen))[None, None]


def dense_kernel(post, h: int, w: int) -> torch.Tensor:
    """``K`` ``(hw, hw)`` of a posterior's kernel map, applied to every unit image at once."""
    n = h * w
    basis = torch.eye(n, dtype=torch.float64).reshape(1, n, h, w)
    return post.kernel(basis)[0].reshape(n, n).T


def zero_border_gram(taps: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``K_ij = k(x_i − x_j)`` over an ``h×w`` grid from centred taps, 0 beyond their radius (the
    kernel restricted to in-image pixels, Corollary 11), built without any convolution."""
    r = taps.shape[-1] // 2
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
    delta = pos[:, None, :] - pos[None, :, :]
    near = (delta.abs().amax(-1) <= r).double()
    idx = (delta + r).clamp(0, 2 * r)
    return taps.double()[idx[..., 0], idx[..., 1]] * near


def dense_covariance(kernel: torch.Tensor, op: torch.Tensor, lam: float) -> torch.Tensor:
    """``K − K Aᵀ (A K Aᵀ + λI)⁻¹ A K`` (the posterior covariance over ``s²``)."""
    gram = op @ kernel @ op.T + lam * torch.eye(op.shape[0], dtype=torch.float64)
    return kernel - kernel @ op.T @ torch.linalg.solve(gram, op @ kernel)


def reference_std(predictor, *args, kernel: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``sqrt(diag Σ)`` ``(H, W)`` of sample 0, dense, with the module's ``s²`` and ``λ``; ``kernel``
    replaces the kernel map's matrix by an independently built one."""
    post = gaussian_posterior(predictor, *args, **kwargs)
    _, _, h, w = post.shape
    k = dense_kernel(post, h, w) if kernel is None else kernel
    a = post.op.dense(h, w)
    cov = dense_covariance(k, a, float(post.lam[0]))
    s2 = posterior(predictor, *args, generator=torch.Generator().manual_seed(0), **kwargs).amplitude[0]
    return (float(s2) * cov.diagonal()).sqrt().reshape(h, w)


def relative_error(predictor, *args, kernel=None, **kwargs) -> tuple[float, float, object]:
    """Mean and max relative error of the module's std map (sample 0, channel 0) against the dense one."""
    got = posterior(predictor, *args, generator=torch.Generator().manual_seed(1), **kwargs)
    want = reference_std(predictor, *args, kernel=kernel, **kwargs)
    rel = (got.std[0, 0].double() - want).abs() / want
    return rel.mean().item(), rel.max().item(), got


# --- exact paths -----------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["symmetric", "circular"])
def test_exact_denoise_stationary_transform(padding: str) -> None:
    predictor = variant("denoise-stationary-kglm", 1, padding=padding)
    x = scene(sigma=0.1)
    _, worst, got = relative_error(predictor, x, sigma=25.0)
    assert got.exact and got.probes == 0
    assert worst < 1e-6  # the float32 rounding of the returned map
    if padding == "circular":  # the DFT's |U_if|² = 1/N: the same variance at every pixel
        assert torch.allclose(got.std, got.std[..., :1, :1].expand_as(got.std), rtol=1e-6)
    else:  # the DCT's is not: the border differs from the interior
        assert not torch.allclose(got.std[0, 0, 0, 0], got.std[0, 0, SIZE // 2, SIZE // 2], rtol=1e-3)


def test_exact_deblur_symmetric_even_psf() -> None:
    """The shipped conv deblurrer (symmetric border) with an axis-even PSF: ``H K Hᵀ`` in the DCT."""
    predictor = latest("deblur-kglm", 1)
    _, worst, got = relative_error(predictor, scene(sigma=0.02), parse_psf("gaussian:1.6"), sigma=5.0)
    assert got.exact
    assert worst < 1e-6


def test_colour_channels_share_the_map() -> None:
    predictor = variant("denoise-stationary-kglm", 1, padding="symmetric")
    x = scene(sigma=0.1).expand(2, 3, SIZE, SIZE).clone()
    std = posterior_std(predictor, x, sigma=[10.0, 40.0])
    assert std.shape == (2, 3, SIZE, SIZE)
    assert torch.equal(std[:, :1].expand_as(std), std)
    assert bool((std[1] > std[0]).all())  # more noise, less certainty


# --- probed paths (the shipped models) -------------------------------------------------------------


def test_probed_denoise_stationary_zero_border() -> None:
    """The shipped stationary denoiser (zero border: no transform), against a Gram matrix built from
    its taps without convolution."""
    predictor = latest("denoise-stationary-kglm", 1)
    kernel = zero_border_gram(predictor.tensors["w1"][0, 0], SIZE, SIZE)
    mean, _, got = relative_error(predictor, scene(sigma=0.1), sigma=25.0, kernel=kernel)
    assert not got.exact and got.probes == 72
    assert mean < 0.05


@pytest.mark.parametrize("sigma", [10.0, 50.0])
def test_probed_default_guided_denoiser(sigma: float) -> None:
    """The default denoiser (adaptive kernel with a guide network), against ``guided_gram``: the
    dense kernel from explicit patch features, on the predictor's own guide and bandwidth."""
    predictor = latest("denoise-kglm")
    x = scene(sigma=sigma / 255.0)
    s = predictor.noise_level(x, sigma)
    level = predictor._guide_level(s)
    guide, _ = predictor.guide(x, level)
    kern = predictor.config.architecture.kernel
    h2 = float(kern.h2(1, level * predictor.tensors["smoothing"].square().sum()))
    spatial = predictor.tensors["spatial"].double()
    kernel = guided_gram(guide[0].double(), spatial, kern.patch_radius, h2, kern.normalize)
    mean, _, got = relative_error(predictor, x, sigma=sigma, kernel=kernel)
    assert mean < 0.05
    assert got.error is not None and float(got.error[0]) < 0.05


def test_guided_kernel_is_the_denoisers_own() -> None:
    """The float64 kernel the module builds is the one the denoiser's solve applies (float32)."""
    predictor = latest("denoise-kglm")
    x = scene(sigma=0.1)
    s = predictor.noise_level(x, 25.0)
    layer, _, _ = predictor._guided(x, predictor._guide_level(s), predictor.lam(s), None, None, None)
    post = gaussian_posterior(predictor, x, sigma=25.0)
    v = torch.randn(1, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    theirs = layer.w1.operator(v)
    assert torch.allclose(post.kernel(v.double()).float(), theirs, rtol=1e-4, atol=1e-6)


def test_probed_inpaint() -> None:
    """The default inpainter (``A = M``; its network only moves the mean), zero-border Gram."""
    predictor = latest("inpaint-kglm")
    missing = torch.rand(1, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(3)) < 0.4
    kernel = zero_border_gram(predictor.tensors["w1"][0, 0], SIZE, SIZE)
    mean, _, got = relative_error(predictor, scene(), missing, kernel=kernel)
    assert mean < 0.05
    # a missing pixel is less certain than an observed one
    std = got.std[0, 0]
    assert std[missing[0, 0]].mean() > 2 * std[~missing[0, 0]].mean()


def test_probed_deblur_asymmetric_psf_and_guided() -> None:
    """A motion PSF at an angle (not axis-even: no transform) and the guided deblurrer (its second
    solve's kernel, given the first solve)."""
    blurred = scene(sigma=0.02)
    mean, _, got = relative_error(latest("deblur-kglm", 1), blurred, parse_psf("motion:5,30"), sigma=5.0)
    assert not got.exact and mean < 0.05
    mean, _, got = relative_error(latest("deblur-kglm", 2), blurred, parse_psf("gaussian:1.6"), sigma=5.0)
    assert not got.exact and mean < 0.05


@pytest.mark.parametrize("scale", [2, 4])
def test_probed_super_resolve(scale: int) -> None:
    """The default super-resolver, ``A = S H`` to a 12×12 (×2) or 32×32 (×4, the largest measured
    ``ρ²``) output."""
    predictor = latest("super-resolve-kglm")
    size = SIZE if scale == 2 else 32
    small = torch.nn.functional.avg_pool2d(scene(size), scale)
    mean, _, got = relative_error(predictor, small, scale=scale)
    assert got.std.shape == (1, 1, size, size)
    assert mean < 0.05


def test_probed_guided_denoiser_larger_image_and_its_error_estimate() -> None:
    """32×32, where the adaptive kernel's correlations are not cut by the image's size; the probes'
    own error estimate (``Uncertainty.error``) is within a factor 2 of the true mean error."""
    predictor = latest("denoise-kglm")
    size = 32
    x = scene(size, sigma=10 / 255.0)
    post = gaussian_posterior(predictor, x, sigma=10.0)
    identity = torch.eye(size * size, dtype=torch.float64)
    cov = dense_covariance(dense_kernel(post, size, size), identity, float(post.lam[0]))
    want = (float(post.amplitude[0]) * cov.diagonal()).sqrt().reshape(size, size)
    got = posterior(predictor, x, sigma=10.0, generator=torch.Generator().manual_seed(2))
    mean = ((got.std[0, 0].double() - want).abs() / want).mean().item()
    assert mean < 0.05
    assert 0.5 * mean < float(got.error[0]) < 2 * mean


def test_maximum_likelihood_amplitude() -> None:
    """Without a noise level, ``s² = (y − Am)ᵀ(A K Aᵀ + λI)⁻¹(y − Am)/n`` over the observed values."""
    predictor = latest("inpaint-kglm")
    missing = torch.rand(1, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(4)) < 0.3
    post = gaussian_posterior(predictor, scene(sigma=0.05), missing)
    k = dense_kernel(post, SIZE, SIZE)
    a = post.op.dense(SIZE, SIZE)
    r = post.centred[0, 0].reshape(-1)
    want = r @ torch.linalg.solve(a @ k @ a.T + float(post.lam[0]) * torch.eye(SIZE**2), r)
    want = want / (~missing).sum()
    got = posterior(predictor, scene(sigma=0.05), missing, generator=torch.Generator().manual_seed(0))
    assert float(got.amplitude[0]) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("which", ["denoise", "deblur"])
def test_the_posterior_mean_is_the_predictors_output(which: str) -> None:
    """The ``K``, ``A`` and ``λ`` the module uses are those of the solve: their dense posterior mean
    ``m + K Aᵀ(A K Aᵀ + λI)⁻¹(y − A m)`` (``m`` the global mean) is the predictor's output."""
    x = scene(sigma=0.05).double()
    if which == "denoise":
        predictor, extra, kw = latest("denoise-stationary-kglm", 1), (), {"sigma": 12.0}
    else:
        predictor, extra, kw = latest("deblur-kglm", 1), (parse_psf("motion:5,30"),), {"sigma": 3.0}
    post = gaussian_posterior(predictor, x.float(), *extra, **kw)
    k = dense_kernel(post, SIZE, SIZE)
    a = post.op.dense(SIZE, SIZE)
    m = x.mean()
    y = x.reshape(-1)
    gram = a @ k @ a.T + float(post.lam[0]) * torch.eye(SIZE**2, dtype=torch.float64)
    want = m + k @ a.T @ torch.linalg.solve(gram, y - a @ (m * torch.ones_like(y)))
    got = predictor.predict(x.float(), *extra, **kw).output.reshape(-1).double()
    assert torch.allclose(got, want, atol=2e-4)


@pytest.mark.parametrize("which", ["denoise-kglm", "inpaint-kglm"])
def test_a_batch_is_its_samples(which: str) -> None:
    """Per-sample ``λ``, ``s²`` and (adaptive) kernels: each sample of a batch gets the map it gets
    alone (the probes are shared by the batch, so with one seed the estimates agree to CG's
    tolerance)."""
    predictor = latest(which)
    images = torch.cat([scene(sigma=0.02, seed=1), scene(sigma=0.15, seed=2).flip(-1)])
    if which == "denoise-kglm":
        args, kwargs = (images,), {"sigma": [5.0, 40.0]}
        alone = [((images[k : k + 1],), {"sigma": kwargs["sigma"][k]}) for k in range(2)]
    else:
        missing = torch.rand(2, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(5)) < 0.3
        args, kwargs = (images, missing), {}
        alone = [((images[k : k + 1], missing[k : k + 1]), {}) for k in range(2)]
    both = posterior_std(predictor, *args, generator=torch.Generator().manual_seed(0), **kwargs)
    for k, (a, kw) in enumerate(alone):
        one = posterior_std(predictor, *a, generator=torch.Generator().manual_seed(0), **kw)
        assert torch.allclose(both[k : k + 1], one, rtol=1e-5)


def test_probe_spacing_rule() -> None:
    """``d = R + 1`` (at most ``MAX_SPACING``), a multiple of the subsampling factor."""
    assert probe_spacing(5) == 6 and probe_spacing(7) == 8 and probe_spacing(12) == MAX_SPACING
    assert probe_spacing(6, 2) == 8 and probe_spacing(6, 3) == 9 and probe_spacing(6, 4) == 8
    with pytest.raises(ValueError):
        posterior(latest("denoise-stationary-kglm", 1), scene(), sigma=10.0, rounds=0)


def test_segmenter_laplace_std() -> None:
    """The segmenter's latent ``η ~ GP(0, K/λ)``: Laplace's covariance at the solved ``π``,
    ``(λK⁻¹ + W)⁻¹ = (λI + KW)⁻¹K`` with ``W = diag(π(1 − π))``, dense from the zero-border Gram
    matrix built without a convolution and without the module's Woodbury form; the probed latent std
    within 5 % mean relative error of it, and the returned map its delta-method image
    ``π(1 − π)·std(η)`` on the probability's scale."""
    predictor = latest("segment-kglm", 1)
    images = scene(sigma=0.05)
    prob = predictor.predict(images).output.double().reshape(-1)
    weight = prob * (1 - prob)
    lam = float(predictor.lam(torch.zeros(1)))
    k = zero_border_gram(predictor.tensors["w1"][0, 0], SIZE, SIZE)
    cov = torch.linalg.solve(lam * torch.eye(SIZE**2, dtype=torch.float64) + k * weight[None, :], k)
    want = cov.diagonal().sqrt().reshape(SIZE, SIZE)
    got = posterior(predictor, images, generator=torch.Generator().manual_seed(1))
    assert not got.exact and got.probes > 0 and got.latent is not None
    rel = (got.latent[0, 0].double() - want).abs() / want
    assert rel.mean().item() < 0.05, rel.mean().item()
    # the labels narrow the prior (std √(K_ii/λ)) and widen it nowhere
    assert (got.latent[0, 0].double() <= k.diagonal().reshape(SIZE, SIZE).div(lam).sqrt() * 1.05).all()
    scaled = got.latent[0, 0] * weight.reshape(SIZE, SIZE).float()
    torch.testing.assert_close(got.std[0, 0], scaled, rtol=1e-6, atol=0)


def test_refuses_what_has_no_gaussian_posterior() -> None:
    with pytest.raises(ValueError, match="plug-and-play"):
        posterior_std(latest("deblur-kglm", 3), scene(), parse_psf("gaussian:1.6"), sigma=5.0)


# --- calibration ------------------------------------------------------------------------------------


def test_calibration_on_prior_draws() -> None:
    """``f ~ GP(0, s² K)`` (Cholesky of the dense ``K``), ``y = f + σε``; the predictor's output (a
    zero-mean stationary denoiser: exactly the posterior mean) is within ``1.96·std`` of ``f`` at
    95 % of the pixels.

    ``N = 400`` images of 12×12 give 57,600 pixels: were they independent, the fraction's standard
    deviation would be ``√(0.95·0.05/N) = 0.0009``, so ±0.01 is 11 standard deviations. The pixels of
    one image are correlated (neighbouring errors share the posterior's correlations); the spread of
    the 400 images' own fractions measures the standard error at 0.0012 (this seed: coverage
    0.9493), so ±0.01 is ~8 standard errors — a failure means miscalibration, not bad luck."""
    predictor = variant("denoise-stationary-kglm", 1, padding="symmetric", mean="none")
    count, sigma = 400, 25.0
    post = gaussian_posterior(predictor, torch.zeros(1, 1, SIZE, SIZE), sigma=sigma)
    k = dense_kernel(post, SIZE, SIZE)
    s2 = float(post.amplitude[0])
    chol = torch.linalg.cholesky(s2 * k + 1e-12 * torch.eye(SIZE**2, dtype=torch.float64))
    gen = torch.Generator().manual_seed(7)
    f = (chol @ torch.randn(SIZE**2, count, generator=gen, dtype=torch.float64)).T
    y = f + sigma / 255.0 * torch.randn(count, SIZE**2, generator=gen, dtype=torch.float64)
    y = y.reshape(count, 1, SIZE, SIZE).float()
    mean = predictor.predict(y, sigma=sigma).output.double().reshape(count, -1)
    std = posterior_std(predictor, y, sigma=sigma).double().reshape(count, -1)
    inside = ((f - mean).abs() <= 1.96 * std).double().mean().item()
    assert inside == pytest.approx(0.95, abs=0.01)
    # and not because the map is loose: at a wrong amplitude (s²/2) coverage falls well below
    narrow = ((f - mean).abs() <= 1.96 * std / math.sqrt(2)).double().mean().item()
    assert narrow < 0.91


def test_calibration_of_the_probed_map_inpainting() -> None:
    """The probed path's calibration: the inpainter's kernel and ``λ``, ``f ~ GP(0, s² K)`` with the
    zero-border Gram matrix, ``y = M f + ε`` (``ε ~ N(0, λ s²)``) under a random mask per image; the
    dense posterior mean (zero mean) against the module's map at the given ``s²`` (one round of
    probes: this kernel's ``ρ²`` is below 10⁻⁴). 200 images × 144 pixels: the spread of the images'
    own fractions measures the standard error at 0.0014 (correlated pixels; this seed: coverage
    0.9494), so ±0.01 is ~7 of them."""
    predictor = latest("inpaint-kglm")
    count, s2 = 200, 0.01
    lam = float(predictor.lam(torch.zeros(1)))
    k = zero_border_gram(predictor.tensors["w1"][0, 0], SIZE, SIZE)
    gen = torch.Generator().manual_seed(11)
    chol = torch.linalg.cholesky(s2 * k + 1e-12 * torch.eye(SIZE**2, dtype=torch.float64))
    f = (chol @ torch.randn(SIZE**2, count, generator=gen, dtype=torch.float64)).T
    observed = (torch.rand(count, SIZE**2, generator=gen) > 0.4).double()
    y = observed * (f + math.sqrt(lam * s2) * torch.randn(count, SIZE**2, generator=gen, dtype=torch.float64))
    mean = torch.empty_like(f)
    for i in range(count):
        a = torch.diag(observed[i])[observed[i] > 0]
        gram = a @ k @ a.T + lam * torch.eye(a.shape[0], dtype=torch.float64)
        mean[i] = k @ a.T @ torch.linalg.solve(gram, a @ y[i])
    images = y.reshape(count, 1, SIZE, SIZE).float()
    missing = (observed == 0).reshape(count, 1, SIZE, SIZE)
    gen = torch.Generator().manual_seed(0)
    got = posterior(predictor, images, missing, amplitude=s2, rounds=1, generator=gen)
    std = got.std.double().reshape(count, -1)
    inside = ((f - mean).abs() <= 1.96 * std).double().mean().item()
    assert inside == pytest.approx(0.95, abs=0.01)
