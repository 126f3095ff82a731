"""``denoise-poisson``: estimate the photon rate of an image of counts (``kdeq.photon``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kdeq.photon import PhotonDenoiser
from kdeq.predictor import Prediction
from kdeq.tasks import register_task
from kdeq.tasks.base import InputError, Options, Request, ResultField, Task, Variant


class DenoisePoissonOptions(Options):
    peak: float | None = Field(
        None,
        gt=0,
        le=65535,
        allow_inf_nan=False,
        description="the counts shown as full scale (white) in the output (default: the estimate's "
        "99.5th percentile, at least 1)",
    )


@register_task
class DenoisePoisson(Task):
    """Estimate the Poisson rate of `image`, whose pixel values are photon counts (8- or 16-bit); the
    output is the rate scaled so that `peak` counts are full scale, in the input's bit depth."""

    name = "denoise-poisson"
    family = "poisson"
    summary = "Remove photon (Poisson) noise from an image of counts"
    sample = "counts"
    predictor = PhotonDenoiser
    options = DenoisePoissonOptions
    fields = (ResultField("peak", "counts shown as full scale: rate = pixel ÷ full scale × peak", ".6g"),)
    counts = True
    variant = Variant(
        "denoise",
        "noise",
        "poisson",
        "gaussian",
        "photon counts as stored, with `peak`",
    )
    architectures = ("guided",)
    network = "sigma"

    def batch_key(self, request: Request) -> Hashable:
        # given peaks may differ within a batch (one per sample); estimated ones are estimated per image
        return (request.options.peak is None, request.solver)

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        peaks = None if first.options.peak is None else [r.options.peak for r in requests]
        return (images,), {"peak": peaks, "solver": first.solver}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"peak": float(prediction.peak[index])}

    def check_uncertainty(self, request: Request) -> None:
        """The Laplace map (``kdeq.uncertainty``) weighs each pixel by its rate, which differs between
        a colour image's channels; the map is one ``(H, W)`` image, so grey counts only."""
        if request.image.shape[0] != 1:
            raise InputError(
                "uncertainty_unsupported", "the photon-count uncertainty map is for grey images only"
            )

    def warmup(self, size: int) -> Request:
        """Counts of a generated rate image at a peak of 10."""
        rng = np.random.default_rng(0)
        rate = 10.0 * rng.random((1, size, size))
        return Request(rng.poisson(rate).astype(np.float32), self.options())
