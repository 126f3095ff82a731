"""``super-resolve``: a ``scale×`` larger image, as the kGLM-DEQ observed through ``A = S H``.

The degradation model is the field's standard, MATLAB's ``imresize(f, 1/s, 'bicubic')``
(anti-aliased Keys cubic, ``a = −0.5``, symmetric border; ``kdeq.psf.bicubic_taps``): the
low-resolution image is ``y = S H f`` and the super-resolver is kernel ridge regression through it
(DESIGN §2 fact 8),

    f = m + K Aᵀ (A K Aᵀ + λI)⁻¹ (y − A m),      A = S H,

with the prior mean ``m`` the bicubic interpolation of ``y`` (``upsample``): the output is that
interpolation corrected, through the kernel, until its degradation reproduces ``y`` up to ``λ``.
With a network (``kdeq.guidenet``, ``condition = "scale"``) the mean is its pilot
``p = u + N_θ(u − ū, 1/s)`` on the interpolation ``u``, corrected the same way.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from kdeq.checkpoint import ModelSpec
from kdeq.guidenet import upscale_pilot
from kdeq.operators import BlurSubsample, KernelMap, mirror, solve_observed
from kdeq.predictor import Prediction, Predictor, SolverOverride
from kdeq.psf import SR_SCALES, bicubic_taps, keys_cubic
from kdeq.tasks import register_task
from kdeq.tasks.base import Options, Request, Task, shared_value, tile_level
from kdeq.train.data import Corruption
from kdeq.train.objectives import psnr


def _interpolation_taps(n: int, scale: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The nonzero entries of ``interpolation_matrix(n, scale)`` as four ``(rows, columns, weights)``
    triples, one per cubic tap (a column may repeat: the mirrored border's)."""
    u = (torch.arange(scale * n, dtype=torch.float64) + 0.5) / scale - 0.5
    base = torch.floor(u).long()
    rows = torch.arange(scale * n)
    return [(rows, mirror(base + t, n), keys_cubic(u - (base + t).double())) for t in range(-1, 3)]


