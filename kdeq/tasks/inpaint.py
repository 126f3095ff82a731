"""``inpaint``: fill the pixels a mask (or a zero alpha) marks missing (``kdeq.predictors.inpaint``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kdeq.predictors.base import SolverOverride, pad_images
from kdeq.predictors.inpaint import Inpainter
from kdeq.tasks.base import FileInput, InputError, Options, Request, Task, tile_level


class Inpaint(Task):
    """Fill the missing pixels of `image` (given by `mask`, or by a zero alpha channel); known pixels
    are kept."""

    name = "inpaint"
    summary = "Fill missing pixels"
    sample = "holey"
    predictor = Inpainter
    files = (
        FileInput(
            "mask",
            "same size as `image`, non-zero = missing; when absent, the image's alpha channel is 0 where "
            "missing",
            "mask",
        ),
    )

    def prepare(
        self,
        image: np.ndarray,
        alpha: np.ndarray | None,
        options: Options,
        files: Mapping[str, np.ndarray],
        solver: SolverOverride | None = None,
    ) -> Request:
        if "mask" in files:
            missing = files["mask"]
        elif alpha is not None:
            missing = (alpha == 0)[None]
        else:
            raise InputError(
                "missing_mask",
                "send a `mask`, or an image with an alpha channel 0 where missing",
                absent=True,
            )
        if bool(missing.all()):
            raise InputError("nothing_observed", "every pixel is marked missing; nothing to inpaint from")
        if not bool(missing.any()):
            raise InputError(
                "nothing_missing", "no pixel is marked missing (mask: non-zero = missing); nothing to fill"
            )
        return Request(image, options, {"missing": missing}, solver)

    def output_alpha(
        self, request: Request, alpha: np.ndarray | None, files: Sequence[str]
    ) -> np.ndarray | None:
        if "mask" in files or alpha is None:
            return alpha
        # holes given by the alpha channel are filled, so they become opaque; the rest keeps its alpha
        return np.where(alpha == 0, np.float32(1), alpha)

    def batch_key(self, request: Request) -> tuple:
        return (request.solver,)

    def tile_halo(self, predictor: Inpainter) -> int:
        """The model's ``solve_reach`` (``kdeq.predictors.inpaint``)."""
        return predictor.solve_reach

    def whole_image(self, predictor: Inpainter, request: Request) -> Request:
        """The observed pixels' channel means (``level``: the mean where no observed pixel is near, and
        what the network centres on) fixed from the whole image."""
        observed = request.inputs["missing"].reshape(request.image.shape[-2:]) == 0
        # numpy accumulates in float64 without a float64 copy of the image
        level = (request.image * observed).sum(axis=(1, 2), dtype=np.float64) / observed.sum()
        return replace(request, inputs={**request.inputs, "level": level.astype(np.float32)})

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        missing, _ = pad_images([torch.from_numpy(r.inputs["missing"]) for r in requests])
        extra = ({} if sizes is None else {"sizes": sizes}) | tile_level(requests)
        return (images, missing), {"solver": requests[0].solver, **extra}

    def warmup(self, size: int) -> Request:
        rng = np.random.default_rng(0)
        image = rng.random((1, size, size), dtype=np.float32)
        return Request(image, self.options(), {"missing": rng.random((1, size, size)) < 0.3})
