"""``segment``: a binary foreground mask by kernel logistic regression (``kdeq.predictors.segment``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import Field

from kdeq.predictors.base import Prediction
from kdeq.predictors.segment import Segmenter
from kdeq.tasks.base import Options, Request, ResultField, Task


class SegmentOptions(Options):
    threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="binarisation threshold in [0, 1] (default: Otsu's)",
    )
    output: Literal["mask", "probability"] = Field(
        "mask", description="`mask`: 0/255 grey PNG; `probability`: foreground probability × 255"
    )


class Segment(Task):
    """Segment `image` into foreground and background with kernel logistic regression."""

    name = "segment"
    summary = "Binary foreground mask"
    sample = "scan"
    predictor = Segmenter
    options = SegmentOptions
    fields = (ResultField("threshold", "threshold used, in [0, 1]", ".4f"),)
    grey_output = True

    def batch_key(self, request: Request) -> tuple:
        # the output kind is chosen per request from the same solve
        return (request.options.threshold, request.solver)

    def output_alpha(self, request: Request, alpha: object, files: Sequence[str]) -> None:
        return None

    def tile_halo(self, predictor: Segmenter) -> int:
        """The model's ``solve_reach`` (``kdeq.predictors.segment``)."""
        return predictor.solve_reach

    def whole_image(self, predictor: Segmenter, request: Request) -> Request:
        """Otsu's threshold of the whole image, where none is given, fixed for its tiles."""
        if request.options.threshold is not None:
            return request
        with torch.inference_mode():
            tau = float(predictor.otsu(torch.from_numpy(request.image)[None]))
        return replace(request, options=request.options.model_copy(update={"threshold": tau}))

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        return (images,), {"threshold": first.options.threshold, "solver": first.solver}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        out = prediction.mask[index].float() if request.options.output == "mask" else prediction.output[index]
        return out, {"threshold": float(prediction.threshold[index])}
