"""Checkpoints scored side by side by the trainer's own validation, on any folder of images.

    .venv/bin/python bench/validate.py --task denoise --val DIR [--channels 3] [--val-limit N]
        [--val-crop 128] [--seed 1] CKPT [CKPT …]

Each checkpoint gets what ``kdeq train`` records at epoch 0 when warm-started from it with the same
``--val``, ``--channels``, ``--val-limit``, ``--val-crop`` and ``--seed`` (``kdeq.train.loop.evaluate``
on the same fixed examples, networks in float32, the training convolution backend and torch's guided
loops), so that a model can be chosen on a split other than the one it trained on: e.g. CBSD432's
scenes that are not in Train400, in colour and in luminance (docs/training.md). Prints a Markdown
table: the task's score overall and per level, mean solver iterations and the converged fraction.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kdeq.train.config import TrainConfig
from kdeq.train.loop import evaluate, reproducible_arithmetic, validation_examples
from kdeq.train.model import TrainableModel, start_tensors
from kdeq.train.trainings import TRAININGS


def scores(checkpoint: Path, args: argparse.Namespace) -> dict[str, float]:
    """The trainer's validation metrics of ``checkpoint`` under ``args``' protocol."""
    cfg = TrainConfig(
        task=args.task,
        spec=str(checkpoint),
        warm_start=checkpoint,
        train=tuple(args.val),  # the config wants training data; nothing here reads it
        val=tuple(args.val),
        out=Path(checkpoint.parent.name, checkpoint.name),  # names the spec; nothing is written
        channels=args.channels,
        val_limit=args.val_limit,
        val_crop=args.val_crop,
        seed=args.seed,
    )
    spec = cfg.model_spec()
    device = torch.device("cpu")
    model = TrainableModel(spec, start_tensors(spec, cfg.init, cfg.seed, cfg.warm_start), device)
    return evaluate(model, validation_examples(cfg), cfg, device)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path, metavar="CKPT")
    parser.add_argument("--task", required=True, choices=sorted(TRAININGS))
    parser.add_argument("--val", nargs="+", required=True, metavar="DIR")
    parser.add_argument("--channels", type=int, choices=(1, 3), default=1)
    parser.add_argument("--val-limit", type=int, default=8)
    parser.add_argument("--val-crop", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    score = f"val_{TRAININGS[args.task].score_name}"
    with reproducible_arithmetic():
        rows = {c: scores(c, args) for c in args.checkpoints}
    levels = sorted(
        {k for r in rows.values() for k in r if k.startswith(f"{score}@")},
        key=lambda k: float(k[len(score) + 1 :]),
    )
    print(
        f"{', '.join(args.val)}: {args.channels} channel(s), the first {args.val_limit} images, "
        f"crop {args.val_crop}, seed {args.seed}"
    )
    print("| checkpoint | " + " | ".join([score, *levels, "iterations", "converged"]) + " |")
    print("|---" * (len(levels) + 4) + "|")
    for ckpt, m in rows.items():
        values = [f"{m[k]:.4f}" for k in (score, *levels)] + [
            f"{m['val_iterations']:.2f}",
            f"{m['val_converged']:.2f}",
        ]
        print(f"| `{ckpt}` | " + " | ".join(values) + " |")


if __name__ == "__main__":
    main()
