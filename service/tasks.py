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

from kdeq.predictor import Predictor, SolverOverride, pad_images


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

    def batch_key(self, model: str, pads_exactly: bool = False) -> Hashable:
        """Requests with equal keys can be solved in one ``predict`` call. For a model that
        ``pads_exactly`` images share a key when each side has the same bit length (``solve_batch``
        pads them), so padding at most quadruples a batch's pixels."""
        c, h, w = self.image.shape
        shape = (c, h.bit_length(), w.bit_length()) if pads_exactly else (c, h, w)
        return (model, shape, self.sigma is None, self.threshold, self.solver)


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
    """Solve compatible ``inputs`` (equal ``batch_key``) in one ``predict`` call; images of different
    sizes are padded to a common one (``kdeq.predictor.pad_images``) and cropped back."""
    first = inputs[0]
    uniform = len({i.image.shape for i in inputs}) == 1
    images, sizes = pad_images([torch.from_numpy(i.image) for i in inputs])
    extra = {} if uniform else {"sizes": sizes}
    if predictor.task == "denoise":
        sigma = None if first.sigma is None else [i.sigma for i in inputs]
        pred = predictor.predict(images, sigma=sigma, solver=first.solver, **extra)
    elif predictor.task == "inpaint":
        missing, _ = pad_images([torch.from_numpy(i.missing) for i in inputs])
        pred = predictor.predict(images, missing, solver=first.solver, **extra)
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
        out = out[:, : sizes[b][0], : sizes[b][1]]
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


def warmup_input(task: str, size: int) -> TaskInput:
    """A generated ``size``×``size`` request for ``task`` that exercises the whole solve."""
    rng = np.random.default_rng(0)
    image = rng.random((1, size, size), dtype=np.float32)
    if task == "inpaint":
        return TaskInput(image, missing=rng.random((1, size, size)) < 0.3)
    return TaskInput(image)
