"""Forward operators (DESIGN §2 fact 8): PSFs, dense matrices against independent constructions, exact
adjoints, the bicubic degradation against PIL, and the kGLM-DEQ through ``A`` against kernel ridge."""

import math

import numpy as np
import pytest
import scipy.signal
import torch
from PIL import Image
from sklearn.kernel_ridge import KernelRidge
from torch import nn

from kdeq import Gaussian, GaussianPrior, Kernel, SolverConfig, conv_deq, grid_coordinates
from kdeq.maths.conv import Padding, ScaledConv, conv
from kdeq.maths.operators import (
    Blur,
    BlurSubsample,
    Identity,
    Operator,
    Restriction,
    Sandwich,
    solve_observed,
)
from kdeq.maths.psf import (
    MAX_PSF_SIDE,
    SUPERSAMPLE,
    bicubic_taps,
    check_psf,
    disk_psf,
    gaussian_psf,
    motion_psf,
    parse_psf,
)
from tests.tolerances import assert_within, dense_solve_error, norm2, observed_solve_error, sum_gap

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


TIGHT = SolverConfig(method="cg", tol=1e-12, max_iter=3000)

PSFS = {
    "gaussian1.2": lambda: gaussian_psf(1.2),
    "disk2.3": lambda: disk_psf(2.3),
    "motion7@0": lambda: motion_psf(7, 0),
    "motion6.5@30": lambda: motion_psf(6.5, 30),
    "motion9@100": lambda: motion_psf(9, 100),
    "motion5@-45": lambda: motion_psf(5, -45),
}


# ---------------------------------------------------------------------------- PSFs


@pytest.mark.parametrize("name", list(PSFS))
def test_psf_is_odd_square_nonnegative_float32_summing_to_one(name: str) -> None:
    h = PSFS[name]()
    assert h.dtype == torch.float32 and h.dim() == 2
    assert h.shape[0] == h.shape[1] and h.shape[0] % 2 == 1 and h.shape[0] >= 3
    assert (h >= 0).all()
    assert abs(h.double().sum().item() - 1.0) < 1e-6
    # the outermost ring is used: the side is no larger than the shape needs
    assert h[[0, -1], :].sum() + h[:, [0, -1]].sum() > 0
    # every shape here is point-symmetric about the centre
    assert torch.equal(h, h.flip(0, 1))


def test_gaussian_psf_values_and_size() -> None:
    sigma = 1.2
    h = gaussian_psf(sigma, dtype=F64)
    k = 2 * math.ceil(3 * sigma) + 1
    offs = np.arange(k) - k // 2
    g = np.exp(-(offs[:, None] ** 2 + offs[None, :] ** 2) / (2 * sigma**2))
    np.testing.assert_allclose(h.numpy(), g / g.sum(), rtol=1e-13)
    assert gaussian_psf(0.2).shape == (3, 3)
    assert gaussian_psf(10.0).shape == (61, 61)


