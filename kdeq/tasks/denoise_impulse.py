"""``denoise-impulse``: remove Gaussian noise and salt-and-pepper impulses (``kdeq.predictors.robust``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kdeq.predictors.base import Prediction
from kdeq.predictors.robust import ImpulseDenoiser, off_end_means, robust_sigma
from kdeq.tasks.base import Request, Task, Variant, noise_levels, tile_level
from kdeq.tasks.denoise import Denoise, DenoiseOptions


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

    def batch_key(self, request: Request) -> Hashable:
        return (request.options.sigma is None, request.solver)

    def tile_halo(self, predictor: ImpulseDenoiser) -> int:
        """The model's ``solve_reach`` (``kdeq.predictors.robust``)."""
        return predictor.solve_reach

    def whole_image(self, predictor: ImpulseDenoiser, request: Request) -> Request:
        """``σ`` estimated on the whole image's impulse-free blocks where not given (at most 255, as
        ``Denoise`` gives it), and the level its guide network centres on (``off_end_means``) fixed."""
        image = torch.from_numpy(request.image)[None]
        options = request.options
        if options.sigma is None:
            options = options.model_copy(update={"sigma": min(float(robust_sigma(image)[0]) * 255.0, 255.0)})
        level = off_end_means(image)[0].numpy()
        return replace(request, options=options, inputs={**request.inputs, "level": level})

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        return (images,), {
            "sigma": noise_levels(requests),
            "solver": requests[0].solver,
            **tile_level(requests),
        }

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"sigma": float(prediction.sigma[index])}

    def warmup(self, size: int) -> Request:
        """A generated image with σ = 15 noise and 10 % salt-and-pepper impulses."""
        rng = np.random.default_rng(0)
        image = np.clip(0.5 + 0.06 * rng.standard_normal((1, size, size)), 0, 1)
        hit = rng.random((1, size, size)) < 0.1
        image[hit] = rng.integers(0, 2, int(hit.sum()))
        return Request(image.astype(np.float32), self.options())
