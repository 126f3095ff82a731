"""Uncertainty maps through requests (``Request.uncertainty`` → ``Solved.uncertainty``): each Gaussian
task's map against the dense posterior built from the predictor's own arguments (``test_uncertainty``'s
reference), tiles put together, the models that have none, the CLI's ``--uncertainty`` and the 16-bit
file format (``kdeq.images.scaledpng``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kdeq.cli import main
from kdeq.images import scaledpng
from kdeq.maths.psf import parse_psf
from kdeq.models.repository import default_models_dir, find_model, load_predictor
from kdeq.predictors.uncertainty import posterior, unsupported
from kdeq.registry import TASKS
from kdeq.serving import tiling
from kdeq.tasks.base import Request, solve_batch
from tests.test_uncertainty import latest, reference_std, scene

SIDE = 16


def asking(request: Request) -> Request:
    return dataclasses.replace(request, uncertainty=True)


def image(c: int = 1, side: int = SIDE, seed: int = 0) -> np.ndarray:
    """A ``(c, side, side)`` float32 scene with an edge, a gradient and noise."""
    x = scene(side, 0.05, seed)[0].expand(c, -1, -1).clone()
    return x.clamp(0, 1).numpy().astype(np.float32)


def cases() -> list[tuple[str, str, int | None, Request, tuple, dict]]:
    """Per Gaussian task: the model, a request (built as the service's and the CLI's are) and the
    predictor's arguments written out by hand, for the dense reference."""
    x = image()
    t = torch.from_numpy(x)[None]
    missing = np.zeros((1, SIDE, SIDE), dtype=bool)
    missing[:, 5:10, 4:12] = True
    psf = parse_psf("gaussian:1.6")
    small = x[:, ::2, ::2].copy()
    denoise, inpaint, deblur, sr = (TASKS[n] for n in ("denoise", "inpaint", "deblur", "super-resolve"))
    return [
        ("denoise", "denoise-kglm", None, Request(x, denoise.options()), (t,), {"sigma": None}),
        (
            "denoise",
            "denoise-stationary-kglm",
            None,
            Request(x, denoise.options(sigma=20.0)),
            (t,),
            {"sigma": [20.0]},
        ),
        (
            "inpaint",
            "inpaint-kglm",
            None,
            Request(x, inpaint.options(), {"missing": missing}),
            (t, torch.from_numpy(missing)[None]),
            {},
        ),
        (
            "deblur",
            "deblur-kglm",
            2,
            Request(x, deblur.options(psf="gaussian:1.6"), {"psf": psf.numpy()}),
            (t, psf),
            {"sigma": None},
        ),
        (
            "super-resolve",
            "super-resolve-kglm",
            None,
            Request(small, sr.options(scale=2)),
            (torch.from_numpy(small)[None],),
            {"scale": 2},
        ),
    ]


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[1]}")
def test_a_requests_map_is_the_dense_posterior_and_leaves_the_solve_alone(case) -> None:
    task_name, model, version, request, args, kwargs = case
    task, predictor = TASKS[task_name], latest(model, version)
    assert unsupported(predictor) is None
    plain = solve_batch(task, predictor, [request])[0]
    asked = solve_batch(task, predictor, [asking(request)])[0]
    assert plain.uncertainty is None
    np.testing.assert_array_equal(asked.output, plain.output)  # the map does not touch the solve
    found = asked.uncertainty
    want = reference_std(predictor, *args, **kwargs).float().numpy()
    assert found.std.shape == want.shape == asked.output.shape[-2:]
    rel = np.abs(found.std - want) / want
    assert rel.mean() < (1e-5 if found.exact else 0.05), (model, rel.mean())
    assert found.exact == (found.probes == 0) and (found.error is None) == found.exact
    if not found.exact:  # its own error estimate is of the size it makes
        assert found.error < 0.05


def test_a_batch_gives_each_request_its_own_map() -> None:
    task, predictor = TASKS["denoise"], latest("denoise-stationary-kglm")
    requests = [asking(Request(image(seed=s), task.options(sigma=10.0 + 20 * s))) for s in range(2)]
    together = solve_batch(task, predictor, requests)
    for request, solved in zip(requests, together, strict=True):
        alone = solve_batch(task, predictor, [request])[0]
        np.testing.assert_array_equal(solved.uncertainty.std, alone.uncertainty.std)
    # a higher noise level is a less certain estimate everywhere
    assert (together[1].uncertainty.std > together[0].uncertainty.std).all()


