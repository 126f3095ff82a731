"""Quality of the default kGLM models against classical baselines, measured side by side.

    .venv-bench/bin/python bench/quality.py [--seed 0] [--no-bm3d] [--bsd68] [--colour N]
        [--only denoise,inpaint,segment,deblur,super-resolve] [--reference-ops] [--out FILE]

Protocol (``bench/baselines.py``): float images in [0, 1]; noise ``N(0, (σ/255)²)``
with seed = image index (+ ``--seed``), not clipped; PSNR on the clipped output;
random masks from ``default_rng(index)``. Deblurring blurs with a symmetric border
before the noise; super-resolution downsamples MATLAB-style bicubic, no noise, and
scores Y of YCbCr (colour) with a ``scale``-pixel border cropped. The PSFs and the
bicubic downsampling are kdeq's (``kdeq.maths.psf``, ``kdeq.maths.operators``) when they exist,
else the references in ``bench/baselines.py`` (``--reference-ops`` forces those).
A model missing from the repository (``deblur-kglm``, ``super-resolve-kglm``) is
skipped with a note. Every method runs in this process on
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

from kdeq.models.repository import default_models_dir, find_model, load_predictor


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
    def __init__(self, title: str, columns: list[str], note: str = "") -> None:
        self.title, self.columns, self.rows, self.note = title, columns, [], note

    def add(self, *cells: object) -> None:
        self.rows.append([f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells])
        print("  " + " | ".join(self.rows[-1]), flush=True)

    def markdown(self) -> str:
        note = f"{self.note}\n\n" if self.note else ""
        head = (
            f"### {self.title}\n\n{note}| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns)
        )
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


def as_float64(a: object) -> np.ndarray:
    """A numpy float64 copy of an array or (CPU or GPU) tensor."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def kdeq_stats(pred: object) -> tuple[float | None, bool | None]:
    """``(iterations, converged)`` of a batch-of-one prediction, ``None`` where it has no stats."""
    stats = getattr(pred, "stats", None)
    if stats is None:
        return None, None
    return float(stats.iterations.item()), bool(stats.converged.item())


def stats_cells(iters: list, conv: list) -> tuple[str, str]:
    """The "iterations (mean)" and "converged" cells of a kdeq row."""
    if not iters or iters[0] is None:
        return "", ""
    return f"{np.mean(iters):.1f}", f"{sum(conv)}/{len(conv)}"


#: the deblurring degradations: (label, PSF sigma or motion length), each with every DEBLUR_SIGMAS
DEBLUR_BLURS = (("Gaussian σ=1.6", "gaussian", 1.6), ("motion 15 px horizontal", "motion", 15))
DEBLUR_SIGMAS = (2.55, 7.65)


def deblur_psfs(reference: bool) -> tuple[dict[str, np.ndarray], str]:
    """The benchmark PSFs by label (float64) and where they came from.

    ``kdeq.maths.psf``'s ``gaussian_psf(1.6)`` and ``motion_psf(15, 0)`` (in float64), checked against
    ``bench/baselines.py``'s references; the references when ``kdeq.maths.psf`` cannot be imported or
    ``reference`` is set.
    """
    refs = {
        label: B.gaussian_psf_reference(p) if kind == "gaussian" else B.motion_psf_reference(p)
        for label, kind, p in DEBLUR_BLURS
    }
    if reference:
        return refs, "bench/baselines.py references (--reference-ops)"
    try:
        from kdeq.maths.psf import gaussian_psf, motion_psf
    except ImportError as exc:
        print(
            f"note: kdeq.maths.psf unavailable ({exc}); using bench/baselines.py's reference PSFs", flush=True
        )
        return refs, "bench/baselines.py references (no kdeq.maths.psf)"
    psfs = {
        label: as_float64(
            gaussian_psf(p, dtype=torch.float64)
            if kind == "gaussian"
            else motion_psf(p, 0, dtype=torch.float64)
        )
        for label, kind, p in DEBLUR_BLURS
    }
    for label, psf in psfs.items():
        ref = refs[label]
        diff = float(np.abs(psf - ref).max()) if psf.shape == ref.shape else float("inf")
        flag = "" if diff < 1e-6 else "  WARNING: differs from the protocol's formula"
        print(
            f"kdeq.maths.psf {label}: {psf.shape}, sum {psf.sum():.6f}, max |Δ| vs reference {diff:.1e}{flag}"
        )
    return psfs, "kdeq.maths.psf"


