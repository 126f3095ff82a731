"""Kernels really are PSD (DESIGN §2.2), and filter banks are their Gram matrices on the grid."""

import math

import pytest
import torch
from pydantic import ValidationError

from kdeq import (
    Coregional,
    Kernel,
    NotPSDError,
    conv,
    filter_symbol,
    gram_min_eigenvalue,
    grid_coordinates,
    require_psd,
    symbol_min_eigenvalue,
)
from tests.helpers import dense_operator

F64 = torch.float64


def _bank(kernel: Kernel) -> torch.Tensor:
    return kernel.filter(F64)[None, None]


def test_box_truncated_squared_exponential_is_not_psd() -> None:
    box = Kernel(profile="se", lengthscale=math.sqrt(10.0), radius=5, taper="box")
    assert symbol_min_eigenvalue(_bank(box)) < -1e-3
    assert gram_min_eigenvalue(box.gram(grid_coordinates(24, 24))) < -1e-3
    with pytest.raises(NotPSDError):
        require_psd(symbol_min_eigenvalue(_bank(box)), 1.0, "box-truncated SE filter")


def test_box_truncation_breaks_psd_past_about_one_pixel_lengthscale() -> None:
    small = Kernel(profile="se", lengthscale=0.8, radius=5, taper="box")
    large = Kernel(profile="se", lengthscale=1.6, radius=5, taper="box")
    assert symbol_min_eigenvalue(_bank(small)) > 0
    assert symbol_min_eigenvalue(_bank(large)) < 0


@pytest.mark.parametrize("profile", ["se", "matern32", "matern52"])
@pytest.mark.parametrize("taper", ["triangular", "wendland"])
@pytest.mark.parametrize("lengthscale", [0.7, 2.0, 5.0])
def test_tapered_kernels_are_psd(profile: str, taper: str, lengthscale: float) -> None:
    kern = Kernel(profile=profile, lengthscale=lengthscale, radius=4, taper=taper)
    scale = kern.filter(F64).sum().item()
    lo = symbol_min_eigenvalue(_bank(kern))
    require_psd(lo, scale, "tapered filter", rtol=1e-12)
    require_psd(gram_min_eigenvalue(kern.gram(grid_coordinates(15, 15))), scale, "tapered Gram", rtol=1e-12)
    scattered = torch.rand(120, 2, dtype=F64) * 8
    require_psd(gram_min_eigenvalue(kern.gram(scattered)), scale, "scattered Gram", rtol=1e-12)


def test_coregional_kernel_is_psd_for_several_channels() -> None:
    k1 = Kernel(profile="se", lengthscale=2.5, radius=5)
    k2 = Kernel(profile="matern32", lengthscale=1.0, radius=3, taper="wendland")
    core = Coregional(
        kernels=(k1, k2),
        mixing=(
            ((1.0, 0.8, 0.5), (0.8, 1.0, 0.6), (0.5, 0.6, 1.0)),
            ((0.3, 0.0, 0.0), (0.0, 0.5, 0.0), (0.0, 0.0, 0.2)),
        ),
    )
    bank = core.filter_bank(F64)
    assert bank.shape == (3, 3, 11, 11)
    assert symbol_min_eigenvalue(bank) > -1e-12
    assert gram_min_eigenvalue(core.gram(grid_coordinates(8, 8))) > -1e-12


def test_coregional_with_box_kernel_fails_and_bad_mixing_is_rejected() -> None:
    box = Kernel(lengthscale=3.0, radius=4, taper="box")
    core = Coregional(kernels=(box,), mixing=(((1.0, 0.5), (0.5, 1.0)),))
    assert symbol_min_eigenvalue(core.filter_bank(F64)) < 0
    with pytest.raises(ValidationError, match="not PSD"):
        Coregional(kernels=(Kernel(),), mixing=(((1.0, 2.0), (2.0, 1.0)),))
    with pytest.raises(ValidationError, match="symmetric"):
        Coregional(kernels=(Kernel(),), mixing=(((1.0, 0.2), (0.1, 1.0)),))


def test_symbol_eigenvalues_are_the_circular_operator_eigenvalues() -> None:
    """Sedghi et al.: the per-frequency matrices carry exactly the circulant operator's spectrum."""
    core = Coregional(
        kernels=(Kernel(lengthscale=1.5, radius=2), Kernel(profile="matern52", radius=1)),
        mixing=(((1.0, 0.4), (0.4, 0.7)), ((0.2, 0.1), (0.1, 0.3))),
    )
    bank = core.filter_bank(F64)
    size = (6, 7)
    dense = dense_operator(lambda x: conv(x, bank, "circular"), (2, *size))
    expected = torch.linalg.eigvalsh(dense).sort().values
    sym = filter_symbol(bank, size)
    got = torch.linalg.eigvalsh(sym).reshape(-1).sort().values
    assert torch.allclose(got, expected, atol=1e-12)


def test_filter_bank_with_zero_padding_is_the_gram_matrix() -> None:
    core = Coregional(kernels=(Kernel(lengthscale=1.7, radius=3),), mixing=(((1.0, 0.3), (0.3, 0.9)),))
    h, w = 7, 9
    dense = dense_operator(lambda x: conv(x, core.filter_bank(F64), "zeros"), (2, h, w))
    assert torch.allclose(dense, core.gram(grid_coordinates(h, w)), atol=1e-14)


def test_kernel_config_is_typed_and_strict() -> None:
    with pytest.raises(ValidationError):
        Kernel(lengthscale=-1.0)
    with pytest.raises(ValidationError):
        Kernel(lenghtscale=2.0)
    with pytest.raises(ValidationError):
        Kernel(profile="rbf")
    kern = Kernel()
    with pytest.raises(ValidationError):
        kern.radius = 3
