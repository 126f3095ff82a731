"""The super-resolver: a ``scale×`` larger image, as the kGLM-DEQ observed through ``A = S H``.

The degradation model is the field's standard, MATLAB's ``imresize(f, 1/s, 'bicubic')``
(anti-aliased Keys cubic, ``a = −0.5``, symmetric border; ``kdeq.maths.psf.bicubic_taps``): the
low-resolution image is ``y = S H f`` and the super-resolver is kernel ridge regression through it
(DESIGN §2 fact 8),

    f = m + K Aᵀ (A K Aᵀ + λI)⁻¹ (y − A m),      A = S H,

with the prior mean ``m`` the bicubic interpolation of ``y`` (``upsample``): the output is that
interpolation corrected, through the kernel, until its degradation reproduces ``y`` up to ``λ``.
With a network (``kdeq.maths.guidenet``, ``condition = "scale"``) the mean is its pilot
``p = u + N_θ(u − ū, 1/s)`` on the interpolation ``u``, corrected the same way.

Its posterior (``gaussian_posterior``, ``kdeq.predictors.uncertainty``) is the Gaussian model
``A = S H`` with the bank on the fine grid and the amplitude by maximum likelihood.
"""

from __future__ import annotations

import torch

from kdeq.maths.guidenet import upscale_pilot
from kdeq.maths.operators import BlurSubsample, KernelMap, mirror, solve_observed
from kdeq.maths.psf import SR_SCALES, bicubic_taps, keys_cubic
from kdeq.predictors.base import GaussianPosterior, Prediction, Predictor, SolverOverride
from kdeq.predictors.spec import ModelSpecBase
from kdeq.predictors.uncertainty import conv_kernel, probe_spacing


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
    network = "scale"
    reads = frozenset({"w1"})

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        super().check_spec(spec)
        if spec.architecture.kernel.channels != 1:
            raise ValueError("the super-resolver applies one kernel to every channel (channels = 1)")
        if spec.mean != "interpolated":
            raise ValueError(
                "the super-resolver's mean is the bicubic interpolation: use mean 'interpolated'"
            )

    def forward(
        self,
        images: torch.Tensor,
        scale: int = 2,
        solver: SolverOverride | None = None,
        level: torch.Tensor | None = None,
    ) -> Prediction:
        """``images`` ``(B, c, h, w)`` → ``output`` ``(B, c, s·h, s·w)`` for ``scale`` ``s`` in
        ``kdeq.maths.psf.SR_SCALES``; ``level`` ``(B, c)`` the interpolation's channel means that the
        network centres on, in place of each image's own (a tile's whole image's, ``kdeq.serving.tiling``)."""
        y = self.images(images)
        taps, offset = bicubic_taps(scale)
        op = BlurSubsample(taps.to(self.device), offset, scale, "symmetric")
        lam = self.lam(torch.zeros(y.shape[0], device=self.device))
        kernel = KernelMap(self.tensors["w1"], torch.ones_like(lam), self.config.architecture.padding)
        pilot = self._pilot(y, scale, None if level is None else level.to(y))
        mean = upsample(y, scale) if pilot is None else pilot
        f, stats = solve_observed(op, kernel, y, lam, mean, self.solver(solver))
        return Prediction(f, stats, lam, pilot=pilot)

    def gaussian_posterior(
        self, images: torch.Tensor, scale: int = 2, solver: SolverOverride | None = None
    ) -> GaussianPosterior:
        """``A = S H`` (the bicubic degradation); ``K`` the bank on the fine grid; fixed ``λ``; ``s²`` by
        maximum likelihood around the model's mean (the interpolation, or its network's pilot).
        Arguments as ``forward``'s."""
        y = self.images(images)
        taps, offset = bicubic_taps(scale, dtype=torch.float64)
        op = BlurSubsample(taps.to(y.device), offset, scale, "symmetric")
        lam = self.lam(torch.zeros(y.shape[0], device=y.device)).double()
        pilot = self._pilot(y, scale)
        mean = upsample(y, scale) if pilot is None else pilot
        centred = y.double() - op.forward(mean.double())
        bsz, c, h, w = y.shape
        kernel, stationary = conv_kernel(self, bsz)
        spacing = probe_spacing(stationary.taps.shape[-1] // 2, scale)
        shape = (bsz, c, scale * h, scale * w)
        return GaussianPosterior(kernel, op, lam, None, centred, shape, stationary, spacing)

    def pilot_only(self, images: torch.Tensor, scale: int = 2) -> torch.Tensor:
        """The network's pilot ``p`` ``(B, c, s·h, s·w)`` alone, without the solve (the trainer's
        pilot phase)."""
        pilot = self._pilot(self.images(images), scale)
        if pilot is None:
            raise ValueError(f"{self.name} has no network")
        return pilot

    def _pilot(self, y: torch.Tensor, scale: int, level: torch.Tensor | None = None) -> torch.Tensor | None:
        """``p = u + N_θ(u − ū, 1/s)`` (``kdeq.maths.guidenet.upscale_pilot``) for ``u`` the interpolation
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
