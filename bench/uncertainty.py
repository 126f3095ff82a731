"""Posterior standard-deviation maps (``kdeq.predictors.uncertainty``): what they cost per request and how
well they cover the true error on real images, for every shipped model that has one.

    .venv/bin/python bench/uncertainty.py [--crop 128] [--images 12] [--fit 12] [--cost-size 256]
        [--models NAME,…] [--skip-coverage] [--out FILE]

Every figure goes through ``solve_batch`` with ``Request.uncertainty`` (the service's and the CLI's
path), at its default probe count and seed.

- **Cost**: per shipped model, its latest version that has a posterior, one Set12 image at
  ``--cost-size``²: the median of 3 solves with the map over the median of 3 without, in this
  process.
- **Coverage**: the fraction of pixels whose true error ``|f − x|`` lies within ``1.96·std`` (95 % for
  a calibrated map), on the centre ``--crop``² of the first ``--images`` images of Set12 and of BSD68,
  with ``z₉₅``, the 95th percentile of ``|f − x|/std`` (1.96 when calibrated). A scale factor
  ``c = z₉₅/1.96`` is fitted per checkpoint on as many Train400 crops (training data only) and the
  coverage of ``c·std`` reported on the test sets.

Corruptions (seed = image index): denoise ``σ = 25`` (the model is told it); inpaint 50 % of the
pixels missing at random; deblur a Gaussian PSF of std 1.6 with a symmetric border, then ``σ = 2.55``
(told); super-resolve ×2 by kdeq's bicubic degradation, no noise (scored on the high-resolution
crop); segment: the clean image itself (its cost only: the segmenter's map is the std of a
probability, which has no clean counterpart to cover). ``--models`` keeps the models whose names
are listed. Needs ``../shared/data``; the plug-and-play deblurrer has no map and is listed as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines as B

from kdeq.maths.psf import parse_psf
from kdeq.models.repository import default_models_dir, load_predictor
from kdeq.predictors.base import Predictor
from kdeq.predictors.super_resolve import degrade
from kdeq.predictors.uncertainty import unsupported
from kdeq.registry import TASKS
from kdeq.tasks.base import Request, Solved, solve_batch

SIGMA = 25.0
DEBLUR_SIGMA = 2.55
PSF = "gaussian:1.6"
SCALE = 2


@dataclass(frozen=True)
class Case:
    """One corrupted image: the request and the clean image ``x`` ``(c, H', W')`` it should give."""

    request: Request
    clean: np.ndarray


def crop(img: np.ndarray, side: int | None) -> np.ndarray:
    """The centre ``side``² of a grey image ``(H, W)`` as ``(1, s, s)`` float32 (whole when ``None``)."""
    if side is not None:
        top, left = (img.shape[0] - side) // 2, (img.shape[1] - side) // 2
        img = img[top : top + side, left : left + side]
    return np.ascontiguousarray(img[None], dtype=np.float32)


def corrupt(task: str, x: np.ndarray, seed: int) -> Case:
    """The request of ``task`` for the clean ``x`` ``(1, H, W)`` (module docstring's corruptions)."""
    rng = np.random.default_rng(seed)
    t = TASKS[task]
    if task == "denoise":
        y = x + SIGMA / 255 * rng.standard_normal(x.shape)
        return Case(Request(y.astype(np.float32), t.options(sigma=SIGMA)), x)
    if task == "inpaint":
        missing = rng.random(x.shape) < 0.5
        return Case(Request(np.where(missing, 0, x).astype(np.float32), t.options(), {"missing": missing}), x)
    if task == "deblur":
        psf = parse_psf(PSF).numpy()
        y = B.blur(x[0].astype(np.float64), psf)[None] + DEBLUR_SIGMA / 255 * rng.standard_normal(x.shape)
        options = t.options(psf=PSF, sigma=DEBLUR_SIGMA)
        return Case(Request(y.astype(np.float32), options, {"psf": psf}), x)
    if task == "super-resolve":
        hr = x[:, : x.shape[1] // SCALE * SCALE, : x.shape[2] // SCALE * SCALE]
        with torch.no_grad():
            lr = degrade(torch.from_numpy(hr)[None].double(), SCALE)[0].float().numpy()
        return Case(Request(np.ascontiguousarray(lr), t.options(scale=SCALE)), hr)
    if task == "segment":
        return Case(Request(x, t.options(output="probability")), x)
    raise KeyError(task)


def solve(predictor: Predictor, case: Case, uncertainty: bool) -> Solved:
    """``case``'s request solved (with its map, ``Solved.uncertainty``, when ``uncertainty``)."""
    request = dataclasses.replace(case.request, uncertainty=uncertainty)
    return solve_batch(TASKS[predictor.task], predictor, [request])[0]


def ratios(predictor: Predictor, cases: list[Case]) -> np.ndarray:
    """``|f − x|/std`` over every pixel of ``cases`` (flattened)."""
    out = []
    for case in cases:
        done = solve(predictor, case, True)
        f, std = done.output, done.uncertainty.std
        out.append((np.abs(f - case.clean) / np.maximum(std, 1e-12)[None]).ravel())
    return np.concatenate(out)


def coverage(z: np.ndarray, factor: float = 1.0) -> float:
    return float((z <= 1.96 * factor).mean())


def models(root: Path, names: set[str] | None) -> list[tuple[str, Predictor | None, str | None]]:
    """Every shipped checkpoint (of the models ``names``, all when ``None``): ``(id, predictor, why it
    has no map or None)``."""
    found = []
    for config in sorted(root.glob("*/*/config.json")):
        if names is not None and config.parent.parent.name not in names:
            continue
        p = load_predictor(config.parent)
        found.append((f"{config.parent.parent.name}:{config.parent.name}", p, unsupported(p)))
    return found


def cost_table(shipped: list, size: int) -> list[str]:
    latest: dict[str, tuple[str, Predictor]] = {}
    for ident, p, why in shipped:
        if why is None:
            latest[ident.split(":")[0]] = (ident, p)  # sorted: the last version wins
    x = crop(B.load_set("Set12")[0][1], size)
    rows = [
        f"### Cost of the map, Set12 image 1 at {size}², median of 3, in process",
        "",
        "| task | model | probes | without (s) | with the map (s) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for ident, p in latest.values():
        task = p.task
        case = corrupt(task, x, 0)
        times = {}
        for asked in (False, True):
            found = solve(p, case, asked).uncertainty  # warm; its map says how it was computed
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                solve(p, case, asked)
                runs.append(time.perf_counter() - start)
            times[asked] = statistics.median(runs)
        probes = "exact" if found.exact else str(found.probes)
        ratio = times[True] / times[False]
        cells = f"{times[False]:.3f} | {times[True]:.2f} | {ratio:.0f}×"
        rows.append(f"| {task} | `{ident}` | {probes} | {cells} |")
        print(rows[-1], flush=True)
    return rows


def coverage_table(shipped: list, side: int, count: int, fit: int) -> list[str]:
    sets = {name: [crop(img, side) for _, img in B.load_set(name)[:count]] for name in ("Set12", "BSD68")}
    train = [crop(img, side) for _, img in B.load_set("Train400")[:fit]]
    rows = [
        f"### Coverage of ±1.96·std, centre {side}² crops: Set12 and BSD68 (first {count} each); "
        f"c fitted on {fit} Train400 crops",
        "",
        "| model | Set12 | z₉₅ | BSD68 | z₉₅ | c (Train400) | Set12 with c | BSD68 with c |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ident, p, why in shipped:
        if why is not None:
            rows.append(f"| `{ident}` | no map: {why} | | | | | | |")
            continue
        if p.task == "segment":
            rows.append(f"| `{ident}` | a probability's std: nothing clean to cover | | | | | | |")
            continue
        zfit = ratios(p, [corrupt(p.task, x, 1000 + i) for i, x in enumerate(train)])
        c = float(np.quantile(zfit, 0.95)) / 1.96
        cells = []
        for images in sets.values():
            z = ratios(p, [corrupt(p.task, x, i) for i, x in enumerate(images)])
            cells.append((coverage(z), float(np.quantile(z, 0.95)), coverage(z, c)))
        (s12, z12, c12), (b68, z68, c68) = cells
        rows.append(
            f"| `{ident}` | {s12:.3f} | {z12:.2f} | {b68:.3f} | {z68:.2f} | {c:.2f} | {c12:.3f} | {c68:.3f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--crop", type=int, default=128)
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--fit", type=int, default=12)
    parser.add_argument("--cost-size", type=int, default=256)
    parser.add_argument("--models", help="comma-separated model names (default: every shipped model)")
    parser.add_argument("--skip-coverage", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    head = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print(head, flush=True)
    shipped = models(default_models_dir(), None if args.models is None else set(args.models.split(",")))
    rows = [head, "", *cost_table(shipped, args.cost_size), ""]
    if not args.skip_coverage:
        rows += coverage_table(shipped, args.crop, args.images, args.fit)
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
