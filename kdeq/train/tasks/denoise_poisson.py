"""How the ``denoise-poisson`` task trains: photon counts of the clean patch at a drawn peak."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import torch
from pydantic import AfterValidator, Field

from kdeq.tasks.denoise_poisson import MAX_PEAK
from kdeq.train.data import log_uniform
from kdeq.train.tasks.base import Knobs, Training


def _peak_range(value: tuple[float, float]) -> tuple[float, float]:
    if not 0 < value[0] <= value[1] <= MAX_PEAK:
        raise ValueError(f"peaks must be a range 0 < lo ≤ hi ≤ {MAX_PEAK}, got {value}")
    return value


class DenoisePoissonKnobs(Knobs):
    peaks: Annotated[tuple[float, float], AfterValidator(_peak_range)] = Field(
        (1.0, 30.0),
        description="photon counts of white, a range drawn log-uniformly (denoise-poisson)",
        json_schema_extra={"metavar": "LO,HI"},
    )


class DenoisePoissonTraining(Training):
    name = "denoise-poisson"
    knobs = DenoisePoissonKnobs

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: DenoisePoissonKnobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """``counts ~ Poisson(peak·clean)`` per pixel, with ``peak`` (white's mean count, also the
        example's ``peak``) drawn log-uniformly from ``settings.peaks`` or the validation ``level``;
        the target is ``clean``, which the model's ``r̂/peak`` estimates."""
        peak = log_uniform(gen, *(settings.peaks if level is None else (level, level)))
        counts = torch.poisson(peak * clean, generator=gen)
        return {"target": clean, "counts": counts, "peak": torch.tensor(peak)}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts, peak)``: the counts ``(B, c, H, W)`` and their peaks ``(B,)``, given."""
        return batch["counts"], batch["peak"]

    def shown_input(self, example: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The counts ÷ peak ``(c, H, W)``: white at the example's peak, as the output is shown."""
        return example["counts"] / example["peak"]

    def val_levels(self, settings: DenoisePoissonKnobs) -> tuple[float, ...]:
        """Peaks 1, 4 and 30: a photon, a few, and a dim photograph."""
        return (1.0, 4.0, 30.0)

    def check_level(self, level: float, settings: DenoisePoissonKnobs) -> None:
        if not 0 < level <= MAX_PEAK:
            raise ValueError(
                f"val level {level:g}: a denoise-poisson level is a peak count in (0, {MAX_PEAK}]"
            )
