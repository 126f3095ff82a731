"""``deblur``: undo a known blur, ``y = h * f + ε``, as the kGLM-DEQ observed through ``A = H``
(the model: ``kdeq.predictors.deblur``).

The PSF is named (``gaussian:SIGMA``, ``disk:RADIUS``, ``motion:LENGTH[,ANGLE_DEGREES]``,
``kdeq.maths.psf.parse_psf``) or uploaded as an image (odd sides, at most ``kdeq.maths.psf.MAX_PSF_SIDE``,
normalised to sum 1; a colour PSF image is read as its mean over channels).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kdeq.maths.psf import MAX_PSF_SIDE, check_psf, parse_psf
from kdeq.predictors.base import Prediction, SolverOverride
from kdeq.predictors.deblur import Deblurrer
from kdeq.tasks.base import (
    FileInput,
    InputError,
    NoiseLevel,
    Options,
    Request,
    ResultField,
    Task,
    noise_levels,
)


class DeblurOptions(Options):
    psf: str | None = Field(
        None,
        max_length=64,
        description="a named PSF: `gaussian:SIGMA`, `disk:RADIUS` or `motion:LENGTH[,ANGLE_DEGREES]` "
        "(pixels; the angle counter-clockwise from horizontal); or upload `psf_image`",
    )
    sigma: NoiseLevel = None


class Deblur(Task):
    """Deblur `image`, blurred by a known PSF (named in `psf` or uploaded as `psf_image`), with a
    Gaussian kGLM-DEQ observed through the blur; `sigma` is estimated per image when absent."""

    name = "deblur"
    summary = "Remove a known blur from an image"
    sample = "blurred"
    predictor = Deblurrer
    options = DeblurOptions
    files = (
        FileInput(
            "psf_image",
            f"the PSF as an image (odd sides, at most {MAX_PSF_SIDE} pixels; normalised to sum 1), "
            "instead of `psf`",
            "image",
        ),
    )
    fields = (ResultField("sigma", "noise level used, 0–255", ".3f"),)

    def prepare(
        self,
        image: np.ndarray,
        alpha: np.ndarray | None,
        options: DeblurOptions,
        files: Mapping[str, np.ndarray],
        solver: SolverOverride | None = None,
    ) -> Request:
        upload = files.get("psf_image")
        if (options.psf is None) == (upload is None):
            raise InputError(
                "psf_required" if upload is None else "psf_twice",
                "give the blur as one of `psf` (e.g. gaussian:1.6) and `psf_image`",
                absent=upload is None,
            )
        try:
            psf = parse_psf(options.psf) if upload is None else check_psf(upload.mean(axis=0))
        except ValueError as err:
            raise InputError("invalid_psf", str(err)) from None
        return Request(image, options, {"psf": psf.numpy()}, solver)

    def batch_key(self, request: Request) -> Hashable:
        # one PSF per batch; given levels may differ within it (σ is per sample)
        psf = request.inputs["psf"]
        return (
            psf.shape,
            hashlib.sha1(psf.tobytes()).hexdigest(),
            request.options.sigma is None,
            request.solver,
        )

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        first = requests[0]
        psf = torch.from_numpy(first.inputs["psf"])
        return (images, psf), {"sigma": noise_levels(requests), "solver": first.solver}

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        return prediction.output[index], {"sigma": float(prediction.sigma[index])}

    def warmup(self, size: int) -> Request:
        rng = np.random.default_rng(0)
        image = rng.random((1, size, size), dtype=np.float32)
        return Request(image, self.options(psf="gaussian:1.6"), {"psf": parse_psf("gaussian:1.6").numpy()})
