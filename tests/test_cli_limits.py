"""``kdeq TASK`` refuses what the service refuses, by the same checks (``kdeq.images.imageio.open_image``):
each class of bad input, the same file to both, gives the CLI's exit status 2 with one line on
standard error and the service's 4xx with its JSON error; the pixel limits, the progress line, the
warning for an image with no noise to remove, and ``kdeq samples --help``."""

from __future__ import annotations

import io
import re
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from kdeq import cli
from kdeq.cli import UNRESOLVED_SIGMA, main
from kdeq.images import imageio
from kdeq.images.imageio import MAX_PIXELS, MAX_UNTILED_PIXELS, PIXEL_LIMITS, pixel_limit
from kdeq.maths.noise import estimate_sigma
from kdeq.serving import batchrun
from service.app import create_app
from service.settings import Settings, SettingsError
from tests.service_helpers import (
    MODELS,
    assert_error,
    encode,
    noisy,
    png_header_only,
    smooth_image,
    to_uint8,
)

#: the limits both sides run under here: small, so that "too many pixels" takes a tiny file
LIMIT, UNTILED, TILE = 8192, 4096, 64
LIMITS = ["--max-pixels", str(LIMIT), "--max-untiled-pixels", str(UNTILED), "--tile", str(TILE)]
SIDE = 32


def frames(count: int = 3) -> bytes:
    """A multi-page TIFF of ``count`` small grey pages."""
    pages = [Image.fromarray(to_uint8(smooth_image(SIDE, SIDE, s))) for s in range(count)]
    out = io.BytesIO()
    pages[0].save(out, format="TIFF", save_all=True, append_images=pages[1:])
    return out.getvalue()


GREY = encode(to_uint8(noisy(smooth_image(SIDE, SIDE), 20.0)))
MASK = np.zeros((SIDE, SIDE), np.uint8)
MASK[8:16, 8:24] = 255


#: the error codes of the checks ``kdeq.images.imageio`` makes for both (``load_image``, ``check_mask_size``)
SHARED_CHECKS = (
    "empty_file",
    "unsupported_media_type",
    "too_many_pixels",
    "image_too_small",
    "multi_frame",
    "size_mismatch",
)


@dataclass
class Case:
    """One bad input: the task, the image's bytes, file inputs' bytes by field, options as the form
    sends them (the CLI takes them as ``--name value``), and the service's status and error code."""

    name: str
    task: str
    image: bytes | None
    status: int
    error: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)


BOMB = png_header_only(100_000, 100_000)


def flat(height: int, width: int, value: int = 0) -> bytes:
    """A PNG of ``height × width`` grey pixels, all ``value``."""
    return encode(np.full((height, width), value, np.uint8))


CASES = [
    # the image itself
    Case("empty file", "denoise", b"", 400, "empty_file"),
    Case("not an image", "denoise", np.random.default_rng(7).bytes(3000), 415, "unsupported_media_type"),
    Case("truncated PNG", "denoise", GREY[:120], 415, "unsupported_media_type"),
    Case("GIF", "denoise", encode(Image.fromarray(to_uint8(smooth_image(SIDE, SIDE))), "GIF"), 415),
    Case("decompression bomb 100000×100000", "denoise", BOMB, 413, "too_many_pixels"),
    Case("over the pixel limit", "denoise", png_header_only(91, 91), 413, "too_many_pixels"),
    Case("all black, over the limit", "denoise", flat(91, 91), 413, "too_many_pixels"),
    Case(
        "over the untiled limit",
        "deblur",
        png_header_only(65, 64),
        413,
        "too_many_pixels",
        {},
        {"psf": "disk:2"},
    ),
    Case("1×1", "denoise", flat(1, 1), 422, "image_too_small"),
    Case("multi-frame TIFF", "denoise", frames(), 422, "multi_frame"),
    Case("output over the limit", "super-resolve", GREY, 413, "too_many_pixels", options={"scale": "4"}),
    Case("no image", "denoise", None, 400, options={"sigma": "20"}),
    # the options
    Case("sigma over its range", "denoise", GREY, 422, options={"sigma": "300"}),
    Case("sigma negative", "denoise", GREY, 422, options={"sigma": "-3"}),
    Case("sigma NaN", "denoise", GREY, 422, options={"sigma": "nan"}),
    Case("sigma not a number", "denoise", GREY, 400, options={"sigma": "loud"}),
    Case("threshold over its range", "segment", GREY, 422, options={"threshold": "2"}),
    Case("scale not a choice", "super-resolve", GREY, 422, options={"scale": "5"}),
    Case("an option of another variant", "denoise", GREY, 422, "misplaced_option", options={"peak": "6"}),
    Case("unknown model", "denoise", GREY, 404, "no_model", options={"model": "no-such-model"}),
    Case("model name with ../", "denoise", GREY, 400, "invalid_model", options={"model": "../../etc"}),
    Case("model of another task", "denoise", GREY, 404, "no_model", options={"model": "segment-kglm"}),
    # the file inputs
    Case("no mask", "inpaint", GREY, 400, "missing_mask"),
    Case("mask of the wrong size", "inpaint", GREY, 422, "size_mismatch", {"mask": flat(5, 5)}),
    Case("mask a decompression bomb", "inpaint", GREY, 413, "too_many_pixels", {"mask": BOMB}),
    Case("mask not an image", "inpaint", GREY, 415, "unsupported_media_type", {"mask": b"not an image"}),
    Case("mask all missing", "inpaint", GREY, 422, "nothing_observed", {"mask": flat(SIDE, SIDE, 255)}),
    Case("mask with nothing missing", "inpaint", GREY, 422, "nothing_missing", {"mask": flat(SIDE, SIDE)}),
    Case("no PSF", "deblur", GREY, 400, "psf_required"),
    Case(
        "PSF named and given",
        "deblur",
        GREY,
        422,
        "psf_twice",
        {"psf_image": encode(MASK)},
        {"psf": "disk:2"},
    ),
    Case("PSF of zeros", "deblur", GREY, 422, "invalid_psf", {"psf_image": flat(5, 5)}),
    Case("PSF named wrong", "deblur", GREY, 422, "invalid_psf", options={"psf": "square:3"}),
]