def score_runs(
    fn: Callable[[np.ndarray, int], np.ndarray],
    inputs: list[np.ndarray],
    targets: list[np.ndarray],
    metric: Callable[[np.ndarray, np.ndarray], float],
) -> tuple[float, float]:
    """Mean ``metric(fn(input, index), target)`` and mean seconds per call of ``fn``."""
    scores, times = [], []
    for i, (x, target) in enumerate(zip(inputs, targets, strict=True)):
        out, t = timed(lambda x=x, i=i: fn(x, i))
        scores.append(metric(out, target))
        times.append(t)
    return float(np.mean(scores)), float(np.mean(times))


def oracle_search(
    make: Callable[[float], Callable[[np.ndarray, int], np.ndarray]],
    grid: tuple[float, ...],
    observed: list[np.ndarray],
    clean: list[np.ndarray],
    stop_early: bool,
) -> dict[float, tuple[float, float]]:
    """``{value: (mean PSNR, s/img)}`` of the method ``make(value)`` over the ascending ``grid``;
    with ``stop_early`` the walk stops at the first value scoring below the best so far (for
    Richardson–Lucy, whose PSNR rises then falls with the iteration count, this saves the long
    runs past the peak)."""
    results: dict[float, tuple[float, float]] = {}
    for value in grid:
        results[value] = score_runs(make(value), observed, clean, B.psnr)
        if stop_early and results[value][0] < max(r[0] for r in results.values()):
            break
    return results


class KdeqRun:
    """A kdeq predictor call ``call(predictor, x) -> Prediction`` as a ``score_runs`` function that
    records the solver's iterations and convergence."""

    def __init__(self, predictor: object, call: Callable[[object, torch.Tensor], object]) -> None:
        self.predictor, self.call, self.iters, self.conv = predictor, call, [], []

    def __call__(self, x: np.ndarray, index: int) -> np.ndarray:
        pred = self.call(self.predictor, to_tensor(x))
        it, ok = kdeq_stats(pred)
        self.iters.append(it)
        self.conv.append(ok)
        return to_numpy(pred.output)

    def cells(self) -> tuple[str, str]:
        return stats_cells(self.iters, self.conv)


def deblur_section(models: dict, args: argparse.Namespace, tables: list[Table]) -> None:
    psfs, source = deblur_psfs(args.reference_ops)
    sets = ["Set12"] + (["BSD68"] if args.bsd68 else [])
    note = (
        f"Protocol: grey; y = conv(x, PSF) with a symmetric border (edge repeated), then N(0, (σ/255)²) "
        f"with seed = image index (+ {args.seed}); PSFs from {source}; PSNR of the clipped output over "
        f"the whole image. Oracle rows: the Richardson–Lucy iteration count of {B.RL_ITERATIONS} (walked "
        f"upward, stopping at the first count below the best) / the Wiener balance of "
        f"{B.WIENER_BALANCES} with the best mean PSNR on this set for this degradation (chosen with "
        f"the clean images). Richardson–Lucy sees max(y, 0) padded symmetrically by "
        f"{B.RL_PAD_PSF} PSF widths, the Wiener filters y's full symmetric extension."
    )
    for name in sets:
        clean = [img for _, img in B.load_set(name)]
        table = Table(
            f"Deblur, {name}: mean PSNR (dB) and seconds per image",
            ["blur", "σ", "method", "PSNR", "s/img", "iterations (mean)", "converged"],
            note,
        )
        print(f"{table.title}\n{note}", flush=True)
        for blur_label, psf in psfs.items():
            blurred = [B.blur(img, psf) for img in clean]
            psf_t = torch.from_numpy(psf.astype(np.float32))
            for sigma in DEBLUR_SIGMAS:
                observed = [B.add_noise(b, sigma, i + args.seed) for i, b in enumerate(blurred)]
                if "deblur-kglm" in models:
                    kdeq = KdeqRun(
                        models["deblur-kglm"],
                        lambda p, x, psf_t=psf_t, s=sigma: p.predict(x, psf=psf_t, sigma=s),
                    )
                    score, secs = score_runs(kdeq, observed, clean, B.psnr)
                    table.add(
                        blur_label,
                        f"{sigma:g}",
                        "kdeq deblur-kglm (σ, PSF known)",
                        score,
                        secs,
                        *kdeq.cells(),
                    )
                oracles = (
                    (
                        "scikit-image Richardson–Lucy",
                        "iterations",
                        B.RL_ITERATIONS,
                        lambda n, psf=psf: lambda y, i: B.richardson_lucy(y, psf, n),
                        True,
                    ),
                    (
                        "scikit-image Wiener",
                        "balance",
                        B.WIENER_BALANCES,
                        lambda b, psf=psf: lambda y, i: B.wiener(y, psf, b),
                        False,
                    ),
                )
                for label, unit, grid, make, stop_early in oracles:
                    results = oracle_search(make, grid, observed, clean, stop_early)
                    best = max(results, key=lambda v, results=results: results[v][0])
                    grid_text = ", ".join(f"{v:g} → {r[0]:.2f}" for v, r in results.items())
                    print(f"    {label} (PSNR by {unit}): {grid_text}", flush=True)
                    table.add(
                        blur_label, f"{sigma:g}", f"{label}, {best:g} {unit} (oracle)", *results[best], "", ""
                    )
                score, secs = score_runs(
                    lambda y, i, psf=psf: B.unsupervised_wiener(y, psf, i + args.seed),
                    observed,
                    clean,
                    B.psnr,
                )
                table.add(blur_label, f"{sigma:g}", "scikit-image unsupervised Wiener", score, secs, "", "")
        tables.append(table)


