"""The paper's results as tests: the kGLM-DEQ equals independent kGLM solvers (float64)."""

import pytest
import torch
from sklearn.kernel_ridge import KernelRidge

from kdeq import (
    Bernoulli,
    Binomial,
    Coregional,
    Gaussian,
    GaussianPrior,
    Kernel,
    LogCoshPrior,
    Poisson,
    SolverConfig,
    Spin,
    conv_deq,
    conv_spectral_norm,
    dense_deq,
    dense_spectral_norm,
    grid_coordinates,
    lambda_from_ratio,
    newton_kglm,
)
from tests.helpers import binary_shapes, flip

F64 = torch.float64
TIGHT = SolverConfig(method="anderson", tol=1e-13, max_iter=2000)


def _sklearn_krr(gram, y, lam, cross):
    model = KernelRidge(kernel="precomputed", alpha=lam).fit(gram.numpy(), y.T.numpy())
    return torch.from_numpy(model.predict(cross.numpy())).T


@pytest.mark.parametrize("method", ["anderson", "cg", "fixed_point"])
def test_gaussian_deq_prediction_equals_kernel_ridge(method: str) -> None:
    kern = Kernel(profile="matern52", lengthscale=1.3, radius=4, taper="wendland")
    x = torch.rand(150, 2, dtype=F64) * 10
    x_test = torch.rand(40, 2, dtype=F64) * 10
    gram, cross = kern.gram(x), kern.gram(x_test, x)
    lam = lambda_from_ratio(dense_spectral_norm(gram), 0.5)
    y = torch.randn(4, 150, dtype=F64)
    layer = dense_deq(Gaussian(), GaussianPrior(), gram, lam, cross=cross)
    with torch.no_grad():
        out = layer(y, solver=TIGHT.model_copy(update={"method": method, "damping": 1.0}))
    assert out.stats.converged.all()
    assert torch.allclose(out.eta, _sklearn_krr(gram, y, lam, cross), atol=1e-8, rtol=0)


def _binary_case(family, seed: int):
    images = binary_shapes(24, 12, seed)
    noisy = flip(images, 0.3, seed + 1)
    return (2 * noisy - 1) if isinstance(family, Spin) else noisy


@pytest.mark.parametrize("family", [Bernoulli(), Spin()], ids=lambda f: f.name)
def test_binary_deq_equals_newton_kernel_logistic_regression(family) -> None:
    """Appendix G: flipped binary images, DEQ probabilities vs IRLS, and thresholded labels."""
    y = _binary_case(family, seed=3)
    kern = Kernel(lengthscale=1.0, radius=3)
    h, w = y.shape[-2:]
    gram = kern.gram(grid_coordinates(h, w))
    # C = 2: beyond Assumption 2's contraction (the paper used C = 1/8)
    lam = lambda_from_ratio(dense_spectral_norm(gram), 2.0, family.sup_A2())
    layer = conv_deq(family, GaussianPrior(), kern.filter(F64)[None, None], lam)
    with torch.no_grad():
        out = layer(y, solver=TIGHT)
    assert out.stats.converged.all()
    alpha = newton_kglm(family, GaussianPrior(), gram, y.reshape(len(y), -1), lam)
    p_ref = family.sigma(alpha @ gram)
    p_deq = family.sigma(out.eta.reshape(len(y), -1))
    assert (p_deq - p_ref).abs().max().item() <= 1e-8
    mid = 0.0 if isinstance(family, Spin) else 0.5
    decided = (p_ref - mid).abs() > 1e-6
    assert torch.equal((p_deq > mid)[decided], (p_ref > mid)[decided])
    assert decided.float().mean() > 0.99


