"""The offline CLI on real image files: denoise, inpaint, segment, models, init."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kdeq.cli import main
from kdeq.cli import test_image as piecewise_image
from kdeq.imageio import read_image, write_png
from kdeq.initialize import DEFAULT_SPECS
from kdeq.repository import load_predictor


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    clean = piecewise_image(64)[0]
    noisy = clean + 0.1 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))
    paths = {k: tmp_path / f"{k}.png" for k in ("grey", "colour", "mask")}
    write_png(paths["grey"], noisy)
    write_png(paths["colour"], torch.cat([noisy, clean, 1 - clean]))
    write_png(
        paths["mask"], (torch.rand(1, 64, 64, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    )
    return paths


@pytest.mark.parametrize("kind", ["grey", "colour"])
@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["denoise"], []),
        (["denoise"], ["--sigma", "25"]),
        (["inpaint"], ["--mask", "MASK"]),
        (["segment"], []),
    ],
)
def test_task_commands_write_a_png_and_print_stats(files, tmp_path, capsys, kind, command, extra) -> None:
    out = tmp_path / "out.png"
    extra = [str(files["mask"]) if e == "MASK" else e for e in extra]
    assert main([*command, str(files[kind]), "-o", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    assert "iterations" in printed and "converged True" in printed
    with Image.open(out) as im, Image.open(files[kind]) as src:
        assert im.size == src.size
        expected_mode = "L" if command == ["segment"] else src.mode
        assert im.mode == expected_mode


def test_segment_probability_output_and_errors(files, tmp_path, capsys) -> None:
    out = tmp_path / "p.png"
    assert (
        main(["segment", str(files["grey"]), "-o", str(out), "--output", "probability", "--threshold", "0.5"])
        == 0
    )
    assert read_image(out).unique().numel() > 2
    assert main(["denoise", str(files["grey"]), "-o", str(out), "--model", "../../etc"]) == 2
    assert "invalid model name" in capsys.readouterr().err
    assert main(["denoise", str(files["grey"]), "-o", str(out), "--model", "inpaint-kglm"]) == 2
    assert main(["inpaint", str(files["grey"]), "-o", str(out), "--mask", str(tmp_path / "none.png")]) == 2
    # the stationary denoiser needs ~10 CG iterations; the default may converge in one
    args = [
        "denoise",
        str(files["grey"]),
        "-o",
        str(out),
        "--model",
        "denoise-stationary-kglm",
        "--max-iter",
        "1",
    ]
    assert main(args) == 3


def test_models_lists_the_repository(capsys) -> None:
    assert main(["models"]) == 0
    listed = capsys.readouterr().out
    for spec in DEFAULT_SPECS:
        assert f"{spec.name}:1" in listed


def test_init_from_a_spec_file_writes_a_loadable_checkpoint(tmp_path, capsys) -> None:
    spec = DEFAULT_SPECS[1].model_dump(mode="json") | {"name": "my-denoiser", "version": 3}
    spec["architecture"]["kernel"]["kernels"][0]["lengthscale"] = 2.5
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert main(["init", str(path), "--models-dir", str(tmp_path / "models")]) == 0
    assert "wrote" in capsys.readouterr().out
    model = load_predictor(tmp_path / "models" / "my-denoiser" / "3")
    assert model.predict(torch.rand(1, 1, 16, 16), sigma=25).stats.converged.all()
    path.write_text(json.dumps(spec | {"unknown": 1}))
    assert main(["init", str(path), "--models-dir", str(tmp_path / "models")]) == 2


def test_samples_writes_images_to_try(tmp_path) -> None:
    assert main(["samples", str(tmp_path / "s")]) == 0
    files = {p.name: Image.open(p) for p in (tmp_path / "s").iterdir()}
    assert set(files) == {"photo.png", "noisy.png", "holes.png", "scan.png"}
    assert files["photo.png"].mode == "RGB" and files["scan.png"].mode == "L"
    holes = torch.from_numpy(np.asarray(files["holes.png"]).copy())
    assert 0 < (holes > 0).float().mean() < 0.2  # some pixels to fill, most kept
    assert main(["denoise", str(tmp_path / "s" / "noisy.png"), "-o", str(tmp_path / "clean.png")]) == 0