def test_a_tiled_requests_map_is_its_tiles_put_together() -> None:
    """Tiles compute their maps within their windows: away from the tile seams it is the whole
    image's map; at the seams the halo keeps it close."""
    task, predictor = TASKS["denoise"], latest("denoise-stationary-kglm")
    request = asking(Request(image(side=64), task.options(sigma=25.0)))
    whole = solve_batch(task, predictor, [request])[0].uncertainty
    tiled = tiling.solve_tiled(task, predictor, request, 32)
    assert tiled.uncertainty.std.shape == (64, 64) and not tiled.uncertainty.exact
    assert tiled.uncertainty.probes == whole.probes
    rel = np.abs(tiled.uncertainty.std - whole.std) / whole.std
    assert rel.mean() < 0.03, rel.mean()


@pytest.mark.parametrize(("name", "version", "side"), [("inpaint", 3, 104), ("segment", 1, 72)])
def test_the_inpainters_and_segmenters_tiled_maps_are_close_to_the_whole_image_s(name, version, side) -> None:
    """As the denoiser's: each tile's map within its window (an inpainter's prior amplitude from its
    own observed pixels), close to the whole image's on average; a third of the side per tile with the
    model's reach as its halo, so that no window is the whole image."""
    task = TASKS[name]
    predictor = load_predictor(find_model(default_models_dir(), f"{name}-kglm", version))
    inputs = {"missing": np.random.default_rng(1).random((1, side, side)) < 0.4} if name == "inpaint" else {}
    request = asking(Request(image(side=side), task.options(), inputs))
    whole = solve_batch(task, predictor, [request])[0].uncertainty
    size = side // 3 // 2 * 2
    assert size + 2 * predictor.reach < side
    tiled = tiling.solve_tiled(task, predictor, request, size, halo=predictor.reach)
    assert tiled.uncertainty.std.shape == (side, side) and np.isfinite(tiled.uncertainty.std).all()
    rel = np.abs(tiled.uncertainty.std - whole.std) / whole.std
    assert 0 < rel.mean() < 0.1, rel.mean()


def test_an_inpainting_tile_with_nothing_observed_refuses_a_map() -> None:
    """The prior amplitude is estimated from the observed pixels: a tile inside a hole has none, and
    says so rather than claim any certainty."""
    task, predictor = TASKS["inpaint"], latest("inpaint-kglm")
    missing = np.zeros((1, 64, 64), bool)
    missing[:, :, 8:] = True  # every window but the first column's is all missing
    request = asking(Request(image(side=64), task.options(), {"missing": missing}))
    with pytest.raises(ValueError, match="no observed pixel"):
        tiling.solve_tiled(task, predictor, request, 16, halo=0)
    assert solve_batch(task, predictor, [request])[0].uncertainty is not None  # whole, it has one