@pytest.fixture(scope="module")
def service():
    """The service in process, under ``LIMIT``, ``UNTILED`` and ``TILE``, with a model per task here."""
    settings = Settings(
        models_dir=MODELS,
        device=("cpu",),
        models=("denoise-kglm", "inpaint-kglm", "segment-kglm", "deblur-kglm", "super-resolve-kglm"),
        warmup=False,
        max_pixels=LIMIT,
        max_untiled_pixels=UNTILED,
        tile_size=TILE,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert client.app.state.service.wait_loaded(120)
        yield client


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``kdeq`` in process: its exit status (argparse's included) and its standard error."""
    try:
        code = main(argv)
    except SystemExit as done:
        code = done.code
    return code, capsys.readouterr().err


def assert_one_line(err: str) -> str:
    """``err`` is one line saying what was wrong: no traceback, no pydantic dump, no URL."""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and "http" not in err and "pydantic" not in err.lower(), err
    return err.strip()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_cli_and_the_service_refuse_each_bad_input_alike(case: Case, service, tmp_path, capsys) -> None:
    sent_files = {}
    paths = {"image": tmp_path / "image.png"}
    if case.image is not None:
        paths["image"].write_bytes(case.image)
        sent_files["image"] = ("image.png", case.image, "application/octet-stream")
    for name, data in case.files.items():
        paths[name] = tmp_path / f"{name}.png"
        paths[name].write_bytes(data)
        sent_files[name] = (f"{name}.png", data, "application/octet-stream")
    # options as parts of the multipart form too: a form without a file is still one
    sent_files |= {name: (None, value) for name, value in case.options.items()}
    response = service.post(f"/{case.task}", files=sent_files)
    body = assert_error(response, case.status, case.error)

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in case.options.items()]
    flags += [f"--{k.replace('_', '-')}={paths[k]}" for k in case.files]
    code, err = run_cli(
        [case.task, str(paths["image"]), "-o", str(tmp_path / "out.png"), *LIMITS, *flags], capsys
    )
    line = assert_one_line(err)
    assert code == 2 and line.startswith(f"kdeq {case.task}: error: "), line
    assert not (tmp_path / "out.png").exists()
    # where the refusal is the shared image check's, the words are the service's, the file named
    if case.error in SHARED_CHECKS:
        detail = body["detail"]
        if detail.startswith("`"):
            field_name = detail[1 : detail.index("`", 1)]
            assert str(paths[field_name]) in line, line
            detail = detail[detail.index("`", 1) + 1 :]
        # up to the decoder's own words, which name the file or stream it read
        assert detail.split(": ")[0] in line, (detail, line)
    # an option's refusal names the option and, where it has one, its allowed range
    for name in case.options:
        if case.error is None and case.status == 422:
            assert f"--{name}" in line, line
            assert re.search(r"\d", line), line


def test_the_header_is_checked_before_any_file_is_decoded(tmp_path, capsys, monkeypatch) -> None:
    """With a bomb second among several inputs, not even the first is decoded."""
    good, bomb = tmp_path / "good.png", tmp_path / "bomb.png"
    good.write_bytes(GREY)
    bomb.write_bytes(png_header_only(100_000, 100_000))
    decoded: list[str] = []
    real = imageio.load_image
    monkeypatch.setattr(imageio, "load_image", lambda src, *a: decoded.append(str(src)) or real(src, *a))
    code, err = run_cli(["denoise", str(good), str(bomb), "-o", str(tmp_path / "out")], capsys)
    line = assert_one_line(err)
    assert code == 2 and f"{bomb} declares more than {MAX_PIXELS} pixels" in line and "--max-pixels" in line
    assert decoded == [] and not (tmp_path / "out").exists()


def test_the_flags_raise_the_limits(tmp_path, capsys) -> None:
    """An image over a limit passes its header check once the flag raises it: the header-only file
    then fails at decoding, 415's words, not the pixel count's."""
    path = tmp_path / "wide.png"
    path.write_bytes(png_header_only(65, 64))
    out = ["-o", str(tmp_path / "out.png")]
    # deblur's model solves whole: the untiled limit is its limit
    deblur = ["deblur", str(path), *out, "--psf", "disk:2", "--max-pixels", str(LIMIT), "--tile", str(TILE)]
    code, err = run_cli([*deblur, "--max-untiled-pixels", str(UNTILED)], capsys)
    assert code == 2 and "over the limit of 4096 pixels" in err and "--max-untiled-pixels raises" in err
    code, err = run_cli([*deblur, "--max-untiled-pixels", str(LIMIT)], capsys)
    assert code == 2 and "cannot be decoded" in assert_one_line(err)
    # the denoiser solves in tiles: the same image is under its limit, that of every size
    code, err = run_cli(["denoise", str(path), *out, *LIMITS], capsys)
    assert code == 2 and "cannot be decoded" in assert_one_line(err)
    # --tile 0 solves whole: the untiled limit again
    code, err = run_cli(["denoise", str(path), *out, *LIMITS, "--tile", "0"], capsys)
    assert code == 2 and "--tile 0 solves images whole: --max-untiled-pixels raises" in assert_one_line(err)
    # a tile is solved whole, so it must fit the untiled limit, as KDEQ_TILE_SIZE must
    code, err = run_cli(["denoise", str(path), *out, "--max-untiled-pixels", "4096", "--tile", "66"], capsys)
    assert code == 2 and "--tile 66: a tile of 66² pixels exceeds" in assert_one_line(err)


def test_the_limits_are_one_definition_for_the_cli_and_the_service(capsys) -> None:
    defaults = Settings(models_dir=MODELS)
    assert (defaults.max_pixels, defaults.max_untiled_pixels) == (MAX_PIXELS, MAX_UNTILED_PIXELS)
    for value in (PIXEL_LIMITS[0] - 1, PIXEL_LIMITS[1] + 1):
        with pytest.raises(SettingsError):
            Settings.from_env({"KDEQ_MAX_PIXELS": str(value)})
        code, err = run_cli(["denoise", "x.png", "-o", "y.png", "--max-pixels", str(value)], capsys)
        assert code == 2 and f"[{PIXEL_LIMITS[0]}, {PIXEL_LIMITS[1]}]" in assert_one_line(err)
    for value in PIXEL_LIMITS:
        Settings.from_env({"KDEQ_MAX_PIXELS": str(value)})
        assert cli._pixel_count(str(value)) == value
    assert pixel_limit(True, LIMIT, UNTILED) == LIMIT and pixel_limit(False, LIMIT, UNTILED) == UNTILED
    assert pixel_limit(False, UNTILED, LIMIT) == UNTILED


# ------------------------------------------------------------------------------ σ estimated as ~0


def test_the_resolution_threshold_is_the_least_non_zero_grey_estimate() -> None:
    """On 8-bit grey pixels the estimate is 0 or at least ``UNRESOLVED_SIGMA``, a half grey level
    over Φ⁻¹(3/4), and a noise level a step above it is resolved."""
    rng = np.random.default_rng(3)
    clean = smooth_image(64, 64)
    seen = set()
    for sigma in (0.0, 0.1, 0.3, 0.6, 1.0, 2.0, 4.0):
        eight_bit = (
            np.round(np.clip(clean + sigma / 255 * rng.standard_normal(clean.shape), 0, 1) * 255) / 255
        )
        estimate = float(estimate_sigma(torch.from_numpy(eight_bit).float()[None, None])) * 255
        # float32 arithmetic: a relative 1e-5
        assert estimate == 0 or estimate >= UNRESOLVED_SIGMA * (1 - 1e-5), (sigma, estimate)
        seen.add(estimate == 0)
    assert seen == {True, False}
    assert abs(UNRESOLVED_SIGMA - 0.5 / 0.6744897501960817) < 1e-12


def test_a_noiseless_image_warns_once_and_a_noisy_or_given_one_does_not(tmp_path, capsys) -> None:
    black = tmp_path / "black.png"
    black.write_bytes(encode(np.zeros((SIDE, SIDE), np.uint8)))
    grey = tmp_path / "grey.png"
    grey.write_bytes(GREY)
    out = ["-o", str(tmp_path / "out.png")]
    code, err = run_cli(["denoise", str(black), *out], capsys)
    line = assert_one_line(err)
    assert code == 0 and line.startswith("kdeq denoise: warning: ") and str(black) in line
    assert f"{UNRESOLVED_SIGMA:.2f}" in line and "--sigma" in line
    assert run_cli(["denoise", str(black), *out, "--sigma", "10"], capsys) == (0, "")
    assert run_cli(["denoise", str(grey), *out], capsys) == (0, "")


# ------------------------------------------------------------------------------------------ progress


class Terminal(io.StringIO):
    """A standard error that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_one_long_solve_shows_progress_on_a_terminal_only(tmp_path, capsys, monkeypatch) -> None:
    """A single image solved whole has one unit of progress, done only at the end; the line still
    shows, redrawn by its thread while the solve runs: the solve here waits until it has been drawn
    (no clock involved). Not on a non-terminal: nothing but the result there."""
    source = tmp_path / "in.png"
    source.write_bytes(GREY)
    drawn = threading.Event()
    real = batchrun.solve_batch

    def solve_when_drawn(task, predictor, requests):
        assert drawn.wait(30), "no progress line while the solve ran"
        return real(task, predictor, requests)

    class Watched(Terminal):
        def write(self, text: str) -> int:
            if "0/1 images" in text:
                drawn.set()
            return super().write(text)

    terminal = Watched()
    monkeypatch.setattr(cli.Progress, "DELAY", 0.0)
    monkeypatch.setattr(cli.Progress, "EVERY", 0.01)
    monkeypatch.setattr(batchrun, "solve_batch", solve_when_drawn)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["denoise", str(source), "-o", str(tmp_path / "out.png"), "--sigma", "20"]) == 0
    shown = terminal.getvalue()
    assert "[" + "-" * cli.Progress.WIDTH + "] 0/1 images" in shown and "1/1 images" in shown
    assert shown.endswith("\r\033[K")  # erased at the end: the results are on standard output
    monkeypatch.undo()
    monkeypatch.setattr(cli.Progress, "DELAY", 0.0)
    assert main(["denoise", str(source), "-o", str(tmp_path / "out.png"), "--sigma", "20"]) == 0
    assert capsys.readouterr().err == ""


def test_a_cleared_line_stays_cleared_until_the_next_advance(monkeypatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(cli.Progress, "DELAY", 0.0)
    with cli.Progress(4, "tiles") as progress:
        progress.advance(1)
        assert re.search(r"\[#{7}-{23}\] 1/4 tiles, \d+ s, ~\d+ s left$", terminal.getvalue())
        progress.clear()
        cleared = terminal.getvalue()
        assert cleared.endswith("\r\033[K")
        progress.advance(1)
        assert terminal.getvalue().startswith(cleared) and "2/4 tiles" in terminal.getvalue()[len(cleared) :]


# ------------------------------------------------------------------------------------- samples --help


def test_samples_help_lists_every_file_written(tmp_path, capsys) -> None:
    from kdeq.images.samples import write_samples

    written = [path.name for path in write_samples(tmp_path, size=(32, 32))]
    with pytest.raises(SystemExit) as helped:
        main(["samples", "--help"])
    shown = capsys.readouterr().out
    assert helped.value.code == 0
    assert all(re.search(rf"^\s+{re.escape(name)}\s", shown, re.MULTILINE) for name in written), shown


def test_reading_turns_an_exif_rotated_image_as_the_service_does(tmp_path) -> None:
    """EXIF orientation 6 (turn 90° clockwise to display): the CLI's reader and the service's decoder,
    one ``load_image`` between them, both give the displayed image."""
    from service.decode import decode_image

    stored = to_uint8(smooth_image(24, 40))
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes())
    path = tmp_path / "turned.jpg"
    path.write_bytes(data)
    read = imageio.read_image(path)[0, 0].numpy()
    decoded = decode_image(data, "image", LIMIT).pixels[0]
    displayed = np.rot90(stored, k=-1) / 255.0
    assert read.shape == decoded.shape == displayed.shape == (40, 24)
    np.testing.assert_array_equal(read, decoded)
    # JPEG's loss on a smooth image is a few grey levels; the other turn is off by far more
    assert np.abs(read - displayed).mean() < 4 / 255 < np.abs(read - np.rot90(stored, k=1) / 255.0).mean()
