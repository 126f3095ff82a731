"""Each family's σ, A'' and σ⁻¹ against autograd of its own A; priors likewise."""

import pytest
import torch

from kdeq import Bernoulli, Binomial, Gaussian, LogCoshPrior, Poisson, Spin, get_family, get_prior, rho

FAMILIES = [Gaussian(), Bernoulli(), Binomial(5), Spin(), Poisson(eta_max=3.0)]


def _grid(family) -> torch.Tensor:
    return torch.linspace(-6.0, 6.0, 401, dtype=torch.float64)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sigma_is_derivative_of_log_partition(family) -> None:
    eta = _grid(family).requires_grad_(True)
    (d1,) = torch.autograd.grad(family.A(eta).sum(), eta, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), eta)
    assert torch.allclose(d1, family.sigma(eta), rtol=1e-10, atol=1e-12)
    assert torch.allclose(d2, family.A2(eta), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_curvature_bound_holds(family) -> None:
    eta = torch.linspace(-30.0, 30.0, 6001, dtype=torch.float64)
    a2 = family.A2(eta)
    assert (a2 >= 0).all()
    assert a2.max().item() <= family.sup_A2() * (1 + 1e-12)
    # the bound is attained (tight), so Assumption 2 is not needlessly pessimistic
    assert a2.max().item() >= 0.99 * family.sup_A2()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_link_inverts_mean_map(family) -> None:
    eta = torch.linspace(-5.0, 5.0, 200, dtype=torch.float64)
    assert torch.allclose(family.sigma_inv(family.sigma(eta)), eta, atol=1e-9)


def test_poisson_curvature_is_capped_above_eta_max() -> None:
    fam = Poisson(eta_max=2.0)
    eta = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    e2 = torch.exp(torch.tensor(2.0, dtype=torch.float64))
    expected = torch.stack([torch.exp(eta[0]), e2, e2 * 4.0])
    assert torch.allclose(fam.sigma(eta), expected)
    assert torch.allclose(fam.A2(eta), torch.stack([torch.exp(eta[0]), e2, e2]))
    with pytest.raises(ValueError):
        Poisson(eta_max=float("inf"))


def test_sufficient_statistic_and_registry() -> None:
    y = torch.tensor([0.0, 1.0, 3.0])
    assert torch.equal(get_family("binomial", trials=3).T(y), y)
    assert get_family("bernoulli").sup_A2() == 0.25
    with pytest.raises(ValueError, match="unknown family"):
        get_family("gamma")
    with pytest.raises(ValueError, match="unknown prior"):
        get_prior("cauchy")


def test_logcosh_prior_derivatives_and_log_concavity() -> None:
    prior = LogCoshPrior(strength=0.7, scale=0.3)
    eta = torch.linspace(-40.0, 40.0, 801, dtype=torch.float64).requires_grad_(True)
    (d1,) = torch.autograd.grad(prior.Q(eta).sum(), eta, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), eta)
    assert torch.allclose(d1, prior.dQ(eta), atol=1e-12)
    assert torch.allclose(d2, prior.d2Q(eta), atol=1e-10)
    assert (prior.d2Q(eta) >= 0).all()
    assert torch.isfinite(prior.Q(eta)).all()


@pytest.mark.parametrize("family", [Bernoulli(), Spin(), Gaussian()], ids=lambda f: f.name)
def test_rho_is_non_decreasing(family) -> None:
    z = family.sigma(torch.linspace(-8.0, 8.0, 300, dtype=torch.float64))
    r = rho(LogCoshPrior(0.5, 1.0), family, z)
    assert (r.diff() >= -1e-15).all()
    assert torch.equal(rho(get_prior("gaussian"), family, z), torch.zeros_like(z))
