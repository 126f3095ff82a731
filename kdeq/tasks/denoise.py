"""``denoise``: remove Gaussian noise of a given or estimated level (``kdeq.predictors.denoise``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kdeq.predictors.base import Prediction
from kdeq.predictors.denoise import Denoiser
from kdeq.tasks.base import NoiseLevel, Options, Request, ResultField, Task, noise_levels, tile_level


class DenoiseOptions(Options):
    sigma: NoiseLevel = None


class Denoise(Task):
    """Denoise `image` with a Gaussian kGLM-DEQ; `sigma` is estimated per image when absent."""

    name = "denoise"
    summary = "Remove noise from an image"
    sample = "noisy"
    predictor = Denoiser
    options = DenoiseOptions
    fields = (ResultField("sigma", "noise level used, 0–255", ".3f"),)

    def batch_key(self, request: Request) -> Hashable:
        # given levels may differ within a batch (σ is per sample); estimated ones are estimated per image
        return (request.options.sigma is None, request.solver)

    def tile_halo(self, predictor: Denoiser) -> int:
        """The model's ``solve_reach`` (``kdeq.predictors.denoise``)."""
        return predictor.solve_reach

    def whole_image(self, predictor: Denoiser, request: Request) -> Request:
        """``σ`` estimated on the whole image where not given, and the image's channel means
        (``level``, which the guide network centres on) fixed. An estimate above 255 (no photograph's:
        a fine checkerboard's) is given to the tiles as 255, the largest level a request may give."""
        image = torch.from_numpy(request.image)[None]
        options = request.options
        if options.sigma is None:
            estimate = float(predictor.noise_level(image, None)) * 255.0
            options = options.model_copy(update={"sigma": min(estimate, 255.0)})
        # numpy accumulates in float64 without a float64 copy of the image (torch's mean makes one)
        level = request.image.mean(axis=(1, 2), dtype=np.float64).astype(np.float32)
        return replace(request, options=options, inputs={**request.inputs, "level": level})

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        extra = ({} if sizes is None else {"sizes": sizes}) | tile_level(requests)
        return (images,), {"sigma": noise_levels(requests), "solver": first.solver, **extra}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"sigma": float(prediction.sigma[index])}
