"""How the ``super-resolve`` task trains: the bicubic degradation by a scale drawn per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import torch
from pydantic import AfterValidator, Field

from kdeq.maths.psf import SR_SCALES
from kdeq.predictors.super_resolve import degrade
from kdeq.train.objectives import psnr
from kdeq.train.tasks.base import Knobs, Training, shared_value


def _known_scales(scales: tuple[int, ...]) -> tuple[int, ...]:
    if not set(scales) <= set(SR_SCALES):
        raise ValueError(f"scales must be among {list(SR_SCALES)}, got {list(scales)}")
    return scales


class SuperResolveKnobs(Knobs):
    scales: Annotated[tuple[int, ...], AfterValidator(_known_scales)] = Field(
        (2, 3, 4),
        min_length=1,
        description="factors drawn from, one per step (super-resolve; each 2, 3 or 4)",
        json_schema_extra={"metavar": "S"},
    )


class SuperResolveTraining(Training):
    name = "super-resolve"
    knobs = SuperResolveKnobs

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: SuperResolveKnobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """``low = S H target`` ``(c, H/s, W/s)``, the bicubic degradation
        (``kdeq.predictors.super_resolve.degrade``), of ``target``, ``clean`` cropped to a multiple of
        ``s``; the scale ``s`` (the example's ``scale``) drawn from ``settings.scales`` by ``shared``
        (one per step: the predictor takes one per call), or the validation ``level`` itself. No
        noise, as in the field's protocol."""
        if level is None:
            draw = gen if shared is None else shared
            s = settings.scales[int(torch.randint(len(settings.scales), (), generator=draw))]
        else:
            s = int(level)
        h, w = clean.shape[-2:]
        target = clean[:, : h - h % s, : w - w % s]
        return {"target": target, "low": degrade(target[None], s)[0], "scale": torch.tensor(s)}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``(low, scale)``: the low-resolution images ``(B, c, h, w)`` and the batch's one scale."""
        return batch["low"], int(shared_value(batch, "scale", "super-resolve", "scale"))

    def score(self, out: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """PSNR with a ``scale``-pixel border cropped (the field's convention)."""
        s = int(batch["scale"][0])
        return psnr(out[..., s:-s, s:-s], batch["target"][..., s:-s, s:-s])

    def val_levels(self, settings: SuperResolveKnobs) -> tuple[float, ...]:
        """Every scale of the run."""
        return tuple(float(s) for s in settings.scales)

    def check_level(self, level: float, settings: SuperResolveKnobs) -> None:
        if level not in SR_SCALES:
            raise ValueError(
                f"val level {level:g}: a super-resolve level is a scale, one of {list(SR_SCALES)}"
            )