SR_SCALES = (2, 3, 4)


def kdeq_downsample(hr: np.ndarray, scale: int) -> np.ndarray:
    """kdeq's super-resolution degradation of an ``H×W`` or ``H×W×C`` image (sides multiples of
    ``scale``): ``kdeq.predictors.super_resolve.degrade`` (the model's forward operator ``S H``), in
    float64."""
    from kdeq.predictors.super_resolve import degrade

    x = torch.from_numpy(np.asarray(hr, dtype=np.float64))
    with torch.no_grad():
        return to_numpy(degrade((x[None] if x.dim() == 2 else x.permute(2, 0, 1))[None], scale))


def downsampler(reference: bool) -> tuple[Callable[[np.ndarray, int], np.ndarray], str]:
    """The super-resolution degradation ``(hr, scale) -> lr`` and where it comes from: kdeq's when
    ``kdeq.maths.psf.bicubic_taps`` and ``kdeq.maths.operators.BlurSubsample`` import, else (or with
    ``reference``) ``B.bicubic_downsample``."""
    if reference:
        return B.bicubic_downsample, "bench/baselines.py reference (--reference-ops)"
    try:
        from kdeq.maths.operators import BlurSubsample  # noqa: F401
        from kdeq.maths.psf import bicubic_taps  # noqa: F401
    except ImportError as exc:
        print(f"note: kdeq bicubic downsampling unavailable ({exc}); using bench/baselines.py's", flush=True)
        return B.bicubic_downsample, "bench/baselines.py reference (no kdeq.maths.operators / kdeq.maths.psf)"
    return kdeq_downsample, "kdeq.maths.psf.bicubic_taps + kdeq.maths.operators.BlurSubsample"