def test_the_segmenters_map_through_a_request_and_the_cli(tmp_path: Path, capsys) -> None:
    """The segmenter's Laplace map (``kdeq.predictors.uncertainty``, tested against the dense covariance
    there) comes with a request, leaves its solve alone, and the CLI writes it."""
    task, predictor = TASKS["segment"], latest("segment-kglm")
    x = image()
    request = Request(x, task.options(output="probability"))
    plain = solve_batch(task, predictor, [request])[0]
    asked = solve_batch(task, predictor, [asking(request)])[0]
    np.testing.assert_array_equal(asked.output, plain.output)
    found = asked.uncertainty
    want = posterior(predictor, torch.from_numpy(x)[None], generator=torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(found.std, want.std[0, 0].numpy())
    assert not found.exact and found.probes == want.probes and 0 < found.error < 0.05
    # a probability's std is at most that of a coin, and largest where the model is least sure
    prob = plain.output[0]
    assert found.std.max() <= 0.5
    assert found.std[np.abs(prob - 0.5) < 0.2].mean() > found.std[np.abs(prob - 0.5) > 0.45].mean()
    source = write(tmp_path / "a.png", x)
    out = ["-o", str(tmp_path / "m.png"), "--uncertainty", str(tmp_path / "s.png")]
    assert main(["segment", str(source), *out]) == 0
    assert "std max" in capsys.readouterr().out
    assert scaledpng.decode(tmp_path / "s.png").shape == (SIDE, SIDE)


def test_models_without_a_gaussian_posterior_say_why() -> None:
    assert "plug-and-play" in unsupported(latest("deblur-kglm"))  # the default deblurrer (version 3)
    request = asking(TASKS["deblur"].warmup(SIDE))
    with pytest.raises(ValueError, match="plug-and-play"):
        solve_batch(TASKS["deblur"], latest("deblur-kglm"), [request])


def test_a_posterior_is_the_models_own_and_is_not_inherited_by_the_impulse_denoiser(capsys) -> None:
    """``has_posterior`` is whether the predictor class overrides ``gaussian_posterior``: every Gaussian
    task's does; the impulse denoiser, a guided denoiser underneath whose robust output is no Gaussian
    posterior mean, declines the method it would inherit, so its requests are refused, naming the
    tasks that have one, and its command takes no ``--uncertainty``."""
    has = {name for name, task in TASKS.items() if task.predictor.has_posterior}
    assert {"denoise", "inpaint", "segment", "deblur", "super-resolve", "denoise-poisson"} <= has
    assert "denoise-impulse" not in has
    impulse = latest("denoise-impulse-kglm")
    why = unsupported(impulse)
    assert why.startswith("the denoise-impulse task has no Gaussian posterior") and "'denoise'" in why
    with pytest.raises(ValueError, match=f"{impulse.name}: the denoise-impulse task has no Gaussian"):
        posterior(impulse, scene(SIDE), sigma=10.0)
    for name, offered in (("denoise", True), ("denoise-impulse", False)):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert ("--uncertainty" in capsys.readouterr().out) == offered


# --- the file format ---------------------------------------------------------------------------------


def test_scaled_png_round_trips_within_half_a_step(tmp_path: Path) -> None:
    values = np.random.default_rng(0).gamma(2.0, 0.01, size=(20, 30))
    data, scale = scaledpng.encode(values)
    assert scale == pytest.approx(values.max() / 65535)
    (tmp_path / "m.png").write_bytes(data)
    with Image.open(tmp_path / "m.png") as im:
        assert im.mode == "I;16" and im.size == (30, 20)
        assert float(im.info[scaledpng.SCALE_KEY]) == scale
    for back in (scaledpng.decode(data), scaledpng.decode(data, scale), scaledpng.decode(tmp_path / "m.png")):
        assert np.abs(back - values).max() <= scale / 2 * (1 + 1e-9)
    zeros, zero_scale = scaledpng.encode(np.zeros((3, 4)))
    assert zero_scale > 0 and not scaledpng.decode(zeros).any()
    for bad in (np.full((2, 2), -1.0), np.full((2, 2), np.nan), np.zeros(4)):
        with pytest.raises(ValueError, match="non-negative"):
            scaledpng.encode(bad)
    plain = tmp_path / "plain.png"
    Image.fromarray(np.zeros((2, 2), np.uint16)).save(plain)
    with pytest.raises(ValueError, match="give its scale"):
        scaledpng.decode(plain)


# --- the command line --------------------------------------------------------------------------------


def write(path: Path, x: np.ndarray) -> Path:
    Image.fromarray(np.rint(x[0] * 255).astype(np.uint8)).save(path)
    return path


def test_cli_writes_each_inputs_map_beside_its_output(tmp_path: Path, capsys) -> None:
    inputs = [write(tmp_path / f"{stem}.png", image(seed=s)) for s, stem in enumerate("ab")]
    common = ["--model", "denoise-stationary-kglm", "--sigma", "20"]
    assert (
        main(
            [
                "denoise",
                str(inputs[0]),
                "-o",
                str(tmp_path / "o.png"),
                "--uncertainty",
                str(tmp_path / "s.png"),
                *common,
            ]
        )
        == 0
    )
    line = capsys.readouterr().out
    assert "std max" in line and "probes" in line
    # the file alone reads back (its scale is in it) to the map of the request the CLI made
    task, predictor = TASKS["denoise"], latest("denoise-stationary-kglm")
    pixels = np.asarray(Image.open(inputs[0]), dtype=np.float32)[None] / 255
    want = solve_batch(task, predictor, [asking(Request(pixels, task.options(sigma=20.0)))])[
        0
    ].uncertainty.std
    back = scaledpng.decode(tmp_path / "s.png")
    assert np.abs(back - want).max() <= want.max() / 65535
    # several inputs: a folder of maps named after them
    out, stds = tmp_path / "out", tmp_path / "stds"
    assert main(["denoise", *map(str, inputs), "-o", str(out), "--uncertainty", str(stds), *common]) == 0
    assert sorted(p.name for p in stds.iterdir()) == ["a.png", "b.png"]
    np.testing.assert_allclose(scaledpng.decode(stds / "a.png"), back, rtol=0, atol=1e-12)
    capsys.readouterr()
    # refused: a map over an output, a model without a posterior
    assert (
        main(
            [
                "denoise",
                str(inputs[0]),
                "-o",
                str(tmp_path / "x.png"),
                "--uncertainty",
                str(tmp_path / "x.png"),
            ]
        )
        == 2
    )
    assert "overwrite" in capsys.readouterr().err
    assert (
        main(
            [
                "deblur",
                str(inputs[0]),
                "-o",
                str(tmp_path / "y.png"),
                "--psf",
                "gaussian:1.6",
                "--uncertainty",
                str(tmp_path / "z.png"),
            ]
        )
        == 2
    )
    assert "plug-and-play" in capsys.readouterr().err and not (tmp_path / "y.png").exists()
