"""``denoise-poisson``: estimate the photon rate of an image of counts (``kdeq.predictors.photon``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kdeq.predictors.base import Prediction
from kdeq.predictors.photon import PhotonDenoiser, WholeImage, full_scale
from kdeq.tasks.base import InputError, Options, Request, ResultField, Solved, Task, Variant

#: the largest peak: a 16-bit detector's full scale
MAX_PEAK = 65535


class DenoisePoissonOptions(Options):
    peak: float | None = Field(
        None,
        gt=0,
        le=MAX_PEAK,
        allow_inf_nan=False,
        description="the counts shown as full scale (white) in the output (default: the estimate's "
        "99.5th percentile, at least 1)",
    )


class DenoisePoisson(Task):
    """Estimate the Poisson rate of `image`, whose pixel values are photon counts (8- or 16-bit); the
    output is the rate scaled so that `peak` counts are full scale, in the input's bit depth."""

    name = "denoise-poisson"
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

    def batch_key(self, request: Request) -> Hashable:
        # given peaks may differ within a batch (one per sample); estimated ones are estimated per image
        return (request.options.peak is None, request.solver)

    def tile_halo(self, predictor: PhotonDenoiser) -> int:
        """The model's ``solve_reach`` (``kdeq.predictors.denoise``): the Poisson equation at a pixel reads
        the guided kernel's row, the counts and the mean within the guided denoiser's reach."""
        return predictor.solve_reach

    def whole_image(self, predictor: PhotonDenoiser, request: Request) -> Request:
        """The guide's scale, the level its network centres on and the largest count fixed from the
        whole image (``kdeq.predictors.photon.WholeImage``); without a given peak the tiles keep their rates
        in counts (peak 1), and ``whole_result`` scales the whole output."""
        whole = WholeImage.of(torch.from_numpy(request.image)[None])
        options = request.options
        if options.peak is None:
            options = options.model_copy(update={"peak": 1.0})
        return replace(request, options=options, inputs={**request.inputs, "whole": whole})

    def whole_result(self, request: Request, solved: Solved) -> Solved:
        """Without a given peak: the output and its uncertainty divided by the whole estimate's
        ``full_scale`` (``kdeq.predictors.photon``), as an untiled solve divides them."""
        if request.options.peak is not None:
            return solved
        peak = float(full_scale(torch.from_numpy(solved.output)[None]))
        std = solved.uncertainty
        if std is not None:
            std = replace(std, std=std.std / np.float32(peak))
        output = solved.output / np.float32(peak)
        return replace(solved, output=output, fields={"peak": peak}, uncertainty=std)

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        peaks = None if first.options.peak is None else [r.options.peak for r in requests]
        extra = {}
        if "whole" in first.inputs:  # tiles of one image (kdeq.serving.tiling), never batched with others
            extra["whole"] = first.inputs["whole"]
        return (images,), {"peak": peaks, "solver": first.solver, **extra}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"peak": float(prediction.peak[index])}

    def check_uncertainty(self, request: Request) -> None:
        """The Laplace map (``kdeq.predictors.uncertainty``) weighs each pixel by its rate, which differs
        between a colour image's channels; the map is one ``(H, W)`` image, so grey counts only."""
        if request.image.shape[0] != 1:
            raise InputError(
                "uncertainty_unsupported", "the photon-count uncertainty map is for grey images only"
            )

    def warmup(self, size: int) -> Request:
        """Counts of a generated rate image at a peak of 10."""
        rng = np.random.default_rng(0)
        rate = 10.0 * rng.random((1, size, size))
        return Request(rng.poisson(rate).astype(np.float32), self.options())
