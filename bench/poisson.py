"""Photon-limited denoising (issue 25, part 2): kdeq's Poisson kGLM against the variance-stabilising
baselines, in one run.

    .venv-bench/bin/python bench/poisson.py [--sets Set12 BSD68] [--peaks 1 2 4 8 30] [--limit N]
        [--models NAME:VERSION …] [--no-bm3d] [--out FILE]

Protocol: a clean grey image ``x`` in [0, 1] (the set's 8-bit PNG ÷ 255), counts ``y ~ Poisson(peak·x)``
drawn from ``numpy.random.default_rng([index, round(10·peak)])`` (``index`` the image's 0-based place in
the sorted set), every method's rate estimate ``r̂`` scored by the PSNR of ``clip(r̂/peak, 0, 1)``
against ``x``. The methods:

- kdeq's ``denoise-poisson`` models (``--models``; default every shipped version), through
  ``solve_batch`` as the service and the CLI solve them, told the peak;
- Anscombe ``a = 2√(y + 3/8)``, scaled to ``u = (a − a(0))/(a(P) − a(0))`` with ``P`` the counts'
  99.9th percentile (so that its noise is ``σ = 1/(a(P) − a(0))`` on [0, 1]), denoised at that ``σ``
  by scikit-image's non-local means, by BM3D (``bench/baselines.py``, their defaults) and by kdeq's
  Gaussian default ``denoise-kglm`` (each version), then mapped back by the closed-form
  approximation of the exact unbiased inverse (Mäkitalo & Foi 2011,
  ``kdeq.predictors.photon.inverse_anscombe``).

Reported per set and peak: mean PSNR (dB), mean seconds per image, and for kdeq's models the mean
iterations and whether every solve converged. Needs ``../shared/data`` and the benchmark environment
(scikit-image, bm3d).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines as B

from kdeq.models.repository import default_models_dir, find_reference, list_models, load_predictor
from kdeq.predictors.photon import ANSCOMBE_ZERO, GUIDE_QUANTILE, anscombe, inverse_anscombe
from kdeq.registry import TASKS
from kdeq.tasks.base import Request, solve_batch


def counts(clean: np.ndarray, peak: float, index: int) -> np.ndarray:
    """``y ~ Poisson(peak·x)`` ``(H, W)`` float64 for the image ``index`` of its set (module docstring)."""
    return np.random.default_rng([index, round(10 * peak)]).poisson(peak * clean).astype(np.float64)


def stabilised(y: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The scaled Anscombe image ``u``, its noise ``σ`` on the 0–255 scale and the span ``a(P) − a(0)``."""
    bright = max(float(np.quantile(y, GUIDE_QUANTILE)), 1.0)
    span = float(anscombe(torch.tensor(bright))) - ANSCOMBE_ZERO
    a = anscombe(torch.from_numpy(y)).numpy()
    return (a - ANSCOMBE_ZERO) / span, 255.0 / span, span


def via_anscombe(denoise: Callable[[np.ndarray, float], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """The rate estimator ``y ↦ I(span·denoise(u, σ) + a(0))`` for a Gaussian denoiser of ``u`` at ``σ``."""

    def estimate(y: np.ndarray) -> np.ndarray:
        u, sigma, span = stabilised(y)
        return inverse_anscombe(torch.from_numpy(denoise(u, sigma) * span + ANSCOMBE_ZERO)).numpy()

    return estimate


def kdeq_gaussian(ref: str) -> Callable[[np.ndarray, float], np.ndarray]:
    """kdeq's Gaussian denoiser ``ref`` on ``u`` at ``σ`` (capped at 255, the largest level it takes)."""
    predictor = load_predictor(_path(ref))
    task = TASKS["denoise"]

    def run(u: np.ndarray, sigma: float) -> np.ndarray:
        options = task.options(sigma=min(sigma, 255.0))
        [solved] = solve_batch(task, predictor, [Request(u[None].astype(np.float32), options)])
        return solved.output[0].astype(np.float64)

    return run


def _path(ref: str) -> Path:
    return find_reference(default_models_dir(), ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", nargs="+", default=["Set12", "BSD68"])
    parser.add_argument("--peaks", nargs="+", type=float, default=[1, 2, 4, 8, 30])
    parser.add_argument("--limit", type=int, default=None, help="the first N images of each set")
    parser.add_argument("--models", nargs="+", default=None, help="denoise-poisson models (NAME:VERSION)")
    parser.add_argument("--no-bm3d", action="store_true", help="leave BM3D out (the slowest baseline)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    shipped = [
        e
        for e in list_models(default_models_dir())
        if e.config is not None and e.config.task == "denoise-poisson"
    ]
    refs = args.models or [f"{e.name}:{e.version}" for e in shipped]
    task = TASKS["denoise-poisson"]
    methods: dict[str, Callable[[np.ndarray, float], tuple[np.ndarray, int | None, bool | None]]] = {}
    for ref in refs:
        predictor = load_predictor(_path(ref))

        def poisson(y: np.ndarray, peak: float, predictor=predictor) -> tuple[np.ndarray, int, bool]:
            request = Request(y[None].astype(np.float32), task.options(peak=peak))
            [solved] = solve_batch(task, predictor, [request])
            return solved.output[0].astype(np.float64) * peak, solved.iterations, solved.converged

        methods[ref] = poisson
    gaussians = [
        f"{e.name}:{e.version}" for e in list_models(default_models_dir()) if e.name == "denoise-kglm"
    ]
    baselines = {f"Anscombe + {ref}": via_anscombe(kdeq_gaussian(ref)) for ref in gaussians}
    baselines["Anscombe + NLM (scikit-image)"] = via_anscombe(B.nlm_skimage)
    if not args.no_bm3d:
        baselines["Anscombe + BM3D"] = via_anscombe(B.bm3d_denoise)
    for name, fn in baselines.items():
        methods[name] = lambda y, peak, fn=fn: (fn(y), None, None)

    figures: dict = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "results": [],
    }
    for set_name in args.sets:
        images = B.load_set(set_name, args.limit)
        for peak in args.peaks:
            rows = {name: {"psnr": [], "seconds": [], "iterations": [], "converged": []} for name in methods}
            for index, (_, clean) in enumerate(images):
                y = counts(clean, peak, index)
                for name, method in methods.items():
                    start = time.perf_counter()
                    rate, iterations, converged = method(y, peak)
                    rows[name]["seconds"].append(time.perf_counter() - start)
                    rows[name]["psnr"].append(B.psnr(rate / peak, clean))
                    if iterations is not None:
                        rows[name]["iterations"].append(iterations)
                        rows[name]["converged"].append(converged)
            print(f"\n{set_name} ({len(images)} images), peak {peak:g}")
            print("| method | PSNR (dB) | s / image | iterations | all converged |\n|---|---|---|---|---|")
            for name, row in rows.items():
                entry = {
                    "set": set_name,
                    "peak": peak,
                    "method": name,
                    "psnr": statistics.fmean(row["psnr"]),
                    "seconds": statistics.fmean(row["seconds"]),
                    "iterations": statistics.fmean(row["iterations"]) if row["iterations"] else None,
                    "converged": all(row["converged"]) if row["converged"] else None,
                }
                figures["results"].append(entry)
                its = "" if entry["iterations"] is None else f"{entry['iterations']:.1f}"
                conv = "" if entry["converged"] is None else ("yes" if entry["converged"] else "**no**")
                print(
                    f"| {name} | {entry['psnr']:.2f} | {entry['seconds']:.3f} | {its} | {conv} |", flush=True
                )
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
