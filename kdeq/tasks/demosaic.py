"""``demosaic``: a colour image from the samples of a Bayer colour filter array
(``kdeq.predictors.demosaic``)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kdeq.predictors.base import SolverOverride
from kdeq.predictors.demosaic import Demosaicker, Pattern
from kdeq.tasks.base import InputError, Options, Request, Task


class DemosaicOptions(Options):
    pattern: Pattern = Field(
        "RGGB",
        description="the Bayer pattern: the colours of the 2×2 tile at the top-left corner, row by row",
    )


class Demosaic(Task):
    """Reconstruct the colour image from a Bayer mosaic (one sample per pixel), or from a colour image
    read through the pattern (each pixel at its own colour only); observed samples are kept."""

    name = "demosaic"
    summary = "Reconstruct colour from a Bayer mosaic"
    sample = "photo"
    predictor = Demosaicker
    options = DemosaicOptions

    def prepare(
        self,
        image: np.ndarray,
        alpha: np.ndarray | None,
        options: Options,
        files: Mapping[str, np.ndarray],
        solver: SolverOverride | None = None,
    ) -> Request:
        """A grey image is the mosaic, a colour one is read through the pattern; either is stored as
        ``(3, H, W)`` (a mosaic's sample in every channel), so that both batch together."""
        if image.shape[0] not in (1, 3):
            raise InputError(
                "not_a_mosaic",
                f"send a grey Bayer mosaic or a colour image, not {image.shape[0]} channels",
            )
        if min(image.shape[-2:]) < 2:
            raise InputError(
                "too_small", f"a mosaic needs at least one 2×2 tile, got {image.shape[-1]}×{image.shape[-2]}"
            )
        return Request(np.broadcast_to(image, (3, *image.shape[-2:])).copy(), options, {}, solver)

    def output_mode(self, mode: str) -> str:
        """A colour image whatever the input: a grey mosaic's output is RGB (RGBA with an alpha)."""
        return {"L": "RGB", "I;16": "RGB", "LA": "RGBA"}.get(mode, mode)

    def batch_key(self, request: Request) -> Hashable:
        return (request.options.pattern, request.solver)

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        extra = {} if sizes is None else {"sizes": sizes}
        return (images,), {"pattern": requests[0].options.pattern, "solver": requests[0].solver, **extra}

    def warmup(self, size: int) -> Request:
        rng = np.random.default_rng(0)
        return Request(rng.random((3, size, size), dtype=np.float32), self.options())