def interpolation_matrix(n: int, scale: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``U`` ``(s·n, n)``: bicubic interpolation (Keys, ``a = −0.5``) of a length-``n`` signal at the
    ``s·n`` pixel centres of the finer grid, ``u_j = (j + ½)/s − ½`` on the coarse one; samples past
    the border mirror it with the edge repeated."""
    out = torch.zeros(scale * n, n, dtype=torch.float64)
    for rows, cols, weight in _interpolation_taps(n, scale):
        out.index_put_((rows, cols), weight, accumulate=True)
    return out.to(dtype)


def interpolation_sums(n: int, scale: int) -> torch.Tensor:
    """``Uᵀ1`` ``(n,)`` float64: the column sums of ``interpolation_matrix(n, scale)``, without it."""
    out = torch.zeros(n, dtype=torch.float64)
    for _, cols, weight in _interpolation_taps(n, scale):
        out.index_add_(0, cols, weight)
    return out


def degrade(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``S H x`` ``(B, c, H/s, W/s)`` for ``x`` ``(B, c, H, W)`` (sides multiples of ``s``): MATLAB's
    ``imresize(x, 1/s, 'bicubic')``, the model's forward operator."""
    taps, offset = bicubic_taps(scale, dtype=x.dtype)
    return BlurSubsample(taps.to(x.device), offset, scale, "symmetric").forward(x)


def upsample(y: torch.Tensor, scale: int) -> torch.Tensor:
    """Bicubic interpolation ``(B, c, s·h, s·w)`` of ``y`` ``(B, c, h, w)`` (``interpolation_matrix``)."""
    rows = interpolation_matrix(y.shape[-2], scale, y.dtype).to(y.device)
    cols = interpolation_matrix(y.shape[-1], scale, y.dtype).to(y.device)
    return rows @ y @ cols.T


class SuperResolver(Predictor):
    """Gaussian kGLM super-resolver; see the module docstring."""

    task = "super-resolve"
    reads = frozenset({"w1"})

    def forward(
        self,
        images: torch.Tensor,
        scale: int = 2,
        solver: SolverOverride | None = None,
        level: torch.Tensor | None = None,
    ) -> Prediction:
        """``images`` ``(B, c, h, w)`` → ``output`` ``(B, c, s·h, s·w)`` for ``scale`` ``s`` in
        ``kdeq.psf.SR_SCALES``; ``level`` ``(B, c)`` the interpolation's channel means that the
        network centres on, in place of each image's own (a tile's whole image's, ``kdeq.tiling``)."""
        y = self.images(images)
        taps, offset = bicubic_taps(scale)
        op = BlurSubsample(taps.to(self.device), offset, scale, "symmetric")
        lam = self.lam(torch.zeros(y.shape[0], device=self.device))
        kernel = KernelMap(self.tensors["w1"], torch.ones_like(lam), self.config.architecture.padding)
        pilot = self._pilot(y, scale, None if level is None else level.to(y))
        mean = upsample(y, scale) if pilot is None else pilot
        f, stats = solve_observed(op, kernel, y, lam, mean, self.solver(solver))
        return Prediction(f, stats, lam, pilot=pilot)

    def pilot_only(self, images: torch.Tensor, scale: int = 2) -> torch.Tensor:
        """The network's pilot ``p`` ``(B, c, s·h, s·w)`` alone, without the solve (the trainer's
        pilot phase)."""
        pilot = self._pilot(self.images(images), scale)
        if pilot is None:
            raise ValueError(f"{self.name} has no network")
        return pilot

    def _pilot(self, y: torch.Tensor, scale: int, level: torch.Tensor | None = None) -> torch.Tensor | None:
        """``p = u + N_θ(u − ū, 1/s)`` (``kdeq.guidenet.upscale_pilot``) for ``u`` the interpolation
        of ``y``, the prior mean; ``None`` without a network."""
        net = self.config.architecture.net
        if net is None:
            return None
        return upscale_pilot(upsample(y, scale), scale, self.tensors, net, level)

    def reach(self, scale: int) -> int:
        """``ρ`` in input pixels at scale ``s``: the equation ``(A K Aᵀ + λI)α = y − A m`` at a
        low-resolution pixel reads ``α`` within ``⌊(n − 1 + r)/s⌋`` (``A``'s ``n`` bicubic taps, ``K``'s
        radius ``r``) and ``y`` within ``⌈(n + r + q)/s⌉ + 2`` (the mean's network reads ``q = 2·depth
        + 1`` output pixels of the interpolation, which reads 2 input pixels around each)."""
        n = bicubic_taps(scale)[0].numel()
        r = self.tensors["w1"].shape[-1] // 2
        net = self.config.architecture.net
        q = 0 if net is None else 2 * net.depth + 1
        return -(-(n + r + q) // scale) + 2

    @property
    def solve_reach(self) -> int:
        """The tiles' halo, in input pixels: the largest scale's ``reach`` plus four of ``K``'s radii
        (``Predictor.coupled_reach``: the stationary kernel's CG carries the coupling further)."""
        return self.coupled_reach(max(self.reach(s) for s in SR_SCALES))


class SuperResolveOptions(Options):
    scale: Literal[2, 3, 4] = Field(2, description="the factor on each side of the image")


@register_task
class SuperResolve(Task):
    """Enlarge `image` `scale` times in each axis with a Gaussian kGLM-DEQ observed through the
    bicubic degradation (MATLAB's `imresize(f, 1/scale, 'bicubic')`); the pixel limit applies to
    the output."""

    name = "super-resolve"
    summary = "Enlarge an image 2, 3 or 4 times"
    sample = "small"
    predictor = SuperResolver
    options = SuperResolveOptions
    network = "scale"

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

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: Corruption,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """``low = S H target`` ``(c, H/s, W/s)``, the bicubic degradation (``degrade``), of
        ``target``, ``clean`` cropped to a multiple of ``s``; the scale ``s`` (the example's
        ``scale``) drawn from ``settings.scales`` by ``shared`` (one per step: the predictor takes
        one per call), or the validation ``level`` itself. No noise, as in the field's protocol."""
        if level is None:
            draw = gen if shared is None else shared
            s = settings.scales[int(torch.randint(len(settings.scales), (), generator=draw))]
        else:
            s = int(level)
        h, w = clean.shape[-2:]
        target = clean[:, : h - h % s, : w - w % s]
        return {"target": target, "low": degrade(target[None], s)[0], "scale": torch.tensor(s)}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``(low, scale)``: the low-resolution images ``(B, c, h, w)`` and the batch's one scale."""
        return batch["low"], int(shared_value(batch, "scale", "super-resolve", "scale"))

    def score(self, out: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """PSNR with a ``scale``-pixel border cropped (the field's convention)."""
        s = int(batch["scale"][0])
        return psnr(out[..., s:-s, s:-s], batch["target"][..., s:-s, s:-s])

    def val_levels(self, settings: Corruption) -> tuple[float, ...]:
        """Every scale of the run."""
        return tuple(float(s) for s in settings.scales)

    def check_level(self, level: float, settings: Corruption) -> None:
        if level not in SR_SCALES:
            raise ValueError(
                f"val level {level:g}: a super-resolve level is a scale, one of {list(SR_SCALES)}"
            )
