"""Stein's unbiased risk estimate of a blend (``kdeq.maths.sure``) and the denoiser that blends by it
(``Refine.blend = "sure"``, ``denoise-kglm-collab:2``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdeq.maths import sure
from kdeq.maths.guidenet import Refine
from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.repository import default_models_dir, load_predictor
from tests.helpers import dense_operator
from tests.test_collab import psnr, stripes

F64 = torch.float64


def circular(y: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``y`` ``(B, 1, H, W)`` convolved with ``taps`` ``(k, k)``, wrapping at the borders: a linear map
    whose diagonal is ``taps``' centre at every pixel."""
    r = taps.shape[-1] // 2
    return F.conv2d(F.pad(y, (r,) * 4, mode="circular"), taps[None, None])


def test_the_probe_is_plus_or_minus_one_and_each_images_own() -> None:
    like = torch.zeros(2, 1, 9, 11)
    delta = sure.probe(like)
    assert set(delta.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(delta, sure.probe(like))  # a function of the shape alone
    assert abs(float(delta.mean())) < 0.2
    padded = sure.probe(like, [(6, 7), (9, 11)])
    assert torch.equal(padded[0, :, :6, :7], sure.probe(torch.zeros(1, 1, 6, 7))[0])
    assert torch.equal(padded[1], delta[1])
    assert not padded[0, :, 6:].any() and not padded[0, :, :, 7:].any()


def test_the_probed_divergence_of_a_linear_map_is_the_probes_quadratic_form() -> None:
    """For ``g = A y`` the probe reads ``δᵀAδ`` exactly, ``A`` here written out as a matrix; over each
    image's own pixels in a padded batch."""
    gen = torch.Generator().manual_seed(1)
    taps = torch.randn(3, 3, generator=gen, dtype=F64)
    h, w = 6, 7
    matrix = dense_operator(lambda v: circular(v, taps), (1, h, w))
    y = torch.rand(1, 1, h, w, generator=gen, dtype=F64)
    delta = sure.probe(y)
    step = torch.tensor([0.01], dtype=F64)
    got = sure.divergence(delta, circular(y, taps), circular(y + step * delta, taps), step)
    want = delta.reshape(-1) @ matrix @ delta.reshape(-1)
    assert torch.allclose(got, want[None], rtol=1e-9)
    # the same image in a padded batch: the padding's values are not read
    batch = torch.full((2, 1, h + 2, w + 3), 5.0, dtype=F64)
    batch[0, :, :h, :w] = circular(y, taps)[0]
    after = batch.clone()
    after[0, :, :h, :w] = circular(y + step * delta, taps)[0]
    after[0, :, h:] = -7.0
    probes = sure.probe(batch, [(h, w), (h + 2, w + 3)])
    both = sure.divergence(probes, batch, after, step.expand(2), [(h, w), (h + 2, w + 3)])
    assert torch.allclose(both[0], got[0], rtol=1e-9) and both[1] == 0


def cautious_risk(y, p, g, div, sigma, b):
    """``SURE(b) + 2b·z·σ‖g‖`` in float64, written out: the risk whose least on ``[0, 1]`` is the
    cautious weight (``div p`` left out: it does not depend on ``b``)."""
    risk = ((y - p - b * g) ** 2).sum() - y.numel() * sigma**2 + 2 * sigma**2 * b * div
    return float(risk + 2 * b * sure.MARGIN * sigma * g.square().sum().sqrt())


@pytest.mark.parametrize("div", [-300.0, 0.0, 40.0, 400.0, 4000.0])
def test_the_blend_weight_is_the_least_risk_on_the_unit_interval(div) -> None:
    """``blend_weight`` against a search over 2001 weights of SURE with the margin's penalty: inside
    ``[0, 1]`` and clipped at either end (the divergences chosen to land on each side)."""
    gen = torch.Generator().manual_seed(2)
    y = torch.rand(1, 1, 20, 24, generator=gen, dtype=F64)
    p = y + 0.1 * torch.randn(y.shape, generator=gen, dtype=F64)
    g = 0.1 * torch.randn(y.shape, generator=gen, dtype=F64) - 0.5 * (p - y)
    sigma = 0.2
    got = float(sure.blend_weight(y, p, g, torch.tensor([div], dtype=F64), torch.tensor([sigma], dtype=F64)))
    grid = [k / 2000 for k in range(2001)]
    best = min(grid, key=lambda b: cautious_risk(y, p, g, div, sigma, b))
    assert abs(got - best) <= 1 / 2000
    assert (
        sure.blend_weight(y, p, torch.zeros_like(g), torch.zeros(1, dtype=F64), torch.ones(1, dtype=F64)) == 0
    )


def test_the_weight_finds_the_best_blend_without_the_clean_image(monkeypatch) -> None:
    """Noisy textured images at σ = 0.1, a blur ``p`` that loses the texture and the noisy image itself
    as ``ν``: over 200 draws SURE's weight from ``y`` alone (without the margin) averages the oracle's
    ``⟨x − p, g⟩/‖g‖²`` (from the clean image) within 0.01, where leaving out the divergence term would
    take ``ν`` whole; the cautious weight is below the oracle's, by about its margin ``z·σ/‖g‖``."""
    n = 64
    i, j = torch.meshgrid(torch.arange(n, dtype=F64), torch.arange(n, dtype=F64), indexing="ij")
    clean = (0.5 + 0.2 * torch.sin(2 * math.pi * (i + 2 * j) / 7) * (i < 32) + 0.2 * (j > 40))[None, None]
    blur = torch.full((7, 7), 1 / 49, dtype=F64)
    sigma = torch.tensor([0.1], dtype=F64)
    step = sigma * sure.STEP
    gen = torch.Generator().manual_seed(0)
    weights, naive, cautious, gain, energy = [], [], [], 0.0, 0.0
    for _ in range(200):
        y = clean + sigma * torch.randn(clean.shape, generator=gen, dtype=F64)
        p = circular(y, blur)
        g = y - p
        delta = sure.probe(y)
        probed = y + step * delta
        div = sure.divergence(delta, g, probed - circular(probed, blur), step)
        cautious.append(float(sure.blend_weight(y, p, g, div, sigma)) + float(sure.MARGIN * sigma / g.norm()))
        with monkeypatch.context() as m:
            m.setattr(sure, "MARGIN", 0.0)
            weights.append(float(sure.blend_weight(y, p, g, div, sigma)))
            naive.append(float(sure.blend_weight(y, p, g, torch.zeros(1, dtype=F64), sigma)))
        gain, energy = gain + float(((clean - p) * g).sum()), energy + float((g * g).sum())
    oracle = gain / energy
    assert 0.2 < oracle < 0.8
    assert abs(sum(weights) / len(weights) - oracle) < 0.01
    assert min(naive) > oracle + 0.3
    # the margin's shift is what separates the cautious weight from SURE's
    assert abs(sum(cautious) / len(cautious) - oracle) < 0.01


def test_the_filter_options_are_the_collaborative_estimates_and_written_only_when_set() -> None:
    assert "blend" not in Refine(estimate="collaborative").model_dump()
    chosen = Refine(estimate="collaborative", blend="sure")
    assert chosen.model_dump()["blend"] == "sure"
    assert Refine.model_validate(chosen.model_dump()) == chosen
    with pytest.raises(ValueError, match="collaborative"):
        Refine(blend="sure")
    wider = Refine(estimate="collaborative", search_radius=12)
    assert "search_radius" not in chosen.model_dump() and wider.model_dump()["search_radius"] == 12
    assert Refine.model_validate(wider.model_dump()) == wider
    with pytest.raises(ValueError, match="collaborative"):
        Refine(search_radius=12)
    larger = Refine(estimate="collaborative", patch_radius=4)
    assert "patch_radius" not in wider.model_dump() and larger.model_dump()["patch_radius"] == 4
    assert Refine.model_validate(larger.model_dump()) == larger
    with pytest.raises(ValueError, match="collaborative"):
        Refine(patch_radius=4)
    both = Refine(estimate="collaborative", patch_radius=4, first_stage="dct+biorthogonal")
    assert "first_stage" not in larger.model_dump() and both.model_dump()["first_stage"] == "dct+biorthogonal"
    assert Refine.model_validate(both.model_dump()) == both
    with pytest.raises(ValueError, match="collaborative"):
        Refine(first_stage="dct+biorthogonal")
    with pytest.raises(ValueError, match="power of two"):
        Refine(estimate="collaborative", patch_radius=3, first_stage="dct+biorthogonal")
    with pytest.raises(ValueError):
        Refine(estimate="collaborative", patch_radius=4, first_stage="wavelets")


def shipped_versions():
    root = default_models_dir()
    if not (root / "denoise-kglm-collab" / "5").is_dir():
        pytest.skip(f"no denoise-kglm-collab:5 in {root}")
    return (load_predictor(root / "denoise-kglm-collab" / str(v)) for v in (1, 2, 3, 4, 5))


@pytest.mark.parametrize(
    ("version", "options"),
    [
        (2, {"blend": "sure"}),
        (3, {"blend": "sure", "search_radius": 12}),
        (4, {"blend": "sure", "search_radius": 12, "patch_radius": 4}),
        (5, {"blend": "sure", "search_radius": 12, "patch_radius": 4, "first_stage": "dct+biorthogonal"}),
    ],
)
def test_the_shipped_blends_are_version_1_with_their_options(version, options) -> None:
    """``denoise-kglm-collab:2`` is version 1 with the blend, 3 with the blend and the filter's 25×25
    windows, 4 with those and its 9×9 patches, 5 with those and the wavelets' first stage beside the
    DCT's: the same architecture otherwise and the same tensors bit for bit (nothing trained)."""
    root = default_models_dir()
    if not (root / "denoise-kglm-collab" / str(version)).is_dir():
        pytest.skip(f"no denoise-kglm-collab:{version} in {root}")
    one, other = (load_checkpoint(root / "denoise-kglm-collab" / str(v)) for v in (1, version))
    refine = one.config.architecture.net.refine
    net = one.config.architecture.net.model_copy(update={"refine": refine.model_copy(update=options)})
    assert other.config.architecture == one.config.architecture.model_copy(update={"net": net})
    assert other.tensors.keys() == one.tensors.keys()
    assert all(torch.equal(other.tensors[k], one.tensors[k]) for k in one.tensors)


def test_the_blend_takes_the_filter_on_repeated_texture_and_keeps_the_pilot_elsewhere() -> None:
    """At σ = 25: on stripes whose contrast varies, version 2 is more than 0.5 dB above version 1 (whose
    ``H_φ`` trusts the filter little); on a smooth image with edges, within 0.05 dB of it; the same
    call twice gives the same image; a colour image is version 1's bit for bit, in versions 3 to 5
    too."""
    one, two, three, four, five = shipped_versions()
    gen = torch.Generator().manual_seed(4)
    sigma = 25.0
    textured = stripes(96, 96)
    i, j = torch.meshgrid(torch.arange(96.0), torch.arange(96.0), indexing="ij")
    smooth = (0.3 + 0.4 * (i > 40) * (j > 30) + 0.2 * torch.sin(i / 15) * torch.cos(j / 19))[None]
    for clean, gain in ((textured, 0.5), (smooth, -0.05)):
        y = (clean + sigma / 255 * torch.randn(clean.shape, generator=gen))[None]
        first, second = one.predict(y, sigma=sigma), two.predict(y, sigma=sigma)
        assert psnr(second.output[0], clean) > psnr(first.output[0], clean) + gain
        assert bool(second.stats.converged.all())
        assert torch.equal(second.output, two.predict(y, sigma=sigma).output)
    colour = (smooth.expand(3, -1, -1) + sigma / 255 * torch.randn(3, 96, 96, generator=gen))[None]
    first = one.predict(colour, sigma=sigma).output
    assert torch.equal(first, two.predict(colour, sigma=sigma).output)
    # the search, the patches and the first stage are the grey filter's
    for later in (three, four, five):
        assert torch.equal(first, later.predict(colour, sigma=sigma).output)
