"""The task models against independent closed-form solvers, and the predictor interface."""

import math
from pathlib import Path

import pytest
import torch

from kdeq import Bernoulli, GaussianPrior, grid_coordinates, newton_kglm
from kdeq.cli import psnr
from kdeq.cli import test_image as piecewise_image
from kdeq.maths.adaptive import guided_gram
from kdeq.maths.filters import gaussian_taps, normalized_convolution, separable_blur
from kdeq.models.checkpoint import FixedLambda
from kdeq.models.initialize import DEFAULT_SPECS, init_checkpoint
from kdeq.models.repository import load_predictor
from kdeq.predictors.base import SolverOverride, resolve_device
from kdeq.predictors.segment import otsu_threshold
from tests.tolerances import gamma

F64 = torch.float64
EXACT = SolverOverride(tol=1e-6, max_iter=3000)
SPECS = {s.name: s for s in DEFAULT_SPECS}


def predictor(tmp_path: Path, name: str, **changes):
    spec = SPECS[name].model_copy(update=changes)
    return load_predictor(init_checkpoint(spec, tmp_path)[0])


def krr(gram: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, lam: float) -> torch.Tensor:
    """``m + K(K + λI)⁻¹(y − m)`` by a dense solve (vectors ``(n,)``)."""
    eye = torch.eye(gram.shape[0], dtype=F64)
    return mean + gram @ torch.linalg.solve(gram + lam * eye, y - mean)


def test_stationary_denoiser_equals_dense_kernel_ridge(tmp_path: Path) -> None:
    model = predictor(tmp_path, "denoise-stationary-kglm")
    y = torch.rand(1, 1, 13, 17)
    out = model.predict(y, sigma=30.0, solver=EXACT).output
    kern = SPECS["denoise-stationary-kglm"].architecture.kernel.kernels[0]
    gram = kern.gram(grid_coordinates(13, 17))
    lam = (30 / 255) ** 2 / 0.005
    yv = y.reshape(-1).to(F64)
    expected = krr(gram, yv, yv.mean().expand_as(yv), lam)
    torch.testing.assert_close(out.reshape(-1).to(F64), expected, rtol=0, atol=2e-5)


def test_adaptive_denoiser_equals_dense_kernel_ridge_with_its_local_mean(tmp_path: Path) -> None:
    spec = SPECS["denoise-kglm"]
    model = predictor(tmp_path, "denoise-kglm")
    y = piecewise_image(16)[..., :12, :] + 0.05 * torch.randn(1, 1, 12, 16)
    pred = model.predict(y, sigma=20.0, solver=EXACT)
    arch = spec.architecture
    taps = gaussian_taps(arch.smoothing, F64)
    guide = separable_blur(y.to(F64), taps)[0]
    s = 20 / 255
    h2 = arch.kernel.h2(1, torch.tensor(s * taps.square().sum().item(), dtype=F64)).item()
    k0 = guided_gram(guide, arch.kernel.spatial.filter(F64), arch.kernel.patch_radius, h2, normalize=False)
    d = k0.sum(dim=1)
    gram = k0 / torch.sqrt(d[:, None] * d[None, :])
    yv = y.reshape(-1).to(F64)
    expected = krr(gram, yv, k0 @ yv / d, s**2 / 0.005)
    torch.testing.assert_close(pred.output.reshape(-1).to(F64), expected, rtol=0, atol=2e-5)
    assert pred.lam.item() == pytest.approx(s**2 / 0.005, rel=1e-5)


