"""Quality of the default kGLM models against classical baselines, measured side by side.

    .venv-bench/bin/python bench/quality.py [--seed 0] [--no-bm3d] [--bsd68] [--colour N]

Protocol (``bench/baselines.py``): float images in [0, 1]; noise ``N(0, (σ/255)²)``
with seed = image index (+ ``--seed``), not clipped; PSNR on the clipped output;
random masks from ``default_rng(index)``. Every method runs in this process on
the same inputs; times are seconds per image on this machine with torch's
default threads. Needs ``../shared/data`` and the benchmark environment
(scikit-image, opencv-python-headless, bm3d, scipy); BM3D is a benchmark
reference only, never a dependency of kdeq.
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

from kdeq.repository import default_models_dir, find_model, load_predictor


def to_tensor(img: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(img.astype(np.float32))
    return (t[None] if t.dim() == 2 else t.permute(2, 0, 1))[None]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    a = t[0].double().numpy()
    return a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)


def timed(fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


class Table:
    def __init__(self, title: str, columns: list[str]) -> None:
        self.title, self.columns, self.rows = title, columns, []

    def add(self, *cells: object) -> None:
        self.rows.append([f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells])
        print("  " + " | ".join(self.rows[-1]), flush=True)

    def markdown(self) -> str:
        head = f"### {self.title}\n\n| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns)
        return head + "\n" + "\n".join("| " + " | ".join(r) + " |" for r in self.rows) + "\n"


def denoise_section(models: dict, args: argparse.Namespace, tables: list[Table]) -> None:
    sets = [("Set12", (15, 25, 50), None)]
    if args.bsd68:
        sets.append(("BSD68", (25,), None))
    if args.colour:
        sets.append(("CBSD68", (25,), args.colour))
    for name, sigmas, limit in sets:
        images = B.load_set(name, limit)
        table = Table(
            f"Denoise, {name}{f' (first {limit})' if limit else ''}: mean PSNR (dB) and seconds per image",
            ["σ", "method", "PSNR", "s/img", "iterations (mean)", "converged"],
        )
        print(table.title, flush=True)
        for sigma in sigmas:
            noisy = [B.add_noise(img, sigma, i + args.seed) for i, (_, img) in enumerate(images)]
            clean = [img for _, img in images]

            def run_kdeq(label, model, known, noisy=noisy, clean=clean, sigma=sigma, table=table) -> None:
                scores, times, iters, conv = [], [], [], []
                for y, c in zip(noisy, clean, strict=True):
                    start = time.perf_counter()
                    pred = models[model].predict(to_tensor(y), sigma=sigma if known else None)
                    times.append(time.perf_counter() - start)
                    scores.append(B.psnr(to_numpy(pred.output), c))
                    iters.append(pred.stats.iterations.item())
                    conv.append(bool(pred.stats.converged.item()))
                table.add(
                    sigma,
                    label,
                    np.mean(scores),
                    np.mean(times),
                    f"{np.mean(iters):.1f}",
                    f"{sum(conv)}/{len(conv)}",
                )

            def run_base(label, fn, noisy=noisy, clean=clean, table=table, sigma_=sigma) -> None:
                scores, times = [], []
                for y, c in zip(noisy, clean, strict=True):
                    out, t = timed(lambda y=y, c=c: fn(y, c))
                    scores.append(B.psnr(out, c))
                    times.append(t)
                table.add(sigma_, label, np.mean(scores), np.mean(times), "", "")

            run_kdeq("kdeq denoise-kglm (σ known)", "denoise-kglm", True)
            run_kdeq("kdeq denoise-kglm (σ estimated)", "denoise-kglm", False)
            run_kdeq("kdeq denoise-stationary-kglm (σ known)", "denoise-stationary-kglm", True)
            run_base(
                "Gaussian filter, best std per image (oracle)",
                lambda y, c, sigma=sigma: B.gaussian_filter_best(y, sigma, c)[0],
            )
            run_base("scikit-image TV (Chambolle)", lambda y, c, sigma=sigma: B.tv_skimage(y, sigma))
            run_base("scikit-image non-local means", lambda y, c, sigma=sigma: B.nlm_skimage(y, sigma))
            run_base("OpenCV non-local means", lambda y, c, sigma=sigma: B.nlm_opencv(y, sigma))
            if args.bm3d and name != "BSD68":
                run_base("BM3D (PyPI bm3d)", lambda y, c, sigma=sigma: B.bm3d_denoise(y, sigma))
        tables.append(table)


def inpaint_section(models: dict, args: argparse.Namespace, tables: list[Table]) -> None:
    images = B.load_set("Set12")
    table = Table(
        "Inpaint, Set12: mean PSNR (dB) on the whole image / on the missing pixels, seconds per image",
        ["mask", "method", "PSNR full", "PSNR missing", "s/img", "iterations (mean)"],
    )
    print(table.title, flush=True)
    masks: dict[str, Callable[[int, tuple[int, int]], np.ndarray]] = {
        "50 % random": lambda i, hw: B.random_mask(hw, 0.5, i + args.seed),
        "80 % random": lambda i, hw: B.random_mask(hw, 0.8, i + args.seed),
        "centred H/8 block": lambda i, hw: B.block_mask(hw),
    }
    for mask_name, make in masks.items():
        cases = [(img, make(i, img.shape[:2])) for i, (_, img) in enumerate(images)]

        def kdeq_fn(img: np.ndarray, miss: np.ndarray) -> np.ndarray:
            pred = models["inpaint-kglm"].predict(to_tensor(img), torch.from_numpy(miss)[None, None])
            kdeq_fn.iters.append(pred.stats.iterations.item())
            return to_numpy(pred.output)

        kdeq_fn.iters = []
        for label, fn in (
            ("kdeq inpaint-kglm", kdeq_fn),
            ("scikit-image biharmonic", B.biharmonic),
            ("OpenCV Telea", B.opencv_telea),
            ("OpenCV Navier–Stokes", B.opencv_ns),
        ):
            full, missing, times = [], [], []
            for img, miss in cases:
                out, t = timed(lambda img=img, miss=miss, fn=fn: fn(np.where(miss, 0.0, img), miss))
                full.append(B.psnr(out, img))
                missing.append(B.psnr(out, img, miss))
                times.append(t)
            its = f"{np.mean(kdeq_fn.iters):.1f}" if fn is kdeq_fn else ""
            table.add(mask_name, label, np.mean(full), np.mean(missing), np.mean(times), its)
    tables.append(table)


#: the segmentation corruptions of a clean {0, 1} image, each with the noise level TV is told
SEGMENT_CORRUPTIONS = {
    "30 % flipped": (lambda b, rng: np.where(rng.random(b.shape) < 0.3, ~b, b).astype(np.float64), 0.5),
    "additive σ=0.5": (lambda b, rng: b + 0.5 * rng.standard_normal(b.shape), 0.5),
    "additive σ=1.0": (lambda b, rng: b + 1.0 * rng.standard_normal(b.shape), 1.0),
}


def segment_targets() -> list[tuple[str, np.ndarray]]:
    """The binary test images: the horse, four generated shapes images and four Train400 images
    thresholded at their median (the first four by name, which segmentation training leaves out:
    docs/training.md)."""
    targets = [("horse", B.horse())] + [(f"shapes seed {s}", B.shapes(256, s)) for s in range(4)]
    for i, (_, img) in enumerate(B.load_set("Train400", 4)):
        targets.append((f"Train400 #{i} at its median", img > np.median(img)))
    return targets


def segment_section(models: dict, args: argparse.Namespace, tables: list[Table]) -> None:
    targets = segment_targets()
    table = Table(
        "Segment: IoU against the clean binary image (mean over the images), seconds per image",
        ["corruption", "method", "IoU mean", "IoU horse", "s/img"],
    )
    print(table.title, flush=True)
    for cname, (corrupt, tv_sigma) in SEGMENT_CORRUPTIONS.items():
        cases = [(b, corrupt(b, np.random.default_rng(i + args.seed))) for i, (_, b) in enumerate(targets)]

        def kdeq_fn(y: np.ndarray) -> np.ndarray:
            return models["segment-kglm"].predict(to_tensor(y)).mask[0, 0].numpy()

        for label, fn in (
            ("kdeq segment-kglm", kdeq_fn),
            ("scikit-image TV then threshold 0.5", lambda y, ts=tv_sigma: B.tv_threshold(y, ts)),
            ("Otsu threshold only", lambda y: y > B.otsu_threshold(y)),
        ):
            scores, times = [], []
            for b, y in cases:
                out, t = timed(lambda y=y, fn=fn: fn(y))
                scores.append(B.iou(out, b))
                times.append(t)
            table.add(cname, label, float(np.mean(scores)), scores[0], np.mean(times))
    tables.append(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0, help="added to every per-image seed")
    parser.add_argument("--no-bm3d", dest="bm3d", action="store_false", help="skip BM3D (slow)")
    parser.add_argument("--bsd68", action="store_true", help="also denoise BSD68 at σ=25 (no BM3D)")
    parser.add_argument("--colour", type=int, default=0, help="also denoise the first N CBSD68 images")
    parser.add_argument("--only", choices=("denoise", "inpaint", "segment"))
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    args = parser.parse_args()
    root = default_models_dir()
    names = ("denoise-kglm", "denoise-stationary-kglm", "inpaint-kglm", "segment-kglm")
    models = {n: load_predictor(find_model(root, n)) for n in names}
    threads = torch.get_num_threads()
    print(f"machine: {platform.node()} {platform.machine()}, {threads} torch threads; seed {args.seed}")
    tables: list[Table] = []
    sections = {"denoise": denoise_section, "inpaint": inpaint_section, "segment": segment_section}
    for key, section in sections.items():
        if args.only in (None, key):
            section(models, args, tables)
    text = "\n".join(t.markdown() for t in tables)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
