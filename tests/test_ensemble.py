"""The self-ensemble of the learned networks (``GuideNet.ensemble``, ``kdeq.maths.guidenet.dihedral_mean``):
the eight symmetries of the square against numpy's, the mean against the formula written out, its
equivariance, the 2×2 unshuffle's grid kept on odd sizes and in tiles, each task's network averaged
through it, the config's values, and the shipped ensemble model against the model it averages.
Every test makes its own images."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from kdeq.maths.guidenet import (
    DIHEDRAL,
    GuideNet,
    dihedral_mean,
    inpaint_pilot,
    pilot,
    segment_mean,
    unshuffle,
    upscale_pilot,
)
from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.repository import default_models_dir
from tests.helpers import assert_refinement_alone_retrained
from tests.test_guidenet import trained_like

NET = GuideNet(depth=3, channels=8)


def numpy_symmetry(x: np.ndarray, turns: int, mirrored: bool) -> np.ndarray:
    """``g x`` on the last two axes by numpy: mirrored left to right, then turned anticlockwise."""
    x = x[..., ::-1] if mirrored else x
    return np.rot90(x, turns, axes=(-2, -1))


def numpy_inverse(x: np.ndarray, turns: int, mirrored: bool) -> np.ndarray:
    x = np.rot90(x, -turns, axes=(-2, -1))
    return x[..., ::-1] if mirrored else x


def lopsided(seed: int, cin: int = 1, cout: int = 1):
    """A function of images no symmetry of the square leaves alone: a random 3×3 convolution (zero
    border), a ReLU and a ramp along the width added."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(cout, cin, 3, 3, generator=gen, dtype=torch.float64)

    def fn(*images: torch.Tensor) -> torch.Tensor:
        x = torch.cat(images, dim=1)
        ramp = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
        return F.relu(F.conv2d(x, weight, padding=1)) + ramp

    return fn


