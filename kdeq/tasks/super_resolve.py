"""``super-resolve``: a ``scale×`` larger image, as the kGLM-DEQ observed through ``A = S H`` (the
model and its degradation, MATLAB's ``imresize(f, 1/s, 'bicubic')``: ``kdeq.predictors.super_resolve``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from kdeq.maths.psf import SR_SCALES
from kdeq.predictors.super_resolve import SuperResolver, interpolation_sums
from kdeq.tasks.base import Options, Request, Task, tile_level


class SuperResolveOptions(Options):
    scale: Literal[2, 3, 4] = Field(2, description="the factor on each side of the image")


class SuperResolve(Task):
    """Enlarge `image` `scale` times in each axis with a Gaussian kGLM-DEQ observed through the
    bicubic degradation (MATLAB's `imresize(f, 1/scale, 'bicubic')`); the pixel limit applies to
    the output."""

    name = "super-resolve"
    summary = "Enlarge an image 2, 3 or 4 times"
    sample = "small"
    predictor = SuperResolver
    options = SuperResolveOptions

    def output_size(self, request: Request) -> tuple[int, int]:
        s = request.options.scale
        return s * request.image.shape[-2], s * request.image.shape[-1]

    def output_alpha(
        self, request: Request, alpha: np.ndarray | None, files: Sequence[str]
    ) -> np.ndarray | None:
        if alpha is None:
            return None
        s = request.options.scale
        return np.repeat(np.repeat(alpha, s, axis=-2), s, axis=-1)

    def batch_key(self, request: Request) -> Hashable:
        return (request.options.scale, request.solver)

    def tile_halo(self, predictor: SuperResolver) -> int:
        """The model's ``solve_reach``."""
        return predictor.solve_reach

    def whole_image(self, predictor: SuperResolver, request: Request) -> Request:
        """The interpolation's channel means (``level``, which the network centres on) fixed from the
        whole image: ``ū = rᵀ y c / (s²hw)`` with ``r``, ``c`` the column sums of the two axes'
        interpolation matrices, without interpolating the image."""
        s = request.options.scale
        _, h, w = request.image.shape
        rows, cols = interpolation_sums(h, s).numpy(), interpolation_sums(w, s).numpy()
        level = np.einsum("h,chw,w->c", rows, request.image, cols, dtype=np.float64) / (s * s * h * w)
        return replace(request, inputs={**request.inputs, "level": level.astype(np.float32)})

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        return (images,), {"scale": first.options.scale, "solver": first.solver, **tile_level(requests)}

    def warmup(self, size: int) -> Request:
        rng = np.random.default_rng(0)
        small = max(2, size // max(SR_SCALES))
        return Request(rng.random((1, small, small), dtype=np.float32), self.options(scale=max(SR_SCALES)))
