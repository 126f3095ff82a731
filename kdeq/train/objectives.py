"""Losses and scores: what the tasks' trainings (``kdeq.train.tasks.base.Training.loss`` and ``score``)
minimise and report, on batches of outputs and targets ``(B, c, H, W)``."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

SquaredError = Literal["log_mse", "mse"]


def squared_error(out: torch.Tensor, target: torch.Tensor, kind: SquaredError) -> torch.Tensor:
    """The mean squared error (``mse``), or the mean over samples of ``ln MSE_b`` (``log_mse``: −PSNR
    up to a factor, so every sample counts alike, whatever its noise level or missing fraction);
    a scalar."""
    err = (out - target).square()
    if kind == "mse":
        return err.mean()
    return torch.log(err.flatten(1).mean(1) + 1e-10).mean()


def cross_entropy(prob: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the probability ``prob`` against the labels ``target`` in {0, 1}, a
    scalar; ``prob`` is kept off 0 and 1 so that a saturated pixel costs a bounded amount."""
    return F.binary_cross_entropy(prob.clamp(1e-6, 1 - 1e-6), target)


def psnr(out: torch.Tensor, target: torch.Tensor, region: torch.Tensor | None = None) -> torch.Tensor:
    """PSNR (dB) per sample ``(B,)`` of ``out`` clipped to [0, 1], over ``region`` ``(B, 1, H, W)`` or all."""
    err = (out.clamp(0, 1) - target).square()
    if region is None:
        mse = err.flatten(1).mean(1)
    else:
        w = region.expand_as(err).to(err.dtype)
        mse = (err * w).flatten(1).sum(1) / w.flatten(1).sum(1).clamp(min=1)
    return 10 * torch.log10(1.0 / mse.clamp(min=1e-12))


def iou(prob: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Intersection over union per sample ``(B,)`` of ``prob > 1/2`` and ``target > 1/2``."""
    a, b = (prob > 0.5).flatten(1), (target > 0.5).flatten(1)
    union = (a | b).sum(1)
    return torch.where(union > 0, (a & b).sum(1) / union.clamp(min=1), 1.0)
