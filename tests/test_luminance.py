"""How the grey guide network reads a colour image's luminance (``GuideNet.luminance``): under
``mean`` the opponent luminance ``y₀ = (R + G + B)/√3`` goes to ``N_θ`` at a grey image's scale, so a
colour pilot's luminance must be √3 times the grey pilot of the channel mean ``(R + G + B)/3`` at
``σ/√3`` (computed here through the grey path, one channel), its colour differences unchanged, and
grey images untouched; and the option's config."""

import math

import pytest
import torch
from pydantic import ValidationError

from kdeq.maths.guidenet import GuideNet, opponent, pilot
from kdeq.models.checkpoint import ModelSpec
from tests.test_guidenet import grown_spec, trained_like

OPPONENT = GuideNet(depth=3, channels=8)
MEAN = GuideNet(depth=3, channels=8, luminance="mean")


@pytest.mark.parametrize("tile", [False, True])
def test_the_luminance_is_read_as_the_grey_image_of_the_channel_mean(tile: bool) -> None:
    t = trained_like(OPPONENT, 5)
    t["net_skip"] = torch.tensor([0.3])  # so that the skip's share of the identity is checked too
    gen = torch.Generator().manual_seed(4)
    y, base = torch.rand(2, 3, 17, 22, generator=gen), torch.rand(2, 3, 17, 22, generator=gen)
    sigma = torch.tensor([0.06, 0.2])
    level = torch.rand(2, 3, generator=gen) if tile else None
    q = opponent(3)
    got = torch.einsum("dc,bchw->bdhw", q, pilot(y, base, sigma, t, MEAN, level))
    grey = pilot(
        y.mean(1, keepdim=True),
        base.mean(1, keepdim=True),
        sigma / math.sqrt(3.0),
        t,
        OPPONENT,
        None if level is None else level.mean(1, keepdim=True),
    )
    assert torch.allclose(got[:, :1], math.sqrt(3.0) * grey, atol=1e-5)
    before = torch.einsum("dc,bchw->bdhw", q, pilot(y, base, sigma, t, OPPONENT, level))
    assert torch.allclose(got[:, 1:], before[:, 1:], atol=1e-6)
    # and it is a different reading: the network is not scale-equivariant
    assert (got[:, :1] - before[:, :1]).abs().amax() > 1e-4


def test_grey_images_are_read_as_before() -> None:
    t = trained_like(OPPONENT, 6)
    g = torch.rand(3, 1, 16, 19, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.02, 0.1, 0.3])
    assert torch.equal(pilot(g, g, sigma, t, MEAN), pilot(g, g, sigma, t, OPPONENT))


def test_the_option_is_written_only_when_set_and_only_for_the_grey_sigma_network() -> None:
    assert "luminance" not in OPPONENT.model_dump()
    assert MEAN.model_dump()["luminance"] == "mean"
    spec = grown_spec(MEAN)
    assert ModelSpec.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValidationError, match="luminance 'mean'"):
        GuideNet(depth=3, channels=8, luminance="mean", colour_channels=8)
    with pytest.raises(ValidationError, match="luminance 'mean'"):
        GuideNet(depth=3, channels=8, luminance="mean", condition="mask")
    with pytest.raises(ValidationError):
        GuideNet(depth=3, channels=8, luminance="sum")
