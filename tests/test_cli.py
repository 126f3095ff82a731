"""The offline CLI on real image files: every task on one or several files, models, init."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kdeq.cli import LOADED_WHEN_RUN, main
from kdeq.cli import test_image as piecewise_image
from kdeq.images.imageio import read_image, write_png
from kdeq.images.samples import SAMPLE_FILES
from kdeq.models.initialize import DEFAULT_SPECS
from kdeq.models.repository import load_predictor
from kdeq.registry import TASKS
from kdeq.serving import batchrun


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
    assert set(files) == set(SAMPLE_FILES)
    assert files["photo.png"].mode == "RGB" and files["scan.png"].mode == "L"
    # photon counts of the photo at a peak of 10, as stored: small integers, not a [0, 1] image
    assert files["counts.png"].mode == "L" and 5 <= np.asarray(files["counts.png"]).max() <= 40
    # salt and pepper: about a tenth of the pixels black or white in every channel
    impulses = np.asarray(files["impulses.png"])
    ends = ((impulses == 0) | (impulses == 255)).all(axis=-1).mean()
    assert files["impulses.png"].mode == "RGB" and 0.08 < ends < 0.15
    holes = torch.from_numpy(np.asarray(files["holes.png"]).copy())
    assert 0 < (holes > 0).float().mean() < 0.2  # some pixels to fill, most kept
    assert main(["denoise", str(tmp_path / "s" / "noisy.png"), "-o", str(tmp_path / "clean.png")]) == 0


# ---------------------------------------------------------------------------- several inputs, one process


def noisy_images(folder: Path, shapes: list[tuple[int, int]], colour: bool = False) -> list[Path]:
    """Noisy piecewise images of ``shapes`` written as ``folder/img<k>.png``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, (h, w) in enumerate(shapes):
        clean = piecewise_image(max(h, w))[0][:, :h, :w]
        clean = torch.cat([clean, clean.flip(-1), 1 - clean]) if colour else clean
        noisy = clean + 0.08 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(k))
        paths.append(folder / f"img{k}.png")
        write_png(paths[-1], noisy.clamp(0, 1))
    return paths


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im).astype(int)


