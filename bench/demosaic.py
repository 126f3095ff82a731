"""Demosaicking: the shipped ``demosaic-kglm`` against bilinear interpolation on the same mosaics.

    .venv/bin/python bench/demosaic.py [--data ../shared/data/Kodak24] [--crop 256] [--pattern RGGB]

Each colour image of ``--data`` (centre-cropped to ``--crop``², 0: whole) is sampled through the Bayer
``--pattern``; the model and bilinear interpolation (``tests.helpers.bilinear``: each missing sample
the tent-weighted mean of its colour's nearest samples) demosaic the same mosaic. Prints each image's
PSNR (dB, 4 pixels in from the border, where both see whole neighbourhoods) for both, their mean,
and the model's seconds per image; the data are read in place (research-only: never copied).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdeq.images.imageio import read_image  # noqa: E402
from kdeq.models.repository import default_models_dir, find_model, load_predictor  # noqa: E402
from kdeq.predictors.demosaic import cfa_mask  # noqa: E402
from kdeq.train.data import centre_crop  # noqa: E402
from kdeq.train.objectives import psnr  # noqa: E402
from tests.helpers import bilinear  # noqa: E402

BORDER = 4


def inner_psnr(out: torch.Tensor, clean: torch.Tensor) -> float:
    """PSNR (dB) of ``out`` clipped to [0, 1] against ``clean``, both ``(1, 3, H, W)``, within ``BORDER``."""
    inner = (..., slice(BORDER, -BORDER), slice(BORDER, -BORDER))
    return float(psnr(out[inner], clean[inner]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "Kodak24")
    parser.add_argument("--crop", type=int, default=256, help="centre crop side; 0: the whole image")
    parser.add_argument("--pattern", default="RGGB", choices=["RGGB", "BGGR", "GRBG", "GBRG"])
    args = parser.parse_args()
    files = sorted(p for p in args.data.iterdir() if p.suffix.lower() == ".png")
    if not files:
        raise SystemExit(f"no PNG images in {args.data}")
    model = load_predictor(find_model(default_models_dir(), "demosaic-kglm"))
    print(f"{model.name} ÷ bilinear, {args.pattern}, {args.crop or 'whole'} crops of {args.data}")
    ours, theirs, seconds = [], [], []
    for path in files:
        clean = read_image(path)
        if clean.shape[1] != 3:
            continue
        clean = centre_crop(clean, args.crop)
        observed = cfa_mask(args.pattern, *clean.shape[-2:])
        mosaic = (clean * observed).sum(dim=1, keepdim=True)
        start = time.perf_counter()
        out = model.predict(mosaic, pattern=args.pattern).output
        seconds.append(time.perf_counter() - start)
        ours.append(inner_psnr(out, clean))
        theirs.append(inner_psnr(bilinear(mosaic, args.pattern), clean))
        print(f"{path.name:<14} {ours[-1]:6.2f} dB   bilinear {theirs[-1]:6.2f} dB   {seconds[-1]:.2f} s")
    n = len(ours)
    print(
        f"mean of {n}: {sum(ours) / n:.2f} dB against bilinear's {sum(theirs) / n:.2f} dB "
        f"(+{(sum(ours) - sum(theirs)) / n:.2f} dB), {sum(seconds) / n:.2f} s per image"
    )


if __name__ == "__main__":
    main()
