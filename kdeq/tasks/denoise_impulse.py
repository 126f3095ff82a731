"""``denoise-impulse``: remove Gaussian noise and salt-and-pepper impulses (``kdeq.robust``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from kdeq.predictor import Prediction
from kdeq.robust import ImpulseDenoiser
from kdeq.tasks import register_task
from kdeq.tasks.base import Request, Task, Variant, noise_levels
from kdeq.tasks.denoise import Denoise, DenoiseOptions


@register_task
class DenoiseImpulse(Task):
    """Denoise `image` with Gaussian noise and salt-and-pepper impulses (pixels at black or white that
    differ from their neighbours): the impulses are left out and filled in by the kernel, the rest is
    fitted under KerDEQ's Gaussian (Welsch) data term; `sigma` is estimated on the impulse-free pixels
    when absent."""

    name = "denoise-impulse"
    summary = "Remove noise and salt-and-pepper impulses from an image"
    sample = "impulses"
    predictor = ImpulseDenoiser
    options = DenoiseOptions
    fields = Denoise.fields
    variant = Variant(
        "denoise", "noise", "impulse", "gaussian", "Gaussian noise plus salt-and-pepper impulses"
    )
    architectures = ("guided",)
    network = "sigma"

    def batch_key(self, request: Request) -> Hashable:
        return (request.options.sigma is None, request.solver)

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        return (images,), {"sigma": noise_levels(requests), "solver": requests[0].solver}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"sigma": float(prediction.sigma[index])}

    def warmup(self, size: int) -> Request:
        """A generated image with σ = 15 noise and 10 % salt-and-pepper impulses."""
        rng = np.random.default_rng(0)
        image = np.clip(0.5 + 0.06 * rng.standard_normal((1, size, size)), 0, 1)
        hit = rng.random((1, size, size)) < 0.1
        image[hit] = rng.integers(0, 2, int(hit.sum()))
        return Request(image.astype(np.float32), self.options())