def test_the_symmetries_are_the_eight_of_the_square_and_their_prefixes_groups() -> None:
    x = torch.rand(1, 1, 6, 6, dtype=torch.float64)
    seen = [numpy_symmetry(x.numpy(), *g).copy() for g in DIHEDRAL]
    assert len({a.tobytes() for a in seen}) == 8
    for n in (1, 2, 4, 8):
        images = {numpy_symmetry(x.numpy(), *g).tobytes() for g in DIHEDRAL[:n]}
        for g, h in itertools.product(DIHEDRAL[:n], repeat=2):
            composed = numpy_symmetry(numpy_symmetry(x.numpy(), *h), *g)
            assert composed.tobytes() in images, (n, g, h)
    # the first four keep an image's shape, the others swap its sides
    for g in DIHEDRAL:
        shape = numpy_symmetry(np.zeros((4, 6)), *g).shape
        assert shape == ((4, 6) if g in DIHEDRAL[:4] else (6, 4))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_mean_is_the_formula_written_out(n) -> None:
    fn = lopsided(0)
    x = torch.rand(2, 1, 10, 14, dtype=torch.float64)
    want = np.mean(
        [
            numpy_inverse(fn(torch.from_numpy(numpy_symmetry(x.numpy(), *g).copy())).numpy(), *g)
            for g in DIHEDRAL[:n]
        ],
        axis=0,
    )
    assert np.allclose(dihedral_mean(fn, (x,), n).numpy(), want, atol=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_mean_commutes_with_the_symmetries_it_averages_over(n) -> None:
    """For every ``h`` of the ``n``: ``mean(h x) = h mean(x)``; a symmetry outside them does not commute."""
    fn = lopsided(1, cin=2)
    x, mask = torch.rand(1, 1, 12, 12, dtype=torch.float64), torch.rand(1, 1, 12, 12, dtype=torch.float64)

    def moved(h: tuple[int, bool]) -> torch.Tensor:
        images = tuple(torch.from_numpy(numpy_symmetry(v.numpy(), *h).copy()) for v in (x, mask))
        return dihedral_mean(fn, images, n)

    base = dihedral_mean(fn, (x, mask), n).numpy()
    for h in DIHEDRAL:
        commutes = np.allclose(moved(h).numpy(), numpy_symmetry(base, *h), atol=1e-12)
        assert commutes == (h in DIHEDRAL[:n]), h


@pytest.mark.parametrize("n", [2, 4, 8])
def test_odd_images_and_their_tiles_keep_the_unshuffle_grid(n) -> None:
    """A network's layout: a 3×3 convolution of the 2×2-unshuffled image, shuffled back, which reads
    each pixel of a block differently. On an odd-sized image, the mean over a tile that starts on an
    even pixel equals the whole image's mean 4 pixels in from the tile's edges (each ``g`` sees the
    whole image's blocks), and a tile that starts on an odd pixel does not."""
    weight = torch.randn(4, 4, 3, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        blocks = F.conv2d(unshuffle(x), weight, padding=1)
        return F.pixel_shuffle(blocks, 2)[..., : x.shape[-2], : x.shape[-1]]

    x = torch.rand(1, 1, 23, 29, dtype=torch.float64)
    whole = dihedral_mean(fn, (x,), n)
    assert whole.shape == x.shape

    def inner(v: torch.Tensor) -> torch.Tensor:
        return v[..., 4:-4, 4:-4]

    for top, left, h, w in [(2, 4, 17, 19), (2, 4, 16, 18), (6, 8, 15, 20), (0, 0, 23, 29)]:
        tile = dihedral_mean(fn, (x[..., top : top + h, left : left + w],), n)
        assert torch.allclose(inner(tile), inner(whole[..., top : top + h, left : left + w]), atol=1e-12)
    shifted = dihedral_mean(fn, (x[..., 3:20, 5:24],), n)
    assert not torch.allclose(inner(shifted), inner(whole[..., 3:20, 5:24]), atol=1e-3)


def by_hand(fn, images: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    """``(1/n)·Σ_g g⁻¹ fn(g x, …)`` by numpy's symmetries, for images with even sides."""
    outs = []
    for g in DIHEDRAL[:n]:
        moved = tuple(torch.from_numpy(numpy_symmetry(x.numpy(), *g).copy()) for x in images)
        outs.append(numpy_inverse(fn(*moved).numpy(), *g))
    return torch.from_numpy(np.mean(outs, axis=0))


@pytest.mark.parametrize(
    ("net", "channels"),
    [
        (NET, 1),
        (GuideNet(depth=3, channels=8, luminance="mean"), 3),
        (GuideNet(depth=3, channels=8, colour_channels=8), 3),
    ],
)
def test_the_denoisers_pilot_averages_its_network_over_the_symmetries(net, channels) -> None:
    """``p = b + a·(y − b) + (1/8)Σ_g g⁻¹N_θ(g y)``: the ensemble model's pilot is the plain model's
    pilots of the turned and mirrored images, turned back and averaged (the channel means and ``σ``
    that ``N_θ`` reads are the same for every ``g``)."""
    t = trained_like(net, 5)
    gen = torch.Generator().manual_seed(6)
    y, base = torch.rand(2, channels, 12, 16, generator=gen), torch.rand(2, channels, 12, 16, generator=gen)
    sigma = torch.tensor([0.1, 0.2])
    eight = net.model_copy(update={"ensemble": 8})
    got = pilot(y, base, sigma, t, eight)
    want = by_hand(lambda v, b: pilot(v, b, sigma, t, net), (y, base), 8)
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert not torch.allclose(got, pilot(y, base, sigma, t, net), atol=1e-4)


def test_the_other_tasks_networks_average_over_the_symmetries() -> None:
    gen = torch.Generator().manual_seed(7)
    y = torch.rand(1, 1, 12, 16, generator=gen)
    mask = (torch.rand(1, 1, 12, 16, generator=gen) > 0.4).float()
    cases = [
        (
            GuideNet(depth=3, channels=8, condition="mask"),
            lambda t, n: lambda v, m: inpaint_pilot(v, m, v, t, n),
            (y, mask),
        ),
        (
            GuideNet(depth=3, channels=8, condition="image"),
            lambda t, n: lambda v, m: segment_mean(v, torch.tensor([0.5]), m, t, n),
            (y, mask),
        ),
        (
            GuideNet(depth=3, channels=8, condition="scale"),
            lambda t, n: lambda v: upscale_pilot(v, 2, t, n),
            (y,),
        ),
    ]
    for net, call, images in cases:
        t = trained_like(net, 8)
        got = call(t, net.model_copy(update={"ensemble": 4}))(*images)
        assert torch.allclose(got, by_hand(call(t, net), images, 4).float(), atol=1e-5), net.condition


def test_the_config_takes_one_two_four_or_eight_and_writes_only_more_than_one() -> None:
    for n in (1, 2, 4, 8):
        assert GuideNet(ensemble=n).ensemble == n
    for bad in (0, 3, 16):
        with pytest.raises(ValidationError):
            GuideNet(ensemble=bad)
    assert "ensemble" not in GuideNet().model_dump()
    assert GuideNet(ensemble=8).model_dump()["ensemble"] == 8


def test_the_shipped_ensemble_model_is_the_default_denoiser_averaged() -> None:
    """``denoise-kglm-x8:1`` is ``denoise-kglm:8`` with ``ensemble = 8``: the same kernel, λ, mean,
    solver and guide network bit for bit; only the refinement ``H_φ`` and ``β`` were trained again
    (docs/training.md)."""
    root = default_models_dir()
    if not (root / "denoise-kglm-x8").is_dir():
        pytest.skip(f"no denoise-kglm-x8 in {root}")
    plain = load_checkpoint(root / "denoise-kglm" / "8")
    x8 = load_checkpoint(root / "denoise-kglm-x8" / "1")
    assert x8.config.architecture.net.ensemble == 8
    net = x8.config.architecture.net.model_copy(update={"ensemble": 1})
    assert x8.config.architecture.model_copy(update={"net": net}) == plain.config.architecture
    assert_refinement_alone_retrained(x8, plain)
