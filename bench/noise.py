"""The noise-level estimates (``kdeq.noise``) against the truth: the Haar estimate and the one
``estimate_sigma`` gives, side by side, in one run.

    .venv-bench/bin/python bench/noise.py [--sets Set12 BSD68 CBSD68 Kodak24] [--sigmas 5 15 25 50]

Protocol: each image of each set with ``bench/baselines.py``'s Gaussian noise (seed = the image's
index), both estimates on the same noisy image (one thread). Prints a Markdown table per set and σ:
each estimate's error in grey levels (mean, rms, largest) and its mean milliseconds per image: the
whole image's Haar estimate (``haar_sigma``) beside ``estimate_sigma`` (the flattest tiles' for grey
sets, the patch covariance's for colour ones). Needs ``../shared/data``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines as B

from kdeq.noise import estimate_sigma, haar_sigma


def errors(estimator, images: list[torch.Tensor], sigma: float) -> tuple[np.ndarray, float]:
    """Each image's ``255·σ̂ − σ`` and the mean seconds per image."""
    out, seconds = [], 0.0
    for x in images:
        start = time.perf_counter()
        value = float(estimator(x))
        seconds += time.perf_counter() - start
        out.append(255.0 * value - sigma)
    return np.array(out), seconds / len(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["Set12", "BSD68", "CBSD68", "Kodak24"])
    parser.add_argument("--sigmas", nargs="+", type=float, default=[5.0, 15.0, 25.0, 50.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, 1 thread")
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
