"""``segment``: a binary foreground mask by kernel logistic regression (``kdeq.segment``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import Field

from kdeq.checkpoint import ModelSpec
from kdeq.predictor import Prediction
from kdeq.segment import Segmenter
from kdeq.tasks import register_task
from kdeq.tasks.base import Options, Request, ResultField, Task
from kdeq.train.data import Corruption, binary_target, uniform
from kdeq.train.objectives import SquaredError, cross_entropy, iou


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


@register_task
class Segment(Task):
    """Segment `image` into foreground and background with kernel logistic regression."""

    name = "segment"
    family = "bernoulli"
    summary = "Binary foreground mask"
    sample = "scan"
    predictor = Segmenter
    options = SegmentOptions
    fields = (ResultField("threshold", "threshold used, in [0, 1]", ".4f"),)
    grey_output = True
    score_name = "iou"
    score_label = "IoU"
    network = "image"

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        if spec.architecture.net is not None and spec.mean != "none":
            raise ValueError("the segmenter's network is its mean: use mean 'none'")

    def batch_key(self, request: Request) -> tuple:
        # the output kind is chosen per request from the same solve
        return (request.options.threshold, request.solver)

    def output_alpha(self, request: Request, alpha: object, files: Sequence[str]) -> None:
        return None

    def tile_halo(self, predictor: Segmenter) -> int:
        """The model's ``solve_reach`` (``kdeq.segment``)."""
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

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: Corruption,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """The target ``t = [x̄ > τ]`` ``(1, H, W)`` (``x̄`` the patch's luminance, ``τ`` its Otsu
        threshold); the input ``noisy``: ``t`` with a fraction of its labels flipped, drawn from
        ``settings.flip`` or the validation ``level``, plus Gaussian noise of a level drawn from
        ``settings.sigma`` (0–255; at validation its middle)."""
        flip, sigma = settings.flip, settings.sigma
        if level is not None:
            mid = sum(settings.sigma) / 2
            flip, sigma = (level, level), (mid, mid)
        target = binary_target(clean)
        # the pixels' uniforms are drawn before the fraction they are compared with (the draws' order
        # is the runs')
        flipped = torch.rand(target.shape, generator=gen) < uniform(gen, *flip)
        s = uniform(gen, *sigma)
        noise = (s / 255.0) * torch.randn(target.shape, generator=gen)
        return {"target": target, "noisy": torch.where(flipped, 1.0 - target, target) + noise}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """``(noisy,)``: the images ``(B, c, H, W)``."""
        return (batch["noisy"],)

    def loss(self, out: torch.Tensor, target: torch.Tensor, kind: SquaredError) -> torch.Tensor:
        """Cross-entropy of the foreground probability (the run's squared-error ``kind`` is the
        Gaussian tasks')."""
        return cross_entropy(out, target)

    def score(self, out: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Intersection over union of the ``> 1/2`` masks."""
        return iou(out, batch["target"])

    def val_levels(self, settings: Corruption) -> tuple[float, ...]:
        """A flip fraction of 0.05."""
        return (0.05,)

    def check_level(self, level: float, settings: Corruption) -> None:
        if not 0 <= level <= 0.5:
            raise ValueError(f"val level {level:g}: a segment level is a label-flip fraction in [0, 0.5]")