@pytest.mark.parametrize(
    "family", [Gaussian(), Bernoulli(), Binomial(4), Spin(), Poisson(eta_max=3.0)], ids=lambda f: f.name
)
@pytest.mark.parametrize("prior", [GaussianPrior(), LogCoshPrior(0.4, 0.5)], ids=lambda p: p.name)
def test_every_family_and_prior_with_mean_matches_newton(family, prior) -> None:
    """Theorem 3 with Appendix H's mean: the embedding ``z = σ(Kα + m)`` and ``η̃ = k(X̃,X)α + m̃``."""
    gen = torch.Generator().manual_seed(7)
    kern = Kernel(profile="matern32", lengthscale=1.5, radius=3)
    x = torch.rand(60, 2, generator=gen, dtype=F64) * 6
    x_test = torch.rand(15, 2, generator=gen, dtype=F64) * 6
    gram, cross = kern.gram(x), kern.gram(x_test, x)
    if isinstance(family, Poisson):
        y = torch.poisson(torch.full((3, 60), 2.0, dtype=F64), generator=gen)
    elif isinstance(family, Binomial):
        y = torch.randint(0, family.trials + 1, (3, 60), generator=gen).to(F64)
    elif isinstance(family, Spin):
        y = torch.randint(0, 2, (3, 60), generator=gen).to(F64) * 2 - 1
    else:
        y = torch.randn(3, 60, generator=gen, dtype=F64)
    mean = 0.3 * torch.randn(3, 60, generator=gen, dtype=F64)
    mean_out = 0.3 * torch.randn(3, 15, generator=gen, dtype=F64)
    lam = lambda_from_ratio(dense_spectral_norm(gram), 3.0, family.sup_A2())
    layer = dense_deq(family, prior, gram, lam, cross=cross)
    with torch.no_grad():
        out = layer(y, mean=mean, mean_out=mean_out, solver=TIGHT)
    assert out.stats.converged.all()
    alpha = newton_kglm(family, prior, gram, y, lam, mean=mean)
    assert torch.allclose(out.z, family.sigma(alpha @ gram + mean), atol=1e-9, rtol=0)
    assert torch.allclose(out.eta, alpha @ cross.T + mean_out, atol=1e-8, rtol=0)


@pytest.mark.parametrize("channels", [1, 3])
def test_convolutional_deq_equals_dense_deq_on_the_grid(channels: int) -> None:
    """Corollary 11, zero-padded borders included: same maps, same fixed point, same prediction."""
    k1 = Kernel(lengthscale=2.0, radius=4)
    k2 = Kernel(profile="matern32", lengthscale=1.0, radius=2)
    eye = tuple(tuple(float(i == j) for j in range(channels)) for i in range(channels))
    ones = tuple(tuple(0.5 for _ in range(channels)) for _ in range(channels))
    core = Coregional(kernels=(k1, k2), mixing=(eye, ones))
    h, w = 9, 11
    bank = core.filter_bank(F64)
    gram = core.gram(grid_coordinates(h, w))
    lam = lambda_from_ratio(conv_spectral_norm(bank, (h, w)), 4.0, 0.25)
    conv_layer = conv_deq(Bernoulli(), LogCoshPrior(0.2, 1.0), bank, lam)
    dense_layer = dense_deq(Bernoulli(), LogCoshPrior(0.2, 1.0), gram, lam)
    v = torch.randn(2, channels, h, w, dtype=F64)
    assert torch.allclose(conv_layer.w1(v).reshape(2, -1), dense_layer.w1(v.reshape(2, -1)), atol=1e-13)
    y = (torch.rand(2, channels, h, w, dtype=F64) > 0.5).to(F64)
    mean = 0.2 * torch.randn(2, channels, h, w, dtype=F64)
    with torch.no_grad():
        c_out = conv_layer(y, mean=mean, mean_out=mean, solver=TIGHT)
        d_out = dense_layer(
            y.reshape(2, -1), mean=mean.reshape(2, -1), mean_out=mean.reshape(2, -1), solver=TIGHT
        )
    assert torch.allclose(c_out.z.reshape(2, -1), d_out.z, atol=1e-11)
    assert torch.allclose(c_out.eta.reshape(2, -1), d_out.eta, atol=1e-10)


def test_beyond_contraction_anderson_and_cg_reach_kernel_ridge() -> None:
    kern = Kernel(lengthscale=2.0, radius=5)
    h = w = 16
    gram = kern.gram(grid_coordinates(h, w))
    lam = lambda_from_ratio(dense_spectral_norm(gram), 30.0)
    layer = conv_deq(Gaussian(), GaussianPrior(), kern.filter(F64)[None, None], lam)
    y = torch.rand(2, 1, h, w, dtype=F64)
    ref = _sklearn_krr(gram, y.reshape(2, -1), lam, gram)
    with torch.no_grad():
        plain = layer(y, solver=SolverConfig(method="fixed_point", damping=1.0, tol=1e-10, max_iter=300))
        assert not plain.stats.converged.any()
        # the plain iterates blow up: the best one is no better than the start
        assert (plain.stats.residual >= 0.99).all()
        for method in ["anderson", "cg"]:
            out = layer(y, solver=SolverConfig(method=method, tol=1e-12, max_iter=1000))
            assert out.stats.converged.all(), method
            assert torch.allclose(out.eta.reshape(2, -1), ref, atol=1e-8, rtol=0), method