def test_inpainter_equals_kernel_ridge_on_the_observed_pixels(tmp_path: Path) -> None:
    model = predictor(tmp_path, "inpaint-kglm", lam=FixedLambda(value=0.2))
    h, w = 11, 14
    y = torch.rand(1, 1, h, w)
    missing = torch.rand(1, 1, h, w) < 0.4
    pred = model.predict(y, missing, solver=EXACT)
    obs = (~missing).reshape(-1)
    kern = SPECS["inpaint-kglm"].architecture.kernel.kernels[0]
    gram = kern.gram(grid_coordinates(h, w))
    mean = normalized_convolution(y.to(F64), (~missing).to(F64), gaussian_taps(2.0, F64)).reshape(-1)
    yv = y.reshape(-1).to(F64)
    alpha = torch.linalg.solve(
        gram[obs][:, obs] + 0.2 * torch.eye(int(obs.sum()), dtype=F64), (yv - mean)[obs]
    )
    expected = torch.where(obs, yv, mean + gram[:, obs] @ alpha)
    assert pred.stats.converged.all()
    torch.testing.assert_close(pred.output.reshape(-1).to(F64), expected, rtol=0, atol=5e-5)


def test_inpainter_ignores_the_values_at_missing_pixels(tmp_path: Path) -> None:
    model = predictor(tmp_path, "inpaint-kglm")
    y = torch.rand(2, 3, 10, 12)
    missing = torch.rand(2, 1, 10, 12) < 0.5
    garbage = torch.where(missing, torch.rand(2, 3, 10, 12) * 9, y)
    torch.testing.assert_close(model.predict(y, missing).output, model.predict(garbage, missing).output)


@pytest.mark.parametrize("warm", [True, False], ids=["linearised-start", "cold-start"])
def test_segmenter_equals_newton_kernel_logistic_regression(tmp_path: Path, warm: bool) -> None:
    model = predictor(tmp_path, "segment-kglm", presmooth=0.0)
    model.warm_start = warm
    y = torch.rand(1, 1, 12, 13)
    pred = model.predict(y, threshold=0.5, solver=SolverOverride(tol=1e-6, max_iter=500))
    t = (y > 0.5).reshape(1, -1).to(F64)
    kern = SPECS["segment-kglm"].architecture.kernel.kernels[0]
    gram = kern.gram(grid_coordinates(12, 13))
    alpha = newton_kglm(Bernoulli(), GaussianPrior(), gram, t, 15.0)
    torch.testing.assert_close(
        pred.output.reshape(-1).to(F64), torch.sigmoid(alpha @ gram)[0], rtol=0, atol=1e-5
    )
    assert torch.equal(pred.mask, pred.output > 0.5)


def test_segmenter_linearised_start_saves_iterations_and_keeps_the_fixed_point(tmp_path: Path) -> None:
    """The start is ``σ(0) + u`` with ``u`` the equilibrium linearised about ``η = 0``; it must lower the
    Anderson iterations on noisy shapes and leave the probability where the cold start puts it."""
    model = predictor(tmp_path, "segment-kglm")
    gen = torch.Generator().manual_seed(4)
    clean = (piecewise_image(96) > 0.5).float()
    x = clean + torch.randn(clean.shape, generator=gen)
    warm = model.predict(x)
    model.warm_start = False
    cold = model.predict(x)
    assert bool(warm.stats.converged.all()) and bool(cold.stats.converged.all())
    assert warm.stats.iterations.item() < cold.stats.iterations.item(), (warm.stats, cold.stats)
    torch.testing.assert_close(warm.output, cold.output, rtol=0, atol=5e-4)


def test_otsu_threshold_matches_brute_force_between_class_variance() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.cat(
        [0.25 + 0.08 * torch.randn(700, generator=gen), 0.7 + 0.05 * torch.randn(300, generator=gen)]
    )
    x = x.to(F64)
    tau = otsu_threshold(x.reshape(1, 1, 20, 50)).item()

    def between(cut: float) -> float:
        lo, hi = x[x <= cut], x[x > cut]
        return len(lo) * len(hi) * (lo.mean() - hi.mean()).item() ** 2

    best = max(between(c) for c in torch.linspace(x.min().item(), x.max().item(), 4001)[1:-1].tolist())
    assert between(tau) >= 0.999 * best
    assert 0.35 < tau < 0.6


