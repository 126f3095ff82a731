"""``kdeq prune``: a denoiser's guide networks cut to their most salient features, a colour network grown
from the grey one first where there is none (``kdeq.train.prune``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kdeq.cli import main as kdeq_main
from kdeq.images.imageio import write_png
from kdeq.maths.guidenet import pilot
from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.repository import default_models_dir, load_predictor
from kdeq.train.prune import prune, pruned

SOURCE = default_models_dir() / "denoise-kglm" / "2"


def _images(channels: int = 1, seed: int = 0, count: int = 3, size: int = 72) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(channels, size, size, generator=gen) for _ in range(count)]


def _image_folder(folder: Path, images: list[torch.Tensor]) -> Path:
    """``images`` written as PNGs into ``folder``, the ``--train`` of a ``kdeq prune`` call."""
    folder.mkdir()
    for k, image in enumerate(images):
        write_png(folder / f"{k}.png", image)
    return folder


def test_keeping_every_feature_keeps_the_network() -> None:
    checkpoint = load_checkpoint(SOURCE)
    spec, tensors = prune(checkpoint, checkpoint.config.architecture.net.channels, _images())
    assert spec.architecture == checkpoint.config.architecture
    assert tensors.keys() == checkpoint.tensors.keys()
    assert all(torch.equal(tensors[k], checkpoint.tensors[k]) for k in tensors)


def test_a_pruned_network_is_the_original_with_the_other_features_silenced() -> None:
    """The pilot of the cut network equals, to float rounding, the original's with each dropped
    feature's filter and bias zeroed (its ReLU output then 0), computed here on the full tensors."""
    checkpoint = load_checkpoint(SOURCE)
    net = checkpoint.config.architecture.net
    gen = torch.Generator().manual_seed(1)
    keep = [torch.randperm(net.channels, generator=gen)[:40].sort().values for _ in range(net.depth - 1)]
    cut = pruned(checkpoint.tensors, "net", net.depth, keep)
    silenced = dict(checkpoint.tensors)
    for i, kept in enumerate(keep):
        dropped = torch.ones(net.channels, dtype=torch.bool)
        dropped[kept] = False
        silenced[f"net_{i}_weight"] = silenced[f"net_{i}_weight"].clone()
        silenced[f"net_{i}_bias"] = silenced[f"net_{i}_bias"].clone()
        silenced[f"net_{i}_weight"][dropped] = 0.0
        silenced[f"net_{i}_bias"][dropped] = 0.0
    y = torch.rand(2, 1, 40, 36, generator=gen)
    base = y.clone()
    sigma = torch.tensor([0.05, 0.2])
    lean = net.model_copy(update={"channels": 40})
    expected = pilot(y, base, sigma, silenced, net)
    torch.testing.assert_close(pilot(y, base, sigma, cut, lean), expected, rtol=1e-5, atol=1e-6)


def test_a_feature_the_next_layer_never_reads_is_the_first_to_go() -> None:
    checkpoint = load_checkpoint(SOURCE)
    tensors = dict(checkpoint.tensors)
    unread = 5
    tensors["net_1_weight"] = tensors["net_1_weight"].clone()
    tensors["net_1_weight"][:, unread] = 0.0
    checkpoint = dataclasses.replace(checkpoint, tensors=tensors)
    _, cut = prune(checkpoint, 63, _images())
    rows = tensors["net_0_weight"].flatten(1)
    kept = cut["net_0_weight"].flatten(1)
    assert not (kept == rows[unread]).all(dim=1).any()
    assert all((kept == rows[j]).all(dim=1).any() for j in range(64) if j != unread)


def test_kdeq_prune_writes_a_checkpoint_that_serves_and_refuses_what_it_cannot_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    images = _image_folder(tmp_path / "images", _images())
    out = tmp_path / "pruned"
    assert (
        kdeq_main(["prune", str(SOURCE), "--channels", "24", "--train", str(images), "--out", str(out)]) == 0
    )
    model = load_predictor(out)
    assert model.config.architecture.net.channels == 24
    assert "pruned from" in model.config.provenance.notes
    noisy = torch.rand(1, 1, 48, 40, generator=torch.Generator().manual_seed(2))
    assert model.predict(noisy, sigma=25).stats.converged.all()
    plain = default_models_dir() / "denoise-kglm" / "1"
    for source, channels, why in (
        (plain, "24", "not a denoiser with a guide network"),
        (SOURCE, "65", "within 1"),
    ):
        capsys.readouterr()
        args = [
            "prune",
            str(source),
            "--channels",
            channels,
            "--train",
            str(images),
            "--out",
            str(tmp_path / "x"),
        ]
        assert kdeq_main(args) == 2
        assert why in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_colour_network_cannot_be_measured_without_colour_images() -> None:
    with pytest.raises(ValueError, match="needs images"):
        prune(load_checkpoint(SOURCE), None, [], colour_channels=16)


def test_a_grown_colour_network_kept_whole_is_the_grey_networks_per_channel_pilot() -> None:
    checkpoint = load_checkpoint(default_models_dir() / "denoise-kglm" / "3")
    net = checkpoint.config.architecture.net
    spec, tensors = prune(
        checkpoint, None, [], colour_channels=3 * net.channels, colour_images=_images(channels=3, seed=3)
    )
    grown = spec.architecture.net
    assert grown.colour_channels == 3 * net.channels and grown.channels == net.channels
    assert all(torch.equal(tensors[k], v) for k, v in checkpoint.tensors.items())  # the rest is kept
    gen = torch.Generator().manual_seed(4)
    y = torch.rand(2, 3, 40, 36, generator=gen)
    sigma = torch.tensor([0.05, 0.2])
    want = pilot(y, y, sigma, checkpoint.tensors, net)  # one opponent channel at a time
    torch.testing.assert_close(pilot(y, y, sigma, tensors, grown), want, rtol=1e-5, atol=1e-5)


def test_kdeq_prune_grows_and_cuts_a_colour_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    images = _image_folder(tmp_path / "images", _images(channels=3, seed=3))
    source = default_models_dir() / "denoise-kglm" / "3"
    out = tmp_path / "colour"
    args = ["prune", str(source), "--colour-channels", "20", "--train", str(images), "--out", str(out)]
    assert kdeq_main(args) == 0
    model = load_predictor(out)
    assert (
        model.config.architecture.net.colour_channels == 20 and model.config.architecture.net.channels == 48
    )
    noisy = torch.rand(1, 3, 48, 40, generator=torch.Generator().manual_seed(5))
    assert model.predict(noisy, sigma=25).stats.converged.all()
    # pruning it again cuts the colour network it has, without growing another
    again = tmp_path / "again"
    assert (
        kdeq_main(["prune", str(out), "--colour-channels", "12", "--train", str(images), "--out", str(again)])
        == 0
    )
    assert load_predictor(again).config.architecture.net.colour_channels == 12
    for extra, why in (
        ([], "nothing to prune"),
        (["--colour-channels", "145"], "within 1 and the colour network's 144"),
    ):
        capsys.readouterr()
        assert (
            kdeq_main(["prune", str(source), *extra, "--train", str(images), "--out", str(tmp_path / "x")])
            == 2
        )
        assert why in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