@pytest.mark.parametrize("radius", [1.5, 2.3, 4.0])
def test_disk_psf_is_even_and_weights_pixels_by_their_share_of_the_disk(radius: float) -> None:
    h = disk_psf(radius, dtype=F64)
    assert torch.equal(h, h.flip(0)) and torch.equal(h, h.flip(1)) and torch.equal(h, h.T)
    k = h.shape[0]
    a = np.abs(np.arange(k) - k // 2)
    near = np.hypot(np.maximum(a[:, None] - 0.5, 0), np.maximum(a[None, :] - 0.5, 0))
    far = np.hypot(a[:, None] + 0.5, a[None, :] + 0.5)
    full = h.max().item()
    # pixels wholly inside the disk get the full weight, pixels wholly outside none, the rest between
    assert np.allclose(h.numpy()[far <= radius], full, rtol=0, atol=1e-15)
    assert (h.numpy()[near >= radius] == 0).all()
    partial = (near < radius) & (far > radius)
    assert ((h.numpy()[partial] > 0) & (h.numpy()[partial] < full)).all()
    # the supersampled area is close to the disk's: full weight × π r² ≈ 1
    assert abs(full * math.pi * radius**2 - 1.0) < 0.2 / SUPERSAMPLE


def test_disk_psf_within_one_pixel_is_the_identity() -> None:
    h = disk_psf(0.5)
    assert h.shape == (3, 3) and h[1, 1] == 1.0 and h.sum() == 1.0


def test_motion_psf_geometry() -> None:
    # horizontal, odd integer length: 1/L on L pixels of the centre row
    h = motion_psf(7, 0)
    expected = torch.zeros(7, 7)
    expected[3] = 1 / 7
    assert torch.allclose(h, expected, atol=1e-7, rtol=0)
    assert torch.equal(h, h.flip(1)) and torch.equal(h, h.flip(0))
    # vertical is its transpose, a half turn changes nothing, −θ mirrors the rows
    assert torch.equal(motion_psf(7, 90), h.T)
    assert torch.equal(motion_psf(6.5, 210), motion_psf(6.5, 30))
    assert torch.equal(motion_psf(6.5, -30), motion_psf(6.5, 30).flip(0))
    # counter-clockwise: at 45° the mass runs from bottom-left to top-right (rows point down)
    d = motion_psf(9, 45)
    k = d.shape[0]
    assert d[0, k - 1] > 0 and d[k - 1, 0] > 0 and d[0, 0] == 0 and d[k - 1, k - 1] == 0
    # mirror-symmetric about its own line, here the anti-diagonal
    assert torch.allclose(d, d.flip(0, 1).T, atol=1e-7, rtol=0)
    # the weight is spread along the segment: its second moment along the direction is L²/12
    rows, cols = torch.meshgrid(*(torch.arange(k, dtype=F64) - k // 2,) * 2, indexing="ij")
    along = (cols - rows) / math.sqrt(2)
    assert abs((d.double() * along**2).sum().item() - 81 / 12) < 0.1


def test_parse_psf_round_trips() -> None:
    assert torch.equal(parse_psf("gaussian:1.5"), gaussian_psf(1.5))
    assert torch.equal(parse_psf(" Disk : 2.5 "), disk_psf(2.5))
    assert torch.equal(parse_psf("motion:9"), motion_psf(9, 0))
    assert torch.equal(parse_psf("motion:9,30"), motion_psf(9, 30))
    assert torch.equal(parse_psf("motion:9, -12.5"), motion_psf(9, -12.5))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("blur:3", "unknown PSF 'blur'"),
        ("gaussian", "no parameters"),
        ("gaussian:", "no parameters"),
        ("gaussian:abc", "gaussian sigma must be a number"),
        ("gaussian:1,2", "wrong number of parameters"),
        ("gaussian:-1", "must be a positive number"),
        ("gaussian:0", "must be a positive number"),
        ("gaussian:nan", "must be finite"),
        ("gaussian:inf", "must be finite"),
        ("gaussian:11", f"largest allowed side is {MAX_PSF_SIDE}"),
        ("disk:40", f"largest allowed side is {MAX_PSF_SIDE}"),
        ("disk:0.01", "below the sampling resolution"),
        ("motion:100,30", f"largest allowed side is {MAX_PSF_SIDE}"),
        ("motion:0.5", "at least 1 pixel"),
        ("motion:5,abc", "motion angle must be a number"),
        ("motion:5,1,2", "wrong number of parameters"),
    ],
)
def test_parse_psf_refusals(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_psf(text)


def test_check_psf_normalises_and_refuses() -> None:
    arr = np.arange(15, dtype=np.float64).reshape(3, 5)
    out = check_psf(arr)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    np.testing.assert_allclose(out.numpy(), arr / arr.sum(), rtol=1e-6)
    assert torch.equal(check_psf([[2.0]]), torch.ones(1, 1))
    bad = [
        (np.ones((3, 4)), "odd"),
        (np.ones((4, 3)), "odd"),
        (-np.eye(3), "negative"),
        (np.zeros((3, 3)), "sums to zero"),
        (np.array([[1.0, np.nan, 1.0]]), "non-finite"),
        (np.array([[1.0, np.inf, 1.0]]), "non-finite"),
        (np.ones((MAX_PSF_SIDE + 2, 3)), "largest allowed side"),
        (np.ones((3, 3, 3)), "must be 2-D"),
        (np.ones(3), "must be 2-D"),
        ([[1, 2], [3]], "2-D array of numbers"),
        ("abc", "2-D array of numbers"),
    ]
    for arr, match in bad:
        with pytest.raises(ValueError, match=match):
            check_psf(arr)


@pytest.mark.parametrize(("scale", "length", "offset"), [(2, 8, -3), (3, 11, -4), (4, 16, -6)])
def test_bicubic_taps_shape(scale: int, length: int, offset: int) -> None:
    w, off = bicubic_taps(scale, dtype=F64)
    assert (w.numel(), off) == (length, offset)
    assert abs(w.sum().item() - 1) < 1e-15
    # symmetric about the LR pixel's centre s·i + (s−1)/2, i.e. about tap (s−1)/2 − offset
    assert torch.allclose(w, w.flip(0), atol=1e-16, rtol=0)
    assert (length - 1) / 2 == (scale - 1) / 2 - offset


def test_bicubic_taps_refuses_other_scales() -> None:
    for s in (1, 5, 2.5):
        with pytest.raises(ValueError, match="scale must be one of"):
            bicubic_taps(s)


# ---------------------------------------------------------------------------- dense matrices


def _basis(h: int, w: int) -> np.ndarray:
    return np.eye(h * w).reshape(h * w, h, w)


def _scipy_blur_matrix(psf: np.ndarray, h: int, w: int, border: str) -> np.ndarray:
    """Columns: ``scipy.signal.convolve2d`` (true convolution) of each basis image, zero ``same`` mode
    or on the ``numpy.pad(mode='symmetric')`` extension in ``valid`` mode."""
    r = psf.shape[0] // 2
    cols = []
    for e in _basis(h, w):
        if border == "zeros":
            cols.append(scipy.signal.convolve2d(e, psf, mode="same").ravel())
        else:
            cols.append(scipy.signal.convolve2d(np.pad(e, r, mode="symmetric"), psf, mode="valid").ravel())
    return np.array(cols).T


@pytest.mark.parametrize("border", ["zeros", "symmetric"])
@pytest.mark.parametrize("name", list(PSFS))
@pytest.mark.parametrize("size", [(8, 9), (5, 4)])
def test_blur_dense_matches_scipy_convolution(name: str, border: str, size: tuple[int, int]) -> None:
    """(5, 4): PSFs wider than the image, the symmetric extension continued periodically."""
    psf = PSFS[name]().double()
    op = Blur(psf, border)
    dense = op.dense(*size)
    assert dense.shape == (size[0] * size[1],) * 2
    ref = _scipy_blur_matrix(psf.numpy(), *size, border)
    # an entry sums the taps that the border folds onto one pixel: at most all of them
    atol = sum_gap(psf.numel(), psf.abs().sum().item())
    np.testing.assert_allclose(dense.numpy(), ref, rtol=0, atol=atol)
    np.testing.assert_allclose(op.dense(*size, adjoint=True).numpy(), ref.T, rtol=0, atol=atol)


def test_symmetric_blur_is_kdeq_conv_with_the_flipped_psf() -> None:
    """The border rule of ``kdeq.maths.conv`` that the transform path's symbols describe."""
    psf = motion_psf(6.5, 30).double()
    x = torch.randn(2, 3, 10, 11, dtype=F64)
    ref = conv(x.reshape(6, 1, 10, 11), psf.flip(0, 1)[None, None], "symmetric").reshape(2, 3, 10, 11)
    assert torch.allclose(Blur(psf, "symmetric").forward(x), ref, atol=1e-15, rtol=0)


def _keys(x: np.ndarray) -> np.ndarray:
    """MATLAB imresize's ``cubic``."""
    t = np.abs(x)
    return (1.5 * t**3 - 2.5 * t**2 + 1) * (t <= 1) + (-0.5 * t**3 + 2.5 * t**2 - 4 * t + 2) * (
        (t > 1) & (t <= 2)
    )


def _matlab_contributions(n: int, s: int, border: str) -> np.ndarray:
    """The ``(n/s, n)`` matrix of MATLAB's ``imresize`` along one axis (scale ``1/s``, antialiasing),
    following ``imresize.m``'s ``contributions`` with its 1-based indices: ``symmetric`` mirrors the
    indices as MATLAB does; ``zeros`` drops out-of-range taps without renormalising."""
    scale = 1 / s
    width = 4 / scale
    x = np.arange(1, n // s + 1)
    u = x / scale + 0.5 * (1 - 1 / scale)
    left = np.floor(u - width / 2)
    ind = left[:, None] + np.arange(math.ceil(width) + 2)[None, :]
    wts = scale * _keys(scale * (u[:, None] - ind))
    wts = wts / wts.sum(axis=1, keepdims=True)
    out = np.zeros((n // s, n))
    rows = np.repeat(np.arange(n // s)[:, None], ind.shape[1], axis=1)
    if border == "symmetric":
        aux = np.concatenate([np.arange(1, n + 1), np.arange(n, 0, -1)])
        idx = aux[np.mod(ind - 1, 2 * n).astype(int)] - 1
        np.add.at(out, (rows, idx), wts)
    else:
        keep = (ind >= 1) & (ind <= n)
        np.add.at(out, (rows[keep], ind[keep].astype(int) - 1), wts[keep])
    return out


@pytest.mark.parametrize("border", ["symmetric", "zeros"])
@pytest.mark.parametrize(("scale", "size"), [(2, (12, 8)), (3, (12, 9)), (4, (12, 8)), (4, (4, 8))])
def test_blur_subsample_dense_matches_matlab_imresize(scale: int, size: tuple[int, int], border: str) -> None:
    w, off = bicubic_taps(scale, dtype=F64)
    op = BlurSubsample(w, off, scale, border)
    h, wd = size
    dense = op.dense(h, wd)
    ref = np.kron(_matlab_contributions(h, scale, border), _matlab_contributions(wd, scale, border))
    # an entry is a product of two per-axis sums of the taps the border folds together, each
    # within γ_k·Σ|w| of exact (MATLAB's weights are normalised after their sum: one more rounding)
    atol = 2 * sum_gap(w.numel() + 2, w.abs().sum().item()) * w.abs().sum().item()
    np.testing.assert_allclose(dense.numpy(), ref, rtol=0, atol=atol)
    np.testing.assert_allclose(op.dense(h, wd, adjoint=True).numpy(), ref.T, rtol=0, atol=atol)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_blur_subsample_equals_pil_bicubic_in_the_interior(scale: int) -> None:
    """PIL's BICUBIC reduction uses the same a = −0.5 cubic stretched by ``s``, but at the border it
    drops the taps outside the image and renormalises instead of mirroring the image, so only the
    LR pixels whose taps all fall inside the image (about 2s HR pixels from each edge) compare."""
    h, w = 48, 60
    x = np.random.default_rng(scale).random((h, w), dtype=np.float32)
    pil = np.asarray(Image.fromarray(x).resize((w // scale, h // scale), Image.Resampling.BICUBIC))
    taps, off = bicubic_taps(scale, dtype=F64)
    ours = BlurSubsample(taps, off, scale).forward(torch.from_numpy(x).double()[None, None])[0, 0].numpy()
    assert ours.shape == pil.shape
    first = -(off // scale)
    rows = slice(first, (h - off - taps.numel()) // scale + 1)
    cols = slice(first, (w - off - taps.numel()) // scale + 1)
    assert rows.stop - rows.start >= h // scale - 5
    np.testing.assert_allclose(ours[rows, cols], pil[rows, cols], rtol=0, atol=1e-5)
    # and the border does differ, so the interior selection above is not vacuous
    assert np.abs(ours - pil).max() > 1e-3


def test_identity_and_restriction_dense() -> None:
    assert torch.equal(Identity().dense(3, 4), torch.eye(12, dtype=F64))
    observed = (torch.rand(2, 1, 4, 5, generator=torch.Generator().manual_seed(0)) > 0.4).double()
    op = Restriction(observed)
    for b in range(2):
        assert torch.equal(op.dense(4, 5, sample=b), torch.diag(observed[b].flatten()))
        assert torch.equal(op.dense(4, 5, sample=b, adjoint=True), torch.diag(observed[b].flatten()))


def _operators() -> dict[str, Operator]:
    ops: dict[str, Operator] = {"identity": Identity()}
    for name in ("gaussian1.2", "disk2.3", "motion6.5@30", "motion9@100"):
        for border in ("zeros", "symmetric"):
            ops[f"blur-{border}-{name}"] = Blur(PSFS[name]().double(), border)
    for s in (2, 3, 4):
        for border in ("symmetric", "zeros"):
            ops[f"sr{s}-{border}"] = BlurSubsample(*bicubic_taps(s, dtype=F64), s, border)
    return ops


OPERATORS = _operators()


def _dense_entry_gap(op: Operator) -> float:
    """A bound on an entry's difference between ``A``'s and ``Aᵀ``'s dense matrices, each applied to
    unit images: an entry of either is the sum of the taps the border folds onto one pixel, at most
    ``T`` terms (the PSF's, or for a separable filter a product of two sums of ``n`` — within ``γ_{2n+1}``,
    below ``γ_{n²}``) whose magnitudes add to at most the filter's ``ℓ₁`` norm; two computations in
    different orders differ by ``sum_gap``. Identity and restriction entries are exact."""
    if isinstance(op, Blur):
        return sum_gap(op.psf.numel(), float(op.psf.abs().sum()))
    if isinstance(op, BlurSubsample):
        return sum_gap(op.taps.numel() ** 2, float(op.taps.abs().sum()) ** 2)
    return 0.0


@pytest.mark.parametrize("name", [*OPERATORS, "restriction"])
def test_adjoint_inner_products(name: str) -> None:
    """``⟨A x, y⟩ = ⟨x, Aᵀ y⟩`` per sample and channel on random batches, and the dense ``Aᵀ = Aᵀ``."""
    gen = torch.Generator().manual_seed(1)
    h, w = 12, 12
    if name == "restriction":
        op = Restriction((torch.rand(2, 1, h, w, generator=gen) > 0.5).double())
    else:
        op = OPERATORS[name]
    oh, ow = op.out_size(h, w)
    x = torch.randn(2, 3, h, w, generator=gen, dtype=F64)
    y = torch.randn(2, 3, oh, ow, generator=gen, dtype=F64)
    ax, aty = op.forward(x), op.adjoint(y)
    assert ax.shape == y.shape and aty.shape == x.shape
    lhs = (ax * y).sum(dim=(2, 3))
    rhs = (x * aty).sum(dim=(2, 3))
    assert torch.allclose(lhs, rhs, atol=1e-12, rtol=0)
    for b in range(op.batch or 1):
        dense = op.dense(h, w, sample=b)
        # the entries' rounding (_dense_entry_gap, ~1e-14 for the 9×9 PSFs), not a fixed 1e-15 an ulp away
        gap = _dense_entry_gap(op)
        assert torch.allclose(op.dense(h, w, sample=b, adjoint=True), dense.T, atol=gap, rtol=0)


def test_operators_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="odd sides"):
        Blur(torch.ones(4, 3))
    with pytest.raises(ValueError, match="border"):
        Blur(torch.ones(3, 3), "circular")
    op = BlurSubsample(*bicubic_taps(3), 3)
    with pytest.raises(ValueError, match="multiple of the scale 3"):
        op.forward(torch.zeros(1, 1, 12, 10))
    with pytest.raises(ValueError, match="B, 1, H, W"):
        Restriction(torch.ones(1, 3, 4, 4))


# ---------------------------------------------------------------------------- the kGLM-DEQ through A

KERNEL = Kernel(profile="se", lengthscale=1.5, radius=3)
LAM = torch.tensor([0.05, 0.4], dtype=F64)


def _case(h: int, w: int, op: Operator, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Observations ``y = A f + noise`` ``(2, 2, H', W')`` of a random image, and a mean ``(2, 2, h, w)``."""
    gen = torch.Generator().manual_seed(seed)
    f = torch.rand(2, 2, h, w, generator=gen, dtype=F64)
    mean = 0.5 + 0.1 * torch.randn(2, 2, h, w, generator=gen, dtype=F64)
    ax = op.forward(f)
    return ax + 0.05 * torch.randn(ax.shape, generator=gen, dtype=F64), mean


def _kernel_map(padding: Padding = "zeros") -> ScaledConv:
    return ScaledConv(KERNEL.filter(F64)[None, None], torch.ones(1, dtype=F64), padding)


def _channel_bank() -> torch.Tensor:
    """``KERNEL`` on each of 2 independent channels, ``(2, 2, k, k)``, for ``conv_deq``."""
    return KERNEL.filter(F64)[None, None] * torch.eye(2, dtype=F64)[:, :, None, None]


def _krr(ad: torch.Tensor, kd: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, lam: float) -> torch.Tensor:
    """One sample's ``m + (K Aᵀ) α`` ``(c, H, W)`` with ``α`` sklearn's kernel-ridge dual for the Gram
    ``A K Aᵀ`` and targets ``y − A m``, from the dense ``ad`` ``(n', n)``, ``kd`` ``(n, n)``, the
    observations ``y`` ``(c, n')`` and the mean ``(c, H, W)``."""
    c = mean.shape[0]
    target = y.T - ad @ mean.reshape(c, -1).T
    model = KernelRidge(alpha=lam, kernel="precomputed").fit((ad @ kd @ ad.T).numpy(), target.numpy())
    return mean + ((kd @ ad.T) @ torch.from_numpy(model.dual_coef_)).T.reshape(mean.shape)


def _krr_error(ad: torch.Tensor, kd: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, lam: float) -> float:
    """A bound on ``‖f − _krr(…)‖₂`` for one sample's ``solve_observed`` output ``f`` (solved to ``TIGHT``):
    the solve's (``tolerances.observed_solve_error``) plus the reference's, whose dual ``α`` solves
    ``(A K Aᵀ + λI) α = y − A m`` (``tolerances.dense_solve_error``) and is multiplied by ``K Aᵀ``."""
    a, k, m = ad.numpy(), kd.numpy(), mean.reshape(mean.shape[0], -1).numpy()
    gram = a @ k @ a.T + lam * np.eye(a.shape[0])
    alpha = np.linalg.solve(gram, (y.numpy() - m @ a.T).T)
    reference = norm2(k @ a.T) * sum(dense_solve_error(gram, column) for column in alpha.T)
    return observed_solve_error(a, k, y.numpy(), m, lam, TIGHT.tol, TIGHT.atol) + reference


def _blur_cases() -> dict[str, tuple[Operator, tuple[int, int]]]:
    cases: dict[str, tuple[Operator, tuple[int, int]]] = {}
    for border in ("zeros", "symmetric"):
        cases[f"blur-{border}-gaussian"] = (Blur(gaussian_psf(1.0, dtype=F64), border), (8, 9))
        cases[f"blur-{border}-motion"] = (Blur(motion_psf(5, 30, dtype=F64), border), (8, 9))
    for s, size in ((2, (8, 10)), (3, (12, 12)), (4, (12, 12))):
        cases[f"sr{s}"] = (BlurSubsample(*bicubic_taps(s, dtype=F64), s), size)
    return cases


BLUR_CASES = _blur_cases()


@pytest.mark.parametrize("name", list(BLUR_CASES))
def test_deq_through_operator_equals_kernel_ridge(name: str) -> None:
    op, (h, w) = BLUR_CASES[name]
    y, mean = _case(h, w, op)
    f, stats = solve_observed(op, _kernel_map(), y, LAM, mean, TIGHT)
    assert f.shape == mean.shape
    assert stats.converged.all() and (stats.iterations > 0).all()
    ad, kd = op.dense(h, w), KERNEL.gram(grid_coordinates(h, w))
    for b in range(2):
        ref = _krr(ad, kd, y[b].reshape(2, -1), mean[b], LAM[b].item())
        assert_within(f[b], ref, _krr_error(ad, kd, y[b].reshape(2, -1), mean[b], LAM[b].item()))


def test_identity_equals_denoising_kernel_ridge_and_the_denoiser() -> None:
    h, w = 9, 10
    op = Identity()
    y, mean = _case(h, w, op)
    f, stats = solve_observed(op, _kernel_map(), y, LAM, mean, TIGHT)
    assert stats.converged.all()
    kd, eye = KERNEL.gram(grid_coordinates(h, w)), torch.eye(h * w, dtype=F64)
    for b in range(2):
        bound = _krr_error(eye, kd, y[b].reshape(2, -1), mean[b], LAM[b].item())
        assert_within(f[b], _krr(eye, kd, y[b].reshape(2, -1), mean[b], LAM[b].item()), bound)
        layer = conv_deq(Gaussian(), GaussianPrior(), _channel_bank(), LAM[b].item())
        with torch.no_grad():
            out = layer(y[b : b + 1], mean=mean[b : b + 1], solver=TIGHT)
        # the denoiser's equilibrium z = m + K(K + λI)⁻¹(y − m) is both its output and ours: two
        # solves of one system to TIGHT, each within the solve's share of the bound of the exact one
        assert_within(f[b : b + 1], out.z, 2 * bound)


def test_restriction_equals_inpainting_kernel_ridge_and_the_inpainting_layer() -> None:
    h, w = 9, 10
    gen = torch.Generator().manual_seed(5)
    observed = (torch.rand(2, 1, h, w, generator=gen, dtype=F64) > 0.6).to(F64)
    op = Restriction(observed)
    y, mean = _case(h, w, op)
    f, stats = solve_observed(op, _kernel_map(), y, LAM, mean, TIGHT)
    assert stats.converged.all()
    kd = KERNEL.gram(grid_coordinates(h, w))
    for b in range(2):
        # kernel ridge on the observed pixels alone (A = the rows of I they pick), predicted everywhere
        sub = torch.eye(h * w, dtype=F64)[observed[b].flatten() > 0]
        ref = _krr(sub, kd, y[b].reshape(2, -1) @ sub.T, mean[b], LAM[b].item())
        bound = _krr_error(sub, kd, y[b].reshape(2, -1) @ sub.T, mean[b], LAM[b].item())
        assert_within(f[b], ref, bound)
        # fact 4: the masked layer's readout m + K M (y − z)/λ
        layer = conv_deq(Gaussian(), GaussianPrior(), _channel_bank(), LAM[b].item())
        with torch.no_grad():
            out = layer(y[b : b + 1], mean=mean[b : b + 1], mask=observed[b : b + 1], solver=TIGHT)
        assert_within(f[b : b + 1], out.eta, 2 * bound)  # two solves of one system, as above


def test_stats_are_per_sample_and_samples_are_independent() -> None:
    op, (h, w) = BLUR_CASES["sr3"]
    y, mean = _case(h, w, op, seed=3)
    lam = torch.tensor([1e-3, 1.0], dtype=F64)
    config = SolverConfig(method="cg", tol=1e-10, max_iter=500)
    f, stats = solve_observed(op, _kernel_map(), y, lam, mean, config)
    for field in (stats.iterations, stats.residual, stats.converged):
        assert field.shape == (2,)
    assert stats.converged.all() and (stats.residual <= 1e-10).all()
    # the smaller λ is the harder system: it takes more iterations
    assert stats.iterations[0] > stats.iterations[1]
    for b in range(2):
        alone, one = solve_observed(op, _kernel_map(), y[b : b + 1], lam[b : b + 1], mean[b : b + 1], config)
        assert one.iterations.item() == stats.iterations[b].item()
        assert torch.allclose(alone, f[b : b + 1], atol=1e-9, rtol=0)
    # without a mean the prior shrinks towards 0: the same as a zero mean
    f0, _ = solve_observed(op, _kernel_map(), y, lam, None, config)
    fz, _ = solve_observed(op, _kernel_map(), y, lam, torch.zeros_like(mean), config)
    assert torch.allclose(f0, fz, atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="2 values for a batch of 1"):
        solve_observed(op, _kernel_map(), y[:1], lam, None, config)


class _Opaque(nn.Module):
    """A kernel map without ``stationary()``: ``solve_affine`` must take CG."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_even_psf_symmetric_blur_takes_the_exact_transform_path() -> None:
    """``A K Aᵀ`` with a symmetric border, an axis-even PSF and an axis-even symmetric-border ``K`` is
    diagonal in the DCT-II: solved in 0 iterations, equal to CG and to kernel ridge on dense matrices."""
    h, w = 12, 13
    op = Blur(gaussian_psf(1.0, dtype=F64), "symmetric")
    y, mean = _case(h, w, op, seed=4)
    k_map = _kernel_map("symmetric")
    fast, stats = solve_observed(op, k_map, y, LAM, mean, TIGHT)
    assert (stats.iterations == 0).all() and stats.converged.all()
    slow, cg_stats = solve_observed(op, _Opaque(k_map), y, LAM, mean, TIGHT)
    assert (cg_stats.iterations > 0).all() and cg_stats.converged.all()
    # K with the symmetric border as a dense matrix: its columns are the map of the basis images
    basis = torch.eye(h * w, dtype=F64).reshape(1, h * w, h, w)
    kd = k_map(basis)[0].reshape(h * w, -1).T
    ad = op.dense(h, w)
    for b in range(2):
        bound = _krr_error(ad, kd, y[b].reshape(2, -1), mean[b], LAM[b].item())
        assert_within(fast[b], _krr(ad, kd, y[b].reshape(2, -1), mean[b], LAM[b].item()), bound)
        # the transform's solve and CG's, each within the bound of the exact one
        assert_within(fast[b], slow[b], 2 * bound)


def test_sandwich_is_stationary_only_where_the_transform_is_exact() -> None:
    scale = torch.tensor([-2.0, -0.5], dtype=F64)
    even = gaussian_psf(1.0, dtype=F64)
    assert Sandwich(Blur(even, "symmetric"), _kernel_map("symmetric"), scale).stationary() is not None
    assert Sandwich(Identity(), _kernel_map("zeros"), scale).stationary() is not None
    for op, padding in [
        (Blur(motion_psf(5, 30, dtype=F64), "symmetric"), "symmetric"),  # not axis-even
        (Blur(even, "zeros"), "zeros"),  # the zero border is not diagonalised
        (Blur(even, "symmetric"), "zeros"),
        (BlurSubsample(*bicubic_taps(2, dtype=F64), 2), "symmetric"),
    ]:
        assert Sandwich(op, _kernel_map(padding), scale).stationary() is None
    # the composed filter applies the same map as the sandwich itself (non-square PSF included)
    x = torch.randn(2, 3, 14, 15, dtype=F64)
    psf = gaussian_psf(1.0, dtype=F64)[1:-1]
    sandwich = Sandwich(Blur(psf, "symmetric"), _kernel_map("symmetric"), scale)
    st = sandwich.stationary()
    assert st is not None and st.taps.shape[0] == st.taps.shape[1]
    via_filter = st.scale * conv(x.reshape(6, 1, 14, 15), st.taps[None, None], "symmetric").reshape(
        2, 3, 14, 15
    )
    assert torch.allclose(sandwich(x), via_filter, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["blur-symmetric-gaussian", "blur-zeros-motion", "sr2"])
def test_gradients_through_the_solve_equal_the_dense_solve(name: str) -> None:
    """The implicit gradient of ``f = m + K Aᵀ(A K Aᵀ + λI)⁻¹(y − A m)`` in the kernel's taps, ``λ``
    and ``m`` (DCT transform path, CG path, subsampling) equals autograd through the dense solve."""
    op, (h, w) = BLUR_CASES[name]
    padding: Padding = "symmetric" if name == "blur-symmetric-gaussian" else "zeros"
    y, mean0 = _case(h, w, op, seed=5)
    taps0 = KERNEL.filter(F64)[None, None]
    weight = torch.randn(mean0.shape, generator=torch.Generator().manual_seed(6), dtype=F64)

    def loss(f: torch.Tensor) -> torch.Tensor:
        return (weight * f).sum() + f.square().sum()

    def leaves() -> tuple[torch.Tensor, ...]:
        return tuple(t.clone().requires_grad_(True) for t in (taps0, LAM, mean0))

    taps, lam, mean = leaves()
    k_map = ScaledConv(taps, torch.ones(1, dtype=F64), padding)
    f, stats = solve_observed(op, k_map, y, lam, mean, TIGHT)
    assert stats.converged.all()
    got = torch.autograd.grad(loss(f), (taps, lam, mean))

    taps, lam, mean = leaves()
    k_map = ScaledConv(taps, torch.ones(1, dtype=F64), padding)
    basis = torch.eye(h * w, dtype=F64).reshape(h * w, 1, h, w)
    kd = k_map(basis).reshape(h * w, -1).T  # column j: K applied to the j-th basis image
    ad = op.dense(h, w)
    outs = []
    for b in range(2):
        u = y[b].reshape(2, -1).T - ad @ mean[b].reshape(2, -1).T
        alpha = torch.linalg.solve(ad @ kd @ ad.T + lam[b] * torch.eye(ad.shape[0], dtype=F64), u)
        outs.append(mean[b] + (kd @ ad.T @ alpha).T.reshape(2, h, w))
    want = list(torch.autograd.grad(loss(torch.stack(outs)), (taps, lam, mean)))
    if padding == "symmetric":
        # the DCT path reads the taps as axis-even (its condition), so its gradient is the derivative
        # along axis-even changes of them: the dense gradient averaged over the axis flips
        g = want[0]
        want[0] = 0.25 * (g + g.flip(-1) + g.flip(-2) + g.flip(-1, -2))
    for g, r in zip(got, want, strict=True):
        assert torch.allclose(g, r, rtol=1e-7, atol=1e-9), (g - r).abs().max()
