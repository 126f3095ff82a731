"""Does fine-tuning pay off? Checkpoints side by side on the quality benchmark's protocol.

    .venv/bin/python bench/finetune.py --task denoise START TUNED [RANDOM …] [--bsd68] [--cbsd68 N] [--blind]
    .venv-bench/bin/python bench/finetune.py --task TASK START TUNED … [--baseline] [--per-image]

Each argument is a checkpoint folder (``models/<name>/<version>``). Denoise: Set12 at
σ = 15/25/50 (and BSD68 at σ = 25 with ``--bsd68``, the first ``N`` CBSD68 images at σ = 25 with
``--cbsd68 N``), σ given to the model or, with ``--blind``, estimated by it per image; inpaint:
Set12 with 50 % and 80 % random pixels missing and with three brush strokes (the trainer's
``stroke_mask``), PSNR on the missing pixels; segment: ``bench/quality.py``'s binary images and
corruptions, IoU of the mask; deblur: Set12 (and BSD68) blurred by ``bench/quality.py``'s Gaussian
(σ = 1.6) and 15-pixel motion PSFs with noise σ = 2.55 and 7.65, σ and the PSF given; super-resolve:
Set12 (and BSD68) and Kodak24 at ×2, ×3, ×4 through ``bench/quality.py``'s degradation, PSNR with a
``scale``-pixel border cropped (on Y for colour). ``--baseline`` adds the task's classical baseline
beside them (``.venv-bench``): BM3D with σ given, scikit-image's biharmonic inpainting, TV then
threshold, scikit-image's unsupervised Wiener filter, PIL's bicubic upsampling.
Noise and random masks are ``bench/baselines.py``'s (seed = image index), so the figures line up
with ``bench/quality.py``'s. Prints a Markdown table: mean PSNR (dB) or IoU (``--digits`` decimals,
2 by default; 2 more for an IoU), mean solver iterations, converged count, seconds per image (scoring
included), and for a model with a network the score of its pilot alone; with
``--per-image``, then each image's scores.
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
from quality import (
    DEBLUR_SIGMAS,
    SEGMENT_CORRUPTIONS,
    SR_SCALES,
    deblur_psfs,
    downsampler,
    segment_targets,
    to_numpy,
    to_tensor,
)

from kdeq.models.repository import load_predictor
from kdeq.runtime import netprecision
from kdeq.train.data import stroke_mask


def cases(
    task: str, bsd68: bool, cbsd68: int = 0
) -> list[tuple[str, list[tuple[np.ndarray, np.ndarray, object]]]]:
    """``(label, [(clean, input, extra)])``: extra is σ (denoise), the missing mask (inpaint), the
    noise level TV is told (segment), ``(PSF, σ, image index)`` (deblur) or the scale
    (super-resolve)."""
    out = []
    if task == "deblur":
        psfs, _ = deblur_psfs(reference=False)
        for name in ["Set12"] + (["BSD68"] if bsd68 else []):
            clean = [c for _, c in B.load_set(name)]
            for label, psf in psfs.items():
                blurred = [B.blur(c, psf) for c in clean]
                for sigma in DEBLUR_SIGMAS:
                    items = [
                        (c, B.add_noise(b, sigma, i), (psf, sigma, i))
                        for i, (c, b) in enumerate(zip(clean, blurred, strict=True))
                    ]
                    out.append((f"{name} {label} σ={sigma:g}", items))
    elif task == "super-resolve":
        down, _ = downsampler(reference=False)
        for name in ["Set12"] + (["BSD68"] if bsd68 else []) + ["Kodak24"]:
            images = [c for _, c in B.load_set(name)]
            for s in SR_SCALES:
                hrs = [B.crop_to_scale(c, s) for c in images]
                out.append((f"{name} ×{s}", [(hr, down(hr, s), s) for hr in hrs]))
    elif task == "segment":
        targets = segment_targets()
        for name, (corrupt, tv_sigma) in SEGMENT_CORRUPTIONS.items():
            items = [(b, corrupt(b, np.random.default_rng(i)), tv_sigma) for i, (_, b) in enumerate(targets)]
            out.append((name, items))
    elif task == "denoise":
        sets = [("Set12", s, None) for s in (15, 25, 50)] + ([("BSD68", 25, None)] if bsd68 else [])
        sets += [("CBSD68", 25, cbsd68)] if cbsd68 else []
        for name, sigma, limit in sets:
            images = B.load_set(name, limit)
            out.append(
                (
                    f"{name}{f' (first {limit})' if limit else ''} σ={sigma}",
                    [(c, B.add_noise(c, sigma, i), sigma) for i, (_, c) in enumerate(images)],
                )
            )
    else:
        images = B.load_set("Set12")
        for frac in (0.5, 0.8):
            masks = [B.random_mask(c.shape, frac, i) for i, (_, c) in enumerate(images)]
            out.append(
                (f"Set12 {frac:.0%} random", [(c, c, m) for (_, c), m in zip(images, masks, strict=True)])
            )
        strokes = [
            stroke_mask(c.shape[:2], torch.Generator().manual_seed(i)).numpy()
            for i, (_, c) in enumerate(images)
        ]
        out.append(("Set12 brush strokes", [(c, c, m) for (_, c), m in zip(images, strokes, strict=True)]))
    return out


def score(
    task: str, model, clean: np.ndarray, y: np.ndarray, extra, blind: bool = False
) -> tuple[float, int, bool, float]:
    """PSNR (IoU for segment), iterations, convergence, and the pilot's score (NaN without a network)."""
    pilot = float("nan")
    if task == "segment":
        pred = model.predict(to_tensor(y))
        value = B.iou(pred.mask[0, 0].numpy(), clean)
        if pred.pilot is not None:
            pilot = B.iou(pred.pilot[0, 0].numpy() > 0.5, clean)
    elif task == "deblur":
        psf, sigma, _ = extra
        pred = model.predict(to_tensor(y), torch.from_numpy(psf.astype(np.float32)), sigma=sigma)
        value = B.psnr(to_numpy(pred.output), clean)
        if pred.pilot is not None and model.config.architecture.net is not None:
            pilot = B.psnr(to_numpy(pred.pilot), clean)
    elif task == "super-resolve":
        pred = model.predict(to_tensor(y), scale=extra)
        value = B.psnr_sr(to_numpy(pred.output), clean, extra)
        if pred.pilot is not None:
            pilot = B.psnr_sr(to_numpy(pred.pilot), clean, extra)
    elif task == "denoise":
        pred = model.predict(to_tensor(y), sigma=None if blind else float(extra))
        value = B.psnr(to_numpy(pred.output), clean)
        if pred.pilot is not None:
            pilot = B.psnr(to_numpy(pred.pilot), clean)
    else:
        pred = model.predict(to_tensor(y), torch.from_numpy(extra)[None, None])
        value = B.psnr(to_numpy(pred.output), clean, extra)
        if pred.pilot is not None:
            pilot = B.psnr(to_numpy(pred.pilot), clean, extra)
    return value, int(pred.stats.iterations.item()), bool(pred.stats.converged.item()), pilot


