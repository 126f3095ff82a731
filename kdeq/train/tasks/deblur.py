"""How the ``deblur`` task trains: the clean patch blurred by a PSF drawn per step, plus noise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import torch
from pydantic import AfterValidator, Field

from kdeq.maths.operators import Blur
from kdeq.maths.psf import parse_psf
from kdeq.train.data import uniform
from kdeq.train.tasks.base import ClippedNoiseKnobs, Training, check_index_level, shared_value

#: the deblurrer's training blurs: PSFs even in each axis, which the model solves by transforms
DEBLUR_PSFS: tuple[str, ...] = (
    "gaussian:1",
    "gaussian:1.6",
    "gaussian:2.4",
    "disk:2.5",
    "motion:9",
    "motion:15",
)


def _named_psfs(names: tuple[str, ...]) -> tuple[str, ...]:
    for name in names:
        try:
            parse_psf(name)
        except ValueError as err:
            raise ValueError(f"psfs: {err}") from None
    return names


class DeblurKnobs(ClippedNoiseKnobs):
    psfs: Annotated[tuple[str, ...], AfterValidator(_named_psfs)] = Field(
        DEBLUR_PSFS,
        min_length=1,
        description="named PSFs (gaussian:SIGMA, disk:RADIUS, motion:LENGTH[,ANGLE]) the blurs are drawn "
        "from, one per step (deblur; a PSF not even in each axis makes every solve CG)",
        json_schema_extra={"metavar": "PSF"},
    )


class DeblurTraining(Training):
    name = "deblur"
    knobs = DeblurKnobs

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: DeblurKnobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """``blurred = h * clean + σn`` ``(c, H, W)`` (``kdeq.maths.operators.Blur``, symmetric border;
        the service's blur model), ``n ~ N(0, I)``: the PSF ``h`` (also the example's ``psf``) drawn
        from ``settings.psfs`` by ``shared`` (one per step: the predictor takes one per call), or the
        one the validation ``level`` indexes; ``σ`` (0–255, the example's ``sigma``) drawn from
        ``settings.sigma``, the range's middle for validation; clipped to [0, 1] with
        ``settings.clip_noise``."""
        if level is None:
            draw = gen if shared is None else shared
            name = settings.psfs[int(torch.randint(len(settings.psfs), (), generator=draw))]
            s = uniform(gen, *settings.sigma)
        else:
            name, s = settings.psfs[int(level)], sum(settings.sigma) / 2
        psf = parse_psf(name)
        blurred = Blur(psf, "symmetric").forward(clean[None])[0]
        blurred = blurred + (s / 255.0) * torch.randn(clean.shape, generator=gen)
        if settings.clip_noise:
            blurred = blurred.clamp(0, 1)
        return {"target": clean, "blurred": blurred, "psf": psf, "sigma": torch.tensor(s)}

    def predictor_inputs(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(blurred, psf, sigma)``: the images ``(B, c, H, W)``, the batch's one PSF ``(k, k)`` and
        the noise levels ``(B,)``, given."""
        return batch["blurred"], shared_value(batch, "psf", "deblur", "PSF"), batch["sigma"]

    def val_levels(self, settings: DeblurKnobs) -> tuple[float, ...]:
        """Every PSF of the run, at the middle of its noise range."""
        return tuple(float(i) for i in range(len(settings.psfs)))

    def check_level(self, level: float, settings: DeblurKnobs) -> None:
        check_index_level(level, "deblur", "psfs", settings.psfs)
