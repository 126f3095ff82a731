"""How the ``inpaint`` task trains: masks of drawn kinds over the clean patch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import torch
from pydantic import AfterValidator, Field

from kdeq.train.data import MASK_KINDS, MaskKind, make_mask
from kdeq.train.objectives import psnr
from kdeq.train.tasks.base import Knobs, Training, check_index_level, closed_range


def _some_kind(kinds: tuple[MaskKind, ...]) -> tuple[MaskKind, ...]:
    if not kinds:
        raise ValueError("mask_kinds needs at least one kind")
    return kinds


class InpaintKnobs(Knobs):
    mask_kinds: Annotated[tuple[MaskKind, ...], AfterValidator(_some_kind)] = Field(
        MASK_KINDS, description="the inpainting mask kinds drawn from"
    )
    missing: Annotated[tuple[float, float], closed_range(1.0)] = Field(
        (0.2, 0.9),
        description="the missing fraction of pixels masks, a range drawn uniformly (inpaint)",
        json_schema_extra={"metavar": "LO,HI"},
    )


class InpaintTraining(Training):
    name = "inpaint"
    knobs = InpaintKnobs

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: InpaintKnobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """A mask ``missing`` ``(1, H, W)`` of a kind drawn from ``settings.mask_kinds`` (``pixels``
        masks miss a fraction drawn from ``settings.missing``), or of the kind the validation
        ``level`` indexes (with the middle of ``missing``); ``image`` is ``clean``, whose missing
        pixels the predictor never reads."""
        if level is None:
            kinds, fraction = settings.mask_kinds, settings.missing
        else:
            mid = sum(settings.missing) / 2
            kinds, fraction = (settings.mask_kinds[int(level)],), (mid, mid)
        # a kind is drawn even from one kind: validation examples are seeded like training ones
        kind = kinds[int(torch.randint(len(kinds), (), generator=gen))]
        miss = make_mask(kind, tuple(clean.shape[-2:]), fraction, gen)
        # a patch with nothing observed carries no information; keep one pixel
        miss.view(-1)[int(torch.randint(miss.numel(), (), generator=gen))] = False
        return {"target": clean, "image": clean, "missing": miss[None]}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image, missing)``: the images ``(B, c, H, W)`` and their masks ``(B, 1, H, W)``."""
        return batch["image"], batch["missing"]

    def score(self, out: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """PSNR on the missing pixels, the ones the model fills."""
        return psnr(out, batch["target"], batch["missing"])

    def val_levels(self, settings: InpaintKnobs) -> tuple[float, ...]:
        """Every mask kind of the run."""
        return tuple(float(i) for i in range(len(settings.mask_kinds)))

    def check_level(self, level: float, settings: InpaintKnobs) -> None:
        check_index_level(level, "inpaint", "mask_kinds", settings.mask_kinds)

    def shown_input(self, example: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The image with its missing pixels black."""
        return torch.where(example["missing"], torch.zeros_like(example["image"]), example["image"])
