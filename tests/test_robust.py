"""The robust kGLM denoiser (``kdeq.predictors.robust``): its fixed point is a stationary point of its energy,
it is the plain denoiser without gates, impulses get no weight, and it refuses bad input."""

from __future__ import annotations

import pytest
import torch

from kdeq.maths.adaptive import guided_gram
from kdeq.maths.filters import separable_blur
from kdeq.maths.noise import estimate_sigma
from kdeq.maths.solvers import SolverConfig
from kdeq.models.repository import default_models_dir, find_model, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.robust import ImpulseDenoiser, RobustDenoiser, robust_sigma


@pytest.fixture(scope="module")
def plain():
    return load_predictor(find_model(default_models_dir(), "denoise-kglm", 1))


@pytest.fixture(scope="module")
def default():
    return load_predictor(find_model(default_models_dir(), "denoise-kglm", 2))


def smooth(size: int, seed: int) -> torch.Tensor:
    """A smooth image in [0.2, 0.8] ``(1, 1, size, size)``."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 1, 4, 4, generator=gen, dtype=torch.float64)
    return 0.2 + 0.6 * torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic").clamp(0, 1)


def corrupt(
    clean: torch.Tensor, sigma255: float, rate: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``clean`` plus Gaussian noise, a fraction ``rate`` of the pixels set to 0 or 1; and where."""
    gen = torch.Generator().manual_seed(seed)
    y = clean + sigma255 / 255.0 * torch.randn(clean.shape, generator=gen, dtype=clean.dtype)
    u = torch.rand(clean.shape, generator=gen, dtype=clean.dtype)
    y = torch.where(u < rate / 2, 0.0, torch.where(u < rate, 1.0, y))
    return y.float(), u < rate


def dense_energy_gradient(y, z, observed, sigma, gamma, patch):
    """``∇D(z)`` ``(H, W)`` by autograd of ``D`` built from an explicit patch-membership matrix
    (one grey image ``(H, W)``, float64), independently of ``kdeq.predictors.robust.patch_weights``."""
    height, width = y.shape
    member = torch.zeros(height * width, height * width, dtype=torch.float64)
    for i in range(height):
        for j in range(width):
            for a in range(max(0, i - patch), min(height, i + patch + 1)):
                for b in range(max(0, j - patch), min(width, j + patch + 1)):
                    member[i * width + j, a * width + b] = 1.0
    count = member.sum(0)  # N(x)
    z = z.reshape(-1).clone().requires_grad_(True)
    r2 = observed.reshape(-1) * (y.reshape(-1) - z).square() / (sigma**2 * count)
    q = member @ r2
    energy = sigma**2 / (2 * gamma) * (1 - torch.exp(-gamma * q)).sum()
    (grad,) = torch.autograd.grad(energy, z)
    return grad.reshape(height, width)


@pytest.mark.parametrize(("patch", "gamma"), [(0, 0.112), (1, 0.5)])
def test_fixed_point_is_a_stationary_point_of_the_energy(plain, patch, gamma):
    clean = smooth(12, 0)
    y, _ = corrupt(clean, 15, 0.1, 1)
    den = RobustDenoiser(
        plain,
        gamma=gamma,
        patch=patch,
        inner=SolverConfig(method="cg", tol=1e-7, max_iter=500),
        outer=SolverConfig(method="fixed_point", damping=1.0, tol=1e-6, max_iter=200),
    )
    res = den(y, 15)
    assert bool(res.stats.converged.all())
    prob = res.problem
    s = float(prob.sigma[0])
    y64, z64 = prob.y[0, 0].double(), res.output[0, 0].double()
    grad = dense_energy_gradient(y64, z64, prob.observed[0, 0].double(), s, gamma, patch)
    # the weights returned are the ones the energy's gradient has: ∇D = W(z − y)
    w = res.weights[0, 0].double()
    torch.testing.assert_close(grad, w * (z64 - y64), atol=1e-6, rtol=1e-4)
    # K̃∇E = λ(z − m) + K̃∇D = 0, with K̃ the dense Gram of the guide's explicit patch features
    guide = separable_blur(prob.filled, plain.tensors["smoothing"])[0].double()
    h2 = float(plain.guide_h2(1, prob.sigma)[0])
    kern = plain.config.architecture.kernel
    gram = guided_gram(guide, plain.tensors["spatial"].double(), kern.patch_radius, h2, kern.normalize)
    lam = float(prob.lam[0])
    prior = lam * (z64 - prob.mean[0, 0].double()).reshape(-1)
    stationarity = prior + gram @ grad.reshape(-1)
    assert float(stationarity.norm() / prior.norm()) < 1e-4  # 0.14 with z moved by 10⁻³


@pytest.mark.parametrize("version", [1, 2])
def test_without_gates_it_is_the_plain_kglm_denoiser(version, plain, default):
    model = plain if version == 1 else default
    clean = smooth(20, 2)
    y, _ = corrupt(clean, 20, 0.0, 3)
    assert not bool(((y <= 0.01) | (y >= 0.99)).any())  # nothing at the range's ends
    result = RobustDenoiser(model, gamma=1e-9)(y, 20)
    out, stats = result.output, result.stats
    expected = model.predict(y, 20).output
    assert bool(stats.converged.all())
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=0)


