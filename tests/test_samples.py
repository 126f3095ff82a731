"""``kdeq samples`` writes the files ``kdeq.images.samples.SAMPLE_FILES`` lists, and the README's examples use
them as made: the deblur example deblurs the blurred sample with the PSF that blurred it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from kdeq.cli import main
from kdeq.images.samples import BLUR_PSF, SAMPLE_FILES, write_samples
from kdeq.maths.operators import Blur
from kdeq.maths.psf import parse_psf

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _read(path: Path) -> np.ndarray:
    """``(c, H, W)`` float64 in [0, 1] of an 8-bit PNG."""
    arr = np.asarray(Image.open(path), dtype=np.float64) / 255.0
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def test_every_file_written_is_listed_with_a_one_line_description(tmp_path) -> None:
    paths = write_samples(tmp_path)
    assert paths == [tmp_path / name for name in SAMPLE_FILES]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SAMPLE_FILES)
    for path in paths:
        assert path.read_bytes().startswith(b"\x89PNG"), path
    for name, what in SAMPLE_FILES.items():
        assert what.strip() and "\n" not in what and len(what) <= 100, name


def test_blurred_is_the_photo_through_the_psf_with_a_little_noise(tmp_path) -> None:
    write_samples(tmp_path)
    photo, blurred = _read(tmp_path / "photo.png"), _read(tmp_path / "blurred.png")
    through = Blur(parse_psf(BLUR_PSF), "symmetric").forward(torch.from_numpy(photo)[None])[0].numpy()
    # what is left is the σ = 2 noise plus two 8-bit roundings (variance 1/12 level² each, at most)
    noise = (blurred - through).std() * 255
    assert 2.0 * 0.98 < noise < np.sqrt(2.0**2 + 2 / 12) * 1.02, noise
    # and the blur is there: the file is well away from the sharp photo, many times the noise
    assert np.sqrt(((blurred - photo) ** 2).mean()) * 255 > 3 * noise


def test_deblurring_the_blurred_sample_brings_it_closer_to_the_photo(tmp_path) -> None:
    write_samples(tmp_path, size=(96, 128))
    out = tmp_path / "sharp.png"
    assert main(["deblur", str(tmp_path / "blurred.png"), "--psf", BLUR_PSF, "-o", str(out)]) == 0
    photo = _read(tmp_path / "photo.png")
    before = ((_read(tmp_path / "blurred.png") - photo) ** 2).mean()
    after = ((_read(out) - photo) ** 2).mean()
    assert after < before / 2, (before, after)  # at least 3 dB nearer the sharp scene


def test_the_readme_lists_the_samples_and_deblurs_the_blurred_one() -> None:
    lines = [ln for ln in README.splitlines() if "kdeq samples ." in ln]
    assert len(lines) == 1
    listed = re.findall(r"[\w-]+\.png", lines[0].partition("#")[2])
    assert listed == list(SAMPLE_FILES)
    commands = [
        shlex.split(ln, comments=True) for ln in README.splitlines() if ln.startswith(("curl ", ".venv/"))
    ]
    over_http = [w for w in commands if w[0] == "curl" and w[-1].endswith("/deblur")]
    local = [w for w in commands if w[:2] == [".venv/bin/kdeq", "deblur"]]
    assert len(over_http) == 1 and len(local) == 1
    assert {"image=@blurred.png", f"psf={BLUR_PSF}"} <= set(over_http[0]), over_http
    assert local[0][2] == "blurred.png" and local[0][local[0].index("--psf") + 1] == BLUR_PSF, local
