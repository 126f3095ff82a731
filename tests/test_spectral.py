"""Spectral norms against dense matrices built independently from the operators."""

import pytest
import torch

from kdeq import (
    Kernel,
    circular_spectral_norm,
    conv,
    conv_spectral_norm,
    dense_spectral_norm,
    grid_coordinates,
    lambda_from_ratio,
)
from tests.helpers import dense_operator

F64 = torch.float64


def test_circular_norm_is_exact_for_general_banks() -> None:
    bank = torch.randn(3, 2, 5, 5, dtype=F64)
    size = (8, 6)
    dense = dense_operator(lambda x: conv(x, bank, "circular"), (2, *size))
    assert circular_spectral_norm(bank, size) == pytest.approx(dense_spectral_norm(dense), rel=1e-12)


@pytest.mark.parametrize("padding", ["zeros", "reflect", "circular"])
def test_power_iteration_on_padded_operator(padding: str) -> None:
    bank = torch.randn(2, 2, 3, 3, dtype=F64)
    size = (9, 7)
    dense = dense_operator(lambda x: conv(x, bank, padding), (2, *size))
    assert conv_spectral_norm(bank, size, padding, iters=5000, rtol=1e-13) == pytest.approx(
        dense_spectral_norm(dense), rel=1e-6
    )


def test_zero_padded_kernel_norm_is_gram_norm_and_below_circular() -> None:
    kern = Kernel(lengthscale=2.0, radius=4)
    bank = kern.filter(F64)[None, None]
    size = (20, 20)
    gram_norm = dense_spectral_norm(kern.gram(grid_coordinates(*size)))
    assert conv_spectral_norm(bank, size, "zeros") == pytest.approx(gram_norm, rel=1e-6)
    assert gram_norm <= circular_spectral_norm(bank, size) * (1 + 1e-12)


def test_lambda_from_ratio_sets_assumption_two_constant() -> None:
    kern = Kernel(lengthscale=1.5, radius=3)
    gram = kern.gram(grid_coordinates(10, 10))
    norm = dense_spectral_norm(gram)
    lam = lambda_from_ratio(norm, 0.9, curvature=0.25)
    assert dense_spectral_norm(gram / lam) * 0.25 == pytest.approx(0.9)
    with pytest.raises(ValueError):
        lambda_from_ratio(norm, 0.0)