def test_impulses_get_no_weight(plain):
    clean = smooth(24, 4)
    gen = torch.Generator().manual_seed(5)
    y = (clean + 10 / 255 * torch.randn(clean.shape, generator=gen, dtype=clean.dtype)).float()
    # random-valued impulses, not at the range's ends: only the Welsch gate can find them
    where = torch.rand(clean.shape, generator=gen) < 0.05
    y = torch.where(where, (y + 0.45).remainder(1.0), y)
    res = RobustDenoiser(plain, ends=None, outlier=5.0)(y, 10)
    w = res.weights[0, 0]
    assert float(w[where[0, 0]].max()) < 0.05
    assert float(w[~where[0, 0]].mean()) > 0.8
    # salt and pepper sit at the range's ends: unobserved, weight exactly 0
    y2, hit = corrupt(clean, 10, 0.2, 6)
    res2 = RobustDenoiser(plain)(y2, 10)
    assert float(res2.weights[hit[:, :1]].abs().max()) == 0.0
    assert float((res2.output - clean).square().mean().sqrt()) < 10 / 255


def test_convergence_is_reported_per_sample(plain):
    clean = torch.cat([smooth(16, 7), smooth(16, 8)])
    y, _ = corrupt(clean, 15, 0.1, 9)
    res = RobustDenoiser(plain)(y, torch.tensor([15.0, 25.0]))
    for field in (res.stats.iterations, res.stats.residual, res.stats.converged, res.inner_iterations):
        assert field.shape == (2,)
    assert bool(res.stats.converged.all())
    assert bool((res.stats.residual <= 1e-4).all())
    assert bool((res.stats.iterations >= 1).all())
    assert bool((res.inner_iterations >= res.stats.iterations).all())
    torch.testing.assert_close(res.problem.sigma, torch.tensor([15.0, 25.0]) / 255)


def test_sigma_estimate_is_not_fooled_by_impulses():
    gen = torch.Generator().manual_seed(10)
    noisy = 0.5 + 15 / 255 * torch.randn(1, 1, 96, 96, generator=gen)
    u = torch.rand(noisy.shape, generator=gen)
    y = torch.where(u < 0.1, 0.0, torch.where(u < 0.2, 1.0, noisy))
    assert abs(float(robust_sigma(y)[0]) * 255 / 15 - 1) < 0.1
    assert float(estimate_sigma(y)[0]) * 255 > 1.5 * 15  # what the plain estimator says


def test_bad_input_is_refused(plain):
    y = smooth(8, 11).float()
    with pytest.raises(ValueError, match="gamma"):
        RobustDenoiser(plain, gamma=0.0)
    with pytest.raises(ValueError, match="patch"):
        RobustDenoiser(plain, patch=-1)
    with pytest.raises(ValueError, match="ends"):
        RobustDenoiser(plain, ends=-1.0)
    with pytest.raises(ValueError, match="outlier"):
        RobustDenoiser(plain, outlier=0.0)
    with pytest.raises(ValueError, match="fixed_point"):
        RobustDenoiser(plain, outer=SolverConfig(method="anderson"))
    stationary = load_predictor(find_model(default_models_dir(), "denoise-stationary-kglm", 2))
    with pytest.raises(ValueError, match="guided"):
        RobustDenoiser(stationary)
    den = RobustDenoiser(plain)
    with pytest.raises(ValueError, match=r"\(B, c, H, W\)"):
        den(y[0])
    with pytest.raises(ValueError, match="non-finite"):
        den(torch.full_like(y, float("nan")), 15)
    with pytest.raises(ValueError, match="sigma"):
        den(y, 300)
    with pytest.raises(ValueError, match=r"H, W ≥ 2"):
        robust_sigma(torch.zeros(1, 1, 1, 5))


def test_the_served_impulse_model_is_the_robust_denoiser_on_its_checkpoint(default):
    """``denoise-impulse-kglm:2`` (``ImpulseDenoiser``) answers what ``RobustDenoiser`` on
    ``denoise-kglm:2`` answers, with the outer iteration's statistics, ``λ`` and ``σ``; a solver
    override limits that iteration. Images of different sizes are never padded into one batch for it
    (``pads_exactly``: the zeros would read as impulses)."""
    served = load_predictor(find_model(default_models_dir(), "denoise-impulse-kglm", 2))
    assert isinstance(served, ImpulseDenoiser) and not served.pads_exactly
    y, _ = corrupt(smooth(24, 6), 15, 0.1, 7)
    got = served.predict(y)
    want = RobustDenoiser(default)(y)
    assert torch.equal(got.output, want.output)
    assert torch.equal(got.stats.iterations, want.stats.iterations) and bool(got.stats.converged.all())
    torch.testing.assert_close(got.sigma, want.problem.sigma * 255.0)
    torch.testing.assert_close(got.lam, want.problem.lam)
    once = served.predict(y, 15, SolverOverride(max_iter=1))
    assert int(once.stats.iterations.max()) == 1