#: each task's classical baseline: its name and score(clean, input, extra)
BASELINES = {
    "denoise": ("BM3D (σ given)", lambda c, y, e: B.psnr(B.bm3d_denoise(y, e), c)),
    "inpaint": ("biharmonic", lambda c, y, e: B.psnr(B.biharmonic(c, e), c, e)),
    "segment": ("TV then threshold", lambda c, y, e: B.iou(B.tv_threshold(y, e), c)),
    "deblur": (
        "unsupervised Wiener",
        lambda c, y, e: B.psnr(B.unsupervised_wiener(y, e[0], e[2]), c),
    ),
    "super-resolve": ("bicubic (PIL)", lambda c, y, e: B.psnr_sr(B.upsample_pil(y, e, "bicubic"), c, e)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(BASELINES), required=True)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--bsd68", action="store_true")
    parser.add_argument("--cbsd68", type=int, default=0, metavar="N", help="the first N CBSD68 images")
    parser.add_argument("--blind", action="store_true", help="the models estimate σ per image")
    parser.add_argument("--baseline", action="store_true", help="the task's classical baseline beside")
    parser.add_argument("--per-image", action="store_true", help="also each image's scores")
    parser.add_argument("--digits", type=int, default=2, help="decimals of a PSNR (an IoU: 2 more)")
    parser.add_argument(
        "--network-precision",
        choices=["auto", *netprecision.DTYPES],
        default="auto",
        help="the guide networks' arithmetic (kdeq.runtime.netprecision; default: measured)",
    )
    args = parser.parse_args()
    netprecision.choice.pin(args.network_precision)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} "
        f"({torch.backends.cpu.get_cpu_capability()} kernels), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, networks {args.network_precision}; "
        "protocol of bench/quality.py (seed = image index)"
        + (f"; σ {'estimated' if args.blind else 'given'}" if args.task == "denoise" else "")
    )
    models = [(str(p), load_predictor(p)) for p in args.checkpoints]
    name, baseline = BASELINES[args.task]
    titles = [f"`{m}`" for m, _ in models] + ([name] if args.baseline else [])
    header = "| data | " + " | ".join(titles) + " |"
    rule = "|---|" + "---|" * (len(models) + args.baseline)
    print(header + "\n" + rule)
    d = args.digits
    fmt = (lambda v: f"IoU {v:.{d + 2}f}") if args.task == "segment" else (lambda v: f"{v:.{d}f} dB")
    per_image = []
    for label, items in cases(args.task, args.bsd68, args.cbsd68):
        cells, columns = [], []
        for _, model in models:
            start = time.perf_counter()
            results = [score(args.task, model, c, y, e, args.blind) for c, y, e in items]
            seconds = (time.perf_counter() - start) / len(items)
            values, iters, conv, pilots = zip(*results, strict=True)
            cell = (
                f"{fmt(np.mean(values))} ({np.mean(iters):.1f} it, {sum(conv)}/{len(conv)}, {seconds:.2f} s)"
            )
            if not np.isnan(pilots).any():
                cell += f", pilot {fmt(np.mean(pilots))}"
            cells.append(cell)
            columns.append(values)
        if args.baseline:
            columns.append([baseline(c, y, e) for c, y, e in items])
            cells.append(fmt(np.mean(columns[-1])))
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        per_image.append((label, columns))
    if args.per_image:
        for label, columns in per_image:
            print(f"\n{label}, per image (index)\n\n" + header.replace("| data |", "| image |") + "\n" + rule)
            for i, row in enumerate(zip(*columns, strict=True)):
                print(f"| {i} | " + " | ".join(fmt(v) for v in row) + " |")


if __name__ == "__main__":
    main()
