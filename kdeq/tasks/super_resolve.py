"""``super-resolve``: a ``scale×`` larger image, as the kGLM-DEQ observed through ``A = S H``.

The degradation model is the field's standard, MATLAB's ``imresize(f, 1/s, 'bicubic')``
(anti-aliased Keys cubic, ``a = −0.5``, symmetric border; ``kdeq.psf.bicubic_taps``): the
low-resolution image is ``y = S H f`` and the super-resolver is kernel ridge regression through it
(DESIGN §2 fact 8),

    f = m + K Aᵀ (A K Aᵀ + λI)⁻¹ (y − A m),      A = S H,

with the prior mean ``m`` the bicubic interpolation of ``y`` (``upsample``): the output is that
interpolation corrected, through the kernel, until its degradation reproduces ``y`` up to ``λ``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from kdeq.checkpoint import ModelSpec
from kdeq.operators import BlurSubsample, KernelMap, mirror, solve_observed
from kdeq.predictor import Prediction, Predictor, SolverOverride
from kdeq.psf import SR_SCALES, bicubic_taps, keys_cubic
from kdeq.tasks import register_task
from kdeq.tasks.base import Options, Request, Task


def interpolation_matrix(n: int, scale: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``U`` ``(s·n, n)``: bicubic interpolation (Keys, ``a = −0.5``) of a length-``n`` signal at the
    ``s·n`` pixel centres of the finer grid, ``u_j = (j + ½)/s − ½`` on the coarse one; samples past
    the border mirror it with the edge repeated."""
    u = (torch.arange(scale * n, dtype=torch.float64) + 0.5) / scale - 0.5
    base = torch.floor(u).long()
    out = torch.zeros(scale * n, n, dtype=torch.float64)
    rows = torch.arange(scale * n)
    for t in range(-1, 3):
        i = base + t
        weight = keys_cubic(u - i.double())
        out.index_put_((rows, mirror(i, n)), weight, accumulate=True)
    return out.to(dtype)


def upsample(y: torch.Tensor, scale: int) -> torch.Tensor:
    """Bicubic interpolation ``(B, c, s·h, s·w)`` of ``y`` ``(B, c, h, w)`` (``interpolation_matrix``)."""
    rows = interpolation_matrix(y.shape[-2], scale, y.dtype).to(y.device)
    cols = interpolation_matrix(y.shape[-1], scale, y.dtype).to(y.device)
    return rows @ y @ cols.T


class SuperResolver(Predictor):
    """Gaussian kGLM super-resolver; see the module docstring."""

    task = "super-resolve"

    def forward(
        self, images: torch.Tensor, scale: int = 2, solver: SolverOverride | None = None
    ) -> Prediction:
        """``images`` ``(B, c, h, w)`` → ``output`` ``(B, c, s·h, s·w)`` for ``scale`` ``s`` in
        ``kdeq.psf.SR_SCALES``."""
        y = self.images(images)
        taps, offset = bicubic_taps(scale)
        op = BlurSubsample(taps.to(self.device), offset, scale, "symmetric")
        lam = self.lam(torch.zeros(y.shape[0], device=self.device))
        kernel = KernelMap(self.tensors["w1"], torch.ones_like(lam), self.config.architecture.padding)
        f, stats = solve_observed(op, kernel, y, lam, upsample(y, scale), self.solver(solver))
        return Prediction(f, stats, lam)


class SuperResolveOptions(Options):
    scale: Literal[2, 3, 4] = Field(2, description="the factor on each side of the image")


@register_task
class SuperResolve(Task):
    """Enlarge `image` `scale` times in each axis with a Gaussian kGLM-DEQ observed through the
    bicubic degradation (MATLAB's `imresize(f, 1/scale, 'bicubic')`); the pixel limit applies to
    the output."""

    name = "super-resolve"
    summary = "Enlarge an image 2, 3 or 4 times"
    predictor = SuperResolver
    options = SuperResolveOptions

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        if spec.architecture.kernel.channels != 1:
            raise ValueError("the super-resolver applies one kernel to every channel (channels = 1)")
        if spec.mean != "interpolated":
            raise ValueError(
                "the super-resolver's mean is the bicubic interpolation: use mean 'interpolated'"
            )

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

    def run(
        self,
        predictor: SuperResolver,
        images: torch.Tensor,
        requests: Sequence[Request],
        sizes: list[tuple[int, int]] | None,
    ) -> Prediction:
        first = requests[0]
        return predictor.predict(images, scale=first.options.scale, solver=first.solver)

    def warmup(self, size: int) -> Request:
        rng = np.random.default_rng(0)
        small = max(2, size // max(SR_SCALES))
        return Request(rng.random((1, small, small), dtype=np.float32), self.options(scale=max(SR_SCALES)))
