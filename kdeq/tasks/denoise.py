"""``denoise``: remove Gaussian noise of a given or estimated level (``kdeq.denoise``)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kdeq.checkpoint import ModelSpec
from kdeq.denoise import Denoiser
from kdeq.predictor import Prediction
from kdeq.tasks import register_task
from kdeq.tasks.base import NoiseLevel, Options, Request, ResultField, Task, noise_levels, tile_level
from kdeq.train.data import Corruption, uniform


class DenoiseOptions(Options):
    sigma: NoiseLevel = None


@register_task
class Denoise(Task):
    """Denoise `image` with a Gaussian kGLM-DEQ; `sigma` is estimated per image when absent."""

    name = "denoise"
    summary = "Remove noise from an image"
    sample = "noisy"
    predictor = Denoiser
    options = DenoiseOptions
    fields = (ResultField("sigma", "noise level used, 0–255", ".3f"),)
    architectures = ("conv", "guided")
    network = "sigma"
    chroma_prior_mean = True
    refines_pilot = True

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        if spec.architecture.net is not None and spec.architecture.kind != "guided":
            raise ValueError("the denoiser's network is the guided kernel's guide: use a guided architecture")
        if getattr(spec.architecture, "chroma", "solved") == "prior_mean" and spec.mean == "none":
            raise ValueError("chroma 'prior_mean' leaves the colour differences at the mean: it needs one")

    def batch_key(self, request: Request) -> Hashable:
        # given levels may differ within a batch (σ is per sample); estimated ones are estimated per image
        return (request.options.sigma is None, request.solver)

    def tile_halo(self, predictor: Denoiser) -> int:
        """The model's ``solve_reach`` (``kdeq.denoise``)."""
        return predictor.solve_reach

    def whole_image(self, predictor: Denoiser, request: Request) -> Request:
        """``σ`` estimated on the whole image where not given, and the image's channel means
        (``level``, which the guide network centres on) fixed. An estimate above 255 (no photograph's:
        a fine checkerboard's) is given to the tiles as 255, the largest level a request may give."""
        image = torch.from_numpy(request.image)[None]
        options = request.options
        if options.sigma is None:
            estimate = float(predictor.noise_level(image, None)) * 255.0
            options = options.model_copy(update={"sigma": min(estimate, 255.0)})
        # numpy accumulates in float64 without a float64 copy of the image (torch's mean makes one)
        level = request.image.mean(axis=(1, 2), dtype=np.float64).astype(np.float32)
        return replace(request, options=options, inputs={**request.inputs, "level": level})

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        extra = ({} if sizes is None else {"sizes": sizes}) | tile_level(requests)
        return (images,), {"sigma": noise_levels(requests), "solver": first.solver, **extra}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"sigma": float(prediction.sigma[index])}

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: Corruption,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """``noisy = clean + σn``, ``n ~ N(0, I)``, with ``σ`` (0–255, also the example's ``sigma``) drawn
        from ``settings.sigma`` or the validation ``level``; clipped to [0, 1] with ``settings.clip``."""
        s = uniform(gen, *(settings.sigma if level is None else (level, level)))
        noisy = clean + (s / 255.0) * torch.randn(clean.shape, generator=gen)
        if settings.clip:
            noisy = noisy.clamp(0, 1)
        return {"target": clean, "noisy": noisy, "sigma": torch.tensor(s)}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(noisy, sigma)``: the images ``(B, c, H, W)`` and their noise levels ``(B,)``, given."""
        return batch["noisy"], batch["sigma"]

    def val_levels(self, settings: Corruption) -> tuple[float, ...]:
        """Noise levels σ 15, 25 and 50."""
        return (15.0, 25.0, 50.0)

    def check_level(self, level: float, settings: Corruption) -> None:
        if not 0 <= level <= 255:
            raise ValueError(f"val level {level:g}: a denoise level is a noise level σ in [0, 255]")
