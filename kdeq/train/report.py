"""The training report: ``metrics.json``, curves per epoch and a before/after image grid (PNG).

Plots need matplotlib (``pip install 'kdeq[train]'``), imported through ``kdeq.train.preflight.pyplot``,
which the trainer calls before its first step.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from kdeq.runtime.atomic import write_files
from kdeq.train.config import TrainConfig
from kdeq.train.preflight import pyplot
from kdeq.train.tasks.base import Training
from kdeq.train.trainings import TRAININGS


def _png(fig) -> bytes:
    """``fig`` as PNG bytes; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    pyplot().close(fig)
    return buffer.getvalue()


def _curve(epochs: list[dict], keys: list[tuple[str, str]], ylabel: str, title: str) -> bytes:
    """A PNG of ``keys``' values (``(key, label)``) against the epoch."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for key, label in keys:
        xs = [e["epoch"] for e in epochs if key in e]
        ys = [e[key] for e in epochs if key in e]
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("epoch (0: the start)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _png(fig)


def _show(x: torch.Tensor):
    """``(c, H, W)`` → an array for ``imshow``."""
    a = x.detach().float().clamp(0, 1).cpu()
    return a[0].numpy() if a.shape[0] == 1 else a.permute(1, 2, 0).numpy()


def image_grid(
    training: Training,
    examples: list[dict[str, torch.Tensor]],
    before: list[torch.Tensor],
    after: list[torch.Tensor],
    rows: int = 4,
) -> bytes | None:
    """A PNG of rows of (input as ``training`` shows it, start's output, trained output, target) for
    the first ``rows`` of ``training``'s examples; ``None`` without examples."""
    plt = pyplot()
    n = min(rows, len(examples), len(before), len(after))
    if n == 0:
        return None
    fig, axes = plt.subplots(n, 4, figsize=(10, 2.6 * n), dpi=100, squeeze=False)
    for r in range(n):
        ex = examples[r]
        for c, (img, label) in enumerate(
            (
                (training.shown_input(ex), "input"),
                (before[r], "start"),
                (after[r], "trained"),
                (ex["target"], "target"),
            )
        ):
            ax = axes[r][c]
            ax.imshow(_show(img), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            ax.set_axis_off()
            if r == 0:
                ax.set_title(label)
    fig.tight_layout()
    return _png(fig)


def write_report(
    directory: Path,
    cfg: TrainConfig,
    hist: object,
    val_set: list[dict[str, torch.Tensor]],
    before: list[torch.Tensor],
    after: list[torch.Tensor],
) -> None:
    """``metrics.json`` (settings and every epoch's metrics) and ``loss.png``, ``val_<score>.png`` (the
    task's score), ``iterations.png``, ``grid.png`` in ``directory``, replaced as one set
    (``kdeq.runtime.atomic.write_files``, ``metrics.json`` last)."""
    training = TRAININGS[cfg.task]
    score, name = training.score_name, training.score_label
    epochs = hist.epochs
    doc = {
        "config": cfg.model_dump(mode="json"),
        "best_epoch": hist.best_epoch,
        "rollbacks": hist.rollbacks,
        "epochs": epochs,
    }
    files = {
        "loss.png": _curve(epochs, [("train_loss", "train"), ("val_loss", "validation")], "loss", "Loss"),
        f"val_{score}.png": _curve(
            epochs, [(f"train_{score}", "train"), (f"val_{score}", "validation")], name, f"{name} per epoch"
        ),
        "iterations.png": _curve(
            epochs,
            [("train_iterations", "train"), ("val_iterations", "validation")],
            "mean solver iterations",
            "Forward solver iterations",
        ),
    }
    grid = image_grid(training, val_set, before, after)
    if grid is not None:
        files["grid.png"] = grid
    files["metrics.json"] = (json.dumps(doc, indent=1) + "\n").encode()
    write_files(directory, files)
