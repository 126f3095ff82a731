"""Gaussian noise plus salt-and-pepper impulses: the robust kGLM denoiser against the median filter,
median then NLM, and the default model, measured side by side.

    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/robust.py [--sigmas 15,25] [--rates 0,5,10,20]
        [--limit N] [--no-variants] [--clip]

Protocol (``bench/baselines.py``): Set12, float images in [0, 1]; for image ``i`` (0-based, sorted)
``rng = default_rng(i)`` draws the Gaussian noise ``N(0, (σ/255)²)`` (not clipped) and then, from
``rng.random``, the impulses: a fraction ``rate`` of the pixels, half set to 0 and half to 1. PSNR
on the output clipped to [0, 1]; the mean over the images. Methods, every one in this process on the
same inputs (seconds per image at the process's torch and OpenMP threads):

- ``median k×k``: ``scipy.ndimage.median_filter`` (mirrored borders), 3×3, and 5×5 at 20 %;
- ``median→NLM``: scikit-image's NLM (``baselines.nlm_skimage``) on the median output, its ``σ``
  estimated there by ``skimage.restoration.estimate_sigma`` (the median has changed the noise);
  ``σ given`` instead passes the nominal ``σ``;
- ``denoise-kglm:2``, the default model, ``σ`` estimated by the model (what a user gets) and given;
- ``robust``: ``kdeq.predictors.robust.RobustDenoiser`` on that model's kernel, ``σ`` estimated
  (``robust_sigma``) and given; and, unless ``--no-variants``, its ablations (``σ`` estimated):
  ``mask only`` (``γ = 10⁻⁶``: the unobserved pixels weighted 0, every other one 1), ``every end
  pixel unobserved`` (``κₑ = 0``), ``on denoise-kglm:1`` (the guided kernel without the network),
  ``Welsch only`` (``ends=None``: no pixel unobserved; pixels further than 5σ from their median
  flagged for the guide and mean), per pixel and on 3×3 patches (``γ = 0.5``).

``--clip`` clips the corrupted images to [0, 1] and rounds them to 8 bits, as a file a user sends
holds them: the Gaussian noise then also puts pixels at the range's ends, which the robust denoiser
keeps observed unless they are far from their neighbours.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines as B

from kdeq.models.repository import default_models_dir, find_model, load_predictor
from kdeq.predictors.robust import RobustDenoiser


def corrupt(img: np.ndarray, sigma255: float, rate: float, seed: int, clip: bool = False) -> np.ndarray:
    """``img`` plus Gaussian noise, then a fraction ``rate`` of its pixels set to 0 or 1 (half each);
    ``clip``: then clipped to [0, 1] and rounded to 8 bits, as an image file holds it."""
    rng = np.random.default_rng(seed)
    y = img + sigma255 / 255.0 * rng.standard_normal(img.shape)
    u = rng.random(img.shape)
    y[u < rate / 2] = 0.0
    y[(u >= rate / 2) & (u < rate)] = 1.0
    return np.round(np.clip(y, 0.0, 1.0) * 255.0) / 255.0 if clip else y


def median(y: np.ndarray, size: int) -> np.ndarray:
    from scipy.ndimage import median_filter

    return median_filter(y, size=size, mode="mirror")


def median_nlm(y: np.ndarray, size: int, sigma255: float | None) -> np.ndarray:
    from skimage.restoration import estimate_sigma

    m = median(y, size)
    s = 255.0 * float(estimate_sigma(m)) if sigma255 is None else sigma255
    return B.nlm_skimage(m, s)


def to_tensor(y: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(y.astype(np.float32))[None, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sigmas", default="15", help="Gaussian noise levels (0–255), comma-separated")
    ap.add_argument("--rates", default="0,5,10,20", help="impulse percentages, comma-separated")
    ap.add_argument("--limit", type=int, default=None, help="first N images of Set12")
    ap.add_argument("--no-variants", action="store_true", help="skip the robust denoiser's variants")
    ap.add_argument("--clip", action="store_true", help="clip the observations to [0, 1], 8 bits")
    args = ap.parse_args()
    sigmas = [float(s) for s in args.sigmas.split(",")]
    rates = [float(r) / 100 for r in args.rates.split(",")]

    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}; "
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )
    images = B.load_set("Set12", args.limit)
    model = load_predictor(find_model(default_models_dir(), "denoise-kglm", 2))
    robust = RobustDenoiser(model)
    plain = load_predictor(find_model(default_models_dir(), "denoise-kglm", 1))
    variants = {
        "robust, mask only (γ → 0)": RobustDenoiser(model, gamma=1e-6),
        "robust, every end pixel unobserved (κₑ = 0)": RobustDenoiser(model, ends=0.0),
        "robust on denoise-kglm:1": RobustDenoiser(plain),
        "robust, Welsch only": RobustDenoiser(model, ends=None, outlier=5.0),
        "robust, Welsch only, patch 3×3": RobustDenoiser(model, ends=None, outlier=5.0, patch=1, gamma=0.5),
    }

    for sigma in sigmas:
        for rate in rates:
            methods: dict[str, Callable[[np.ndarray], tuple[np.ndarray, int | None]]] = {
                "median 3×3": lambda y: (median(y, 3), None),
                "median 3×3 → NLM": lambda y: (median_nlm(y, 3, None), None),
                "median 3×3 → NLM, σ given": lambda y, s=sigma: (median_nlm(y, 3, s), None),
            }
            if rate >= 0.2:
                methods["median 5×5"] = lambda y: (median(y, 5), None)
                methods["median 5×5 → NLM"] = lambda y: (median_nlm(y, 5, None), None)

            def kglm(s: float | None) -> Callable[[np.ndarray], tuple[np.ndarray, int | None]]:
                def run(noisy: np.ndarray) -> tuple[np.ndarray, int | None]:
                    p = model.predict(to_tensor(noisy), s)
                    return p.output[0, 0].double().numpy(), int(p.stats.iterations[0])

                return run

            def robust_run(
                den: RobustDenoiser, s: float | None
            ) -> Callable[[np.ndarray], tuple[np.ndarray, int | None]]:
                def run(noisy: np.ndarray) -> tuple[np.ndarray, int | None]:
                    r = den(to_tensor(noisy), s)
                    if not bool(r.stats.converged[0]):
                        print(f"  note: not converged (residual {float(r.stats.residual[0]):.1e})")
                    return r.output[0, 0].double().numpy(), int(r.stats.iterations[0])

                return run

            methods["denoise-kglm:2, σ estimated"] = kglm(None)
            methods["denoise-kglm:2, σ given"] = kglm(sigma)
            methods["robust, σ estimated"] = robust_run(robust, None)
            methods["robust, σ given"] = robust_run(robust, sigma)
            if not args.no_variants:
                for name, den in variants.items():
                    methods[f"{name}, σ estimated"] = robust_run(den, None)

            scores: dict[str, list[float]] = {k: [] for k in methods}
            times: dict[str, list[float]] = {k: [] for k in methods}
            iters: dict[str, list[int]] = {k: [] for k in methods}
            for i, (_, img) in enumerate(images):
                y = corrupt(img, sigma, rate, i, args.clip)
                for name, fn in methods.items():
                    start = time.perf_counter()
                    out, it = fn(y)
                    times[name].append(time.perf_counter() - start)
                    scores[name].append(B.psnr(out, img))
                    if it is not None:
                        iters[name].append(it)
            clipped = ", clipped to 8 bits" if args.clip else ""
            print(f"\nσ = {sigma:g}, impulses {100 * rate:g} %{clipped}, Set12 ({len(images)} images)")
            print("| method | PSNR (dB) | s/image | iterations (mean, max) |")
            print("|---|---:|---:|---|")
            for name in methods:
                it = iters[name]
                it_cell = f"{np.mean(it):.1f}, {max(it)}" if it else "—"
                print(f"| {name} | {np.mean(scores[name]):.2f} | {np.mean(times[name]):.2f} | {it_cell} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