def super_resolve_section(models: dict, args: argparse.Namespace, tables: list[Table]) -> None:
    down, source = downsampler(args.reference_ops)
    sets = ["Set12"] + (["BSD68"] if args.bsd68 else []) + ["Kodak24"]
    for name in sets:
        images = [img for _, img in B.load_set(name)]
        colour = images[0].ndim == 3
        note = (
            f"Protocol: HR cropped to a multiple of the scale; LR = MATLAB-style anti-aliased bicubic "
            f"downsampling ({source}; symmetric border), float, not rounded, no noise; PSNR of the "
            f"clipped output on {'Y of YCbCr (BT.601, 16-235, peak 255)' if colour else 'the grey values'}"
            f" with a border of `scale` pixels cropped. PIL resamples float (mode F) images, per channel."
        )
        table = Table(
            f"Super-resolve, {name}{' (colour, Y)' if colour else ''}: mean PSNR (dB) and seconds per image",
            ["×", "method", "PSNR", "s/img", "iterations (mean)", "converged"],
            note,
        )
        print(f"{table.title}\n{note}", flush=True)
        for scale in SR_SCALES:
            hrs = [B.crop_to_scale(img, scale) for img in images]
            lrs = [down(hr, scale) for hr in hrs]
            if down is not B.bicubic_downsample:
                diff = float(np.abs(lrs[0] - B.bicubic_downsample(hrs[0], scale)).max())
                print(
                    f"  ×{scale}: kdeq downsampling vs reference on image 0: max |Δ| = {diff:.1e}", flush=True
                )

            def metric(out: np.ndarray, hr: np.ndarray, scale: int = scale) -> float:
                if out.shape != hr.shape:
                    raise ValueError(f"×{scale} output {out.shape} for HR {hr.shape}")
                return B.psnr_sr(out, hr, scale)

            if "super-resolve-kglm" in models:
                kdeq = KdeqRun(models["super-resolve-kglm"], lambda p, x, s=scale: p.predict(x, scale=s))
                table.add(
                    scale, "kdeq super-resolve-kglm", *score_runs(kdeq, lrs, hrs, metric), *kdeq.cells()
                )
            for label, method in (("bicubic (PIL)", "bicubic"), ("Lanczos-3 (PIL)", "lanczos")):
                score, secs = score_runs(
                    lambda lr, i, m=method, s=scale: B.upsample_pil(lr, s, m), lrs, hrs, metric
                )
                table.add(scale, label, score, secs, "", "")
        tables.append(table)


#: the models each section uses; one in OPTIONAL_MODELS that the repository lacks is skipped (its rows
#: left out, with a note), any other missing model is an error
SECTION_MODELS = {
    "denoise": ("denoise-kglm", "denoise-stationary-kglm"),
    "inpaint": ("inpaint-kglm",),
    "segment": ("segment-kglm",),
    "deblur": ("deblur-kglm",),
    "super-resolve": ("super-resolve-kglm",),
}
OPTIONAL_MODELS = frozenset({"deblur-kglm", "super-resolve-kglm"})


def load_models(root: Path, names: list[str]) -> dict:
    models = {}
    for name in names:
        try:
            path = find_model(root, name)
        except LookupError as exc:
            if name not in OPTIONAL_MODELS:
                raise
            print(f"note: {exc}; its rows are skipped", flush=True)
            continue
        models[name] = load_predictor(path)
    return models


def section_list(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in SECTION_MODELS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTION_MODELS)}; got {text!r}")
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0, help="added to every per-image seed")
    parser.add_argument("--no-bm3d", dest="bm3d", action="store_false", help="skip BM3D (slow)")
    parser.add_argument(
        "--bsd68", action="store_true", help="also BSD68: denoise at σ=25 (no BM3D), deblur, super-resolve"
    )
    parser.add_argument("--colour", type=int, default=0, help="also denoise the first N CBSD68 images")
    parser.add_argument(
        "--only",
        type=section_list,
        metavar="SECTIONS",
        help=f"comma-separated sections to run, of {', '.join(SECTION_MODELS)} (default all)",
    )
    parser.add_argument(
        "--reference-ops",
        action="store_true",
        help="deblur/super-resolve: bench/baselines.py's PSFs and downsampling even when kdeq has them",
    )
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    args = parser.parse_args()
    keys = [k for k in SECTION_MODELS if args.only is None or k in args.only]
    models = load_models(default_models_dir(), [n for k in keys for n in SECTION_MODELS[k]])
    threads = torch.get_num_threads()
    print(f"machine: {platform.node()} {platform.machine()}, {threads} torch threads; seed {args.seed}")
    tables: list[Table] = []
    sections = {
        "denoise": denoise_section,
        "inpaint": inpaint_section,
        "segment": segment_section,
        "deblur": deblur_section,
        "super-resolve": super_resolve_section,
    }
    for key in keys:
        start = time.perf_counter()
        sections[key](models, args, tables)
        print(f"section {key}: {time.perf_counter() - start:.0f} s", flush=True)
    text = "\n".join(t.markdown() for t in tables)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
