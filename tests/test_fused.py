"""``kdeq.maths.fused``: the guided kernel's Triton kernels, run on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``) against torch's loops (``kdeq.maths.adaptive``) and by ``gradcheck``.

The interpreter runs a kernel's tile operations one by one in numpy (a few hundred microseconds each),
so the images are small; they still cross the kernels' tile edges (8 rows, 32 columns), hold padded
batches of mixed sizes and colour guides. On CUDA the parity suite (``tests/test_cuda.py``) runs every
served model through these kernels, ``auto``'s choice there.
"""

import logging

import pytest
import torch

from kdeq.maths import fused
from kdeq.maths.adaptive import GuidedOperator, apply_weights, guided_weights, half_offsets
from kdeq.maths.kernels import Kernel
from kdeq.runtime import native
from tests.tolerances import gamma, sum_gap, unit_roundoff

pytest.importorskip("triton", reason="the fused kernels need Triton (the gpu extra, in the dev setup)")

F64 = torch.float64


@pytest.fixture(autouse=True)
def interpreted(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def both(fn) -> dict[str, object]:
    """``fn()`` by torch's loops and by the Triton kernels."""
    out = {}
    for name in ("loop", "triton"):
        with native.choice.force(name):
            out[name] = fn()
    return out


def taps(radius: int, dtype: torch.dtype) -> torch.Tensor:
    return Kernel(profile="matern32", lengthscale=2.0, radius=radius).filter(dtype)


CASES = [
    # channels, (B, H, W), patch radius, window radius, sizes
    (1, (2, 11, 13), 1, 2, None),
    (1, (1, 9, 37), 1, 1, None),  # two tiles of columns
    (3, (2, 10, 12), 1, 1, [(10, 12), (7, 9)]),  # colour, a padded batch
    (1, (1, 5, 4), 0, 2, None),  # a window wider than the image, 1-pixel patches
]


def _inputs(channels: int, shape: tuple[int, int, int], dtype: torch.dtype):
    bsz, height, width = shape
    gen = torch.Generator().manual_seed(3)
    guide = torch.rand(bsz, channels, height, width, generator=gen, dtype=dtype)
    x = torch.randn(bsz, 2, height, width, generator=gen, dtype=dtype)
    v = torch.rand(bsz, channels, height, width, generator=gen, dtype=dtype)
    return guide, x, v, torch.linspace(0.05, 0.6, bsz, dtype=dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize(("channels", "shape", "patch", "radius", "sizes"), CASES)
def test_weight_maps_are_torchs(channels, shape, patch, radius, sizes, dtype) -> None:
    """``w_j = k_j e^{inv·D_j}``: ``D_j`` a sum of ``n²c`` squares in another order (each within
    ``γ_{n²c}·D_j``), so ``|Δw| ≤ w·(2γ_{n²c}|inv·D_j| + 2γ₃)`` (the exponential's and the tap's
    roundings), ``|inv·D_j| = |log(w/k_j)|`` read off the loop's own map; 0 in the same places."""
    guide, _, _, h2 = _inputs(channels, shape, dtype)
    spatial = taps(radius, dtype)
    out = both(lambda: guided_weights(guide, spatial, patch, h2, sizes=sizes))
    loop, fast = out["loop"], out["triton"]
    assert torch.equal(loop == 0, fast == 0)
    r = radius
    k = torch.stack([spatial[r + a, r + b] for a, b in half_offsets(r)]).reshape(1, -1, 1, 1)
    n2c = (2 * patch + 1) ** 2 * channels
    exponent = torch.where(loop > 0, (loop / k).log().abs(), 0.0)
    bound = loop * (2 * gamma(n2c, dtype) * exponent + 2 * gamma(3, dtype))
    assert ((fast - loop).abs() <= bound).all()


@pytest.mark.parametrize(("channels", "shape", "patch", "radius", "sizes"), CASES)
def test_kx_is_torchs_on_every_part_of_the_offsets(channels, shape, patch, radius, sizes) -> None:
    """``K x`` from one set of weight maps, whole and on a partition of the half set of offsets: each
    pixel a sum of at most ``2L`` products in another order, within ``2γ_{2L}·(K|x|)``."""
    guide, x, _, h2 = _inputs(channels, shape, F64)
    spatial = taps(radius, F64)
    with native.choice.force("loop"):
        weights = guided_weights(guide, spatial, patch, h2, sizes=sizes)
        magnitude = apply_weights(weights, x.abs())
    offsets = half_offsets(radius)
    cut = len(offsets) // 2
    for part in (offsets, offsets[:cut], offsets[cut:]):
        index = [offsets.index(o) for o in part]
        w = weights[:, index]
        out = both(lambda w=w, part=part: apply_weights(w, x, part))
        bound = sum_gap(2 * len(offsets), 1.0, F64) * magnitude
        assert ((out["triton"] - out["loop"]).abs() <= bound).all()


def _positive_sums_bound(terms: int, power: int, dtype: torch.dtype) -> float:
    """The relative gap between two computations of a ratio of sums of ``terms`` non-negative products
    of ``power + 3`` roundings each (``u^κ``, the scales, the product): each sum within
    ``γ_{terms + power + 3}``, so the ratio within twice that and the division's ``u``, for each of the
    two computations."""
    return 2 * (2 * gamma(terms + power + 3, dtype) + unit_roundoff(dtype))


@pytest.mark.parametrize(("channels", "shape", "patch", "radius", "sizes"), CASES)
@pytest.mark.parametrize("patches", [False, True])
def test_nonlocal_means_are_torchs(channels, shape, patch, radius, sizes, patches) -> None:
    """Both non-local means of a non-negative image at κ = 1 and 3, and the kernel's degree ``d = K1``:
    ratios of sums of non-negative terms, to the positive-sum bound (``_positive_sums_bound``); the
    spread ``log(1 + Σu/c)`` to that bound in absolute terms (``|Δ log y| ≈ |Δy|/y``)."""
    guide, _, v, h2 = _inputs(channels, shape, F64)
    spatial = taps(radius, F64)
    count = len(half_offsets(radius))
    terms = 2 * count * (2 * patch + 1) ** 2

    def run() -> list[torch.Tensor]:
        op = GuidedOperator(guide, spatial, patch, h2, True, sizes=sizes)
        return [op.degree, *(t for k in (1, 3) for t in op.nonlocal_mean(v, k, patches=patches))]

    out = both(run)
    for k, (loop, fast) in enumerate(zip(out["loop"], out["triton"], strict=True)):
        rel = _positive_sums_bound(terms, 3, F64)
        scale = 1.0 if k in (2, 4) else loop.abs()  # the spreads: absolute
        assert ((fast - loop).abs() <= rel * scale + 4 * unit_roundoff(F64)).all(), k


def test_gradcheck_of_kx() -> None:
    """``∂(K x)`` w.r.t. the weight maps and ``x``, by finite differences (float64; ``fast_mode``: along
    random directions, a few interpreted launches rather than two per input entry)."""
    gen = torch.Generator().manual_seed(5)
    guide = torch.rand(1, 1, 5, 6, generator=gen, dtype=F64)
    offsets = half_offsets(1)
    with native.choice.force("loop"):
        weights = guided_weights(guide, taps(1, F64), 1, torch.tensor([0.3], dtype=F64))
    weights.requires_grad_(True)
    x = torch.randn(1, 2, 5, 6, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, y: fused.apply(w, y, offsets), (weights, x), fast_mode=True)


def test_gradcheck_of_the_weight_maps() -> None:
    """``∂w`` w.r.t. the mirrored guide, the taps and ``inv``, by finite differences (float64, along
    random directions), on a padded batch of two sizes and a two-channel guide."""
    gen = torch.Generator().manual_seed(6)
    offsets = half_offsets(1)
    padded = torch.rand(2, 2, 8, 9, generator=gen, dtype=F64, requires_grad=True)
    k = torch.rand(len(offsets), generator=gen, dtype=F64, requires_grad=True)
    inv = torch.tensor([-1.5, -0.7], dtype=F64, requires_grad=True)
    sizes = [(6, 7), (4, 5)]
    assert torch.autograd.gradcheck(
        lambda p, t, i: fused.weights(p, t, i, offsets, sizes, 3, -60.0), (padded, k, inv), fast_mode=True
    )


def test_training_gradients_are_torchs() -> None:
    """A loss through the whole normalised operator ``K̃ x`` (weights from the guide, the degree, both
    applications) on a padded batch: its gradients w.r.t. the guide, the taps, ``h²`` and ``x`` by the
    kernels' backward equal autograd's through torch's loops (float64; they differ by roundings)."""
    gen = torch.Generator().manual_seed(8)
    guide0 = torch.rand(2, 1, 9, 10, generator=gen, dtype=F64)
    x0 = torch.randn(2, 1, 9, 10, generator=gen, dtype=F64)
    target = torch.randn(2, 1, 9, 10, generator=gen, dtype=F64)
    spatial0 = taps(2, F64)

    def grads() -> list[torch.Tensor]:
        guide, x = guide0.clone().requires_grad_(), x0.clone().requires_grad_()
        spatial = spatial0.clone().requires_grad_()
        h2 = torch.tensor([0.2, 0.5], dtype=F64, requires_grad=True)
        op = GuidedOperator(guide, spatial, 1, h2, True, sizes=[(9, 10), (6, 8)])
        ((op(x) - target).square().sum()).backward()
        return [guide.grad, x.grad, spatial.grad, h2.grad]

    out = both(grads)
    for loop, fast in zip(out["loop"], out["triton"], strict=True):
        # finite on both paths: the padding's scale is 0, not tiny^{-1/2} (whose products overflowed)
        assert torch.isfinite(loop).all() and torch.isfinite(fast).all()
        # the gradients are sums of a few hundred terms per entry, each a product of a few factors
        bound = 2 * gamma(2000, F64) * loop.abs().max()
        assert (fast - loop).abs().max() <= bound


def test_when_the_kernels_run(monkeypatch, caplog) -> None:
    """``auto`` keeps a CPU on its own loops; ``triton`` pinned runs them on the CPU only through the
    interpreter (else one warning, and torch's loops); one device and one of float32/float64."""
    x = torch.rand(1, 1, 4, 4)
    assert not fused.enabled(None, x)
    assert fused.enabled("triton", x)
    assert not fused.enabled("loop", x) and not fused.enabled("native", x)
    assert not fused.enabled("triton", x, x.double())
    assert not fused.enabled("triton", x.half())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fused._warn_cpu.cache_clear()
    with caplog.at_level(logging.WARNING, logger="kdeq.fused"):
        assert not fused.enabled("triton", x)
        assert not fused.enabled("triton", x)
    assert sum("TRITON_INTERPRET" in r.getMessage() for r in caplog.records) == 1
    # native's own loops stand aside for a pinned triton
    with native.choice.force("triton"):
        assert not native.enabled(x)


def test_what_the_kernels_refuse() -> None:
    """An output written in place that is strided or is the input (whose neighbours other programs
    read), and weight maps that are not one per offset of the image: each a clear error, not a race or
    a read out of bounds."""
    weights, x = torch.rand(1, 2, 4, 6), torch.rand(1, 1, 4, 6)
    out = torch.zeros(1, 1, 6, 4).transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous"):
        fused.pairs(weights, [1], [(0, 1)], [1.0], 1, x, out)
    with pytest.raises(ValueError, match="over its input"):
        fused.pairs(weights, [1], [(0, 1)], [1.0], 1, x, x)
    with pytest.raises(ValueError, match="a map per offset"):
        fused.apply(weights, x, [(0, 0), (0, 1), (1, 0)])


def test_the_trainer_runs_the_fused_kernels_on_a_gpu() -> None:
    """``kdeq train``'s reproducible arithmetic: torch's loops on a CPU (a machine that compiles its own
    repeats none of another's), the fused kernels on a CUDA device (deterministic sums, no atomics)."""
    from kdeq.train.loop import reproducible_arithmetic

    with reproducible_arithmetic(torch.device("cpu")):
        assert native.choice.pinned() == "loop"
    with reproducible_arithmetic(torch.device("cuda", 0)):
        assert native.choice.pinned() == "triton"
    with reproducible_arithmetic():
        assert native.choice.pinned() == "loop"
