"""The transforms and the linear solves against independent computations."""

import math

import pytest
import torch

from kdeq import Kernel, SolverConfig
from kdeq.maths.conv import ScaledConv, conv
from kdeq.maths.deq import KGLMDEQ
from kdeq.maths.families import Gaussian
from kdeq.maths.linear import Negated, solve_affine
from kdeq.maths.priors import GaussianPrior
from kdeq.maths.solvers import linear_cg
from kdeq.maths.transforms import dct2, dct_symbol, dft_symbol, idct2

F64 = torch.float64


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix from its definition ``c_k cos(πk(2j+1)/2N)``."""
    k = torch.arange(n, dtype=F64)[:, None]
    j = torch.arange(n, dtype=F64)[None, :]
    m = torch.cos(math.pi * k * (2 * j + 1) / (2 * n)) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


def operator_matrix(apply, shape: tuple[int, int]) -> torch.Tensor:
    """The dense matrix of a linear map on ``(1, 1, H, W)`` images, column by column."""
    n = shape[0] * shape[1]
    basis = torch.eye(n, dtype=F64).reshape(n, 1, *shape)
    return torch.cat([apply(basis[i : i + 1]).reshape(-1, 1) for i in range(n)], dim=1)


@pytest.mark.parametrize("shape", [(5, 7), (8, 6), (1, 3), (16, 9)])
def test_dct2_is_the_orthonormal_dct_ii_and_idct2_inverts_it(shape: tuple[int, int]) -> None:
    x = torch.randn(2, 3, *shape, dtype=F64)
    expected = dct_matrix(shape[0]) @ x @ dct_matrix(shape[1]).T
    torch.testing.assert_close(dct2(x), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(idct2(dct2(x)), x, rtol=0, atol=1e-12)


def test_symmetric_border_convolution_is_diagonalised_by_the_dct() -> None:
    taps = Kernel(profile="matern52", lengthscale=1.5, radius=3).filter(F64)
    shape = (9, 7)
    conv_matrix = operator_matrix(lambda x: conv(x, taps[None, None], "symmetric"), shape)
    basis = torch.kron(dct_matrix(shape[0]), dct_matrix(shape[1]))
    diagonal = basis @ conv_matrix @ basis.T
    torch.testing.assert_close(diagonal, torch.diag(dct_symbol(taps, shape).reshape(-1)), rtol=0, atol=1e-12)
    torch.testing.assert_close(conv_matrix, conv_matrix.T, rtol=0, atol=1e-12)


def test_circular_convolution_symbol_is_its_spectrum() -> None:
    taps = Kernel(lengthscale=1.2, radius=2).filter(F64)
    shape = (8, 6)
    conv_matrix = operator_matrix(lambda x: conv(x, taps[None, None], "circular"), shape)
    spectrum = torch.linalg.eigvalsh(conv_matrix).sort().values
    symbol = dft_symbol(taps, shape)
    full = torch.cat([symbol, symbol[:, 1 : (shape[1] + 1) // 2].flip(-1)], dim=-1)
    torch.testing.assert_close(spectrum, full.reshape(-1).sort().values, rtol=0, atol=1e-12)


def gaussian_layer(taps: torch.Tensor, lam: torch.Tensor, padding: str, tied: bool = False) -> KGLMDEQ:
    """``tied``: ``W2 = −W1`` as ``Negated(W1)`` (first residual in one application) and the
    readout's ``V1``, ``V2`` are the modules ``W1``, ``W2`` (read out as ``f(z)``)."""
    bank = taps[None, None]
    inv = 1.0 / lam
    w1 = ScaledConv(bank, -inv, padding)
    if tied:
        w2 = Negated(w1)
        return KGLMDEQ(Gaussian(), GaussianPrior(), w1, w2, None, w1, w2)
    w2 = ScaledConv(bank, inv, padding)
    v1, v2 = ScaledConv(bank, -inv, padding), ScaledConv(bank, inv, padding)
    return KGLMDEQ(Gaussian(), GaussianPrior(), w1, w2, None, v1, v2)