@pytest.mark.parametrize("family", [Gaussian(), Bernoulli()], ids=lambda f: f.name)
def test_fixed_point_is_unique_from_any_start(family) -> None:
    kern = Kernel(lengthscale=1.5, radius=4)
    bank = kern.filter(F64)[None, None]
    lam = lambda_from_ratio(conv_spectral_norm(bank, (14, 14)), 30.0, family.sup_A2())
    layer = conv_deq(family, GaussianPrior(), bank, lam)
    y = (torch.rand(1, 1, 14, 14, dtype=F64) > 0.5).to(F64)
    cfg = SolverConfig(tol=1e-12, max_iter=2000)
    zs = []
    with torch.no_grad():
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            z0 = family.sigma(5 * torch.randn(1, 1, 14, 14, generator=g, dtype=F64))
            out = layer(y, z0=z0, solver=cfg)
            assert out.stats.converged.all()
            zs.append(out.z)
    for z in zs[1:]:
        assert torch.allclose(z, zs[0], atol=1e-9, rtol=0)


@pytest.mark.parametrize("channels", [1, 2])
def test_masked_deq_inpaints_like_kernel_ridge_on_observed_pixels(channels: int) -> None:
    """DESIGN §2.4: W1 = −MKM/λ; the prediction at missing pixels is KRR fitted on observed ones."""
    kern = Kernel(profile="matern52", lengthscale=2.0, radius=4)
    mix = ((1.0,),) if channels == 1 else ((1.0, 0.6), (0.6, 1.0))
    core = Coregional(kernels=(kern,), mixing=(mix,))
    h, w = 12, 10
    gram = core.gram(grid_coordinates(h, w))
    lam = lambda_from_ratio(dense_spectral_norm(gram), 10.0)
    layer = conv_deq(Gaussian(), GaussianPrior(), core.filter_bank(F64), lam)
    y = torch.rand(2, channels, h, w, dtype=F64)
    mask = (torch.rand(2, channels, h, w) > 0.5).to(F64)
    with torch.no_grad():
        out = layer(y, mask=mask, solver=SolverConfig(method="cg", tol=1e-13, max_iter=500))
    assert out.stats.converged.all()
    for b in range(2):
        obs = mask[b].reshape(-1).bool()
        ref = _sklearn_krr(gram[obs][:, obs], y[b].reshape(1, -1)[:, obs], lam, gram[~obs][:, obs])
        got = out.eta[b].reshape(-1)[~obs]
        assert torch.allclose(got, ref[0], atol=1e-8, rtol=0)
        # rows are restricted too: unobserved z sits at σ(m) = 0 and takes no part
        assert torch.equal(out.z[b].reshape(-1)[~obs], torch.zeros(int((~obs).sum()), dtype=F64))


def test_poisson_with_prior_past_the_curvature_cap_matches_newton() -> None:
    """Counts whose MAP η lies above η_max: the capped family is still one strictly convex kGLM."""
    gen = torch.Generator().manual_seed(11)
    kern = Kernel(lengthscale=1.5, radius=3)
    x = torch.rand(50, 2, generator=gen, dtype=F64) * 6
    gram = kern.gram(x)
    family, prior = Poisson(eta_max=1.0), LogCoshPrior(0.4, 0.5)
    y = torch.poisson(torch.full((2, 50), 8.0, dtype=F64), generator=gen)
    lam = lambda_from_ratio(dense_spectral_norm(gram), 0.5, family.sup_A2())
    layer = dense_deq(family, prior, gram, lam)
    with torch.no_grad():
        out = layer(y, solver=TIGHT)
    alpha = newton_kglm(family, prior, gram, y, lam)
    assert out.stats.converged.all()
    assert (alpha @ gram).max() > family.eta_max
    assert torch.allclose(out.eta, alpha @ gram, atol=1e-8, rtol=0)


def test_mean_defaults_and_requirements() -> None:
    kern = Kernel(lengthscale=1.5, radius=2)
    bank = kern.filter(F64)[None, None]
    layer = conv_deq(Gaussian(), GaussianPrior(), bank, 2.0, solver=TIGHT)
    y = torch.rand(1, 1, 8, 8, dtype=F64)
    mean = torch.full_like(y, 0.5)
    with torch.no_grad():
        assert torch.equal(layer(y, mean=mean).eta, layer(y, mean=mean, mean_out=mean).eta)
    x = grid_coordinates(8, 8)
    dense = dense_deq(Gaussian(), GaussianPrior(), kern.gram(x), 2.0, cross=kern.gram(x[:5], x))
    with pytest.raises(ValueError, match="mean_out"):
        dense(y.reshape(1, -1), mean=mean.reshape(1, -1))