def test_otsu_thresholds_counted_in_chunks_are_the_whole_histogram_s(monkeypatch) -> None:
    """The histogram counted a few pixels at a time (chunks that split images and rows) gives each
    image's threshold bit for bit."""
    import kdeq.predictors.segment

    x = torch.rand(3, 1, 37, 53, generator=torch.Generator().manual_seed(4)) ** 3
    whole = otsu_threshold(x)
    monkeypatch.setattr(kdeq.predictors.segment, "OTSU_CHUNK", 7)
    assert torch.equal(otsu_threshold(x), whole)
    assert torch.equal(otsu_threshold(x[1:2]), whole[1:2])


@pytest.mark.parametrize("shape", [(1, 1, 61, 47), (2, 3, 40, 33), (1, 1, 5, 9)])
def test_the_blur_is_a_dense_sum_of_mirrored_neighbours_either_way(shape) -> None:
    """``separable_blur`` (the CPU's shifted sums) and the GPU's grouped convolutions, both against
    ``Σ g[i]g[j] x(mirrored)`` summed directly in float64; gradients reach the image and the taps."""
    import kdeq.maths.filters

    x = torch.rand(*shape, generator=torch.Generator().manual_seed(5))
    taps = gaussian_taps(1.5)
    r = taps.shape[0] // 2
    padded = kdeq.maths.filters.mirror_pad(x.double(), r)
    g = taps.double()
    dense = sum(
        g[i] * g[j] * padded[..., i : i + shape[-2], j : j + shape[-1]]
        for i in range(2 * r + 1)
        for j in range(2 * r + 1)
    )
    # entrywise, two float32 passes of 2r + 1 terms each (x and the taps are float32 values, exact in
    # float64) within γ_{4r+3} of Σ|g_i g_j||x|, not a fixed 1e-6: the taps and x are ≥ 0, so that is dense
    assert bool((g >= 0).all()) and bool((x >= 0).all())
    bound = gamma(2 * (2 * r + 1) + 1, torch.float32) * dense
    grouped = kdeq.maths.filters._blur_grouped(kdeq.maths.filters.mirror_pad(x, r), taps)
    for blurred in (separable_blur(x, taps), grouped):
        error = (blurred.double() - dense).abs()
        assert bool((error <= bound).all()), float((error / bound).max())
    small = (x[..., :6, :7].double().requires_grad_(), g[1:-1].clone().requires_grad_())
    assert torch.autograd.gradcheck(separable_blur, small)


