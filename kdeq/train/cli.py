"""``kdeq train`` and ``python -m kdeq.train`` (also under ``torchrun``): arguments → ``TrainConfig``."""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from pydantic import ValidationError

from kdeq.checkpoint import CheckpointError
from kdeq.tasks import TASKS
from kdeq.train.config import TrainConfig
from kdeq.train.data import DEBLUR_PSFS, MASK_KINDS
from kdeq.train.objectives import SquaredError


def _pair(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(",")
    return (float(lo), float(hi if sep else lo))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer's options (see ``TrainConfig`` for what each means)."""
    # every registered task: one without training hooks is refused by TrainConfig, with the reason
    p.add_argument("--task", required=True, choices=list(TASKS))
    p.add_argument(
        "--spec",
        help="a default model's name, a ModelSpec JSON file or a checkpoint folder (default: <task>-kglm)",
    )
    p.add_argument("--init", choices=("kglm", "random"), default="kglm")
    p.add_argument(
        "--warm-start",
        metavar="DIR",
        help="a checkpoint whose tensors of the spec's names (a guide network) replace the start's",
    )
    p.add_argument(
        "--train-only",
        nargs="+",
        metavar="PREFIX",
        help="train only the tensors whose names start with one of these (e.g. net_refine_)",
    )
    p.add_argument(
        "--colour-net",
        type=int,
        metavar="N",
        help="grow the spec's guide network a joint colour network of N features",
    )
    p.add_argument("--train", nargs="+", required=True, metavar="DIR", help="training image folders")
    p.add_argument("--val", nargs="+", required=True, metavar="DIR", help="validation image folders")
    p.add_argument("--out", required=True, help="models/NAME/VERSION")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--samples-per-epoch", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--patch-size", type=int, default=64)
    p.add_argument(
        "--loss", choices=get_args(SquaredError), default="log_mse", help="the Gaussian tasks' loss"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--sigma", type=_pair, default=(0.0, 55.0), metavar="LO,HI", help="noise range, 0–255")
    p.add_argument("--clip-noise", action="store_true", help="clip noisy inputs to [0, 1]")
    p.add_argument("--mask-kinds", nargs="+", choices=MASK_KINDS, default=list(MASK_KINDS))
    p.add_argument("--missing", type=_pair, default=(0.2, 0.9), metavar="LO,HI")
    p.add_argument("--flip", type=float, default=0.1, help="largest label-flip fraction (segment)")
    p.add_argument(
        "--peaks",
        type=_pair,
        default=(1.0, 30.0),
        metavar="LO,HI",
        help="photon counts of white, drawn log-uniformly (denoise-poisson)",
    )
    p.add_argument(
        "--psfs", nargs="+", default=list(DEBLUR_PSFS), metavar="PSF", help="blurs drawn per step (deblur)"
    )
    p.add_argument(
        "--scales",
        nargs="+",
        type=int,
        default=[2, 3, 4],
        metavar="S",
        help="factors drawn per step (super-resolve)",
    )
    p.add_argument("--train-tol", type=float)
    p.add_argument("--train-max-iter", type=int)
    p.add_argument("--eval-tol", type=float)
    p.add_argument("--eval-max-iter", type=int)
    p.add_argument("--backward", choices=("implicit", "jacobian_free"), default="implicit")
    p.add_argument(
        "--pilot-loss", type=float, default=1.0, help="weight of a guide network's pilot in the loss"
    )
    p.add_argument(
        "--pilot-epochs", type=int, default=0, help="first epochs train a guide network's pilot alone"
    )
    p.add_argument("--min-converged", type=float, default=0.5)
    p.add_argument("--max-rollbacks", type=int, default=20)
    p.add_argument("--val-levels", type=_floats, default=(), metavar="A,B,…")
    p.add_argument("--val-limit", type=int, default=8)
    p.add_argument("--val-crop", type=int, default=0)
    p.add_argument("--channels", type=int, choices=(1, 3), default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--workers", type=int, default=1, help="data-loading processes")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="under torchrun: how long a rank waits for the others, rank 0's validation included",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT/train-state")
    p.add_argument("--stop-after", type=int, metavar="EPOCH", help="end after this epoch (resume later)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = set(TrainConfig.model_fields)
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values["spec"] = args.spec or f"{args.task}-kglm"
    values["mask_kinds"] = tuple(args.mask_kinds)
    values["psfs"], values["scales"] = tuple(args.psfs), tuple(args.scales)
    values["train_only"] = tuple(args.train_only or ())
    return TrainConfig.model_validate(values)


def run(args: argparse.Namespace) -> int:
    """Train; exit status 0, or 2 with a message for bad settings or data, 4 when training failed."""
    from kdeq.train.loop import TrainingError, train

    try:
        cfg = config_from_args(args)
        progress = None
        if not args.quiet:
            from tqdm import tqdm

            def progress(total: int) -> tqdm:
                return tqdm(total=total, dynamic_ncols=True, unit="step")

        report = train(cfg, progress)
    except (ValidationError, ValueError, CheckpointError, OSError) as err:
        print(f"kdeq train: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        print(f"kdeq train: needs {err.name}: pip install 'kdeq[train]'", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"kdeq train: failed: {err}", file=sys.stderr)
        return 4
    hist = report["history"]
    if not hist["epochs"]:  # another rank's process: rank 0 reports
        return 0
    if hist["best_epoch"] is None:
        print("kdeq train: failed: no epoch had a finite validation score; nothing written", file=sys.stderr)
        return 4
    score = f"val_{TASKS[cfg.task].score_name}"
    start, best = hist["epochs"][0][score], hist["epochs"][hist["best_epoch"]][score]
    print(
        f"wrote {cfg.out}: epoch {hist['best_epoch']} of {cfg.epochs}, {score} {start:.4g} at the "
        f"start → {best:.4g}; {hist['rollbacks']} rollbacks; report in {cfg.out / 'report'}"
    )
    if best <= start:
        print(
            f"kdeq train: warning: no epoch beat the start on validation ({best:.4g} ≤ {start:.4g})",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdeq.train", description="train a kGLM-DEQ checkpoint")
    add_arguments(parser)
    return run(parser.parse_args(argv))