@pytest.mark.parametrize("colour", [False, True])
def test_several_inputs_are_solved_in_one_call_as_each_alone(tmp_path, capsys, colour) -> None:
    # two 40×48 images share a batch, the 32×32 one has its own: two batches
    inputs = noisy_images(tmp_path / "in", [(40, 48), (32, 32), (40, 48)], colour)
    out = tmp_path / "out"
    common = ["--sigma", "20", "--model", "denoise-stationary-kglm"]
    assert main(["denoise", *map(str, inputs), "-o", str(out), "--batch-size", "4", *common]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sorted(p.name for p in out.iterdir()) == ["img0.png", "img1.png", "img2.png"]
    assert [line.split(": ")[0] for line in printed[:3]] == [str(inputs[0]), str(inputs[2]), str(inputs[1])]
    assert printed[-1].startswith("3 images in 2 batches: 3/3 converged")
    for path in inputs:
        alone = tmp_path / f"alone-{path.name}"
        assert main(["denoise", str(path), "-o", str(alone), *common]) == 0
        # the same system per image, to the solver's tolerance: at most one grey level apart
        assert np.abs(pixels(out / path.name) - pixels(alone)).max() <= 1


def test_masks_are_matched_to_inputs_by_name(tmp_path, capsys) -> None:
    inputs = noisy_images(tmp_path / "in", [(32, 32), (32, 32)])
    masks = tmp_path / "masks"
    masks.mkdir()
    for k, path in enumerate(inputs):
        gen = torch.Generator().manual_seed(10 + k)
        write_png(masks / path.name, (torch.rand(1, 32, 32, generator=gen) < 0.3).float())
    out = tmp_path / "out"
    assert main(["inpaint", *map(str, inputs), "-o", str(out), "--mask", str(masks)]) == 0
    for path in inputs:
        alone = tmp_path / f"alone-{path.name}"
        assert main(["inpaint", str(path), "-o", str(alone), "--mask", str(masks / path.name)]) == 0
        assert np.abs(pixels(out / path.name) - pixels(alone)).max() <= 1
    # a missing mask stops the run before anything is written
    (masks / inputs[1].name).unlink()
    capsys.readouterr()
    assert main(["inpaint", *map(str, inputs), "-o", str(tmp_path / "none"), "--mask", str(masks)]) == 2
    assert f"has no image named {inputs[1].stem}.*" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_several_inputs_refuse_clashing_names_a_file_as_folder_and_bad_files(tmp_path, capsys) -> None:
    a, b = noisy_images(tmp_path / "a", [(32, 32), (32, 32)])
    clash = tmp_path / "b" / a.name
    clash.parent.mkdir()
    clash.write_bytes(a.read_bytes())
    assert main(["denoise", str(a), str(clash), "-o", str(tmp_path / "out")]) == 2
    assert "would both be written to" in capsys.readouterr().err
    assert main(["denoise", str(a), str(b), "-o", str(a)]) == 2
    assert "with several inputs -o names a folder" in capsys.readouterr().err
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    assert main(["denoise", str(a), str(broken), "-o", str(tmp_path / "out")]) == 2
    assert "broken.png is not a PNG, JPEG, WebP or TIFF image" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_exit_status_is_3_when_any_solve_of_several_did_not_converge(tmp_path, capsys) -> None:
    inputs = noisy_images(tmp_path / "in", [(40, 40), (40, 40)])
    args = ["denoise", *map(str, inputs), "-o", str(tmp_path / "out"), "--model", "denoise-stationary-kglm"]
    assert main([*args, "--max-iter", "1"]) == 3
    assert "0/2 converged" in capsys.readouterr().out
    # every output is still written
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["img0.png", "img1.png"]


def test_batches_group_by_shape_and_batch_key_in_order_and_cut_to_size() -> None:
    task = TASKS["deblur"]

    def job(k: int, shape: tuple[int, int], psf: str) -> batchrun.Job:
        image = np.zeros((1, *shape), dtype=np.float32)
        request = task.prepare(image, None, task.options(psf=psf), {})
        return batchrun.Job(Path(f"in{k}.png"), Path(f"out{k}.png"), request)

    jobs = [
        job(0, (16, 16), "gaussian:1"),
        job(1, (16, 16), "disk:2"),  # another PSF: another batch
        job(2, (16, 16), "gaussian:1"),
        job(3, (16, 20), "gaussian:1"),  # another shape
        job(4, (16, 16), "gaussian:1"),
    ]
    got = [[j.source.name for j in batch] for batch in batchrun.batches(task, jobs, 2)]
    assert got == [["in0.png", "in2.png"], ["in4.png"], ["in1.png"], ["in3.png"]]
    with pytest.raises(ValueError, match="at least 1"):
        batchrun.batches(task, jobs, 0)


@pytest.mark.parametrize(
    ("per_image", "expected"),
    [
        ({1: 1.0, 2: 0.8, 4: 0.6, 8: 0.5}, [1, 1, 2, 4, 8, 6]),  # each doubling pays: up to 8
        ({1: 1.0, 2: 0.8, 4: 0.9, 8: 0.5}, [1, 1, 2, 4] + [2] * 7),  # 4 loses to 2: 8 is never tried
        ({1: 1.0, 2: 1.2, 4: 0.5, 8: 0.5}, [1, 1, 2] + [1] * 18),  # batching does not pay: stop at 2
    ],
)
def test_measured_batching_doubles_the_batch_while_it_is_faster(
    monkeypatch, per_image: dict[int, float], expected: list[int]
) -> None:
    """``run`` without a size, on a fake clock: image 1 alone (a warm-up), image 2 alone (timed), then
    batches of 2, 4 and 8 while each is faster per image than the best before, then the rest in
    batches of the fastest size."""
    clock = [0.0]
    sizes: list[int] = []

    def solve(task, predictor, requests):
        sizes.append(len(requests))
        # a batch of 6 costs what one of 8 does per image
        cost = per_image[1 << (len(requests) - 1).bit_length()]
        clock[0] += cost * len(requests) if len(sizes) > 1 else 100.0
        return [f"solved {r}" for r in requests]

    monkeypatch.setattr(batchrun, "solve_batch", solve)
    monkeypatch.setattr(batchrun.time, "perf_counter", lambda: clock[0])
    task = TASKS["denoise"]
    image = np.zeros((1, 8, 8), dtype=np.float32)
    jobs = [
        batchrun.Job(Path(f"{k}.png"), Path(f"o{k}.png"), task.prepare(image, None, task.options(), {}))
        for k in range(22)
    ]
    done = list(batchrun.run(task, None, jobs, None))
    assert sizes == expected
    assert [job.source.name for batch, _, _ in done for job in batch] == [f"{k}.png" for k in range(22)]
    assert all(len(batch) == len(solved) for batch, solved, _ in done)


def test_a_task_command_loads_none_of_the_trainers_modules_and_they_load_when_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kdeq denoise`` in a fresh interpreter imports neither the trainer's nor the experiments'
    modules (``kdeq.cli.LOADED_WHEN_RUN``), nor ``kdeq.models.initialize`` and ``kdeq.images.samples``; each
    of those commands still parses its own options."""
    source = tmp_path / "in.png"
    write_png(source, piecewise_image(32)[0])
    script = (
        "import sys; from kdeq.cli import main; "
        f"code = main(['denoise', {str(source)!r}, '-o', {str(tmp_path / 'out.png')!r}, '--sigma', '20']); "
        "print(sorted(m for m in sys.modules if m.startswith('kdeq')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    assert "kdeq.tasks" in loaded and (tmp_path / "out.png").exists()
    lazy = {module for module, _, _ in LOADED_WHEN_RUN.values()} | {
        "kdeq.models.initialize",
        "kdeq.images.samples",
    }
    assert not lazy & loaded, lazy & loaded
    for path in LOADED_WHEN_RUN:
        with pytest.raises(SystemExit) as helped:
            main([*path, "--help"])
        assert helped.value.code == 0 and "--" in capsys.readouterr().out