def test_views_of_one_mean_are_read_out_as_the_map_like_the_tensor_itself(monkeypatch) -> None:
    """``f(z)`` is the output when ``mean_out`` is ``mean``'s values in the same memory (two slices of
    one tensor: the colour denoiser's luminance), at no more ``W1`` applications than with one tensor
    and two fewer than with a copy (which is read out as ``V1 z + V2 t + m̃``); all three agree."""
    gen = torch.Generator().manual_seed(4)
    taps = Kernel(profile="se", lengthscale=1.5, radius=3).filter(F64)
    layer = gaussian_layer(taps, torch.tensor([0.5], dtype=F64), "zeros", tied=True)
    y = torch.rand(1, 1, 12, 10, dtype=F64, generator=gen)
    both = torch.rand(1, 3, 12, 10, dtype=F64, generator=gen)
    calls = []
    forward = type(layer.w1).forward
    monkeypatch.setattr(type(layer.w1), "forward", lambda self, x: calls.append(1) or forward(self, x))
    cfg = SolverConfig(method="cg", tol=1e-10, max_iter=200)
    counts, outputs = [], []
    with torch.inference_mode():
        for mean, mean_out in (
            (both[:, :1], both[:, :1]),
            (both[:, :1],) * 2,
            (both[:, :1], both[:, :1].clone()),
        ):
            calls.clear()
            outputs.append(layer(y, mean=mean, mean_out=mean_out, solver=cfg).eta)
            counts.append(len(calls))
    assert counts[0] == counts[1] == counts[2] - 2
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=0, atol=1e-9)


@pytest.mark.parametrize("tied", [False, True], ids=["readout", "readout-is-map"])
@pytest.mark.parametrize("padding", ["symmetric", "circular", "zeros", "reflect"])
@pytest.mark.parametrize("mean", ["global", "varying"])
def test_linear_solve_equals_the_dense_solve_and_the_anderson_deq(
    padding: str, mean: str, tied: bool
) -> None:
    """The fast path (transform or PCG) meets ``(I − W1) z = W2 t + m`` solved densely, and the
    generic DEQ path with Anderson on the same layer; with tied maps its readout is the ``f(z)`` the
    solve computed, which must equal ``V1 z + V2 t + m`` read out after Anderson."""
    gen = torch.Generator().manual_seed(3)
    taps = Kernel(profile="se", lengthscale=1.5, radius=3).filter(F64)
    y = torch.rand(2, 3, 12, 10, dtype=F64, generator=gen)
    m = (
        y.mean(dim=(2, 3), keepdim=True).expand_as(y)
        if mean == "global"
        else torch.rand(y.shape, generator=gen, dtype=F64)
    )
    lam = torch.tensor([0.5, 2.0], dtype=F64)
    layer = gaussian_layer(taps, lam, padding, tied)
    assert layer.readout_is_map == tied
    with torch.inference_mode():
        fast = layer(y, mean=m, solver=SolverConfig(method="cg", tol=1e-12, max_iter=500))
        deq = layer(y, mean=m, solver=SolverConfig(method="anderson", tol=1e-12, max_iter=500))
    conv_matrix = operator_matrix(lambda x: conv(x, taps[None, None], padding), (12, 10))
    for b in range(2):
        a = torch.eye(120, dtype=F64) + conv_matrix / lam[b]
        rhs = (conv_matrix / lam[b]) @ y[b].reshape(3, -1).T + m[b].reshape(3, -1).T
        z = torch.linalg.solve(a, rhs).T.reshape(3, 12, 10)
        torch.testing.assert_close(fast.z[b], z, rtol=0, atol=1e-9)
        torch.testing.assert_close(deq.z[b], z, rtol=0, atol=1e-9)
    assert bool(fast.stats.converged.all())
    torch.testing.assert_close(fast.eta, deq.eta, rtol=0, atol=1e-9)