def test_defaults_restore_images(tmp_path: Path) -> None:
    clean = piecewise_image(128)
    noisy = clean + 25 / 255 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))
    adaptive = predictor(tmp_path, "denoise-kglm")
    stationary = predictor(tmp_path, "denoise-stationary-kglm")
    known = psnr(adaptive.predict(noisy, sigma=25).output, clean)
    estimated = adaptive.predict(noisy)
    assert known > psnr(noisy, clean) + 8
    assert psnr(estimated.output, clean) > known - 0.3
    assert estimated.sigma.item() == pytest.approx(25, rel=0.1)
    assert known > psnr(stationary.predict(noisy, sigma=25).output, clean) + 1
    missing = torch.rand(clean.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    filled = predictor(tmp_path, "inpaint-kglm").predict(clean, missing).output
    assert psnr(filled, clean) > 30
    shape = (clean > 0.5).float()
    seg = predictor(tmp_path, "segment-kglm").predict(shape + 0.5 * torch.randn(shape.shape))
    inter = (seg.mask & (shape > 0)).sum().item()
    assert inter / (seg.mask | (shape > 0)).sum().item() > 0.95


def test_batch_results_equal_single_results_with_per_sample_stats(tmp_path: Path) -> None:
    model = predictor(tmp_path, "denoise-kglm")
    x = torch.rand(3, 3, 19, 23)
    batch = model.predict(x, sigma=[10.0, 25.0, 40.0])
    for field in ("iterations", "residual", "converged"):
        assert getattr(batch.stats, field).shape == (3,)
    for b, s in enumerate((10.0, 25.0, 40.0)):
        single = model.predict(x[b : b + 1], sigma=s)
        torch.testing.assert_close(batch.output[b : b + 1], single.output, rtol=0, atol=1e-5)
    assert batch.output.shape == x.shape and torch.is_inference(batch.output)


def test_a_channels_last_batch_is_made_contiguous_and_gives_the_same_result(tmp_path: Path) -> None:
    """An (H, W, c) array permuted to (c, H, W) is channels-last; the kernels must not run on it strided."""
    model = predictor(tmp_path, "denoise-kglm")
    hwc = torch.rand(1, 20, 24, 3)
    strided = hwc.permute(0, 3, 1, 2)
    assert not strided.is_contiguous() and model.images(strided).is_contiguous()
    torch.testing.assert_close(
        model.predict(strided, sigma=20.0).output, model.predict(strided.contiguous(), sigma=20.0).output
    )


def test_solver_override_caps_iterations_and_reports_non_convergence(tmp_path: Path) -> None:
    model = predictor(tmp_path, "inpaint-kglm")
    x = torch.rand(2, 1, 20, 20)
    missing = torch.rand(2, 1, 20, 20) < 0.6
    capped = model.predict(x, missing, solver=SolverOverride(max_iter=2))
    assert capped.stats.iterations.tolist() == [2, 2] and not capped.stats.converged.any()
    assert model.predict(x, missing).stats.converged.all()
    with pytest.raises(ValueError, match="Extra inputs"):
        SolverOverride(method="cg")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.predict(torch.rand(1, 1, 8, 8), sigma=float("nan")), "sigma"),
        (lambda m: m.predict(torch.rand(1, 1, 8, 8), sigma=-1.0), "sigma"),
        (lambda m: m.predict(torch.rand(2, 1, 8, 8), sigma=[1.0, 2.0, 3.0]), "noise levels"),
        (lambda m: m.predict(torch.rand(8, 8)), "B, c, H, W"),
        (lambda m: m.predict(torch.full((1, 1, 8, 8), math.inf)), "non-finite"),
        (lambda m: m.predict(torch.rand(1, 1, 1, 8)), "2×2"),
    ],
)
def test_denoiser_rejects_bad_input(tmp_path: Path, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(predictor(tmp_path, "denoise-kglm"))


def test_inpainter_and_segmenter_reject_bad_input(tmp_path: Path) -> None:
    inpaint = predictor(tmp_path, "inpaint-kglm")
    with pytest.raises(ValueError, match="no observed pixels"):
        inpaint.predict(torch.rand(2, 1, 8, 8), torch.stack([torch.zeros(1, 8, 8), torch.ones(1, 8, 8)]))
    with pytest.raises(ValueError, match="does not match"):
        inpaint.predict(torch.rand(1, 1, 8, 8), torch.zeros(1, 1, 8, 9))
    segment = predictor(tmp_path, "segment-kglm")
    with pytest.raises(ValueError, match="threshold"):
        segment.predict(torch.rand(1, 1, 8, 8), threshold=1.5)


def test_devices() -> None:
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"unknown device|unsupported device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            resolve_device("cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prediction_matches_cpu(tmp_path: Path) -> None:
    x = torch.rand(2, 1, 32, 32)
    path = init_checkpoint(SPECS["denoise-kglm"], tmp_path)[0]
    cpu = load_predictor(path, "cpu").predict(x, sigma=20)
    gpu = load_predictor(path, "cuda").predict(x, sigma=20)
    torch.testing.assert_close(gpu.output.cpu(), cpu.output, rtol=0, atol=1e-4)


def test_fixed_lambda_is_constant() -> None:
    assert FixedLambda(value=0.3)(torch.tensor([0.0, 0.5])).tolist() == pytest.approx([0.3, 0.3])
