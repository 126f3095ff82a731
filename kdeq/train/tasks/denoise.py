"""How the ``denoise`` task trains: Gaussian noise of a drawn level on the clean patch."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kdeq.train.data import uniform
from kdeq.train.tasks.base import ClippedNoiseKnobs, Training


class DenoiseTraining(Training):
    name = "denoise"
    knobs = ClippedNoiseKnobs

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: ClippedNoiseKnobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """``noisy = clean + σn``, ``n ~ N(0, I)``, with ``σ`` (0–255, also the example's ``sigma``) drawn
        from ``settings.sigma`` or the validation ``level``; clipped to [0, 1] with
        ``settings.clip_noise``."""
        s = uniform(gen, *(settings.sigma if level is None else (level, level)))
        noisy = clean + (s / 255.0) * torch.randn(clean.shape, generator=gen)
        if settings.clip_noise:
            noisy = noisy.clamp(0, 1)
        return {"target": clean, "noisy": noisy, "sigma": torch.tensor(s)}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(noisy, sigma)``: the images ``(B, c, H, W)`` and their noise levels ``(B,)``, given."""
        return batch["noisy"], batch["sigma"]

    def val_levels(self, settings: ClippedNoiseKnobs) -> tuple[float, ...]:
        """Noise levels σ 15, 25 and 50."""
        return (15.0, 25.0, 50.0)

    def check_level(self, level: float, settings: ClippedNoiseKnobs) -> None:
        if not 0 <= level <= 255:
            raise ValueError(f"val level {level:g}: a denoise level is a noise level σ in [0, 255]")
