"""Noise estimation and the adaptive kernel against independent computations."""

from collections.abc import Iterator

import pytest
import torch

from kdeq.cli import test_image as piecewise_image
from kdeq.maths import adaptive
from kdeq.maths.adaptive import (
    GuidedKernel,
    GuidedOperator,
    apply_weights,
    guided_gram,
    guided_weights,
    half_offsets,
)
from kdeq.maths.kernels import Kernel
from kdeq.maths.noise import estimate_sigma
from kdeq.runtime import native
from tests.helpers import require_native

F64 = torch.float64


@pytest.fixture(params=["loop", "native", "gathered"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test below on the CPU's paths (an offset at a time in place, by torch's operations or by
    ``kdeq.runtime.native``'s compiled loops) and on the GPU's (groups of offsets by gathers), which the CPU
    runs as well when told to."""
    if request.param == "native":
        require_native()
    monkeypatch.setattr(adaptive, "_gathers", lambda x: request.param == "gathered")
    with native.choice.force("native" if request.param == "native" else "loop"):
        yield request.param


@pytest.mark.parametrize("sigma", [5.0, 15.0, 50.0])
def test_noise_estimate_within_five_percent_on_a_piecewise_smooth_image(sigma: float) -> None:
    clean = piecewise_image(256).expand(2, 3, 256, 256)
    gen = torch.Generator().manual_seed(1)
    noisy = clean + sigma / 255 * torch.randn(clean.shape, generator=gen)
    est = estimate_sigma(noisy) * 255
    assert torch.allclose(est, torch.full_like(est, sigma), rtol=0.05), est


def test_noise_estimate_of_a_clean_image_is_small() -> None:
    assert estimate_sigma(piecewise_image(128)).item() * 255 < 1.0


def test_half_offsets_cover_every_offset_once_with_its_mirror() -> None:
    half = half_offsets(3)
    full = set(half) | {(-a, -b) for a, b in half}
    assert len(half) == (7 * 7 + 1) // 2 and len(full) == 49


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("budget", [1 << 30, 1], ids=["kept", "recomputed"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("patch", [0, 1, 2])
def test_guided_operator_equals_dense_gram_from_explicit_features(
    normalize: bool, patch: int, budget: int, channels: int, path: str
) -> None:
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=3).filter(F64)
    guide = torch.rand(2, channels, 9, 11, dtype=F64)
    h2 = torch.tensor([0.3, 1.5], dtype=F64)
    op = GuidedOperator(guide, spatial, patch, h2, normalize, budget)
    assert op.parts == (1 if budget > 1 else len(half_offsets(3)))
    x = torch.randn(2, channels, 9, 11, dtype=F64)
    y = op(x)
    for b in range(2):
        gram = guided_gram(guide[b], spatial, patch, h2[b].item(), normalize)
        expected = (gram @ x[b].reshape(channels, -1).T).T.reshape(channels, 9, 11)
        torch.testing.assert_close(y[b], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gram, gram.T, rtol=0, atol=1e-15)
        assert torch.linalg.eigvalsh(gram).min() > -1e-12


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("budget", [1 << 30, 1], ids=["kept", "recomputed"])
def test_the_local_mean_made_with_the_degree_is_the_dense_grams_and_a_separate_passs(
    budget: int, channels: int, path: str
) -> None:
    """``local_mean`` ``D⁻¹K v`` from the pass that makes ``d = K1``: the dense Gram's row-normalised
    product, and bit for bit ``K v / d`` from a pass of its own."""
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=3).filter(F64)
    guide = torch.rand(2, channels, 9, 11, dtype=F64)
    h2 = torch.tensor([0.3, 1.5], dtype=F64)
    v = torch.randn(2, channels, 9, 11, dtype=F64)
    op = GuidedOperator(guide, spatial, 1, h2, True, budget, mean_of=v)
    alone = GuidedOperator(guide, spatial, 1, h2, True, budget)
    assert alone.local_mean is None
    assert torch.equal(op.degree, alone.degree)
    assert torch.equal(op.local_mean, alone.kernel(v) / alone.degree)
    for b in range(2):
        gram = guided_gram(guide[b], spatial, 1, h2[b].item(), normalize=False)
        expected = (gram @ v[b].reshape(channels, -1).T / gram.sum(dim=1, keepdim=True)).T
        torch.testing.assert_close(
            op.local_mean[b], expected.reshape(channels, 9, 11), rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("channels", [1, 3])
def test_guided_weights_with_autograd_equal_the_in_place_path_and_carry_gradients(
    channels: int, path: str
) -> None:
    """Training differentiates through the weights (out of place); serving makes them in place, in
    inference mode, and what it keeps for the next call (the gathers' indices) serves training too."""
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=3).filter(F64)
    guide = torch.rand(2, channels, 10, 12, dtype=F64)
    h2 = torch.tensor([0.05, 0.4], dtype=F64)
    adaptive._indices.cache_clear()
    with torch.inference_mode():
        served = guided_weights(guide, spatial, 2, h2)
    trainable = spatial.clone().requires_grad_(True)
    trained = guided_weights(guide, trainable, 2, h2)
    learned_guide = guide.clone().requires_grad_(True)  # a guide network's output
    (guide_grad,) = torch.autograd.grad(guided_weights(learned_guide, spatial, 2, h2).sum(), learned_guide)
    assert bool(guide_grad.isfinite().all()) and bool(guide_grad.abs().sum() > 0)
    # torch's own loops give the same numbers; the compiled ones take native.c's exponential
    exact = {"rtol": 0, "atol": 0} if path != "native" else {"rtol": 1e-14, "atol": 0}
    torch.testing.assert_close(trained.detach(), served, **exact)
    (grad,) = torch.autograd.grad(trained.sum(), trainable)
    # each tap k_s(o) multiplies w_o and its mirror's map is the same one: d(Σw)/dk_s(o) = Σ_x exp(·)
    half = half_offsets(3)
    taps = torch.stack([spatial[3 + a, 3 + b] for a, b in half])
    expected = served.sum(dim=(0, 2, 3)) / taps
    got = torch.stack([grad[3 + a, 3 + b] for a, b in half])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_weights_of_offsets_wider_than_the_image_are_zero(path: str) -> None:
    """``w_o(x) = 0`` wherever ``x + o`` leaves the image, also for offsets past its whole width."""
    spatial = Kernel(lengthscale=3.0, radius=7).filter(F64)
    weights = guided_weights(torch.rand(1, 1, 4, 5, dtype=F64), spatial, 1, torch.tensor([0.5], dtype=F64))
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(5), indexing="ij")
    for k, (a, b) in enumerate(half_offsets(7)):
        outside = (rows + a >= 4) | (cols + b < 0) | (cols + b >= 5)
        assert not bool(weights[0, k][outside].any()), (a, b)
        assert bool((weights[0, k][~outside] > 0).all()), (a, b)


@pytest.mark.parametrize("group_bytes", [1, 1 << 30], ids=["an-offset-a-group", "one-group"])
def test_the_gathered_path_equals_the_loop_on_padded_batches_and_parts_of_the_offsets(
    group_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's path against the CPU's, both run here: a padded batch of two sizes, three channels,
    the offsets whole and in parts that do not start at the centre, groups of one offset and of all."""
    monkeypatch.setattr(adaptive, "GATHER_BYTES", group_bytes)
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=3).filter(F64)
    guide = torch.rand(2, 3, 10, 13, dtype=F64)
    x = torch.randn(2, 3, 10, 13, dtype=F64)
    h2 = torch.tensor([0.1, 0.7], dtype=F64)
    sizes = [(10, 13), (7, 9)]
    half = half_offsets(3)
    for offsets in (None, half[5:17], [half[3], (0, 0), half[1]]):
        results = {}
        for gathered in (False, True):
            monkeypatch.setattr(adaptive, "_gathers", lambda x, g=gathered: g)
            with torch.no_grad():
                weights = guided_weights(guide, spatial, 1, h2, offsets, sizes)
                results[gathered] = (weights, apply_weights(weights, x, offsets))
        torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-12, atol=1e-13)


def test_weight_maps_are_written_again_only_once_no_operator_holds_them() -> None:
    """The CPU's in-place maps reuse one kept buffer: a second operator made while the first lives gets
    maps of its own (the first's products are unchanged, and each equals its dense Gram's), and once
    its holder is gone the next operator is handed the same memory, in or out of inference mode."""
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=3).filter(F64)
    guides = torch.rand(2, 1, 1, 9, 11, dtype=F64)
    h2 = torch.tensor([0.4], dtype=F64)
    x = torch.randn(1, 1, 9, 11, dtype=F64)
    with torch.inference_mode():
        first = GuidedOperator(guides[0], spatial, 1, h2, False)
    before = first(x)
    second = GuidedOperator(guides[1], spatial, 1, h2, False)
    assert second._weights.data_ptr() != first._weights.data_ptr()
    assert torch.equal(first(x), before)
    for k, product in enumerate((first(x), second(x))):
        gram = guided_gram(guides[k, 0], spatial, 1, 0.4, normalize=False)
        torch.testing.assert_close(product.reshape(-1), gram @ x.reshape(-1), rtol=1e-12, atol=1e-12)
    held = second._weights.data_ptr()
    del second
    with torch.inference_mode():
        third = GuidedOperator(guides[0], spatial, 1, h2, False)
    assert third._weights.data_ptr() == held
    assert torch.equal(third(x), before)


def test_weight_maps_beyond_the_kept_size_are_not_kept_nor_held_beside_a_kept_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Maps within ``KEPT_BYTES`` are kept; a larger image's are not, and an unused kept buffer too small
    for them is let go before they are made (a tiled image's edge tiles would otherwise hold theirs
    beside the next tile's)."""
    monkeypatch.setattr(adaptive, "_kept", adaptive._KeptBuffer())
    monkeypatch.setattr(adaptive, "KEPT_BYTES", 25 * 9 * 11 * 8)  # the 25 maps of one 9×11 image
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=3).filter(F64)
    h2 = torch.tensor([0.4], dtype=F64)
    op = GuidedOperator(torch.rand(1, 1, 9, 11, dtype=F64), spatial, 1, h2, False)
    assert adaptive._kept._buffer.data_ptr() == op._weights.data_ptr()
    del op
    op = GuidedOperator(torch.rand(1, 1, 9, 12, dtype=F64), spatial, 1, h2, False)
    assert adaptive._kept._buffer is None
    del op
    op = GuidedOperator(torch.rand(1, 1, 8, 11, dtype=F64), spatial, 1, h2, False)
    assert adaptive._kept._buffer.data_ptr() == op._weights.data_ptr()


def test_normalized_kernel_has_spectral_radius_one() -> None:
    """``D^{-1/2} K D^{-1/2}`` is similar to the row-stochastic ``D⁻¹K``: its top eigenvalue is 1."""
    spatial = Kernel(lengthscale=2.0, radius=2).filter(F64)
    gram = guided_gram(torch.rand(1, 8, 8, dtype=F64), spatial, 1, 0.5, normalize=True)
    assert torch.linalg.eigvalsh(gram).max().item() == pytest.approx(1.0, abs=1e-10)


def test_guided_kernel_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="Extra inputs"):
        GuidedKernel(bandwith=1.0)
