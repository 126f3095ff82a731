"""What a request asks a model to solve, and how a batch of such requests is solved.

This is the only module that calls the task models (``kdeq`` predictors), and
it runs on the inference workers only: it stacks the images of compatible
requests, calls ``predict`` once, and splits the ``Prediction`` back into one
``Solved`` per request as numpy arrays on the host.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kdeq.predictor import Predictor, SolverOverride


@dataclass(frozen=True)
class TaskInput:
    """A request's input.

    Attributes:
        image: ``(c, H, W)`` float32 array in [0, 1].
        missing: ``(1, H, W)`` bool array, True at pixels to fill (inpaint), else ``None``.
        sigma: noise level on the 0–255 scale (denoise), ``None`` to estimate it.
        threshold: binarisation threshold in [0, 1] (segment), ``None`` for Otsu's.
        output: ``mask`` or ``probability`` (segment).
        solver: per-request solver limits.
    """

    image: np.ndarray
    missing: np.ndarray | None = None
    sigma: float | None = None
    threshold: float | None = None
    output: Literal["mask", "probability"] = "mask"
    solver: SolverOverride | None = None

    def batch_key(self, model: str) -> Hashable:
        """Requests with equal keys can be solved in one ``predict`` call."""
        return (model, tuple(self.image.shape), self.sigma is None, self.threshold, self.solver)


@dataclass(frozen=True)
class Solved:
    """One request's result.

    Attributes:
        output: ``(c, H, W)`` float32 array in [0, 1]: the restored image, or the
            segment mask / probability ``(1, H, W)``.
        iterations, residual, converged: the solver's statistics for this image.
        lam: ``λ`` used; sigma: noise level used (0–255, denoise); threshold: used (segment).
        finite: whether the model's continuous output (image or probability) is finite everywhere.
    """

    output: np.ndarray
    iterations: int
    residual: float
    converged: bool
    lam: float
    sigma: float | None
    threshold: float | None
    finite: bool


def solve_batch(predictor: Predictor, inputs: Sequence[TaskInput]) -> list[Solved]:
    """Solve compatible ``inputs`` (equal ``batch_key``) in one ``predict`` call."""
    first = inputs[0]
    images = torch.from_numpy(np.stack([i.image for i in inputs]))
    if predictor.task == "denoise":
        sigma = None if first.sigma is None else [i.sigma for i in inputs]
        pred = predictor.predict(images, sigma=sigma, solver=first.solver)
    elif predictor.task == "inpaint":
        missing = torch.from_numpy(np.stack([i.missing for i in inputs]))
        pred = predictor.predict(images, missing, solver=first.solver)
    else:
        pred = predictor.predict(images, threshold=first.threshold, solver=first.solver)
    output = pred.output.float().cpu().numpy()
    mask = pred.mask.cpu().numpy().astype(np.float32) if pred.mask is not None else None
    stats = pred.stats
    iterations, residual, converged = (
        stats.iterations.tolist(),
        stats.residual.tolist(),
        stats.converged.tolist(),
    )
    lam = pred.lam.reshape(-1).expand(len(inputs)).tolist()
    sigma = pred.sigma.tolist() if pred.sigma is not None else [None] * len(inputs)
    threshold = pred.threshold.tolist() if pred.threshold is not None else [None] * len(inputs)
    finite = np.isfinite(output.reshape(len(inputs), -1)).all(axis=1).tolist()
    solved = []
    for b, item in enumerate(inputs):
        out = mask[b] if mask is not None and item.output == "mask" else output[b]
        solved.append(
            Solved(
                out,
                int(iterations[b]),
                float(residual[b]),
                bool(converged[b]),
                lam[b],
                sigma[b],
                threshold[b],
                finite[b],
            )
        )
    return solved


def warmup_input(task: str) -> TaskInput:
    """A small generated request for ``task`` that exercises the whole solve."""
    rng = np.random.default_rng(0)
    image = rng.random((1, 32, 32), dtype=np.float32)
    if task == "inpaint":
        return TaskInput(image, missing=rng.random((1, 32, 32)) < 0.3)
    return TaskInput(image)
