"""How the ``segment`` task trains: the clean patch's Otsu mask, labels flipped, plus noise."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field

from kdeq.train.data import binary_target, uniform
from kdeq.train.objectives import SquaredError, cross_entropy, iou
from kdeq.train.tasks.base import NoiseKnobs, Training


class SegmentKnobs(NoiseKnobs):
    flip: float = Field(
        0.1,
        ge=0,
        le=0.5,
        description="the largest label-flip fraction (segment)",
        json_schema_extra={"metavar": "FRACTION"},
    )


class SegmentTraining(Training):
    name = "segment"
    knobs = SegmentKnobs
    score_name = "iou"
    score_label = "IoU"

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: SegmentKnobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """The target ``t = [x̄ > τ]`` ``(1, H, W)`` (``x̄`` the patch's luminance, ``τ`` its Otsu
        threshold); the input ``noisy``: ``t`` with a fraction of its labels flipped, drawn from
        ``[0, settings.flip]`` or the validation ``level``, plus Gaussian noise of a level drawn from
        ``settings.sigma`` (0–255; at validation its middle)."""
        flip, sigma = (0.0, settings.flip), settings.sigma
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

    def val_levels(self, settings: SegmentKnobs) -> tuple[float, ...]:
        """A flip fraction of 0.05."""
        return (0.05,)

    def check_level(self, level: float, settings: SegmentKnobs) -> None:
        if not 0 <= level <= 0.5:
            raise ValueError(f"val level {level:g}: a segment level is a label-flip fraction in [0, 0.5]")
