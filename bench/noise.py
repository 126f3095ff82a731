"""The noise-level estimates (``kdeq.maths.noise``) against the truth: the Haar estimate and the one
``estimate_sigma`` gives, side by side, in one run; with ``--jpeg``, blind denoising of JPEG inputs.

    .venv-bench/bin/python bench/noise.py [--sets Set12 BSD68 CBSD68 Kodak24] [--sigmas 5 15 25 50]
    .venv-bench/bin/python bench/noise.py --jpeg [--sets Set12 CBSD68] [--sigmas 15 25 50]
        [--qualities 75 90 95] [--images 4] [--crop 192]

Protocol: each image of each set with ``bench/baselines.py``'s Gaussian noise (seed = the image's
index), both estimates on the same noisy image (one thread). Prints a Markdown table per set and σ:
each estimate's error in grey levels (mean, rms, largest) and its mean milliseconds per image: the
whole image's Haar estimate (``haar_sigma``) beside ``estimate_sigma`` (the flattest tiles' for grey
sets, the patch covariance's for colour ones). Needs ``../shared/data``.

``--jpeg`` protocol: the central ``crop``² of the first ``images`` images of each set, with the same
noise, clipped and rounded to 8 bits (as an image file holds it), saved by Pillow as a JPEG of each
quality (its defaults: 4:2:0 colour) and decoded; and the 8-bit image itself ("PNG"). On each, the
default denoiser ``models/denoise-kglm/8`` (one thread) with σ given, with the estimate of
``plain_sigma`` (what ``estimate_sigma`` returned before JPEGs were told apart, the baseline) and with
``estimate_sigma``'s. Prints per set, σ and quality: the share told to be JPEGs, the two estimates
(mean), and the mean PSNR of the three denoisings against the clean crop with the differences
(``estimate_sigma``'s minus the baseline's, and minus σ given's); on the PNGs, the largest change of the
estimate (0: non-JPEG estimates are unchanged).
"""

from __future__ import annotations

import argparse
import io
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines as B

from kdeq.maths.noise import estimate_noise, estimate_sigma, haar_sigma, plain_sigma

DENOISER = Path(__file__).resolve().parent.parent / "models" / "denoise-kglm" / "8"


def errors(estimator, images: list[torch.Tensor], sigma: float) -> tuple[np.ndarray, float]:
    """Each image's ``255·σ̂ − σ`` and the mean seconds per image."""
    out, seconds = [], 0.0
    for x in images:
        start = time.perf_counter()
        value = float(estimator(x))
        seconds += time.perf_counter() - start
        out.append(255.0 * value - sigma)
    return np.array(out), seconds / len(images)


def jpeg_round_trip(image: np.ndarray, quality: int | None) -> np.ndarray:
    """``image`` (float in [0, 1], ``H×W`` or ``H×W×3``) clipped and rounded to 8 bits, then saved by
    Pillow as a JPEG of ``quality`` and decoded (``None``: not), as float in [0, 1]."""
    from PIL import Image

    pixels = np.clip(np.round(255 * image), 0, 255).astype(np.uint8)
    if quality is not None:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
        pixels = np.asarray(Image.open(io.BytesIO(buffer.getvalue())))
    return pixels.astype(np.float32) / 255


def jpeg_table(args: argparse.Namespace) -> None:
    """The ``--jpeg`` protocol (module docstring)."""
    from kdeq.models.repository import load_predictor

    model = load_predictor(DENOISER)
    print(f"model {model.name}, central {args.crop}² crops of the first {args.images} images")
    print(
        "| set | σ | JPEG quality | told JPEG | σ̂ baseline → now | PSNR σ given | baseline | now"
        " | now − baseline | now − given | ms per estimate (baseline, now) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sets:
        clean = []
        for _, c in B.load_set(name, args.images):
            i, j = (c.shape[0] - args.crop) // 2, (c.shape[1] - args.crop) // 2
            clean.append(c[i : i + args.crop, j : j + args.crop])
        for sigma in args.sigmas:
            for quality in [*args.qualities, None]:
                rows, seconds = [], np.zeros(2)
                for k, c in enumerate(clean):
                    y = torch.from_numpy(jpeg_round_trip(B.add_noise(c, sigma, k), quality))
                    x = y[None, None] if y.dim() == 2 else y.permute(2, 0, 1)[None].contiguous()
                    start = time.perf_counter()
                    before = float(plain_sigma(x[0]))
                    seconds[0] += time.perf_counter() - start
                    start = time.perf_counter()
                    now = estimate_noise(x)
                    seconds[1] += time.perf_counter() - start

                    def score(s: float, x: torch.Tensor = x, c: np.ndarray = c) -> float:
                        out = model.predict(x, sigma=s).output[0]
                        return B.psnr((out[0] if out.shape[0] == 1 else out.permute(1, 2, 0)).numpy(), c)

                    after = float(now.sigma[0])
                    baseline = score(255 * before)
                    # an unchanged estimate denoises alike: its PSNR is not measured twice
                    rows.append(
                        (
                            float(now.jpeg[0]),
                            255 * before,
                            255 * after,
                            score(sigma),
                            baseline,
                            score(255 * after) if after != before else baseline,
                        )
                    )
                m = np.array(rows)
                mean = m.mean(axis=0)
                label = "PNG" if quality is None else str(quality)
                estimates = f"{mean[1]:.1f} → {mean[2]:.1f}"
                if quality is None:
                    estimates += f" (largest change {np.abs(m[:, 2] - m[:, 1]).max():.2g})"
                cells = [name, f"{sigma:g}", label, f"{mean[0]:.0%}", estimates]
                cells += [f"{v:.2f}" for v in mean[3:]]
                cells += [f"{mean[5] - mean[4]:+.2f}", f"{mean[5] - mean[3]:+.2f}"]
                cells += [f"{1e3 * seconds[0] / len(clean):.1f}, {1e3 * seconds[1] / len(clean):.1f}"]
                print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+")
    parser.add_argument("--sigmas", nargs="+", type=float)
    parser.add_argument("--jpeg", action="store_true", help="blind denoising of JPEG inputs")
    parser.add_argument("--qualities", nargs="+", type=int, default=[75, 90, 95])
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--crop", type=int, default=192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, 1 thread")
    if args.jpeg:
        args.sets = args.sets or ["Set12", "CBSD68"]
        args.sigmas = args.sigmas or [15.0, 25.0, 50.0]
        jpeg_table(args)
        return
    args.sets = args.sets or ["Set12", "BSD68", "CBSD68", "Kodak24"]
    args.sigmas = args.sigmas or [5.0, 15.0, 25.0, 50.0]
    print("| set | σ | Haar: mean / rms / largest error | `estimate_sigma` | ms per image (both) |")
    print("|---|---|---|---|---|")
    for name in args.sets:
        clean = [c for _, c in B.load_set(name)]
        for sigma in args.sigmas:
            images = []
            for i, c in enumerate(clean):
                y = torch.from_numpy(B.add_noise(c, sigma, i)).float()
                images.append(y[None, None] if y.dim() == 2 else y.permute(2, 0, 1)[None].contiguous())
            haar, t_haar = errors(haar_sigma, images, sigma)
            est, t_est = errors(estimate_sigma, images, sigma)

            def cell(e: np.ndarray) -> str:
                return f"{e.mean():+.2f} / {np.sqrt((e**2).mean()):.2f} / {np.abs(e).max():.2f}"

            print(
                f"| {name} | {sigma:g} | {cell(haar)} | {cell(est)} | {1e3 * t_haar:.1f}, {1e3 * t_est:.1f} |"
            )


if __name__ == "__main__":
    main()
