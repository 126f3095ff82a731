"""``kdeq calibrate``: a trained guided denoiser's bandwidth ``h``, chosen on validation images.

A denoiser with a guide network trains without differentiating its weight maps
(``kdeq.train.model``), so ``h`` keeps the start's value while the guide it
measures distances on changes from the smoothed image to the learned pilot. This
command scores the checkpoint with ``h`` multiplied by each given factor on fixed
validation examples (the trainer's: ``kdeq.train.data.validation_set``) and writes
the checkpoint with the best factor to a new folder, with the source's report and
``report/calibration.json`` (every factor's mean PSNR per noise level).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kdeq.models.checkpoint import (
    Checkpoint,
    CheckpointError,
    GuidedArchitecture,
    Provenance,
    load_checkpoint,
    save_checkpoint,
)
from kdeq.predictors.denoise import Denoiser
from kdeq.train.data import image_files, load_images, validation_set
from kdeq.train.objectives import psnr
from kdeq.train.preflight import check_writable
from kdeq.train.trainings import TRAININGS


def with_bandwidth(checkpoint: Checkpoint, factor: float) -> Checkpoint:
    """``checkpoint`` with its guided kernel's bandwidth multiplied by ``factor``."""
    config = checkpoint.config
    arch = config.architecture
    if not isinstance(arch, GuidedArchitecture):
        raise ValueError(f"{checkpoint.path} is not a guided denoiser; only its bandwidth is calibrated")
    data = config.model_dump()
    data["architecture"]["kernel"]["bandwidth"] = arch.kernel.bandwidth * factor
    return Checkpoint(type(config).model_validate(data), checkpoint.tensors, checkpoint.path)


def score(checkpoint: Checkpoint, examples: Sequence[dict[str, torch.Tensor]]) -> dict[float, float]:
    """Mean PSNR (dB, clipped output) per noise level over ``examples``, σ given."""
    model = Denoiser(checkpoint)
    per_level: dict[float, list[float]] = {}
    for ex in examples:
        out = model.predict(ex["noisy"][None], sigma=float(ex["sigma"])).output
        per_level.setdefault(float(ex["level"]), []).append(psnr(out, ex["target"][None]).item())
    return {level: sum(v) / len(v) for level, v in per_level.items()}


def calibrate(
    source: Path,
    out: Path,
    val: Sequence[Path],
    factors: Sequence[float],
    levels: Sequence[float] = (15.0, 25.0, 50.0),
    seed: int = 0,
) -> dict:
    """Write ``source`` to ``out`` with the bandwidth factor of ``factors`` whose mean validation
    PSNR over ``levels`` is highest; returns the scores."""
    if out.exists():
        raise ValueError(f"{out} exists; calibrate writes a new folder")
    check_writable(out)  # before the scoring, which takes a while
    if not factors or any(f <= 0 for f in factors):
        raise ValueError("factors must be positive")
    checkpoint = load_checkpoint(source)
    denoise = TRAININGS["denoise"]
    examples = validation_set(load_images(image_files(val), 1), denoise, denoise.knobs(), levels, seed)
    scores = {f: score(with_bandwidth(checkpoint, f), examples) for f in factors}
    best = max(factors, key=lambda f: sum(scores[f].values()) / len(scores[f]))
    chosen = with_bandwidth(checkpoint, best).config
    prov = chosen.provenance
    note = f"; bandwidth ×{best:g} chosen by kdeq calibrate on {', '.join(map(str, val))}"
    provenance = Provenance(**{**prov.model_dump(), "notes": prov.notes + note})
    save_checkpoint(out, chosen.spec(), checkpoint.tensors, provenance)
    if (source / "report").is_dir():
        shutil.copytree(source / "report", out / "report")
    report = {
        "source": str(source),
        "validation": [str(v) for v in val],
        "examples": len(examples),
        "chosen": best,
        "bandwidth": chosen.architecture.kernel.bandwidth,
        "psnr": {f"{f:g}": {f"{lv:g}": v for lv, v in s.items()} for f, s in scores.items()},
    }
    (out / "report").mkdir(exist_ok=True)
    (out / "report" / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", type=Path, help="a trained guided denoiser's folder")
    p.add_argument("--out", type=Path, required=True, help="a new <models>/<name>/<version> folder")
    p.add_argument("--val", type=Path, nargs="+", required=True, help="validation image folders")
    p.add_argument("--factors", required=True, help="bandwidth factors to try, comma-separated")
    p.add_argument("--levels", default="15,25,50", help="noise levels (0–255), comma-separated")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Calibrate; exit status 0, or 2 with a message for bad settings or files."""
    try:
        factors = [float(v) for v in args.factors.split(",")]
        levels = [float(v) for v in args.levels.split(",")]
        report = calibrate(args.source, args.out, args.val, factors, levels, args.seed)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"kdeq calibrate: error: {err}", file=sys.stderr)
        return 2
    for factor, per_level in report["psnr"].items():
        cells = "  ".join(f"σ={lv}: {v:.3f}" for lv, v in per_level.items())
        print(f"×{factor}: {cells}")
    print(f"wrote {args.out} with bandwidth ×{report['chosen']:g} ({report['bandwidth']:.4g})")
    return 0
