"""The denoiser's joint colour network (``GuideNet.colour_channels``): its layout against the grey
network's per-channel pilot (a colour network built as three copies of the grey one, block by block,
``kdeq.train.prune.colour_copies``, must give the same pilot), its kGLM start, grey images
untouched, the config it writes, and the trainer's ``colour_net``, which grows it and trains only it
on colour images."""

from pathlib import Path

import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from kdeq.maths.guidenet import GuideNet, pilot
from kdeq.models.checkpoint import ModelSpec, load_checkpoint, save_checkpoint
from kdeq.models.initialize import init_checkpoint
from kdeq.predictors.denoise import Denoiser
from kdeq.train.loop import train
from kdeq.train.prune import colour_copies
from tests.test_guidenet import grown_spec, trained_like
from tests.test_train import small_config

GREY = GuideNet(depth=3, channels=8)
JOINT = GuideNet(depth=3, channels=8, colour_channels=24)


def test_three_block_copies_of_the_grey_network_give_its_per_channel_pilot() -> None:
    """``colour_copies`` builds the colour network as three block copies of the grey one; through the
    joint pass (one unshuffle of the three channels, channel-major) it must give the grey network's
    pilot computed one opponent channel at a time."""
    t = colour_copies(trained_like(GREY, 7), GREY)
    gen = torch.Generator().manual_seed(8)
    y, base = torch.rand(2, 3, 18, 23, generator=gen), torch.rand(2, 3, 18, 23, generator=gen)
    sigma = torch.tensor([0.05, 0.2])
    want = pilot(y, base, sigma, t, GREY)  # the grey network, one opponent channel at a time
    assert torch.allclose(pilot(y, base, sigma, t, JOINT), want, atol=1e-5)
    level = torch.rand(2, 3, generator=gen)  # a tile's whole image's channel means (kdeq.serving.tiling)
    assert torch.allclose(
        pilot(y, base, sigma, t, JOINT, level), pilot(y, base, sigma, t, GREY, level), atol=1e-5
    )


def test_the_colour_network_reads_the_channels_together_and_leaves_grey_images_alone() -> None:
    t = trained_like(JOINT, 3)
    gen = torch.Generator().manual_seed(9)
    y = torch.rand(1, 3, 16, 16, generator=gen)
    sigma = torch.tensor([0.1])
    joint = pilot(y, y, sigma, t, JOINT)
    assert not torch.allclose(joint, pilot(y, y, sigma, t, GREY), atol=1e-3)
    # a change in one colour channel moves the others' pilot: the channels are read together
    z = y.clone()
    z[:, 0, 5:9, 5:9] += 0.3
    moved = (pilot(z, z, sigma, t, JOINT) - joint)[:, 1:].abs().amax()
    assert moved > 1e-3
    g = torch.rand(2, 1, 16, 16, generator=gen)
    assert torch.equal(pilot(g, g, sigma.repeat(2), t, JOINT), pilot(g, g, sigma.repeat(2), t, GREY))


def test_the_colour_networks_kglm_start_keeps_the_grey_start_and_gives_colour_its_base() -> None:
    start = JOINT.kglm_start()
    assert set(start) == set(JOINT.shapes())
    for k, v in GREY.kglm_start().items():  # the grey network's start is drawn first, as before
        assert torch.equal(start[k], v)
    assert start["net_colour_2_weight"].abs().sum() == 0 and start["net_colour_skip"].item() == 0
    y = torch.rand(1, 3, 14, 14, generator=torch.Generator().manual_seed(2))
    # p = b, up to the rounding of the opponent basis and back
    assert torch.allclose(pilot(y, y.flip(-1), torch.tensor([0.1]), start, JOINT), y.flip(-1), atol=1e-6)


def test_a_colour_network_is_the_sigma_guide_s_and_absent_from_configs_without_one() -> None:
    with pytest.raises(ValidationError, match="σ-conditioned"):
        GuideNet(condition="mask", colour_channels=16)
    assert "colour_channels" not in GREY.model_dump() and "colour_channels" not in GREY.model_dump_json()
    assert JOINT.model_dump()["colour_channels"] == 24
    assert JOINT.shapes()["net_colour_0_weight"] == (24, 13, 3, 3)
    assert JOINT.shapes()["net_colour_2_weight"] == (12, 24, 3, 3)


def test_a_checkpoint_with_a_colour_network_denoises_both_kinds_of_image(tmp_path: Path) -> None:
    spec = grown_spec(JOINT, "den-colour")
    folder, _ = init_checkpoint(spec, tmp_path)
    ckpt = load_checkpoint(folder)
    ckpt.tensors.update(trained_like(JOINT, 5))
    save_checkpoint(tmp_path / "trained", ckpt.config.spec(), ckpt.tensors)
    model = Denoiser(load_checkpoint(tmp_path / "trained"))
    gen = torch.Generator().manual_seed(6)
    for c in (1, 3):
        x = torch.rand(2, c, 24, 28, generator=gen)
        result = model.predict(x, sigma=[20.0, 20.0])
        assert result.output.shape == x.shape and bool(result.stats.converged.all())


def colour_images(directory: Path, count: int, size: int, seed: int) -> Path:
    """Write ``count`` colour PNGs of smooth blobs, each channel its own."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for k in range(count):
        noise = torch.rand(3, size + 6, size + 6, generator=gen)
        x = torch.nn.functional.avg_pool2d(noise, 7, stride=1)
        x = (x - x.amin()) / (x.amax() - x.amin())
        Image.fromarray((x.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()).save(
            directory / f"{k}.png"
        )
    return directory


def test_the_trainer_grows_a_colour_network_and_trains_only_it_on_colour(tmp_path: Path) -> None:
    start = tmp_path / "start"
    ckpt = load_checkpoint(init_checkpoint(grown_spec(GREY, "den-net"), tmp_path)[0])
    save_checkpoint(start, ckpt.config.spec(), ckpt.tensors | trained_like(GREY, 4))
    folders = (colour_images(tmp_path / "train", 4, 40, 0), colour_images(tmp_path / "val", 2, 32, 1))
    out = tmp_path / "models" / "den-colour" / "1"
    cfg = small_config(
        folders, out, spec=str(start), warm_start=start, colour_net=12, channels=3,
        epochs=2, pilot_epochs=2, samples_per_epoch=8, lr=1e-2,
    )  # fmt: skip
    train(cfg)
    saved, before = load_checkpoint(out), load_checkpoint(start)
    assert saved.config.architecture.net.colour_channels == 12
    for name, value in before.tensors.items():  # the grey network, the kernel and λ's tensors
        assert torch.equal(saved.tensors[name], value), name
    assert saved.config.lam == before.config.lam
    assert saved.tensors["net_colour_2_weight"].abs().sum() > 0
    with pytest.raises(ValidationError, match="colour_net grows"):
        small_config(folders, tmp_path / "m" / "x" / "1", spec=str(out), colour_net=12)
    with pytest.raises(ValidationError, match="has none"):
        small_config(folders, tmp_path / "m" / "x" / "1", colour_net=12)


def test_a_colour_spec_round_trips() -> None:
    spec = grown_spec(JOINT, "den-colour")
    assert ModelSpec.model_validate_json(spec.model_dump_json()) == spec