def test_transform_solve_takes_no_iterations_and_pcg_few() -> None:
    taps = Kernel(profile="se", lengthscale=2.0, radius=5).filter(torch.float32)
    y = torch.rand(1, 1, 64, 64, generator=torch.Generator().manual_seed(0))
    lam = torch.tensor([0.2])
    cfg = SolverConfig(method="cg", tol=1e-4)
    zeros = gaussian_layer(taps, lam, "zeros")
    with torch.inference_mode():
        direct = gaussian_layer(taps, lam, "symmetric")(y, solver=cfg)
        pcg = zeros(y, solver=cfg)
        plain = zeros(y, solver=cfg.model_copy(update={"method": "anderson"}))
        # the same system by CG without the preconditioner, from the same start (the observations)
        _, unpreconditioned, _ = linear_cg(lambda z: z - zeros.w1(z), zeros.w2(y) - y + zeros.w1(y), y, cfg)
    assert direct.stats.iterations.item() == 0 and bool(direct.stats.converged.all())
    # "few" against the unpreconditioned count measured beside it, not a fixed count (8 here, 39
    # without): a count moves by a step or two under another CPU's rounding, a factor 3 does not
    assert bool(pcg.stats.converged.all()) and bool(unpreconditioned.converged.all())
    assert pcg.stats.iterations.item() * 3 <= unpreconditioned.iterations.item(), unpreconditioned
    assert pcg.stats.iterations.item() * 3 <= plain.stats.iterations.item(), (pcg.stats, plain.stats)


@pytest.mark.parametrize(
    ("padding", "shape", "radius", "lam"),
    [("reflect", (64, 48), 5, 0.01), ("circular", (5, 6), 3, 0.05)],
    ids=["reflect-small-lambda", "circular-filter-wider-than-image"],
)
def test_linear_path_falls_back_to_plain_cg_where_no_transform_or_preconditioner_fits(
    padding: str, shape: tuple[int, int], radius: int, lam: float
) -> None:
    """A reflect border makes ``A`` asymmetric at the border, where the symmetric-border
    preconditioner stalled CG (residual 6e-7 after 2000 steps here), and a filter wider than the
    image has no symbol: both must solve, and agree with CG on the fixed-point map."""
    gen = torch.Generator().manual_seed(9)
    taps = Kernel(profile="se", lengthscale=2.0, radius=radius).filter(F64)
    y = torch.rand(1, 1, *shape, dtype=F64, generator=gen)
    layer = gaussian_layer(taps, torch.tensor([lam], dtype=F64), padding)
    cfg = SolverConfig(method="cg", tol=1e-8, max_iter=2000)
    with torch.inference_mode():
        fast = layer(y, solver=cfg)
    generic = layer(y, solver=cfg)  # autograd on: the generic CG on the fixed-point map
    assert bool(fast.stats.converged.all()), fast.stats
    torch.testing.assert_close(fast.z, generic.z.detach(), rtol=0, atol=1e-6)


def test_dct2_serves_autograd_after_an_inference_mode_call() -> None:
    """The transform's cached twiddles are made outside inference mode."""
    with torch.inference_mode():
        dct2(torch.rand(1, 1, 11, 13))
    x = torch.rand(1, 1, 11, 13, dtype=torch.float32, requires_grad=True)
    (grad,) = torch.autograd.grad(dct2(x).square().sum(), x)
    torch.testing.assert_close(grad, 2 * x.detach(), rtol=1e-5, atol=1e-5)  # orthonormal: ∇‖Dx‖² = 2x


@pytest.mark.parametrize("tied", [False, True], ids=["w2", "w2-is-minus-w1"])
def test_linear_solve_with_a_mask_matches_the_dense_restricted_solve(tied: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    taps = Kernel(profile="matern52", lengthscale=1.5, radius=2).filter(F64)
    y = torch.rand(1, 1, 9, 8, dtype=F64, generator=gen)
    mask = (torch.rand(1, 1, 9, 8, generator=gen) < 0.5).to(F64)
    start = torch.rand(1, 1, 9, 8, dtype=F64, generator=gen)
    lam = torch.tensor([0.1], dtype=F64)
    layer = gaussian_layer(taps, lam, "zeros", tied)
    with torch.inference_mode():
        z, stats, fz = solve_affine(
            layer.w1, layer.w2, y, None, mask, start, SolverConfig(method="cg", tol=1e-12)
        )
    assert fz is None
    conv_matrix = operator_matrix(lambda x: conv(x, taps[None, None], "zeros"), (9, 8))
    d = torch.diag(mask.reshape(-1))
    a = torch.eye(72, dtype=F64) + d @ conv_matrix @ d / lam
    expected = torch.linalg.solve(a, d @ conv_matrix @ d @ y.reshape(-1) / lam)
    torch.testing.assert_close(z.reshape(-1), expected, rtol=0, atol=1e-10)
    assert bool(stats.converged.all())
